#include "engine/instance_parts.h"

#include "core/error.h"
#include "model/qwen3_5_moe.h"
#include "transfer/tcp_transfer.h"

namespace tandem {

ModelFactory cpu_model_factory(std::string dir) {
  return [dir = std::move(dir)](const ShardSpec& shard,
                                comm::Communicator* comm) -> std::unique_ptr<Model> {
    const ModelConfig c = ModelConfig::from_dir(dir);
    if (c.is_hybrid()) {
      // NOTE: Qwen35MoeCpu is not shardable yet: one rank holds the whole model.
      TANDEM_CHECK_KIND(kUnsupported, shard.size == 1, dir, "/config.json: model_type '",
                        c.model_type, "' (a Qwen3.5 hybrid model) runs on one rank only, not ",
                        shard.size, " (", shard_mode_name(shard.mode),
                        "): use --tp 1 for prefill and --dp 1 for decode");
      return Qwen35MoeCpu::load(dir);
    }
    return Qwen3MoeCpu::load(dir, shard, comm);
  };
}

std::shared_ptr<transfer::TransferBackend> host_transfer_backend(const HostTransferSettings& s) {
  transfer::HostTcpOptions o;
  o.bind_host = s.bind_host;
  o.timeout = s.timeout;
  return transfer::make_host_tcp_backend(o);
}

}  // namespace tandem
