// The device transfer backend within a host: KV pages move from the prefill ranks' device
// pools straight into the decode ranks' reserved device pages over CUDA IPC (a peer GPU's
// memory mapped into the sender, NVLink; or the same GPU when instances share one), with the
// head split / merge of transfer/head_map.h done by the copy kernel (kv_copy.h).
//
// Registration is once per (sender process, receiver): at the first request a sender connects
// to the receiver's control address (TCP), gets its pool's IPC handle and geometry and maps it;
// every later request to that receiver reuses the mapping. Per request:
//   begin      BEGIN over the control connection (the receiver checks it expects this rank);
//              the page tables go to the device.
//   send_layer the copy of layer l's head run waits for the model's KV write of layer l (an
//              event on KvCache::device_stream()) on the sender's copy stream, then runs:
//              the prefill forward goes on with layer l + 1 meanwhile (no host sync).
//   finish     the model stream waits for the copies (the pages stay unchanged until then);
//              once the copies completed, FINISH(first token) tells the receiver, which
//              completes the request when every sending rank's FINISH arrived.
//              finish_with(hidden states) (descriptor hidden_size > 0; the prefill sends them
//              from rank 0) first sends the wire format's one HIDDEN message cut into chunks of
//              at most 256 KiB over the control connection (hidden_chunks.h), before the FINISH;
//              the receiver reassembles it into a buffer bounded by its descriptor and hands it
//              to on_hidden right before on_complete, as the TCP backend.
//   send_state a hybrid's recurrent state (conv windows + fp32 recurrent states, one state
//              slot) goes device to device: the receiver exports its state slots (one device
//              allocation, KvCache::state_data(0)) by a second IPC handle at registration, the
//              descriptor names the reserved slot (dst_state_slot, bounded by the receiver's slot
//              count and size at expect() and by the sender at begin()), and the sender copies its
//              slot into the mapped one on the copy stream after the model's last write (the
//              model stream waits for the copy before the slot is reused); that rank's FINISH
//              says it copied, and the receiver completes the request only then (no on_state:
//              the state is in the slot). A host state (finish_with_state) is not carried
//              (Error(kUnsupported)).
// Failure isolation as the TCP backend: a lost control connection fails the requests that
// began on it, on both sides; the receiver times a request out `timeout` after expect();
// cancel() on the receiver makes each sender that began the request stop and drain its copies
// before it returns (so no write reaches the pages afterwards).
// Same process (tests): the receiver's pool pointer is used directly (IPC handles do not open
// in the process that made them).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "net/cluster_auth.h"
#include "transfer/transfer.h"

namespace tandem::transfer {

struct CudaIpcOptions {
  std::string bind_host = "127.0.0.1";  // receivers' control listeners
  std::string advertise_host;           // host in address(); empty: bind_host
  /// Receiver: a request not complete this long after expect() fails (covers prefill queueing).
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  /// Control round trips (connect, BEGIN, CANCEL) fail after this.
  std::chrono::milliseconds control_timeout{std::chrono::seconds(10)};
  /// The cluster key (null: none): each control connection starts with the mutual handshake
  /// (net/cluster_auth.h), so no one without it gets the pool's IPC handle or a BEGIN through.
  net::KeyRef key;
};

/// The "cuda-ipc" backend. Caches must be device bf16 pools made by a GPU model
/// (Model::make_kv_cache), one allocation for all layers.
std::unique_ptr<TransferBackend> make_cuda_ipc_backend(CudaIpcOptions options = {});

}  // namespace tandem::transfer
