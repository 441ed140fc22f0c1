#include "disagg/instance_parts.h"

#include "model/qwen3_5_moe.h"
#include "transfer/tcp_transfer.h"

namespace tandem {

ModelFactory cpu_model_factory(std::string dir) {
  return [dir = std::move(dir)](const ShardSpec& shard,
                                comm::Communicator* comm) -> std::unique_ptr<Model> {
    return load_cpu_model(dir, shard, comm);
  };
}

std::shared_ptr<transfer::TransferBackend> host_transfer_backend(const HostTransferSettings& s) {
  transfer::HostTcpOptions o;
  o.bind_host = s.bind_host;
  o.timeout = s.timeout;
  return transfer::make_host_tcp_backend(o);
}

}  // namespace tandem
