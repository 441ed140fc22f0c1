// What the roles (prefill instance, decode instance) are built from besides the engine's
// parts and their communicator: a model factory (CPU or CUDA, any architecture) and a KV
// transfer backend (host TCP, CUDA IPC, ...). The role loops name no backend; the composition
// root (the CLI, a test) picks them. Left empty, a config gets the CPU parts below.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "model/qwen3_moe.h"
#include "net/cluster_auth.h"
#include "transfer/transfer.h"

namespace tandem {

namespace comm {
class Communicator;
}

/// Builds rank `shard.rank`'s slice of the model. `comm` is the instance's group (null in
/// ShardMode::kSingle); it must outlive the model. Called once per rank, on every rank at the
/// same time when the ranks are processes (a sharded load may be collective).
using ModelFactory =
    std::function<std::unique_ptr<Model>(const ShardSpec& shard, comm::Communicator* comm)>;

/// The CPU model of `dir` by config.json's model_type: Qwen3MoeCpu or, for a Qwen3.5 hybrid,
/// Qwen35MoeCpu, sharded as asked (prefill TP/EP: each rank its DeltaNet value heads' states).
ModelFactory cpu_model_factory(std::string dir);

struct HostTransferSettings {
  std::string bind_host = "127.0.0.1";
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  net::KeyRef key;  // the cluster key (null: none)
};
/// The host TCP backend (transfer/tcp_transfer.h).
std::shared_ptr<transfer::TransferBackend> host_transfer_backend(const HostTransferSettings& s);

}  // namespace tandem
