#include "engine/instance_parts.h"

#include "core/error.h"
#include "model/qwen3_5_moe.h"
#include "transfer/tcp_transfer.h"

namespace tandem {

ModelFactory cpu_model_factory(std::string dir) {
  return [dir = std::move(dir)](const ShardSpec& shard,
                                comm::Communicator* comm) -> std::unique_ptr<Model> {
    const ModelConfig c = ModelConfig::from_dir(dir);
    // NOTE: a Qwen3.5 hybrid shards for decode (DP mixers, whole states; EP experts). A TP
    // prefill rank holds a slice of each DeltaNet state, which the transfer does not merge at
    // the decode rank yet (model/hybrid_state.h has the slicing).
    TANDEM_CHECK_KIND(kUnsupported,
                      !c.is_hybrid() || shard.mode != ShardMode::kPrefillTpEp || shard.size == 1,
                      dir, "/config.json: model_type '", c.model_type,
                      "' (a Qwen3.5 hybrid model) prefills on one rank only, not ", shard.size,
                      " (", shard_mode_name(shard.mode), "): use --tp 1 for prefill");
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
