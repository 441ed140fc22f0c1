// The KV transfer engine: moves a prefilled request's KV pages from the prefill instance's
// ranks into pages the decode instance reserved, splitting and merging KV heads to match the
// two shardings (DESIGN.md sections 1, 3 steps 3-5, 4 "Transfer").
//
// Flow of one request:
//   1. Decode reserves pages for the prompt (its block table) on the rank that will run the
//      request and calls TransferReceiver::expect(descriptor); the descriptor goes, through
//      the router, to every rank of the prefill instance.
//   2. Every prefill rank calls TransferSender::begin(descriptors, its block table), then
//      send_layer(request, l, tokens) as soon as layer l's KV of those tokens is written
//      (whole prompt: once per layer; chunked prefill: once per chunk and layer), then
//      finish(request, first_token, logprob). A rank owing the destination no heads (a
//      non-first replica, or disjoint ranges) makes the same calls; they send nothing.
//   3. The receiver writes each piece into the reserved pages at the destination's head
//      offset and token positions (page sizes may differ between the sides: pieces travel
//      page-free, kv_pack.h). Once every (layer, source rank) piece is whole and every sending
//      rank's finish arrived, on_complete(request, first_token, logprob) fires - never
//      before: a half-written request is never marked complete.
//   4. Any failure (connection refused or lost, timeout, a bad descriptor or piece) ends that
//      request alone: on_error(request, message naming request and peer) on the receiver and
//      on the senders. The receiver releases nothing itself: its engine frees the pages.
//
// Pages and threads (the contract every backend keeps):
//   - Receiver: between expect() and the request's callback (or cancel() returning) the
//     backend may write the request's reserved pages at any time from its own thread; the
//     engine must not read, write or free them in that window. It never touches any other
//     page. Callbacks run on the backend's thread, after its last write to the pages; they
//     must not block or destroy the sender / receiver (queue the event to the engine thread);
//     calling the other methods from a callback is fine.
//   - Sender: the request's source pages must stay unchanged from send_layer until the
//     request's on_sent / on_error (the host backend copies them during send_layer, a device
//     backend reads them asynchronously).
//
// Backends: the host one over TCP (transfer/tcp_transfer.h; CPU mode and tests). A device
// backend (NCCL send/recv or peer copies) implements the same two interfaces.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "kv/kv_cache.h"
#include "transfer/head_map.h"

namespace tandem::transfer {

/// What the decode side tells the prefill side about one destination rank of a request.
/// A request whose destination heads are spread over several decode ranks (decode TP) has
/// one descriptor per destination rank.
struct TransferDescriptor {
  std::string request_id;
  std::string dst_address;         // "host:port" of the destination rank's receiver
  std::vector<int32_t> dst_pages;  // destination block table: token t -> dst_pages[t / page_size]
  HeadRange dst_heads;             // global KV heads the destination cache holds, in order
  KvSharding src;                  // the prefill instance's sharding (the router pairs them)
  int64_t num_tokens = 0;          // prompt positions [0, num_tokens) move
  int64_t page_size = 0;           // destination tokens per page (the source's may differ)
  int64_t head_dim = 0;
  int64_t num_layers = 0;
  /// Hybrid models (Qwen3.5): floats of the sequence's recurrent state (Model::state_slot_elems)
  /// that travel with the FINISH (finish_with_state), 0 for attention-only models.
  int64_t state_elems = 0;
  /// Device backends (TransferBackend::carries_device_state): the destination's reserved state
  /// slot (its KvCache state slot of state_elems floats) the state is copied into, device to
  /// device; -1: the state travels with the FINISH (finish_with_state).
  int32_t dst_state_slot = -1;
  /// MTP speculative decoding on the destination (it asked for them): the hidden size of the
  /// prompt's final hidden states (the target's, after the final norm, one row per prompt
  /// position it computed) that travel from one sending rank before its FINISH; 0: none.
  int64_t hidden_size = 0;

  /// Checks the fields against each other (not against a cache); throws
  /// Error(kInvalidArgument) naming the request.
  void validate() const;
  /// The source ranks this destination waits for (senders_for(src, dst_heads)).
  std::vector<int> senders() const { return senders_for(src, dst_heads); }
};

/// How far one expected request has come on the receiver.
/// A token range [begin, end) of a request's prompt; end -1: up to num_tokens.
struct TokenRange {
  int64_t begin = 0;
  int64_t end = -1;
};

/// The prompt's final hidden states a prefill computed (TransferDescriptor::hidden_size > 0):
/// rows for positions [begin, num_tokens) (begin > 0 after a prefix-cache hit there, whose
/// positions have no row).
struct PromptHidden {
  int64_t begin = 0;
  std::vector<float> rows;  // [num_tokens - begin, hidden_size]
  bool empty() const { return rows.empty(); }
};

/// What a FINISH carries beyond the first token, from one sending rank.
struct FinishPayload {
  std::vector<float> state;  // descriptor state_elems floats (hybrid models), or empty
  PromptHidden hidden;       // descriptor hidden_size > 0: the prompt's hidden states, or empty
  bool empty() const { return state.empty() && hidden.empty(); }
};

struct TransferProgress {
  int64_t pieces_received = 0;  // (layer, source rank) pieces wholly written into the pages
  int64_t pieces_expected = 0;  // num_layers * senders
  int senders_finished = 0;     // source ranks whose finish arrived
  int senders_expected = 0;
};

struct SenderCallbacks {
  /// Every destination acknowledged every piece and the finish of this rank's part of the
  /// request; the source pages may be reused.
  std::function<void(const std::string& request)> on_sent;
  /// The request's transfer failed (at most one callback per request).
  std::function<void(const std::string& request, const std::string& message)> on_error;
};

struct ReceiverCallbacks {
  /// The request's KV is complete in its reserved pages.
  std::function<void(const std::string& request, int32_t first_token, float logprob)> on_complete;
  /// The request's transfer failed; the engine frees its pages.
  std::function<void(const std::string& request, const std::string& message)> on_error;
  /// Hybrid models (descriptor state_elems > 0): the request's recurrent state, once, right
  /// before on_complete (same thread). Not called when the request fails.
  std::function<void(const std::string& request, std::vector<float> state)> on_state;
  /// Descriptor hidden_size > 0: the prompt's final hidden states, once, right before
  /// on_complete (same thread, after on_state). Not called when the request fails.
  std::function<void(const std::string& request, PromptHidden hidden)> on_hidden;
};

/// The prefill side of one rank. Thread-safe; callbacks run on the backend's thread. Exactly
/// one callback per begun request unless it is aborted; destroying the sender drops every
/// transfer without callbacks (the receivers see the connections close).
class TransferSender {
 public:
  virtual ~TransferSender() = default;
  /// Starts sending `request` to its destinations (one descriptor per destination rank, all
  /// with the same request id, tokens, layers and source sharding); `src_pages` is the
  /// request's block table in this rank's cache. Throws Error(kInvalidArgument) on a
  /// descriptor that does not fit this rank (sharding, head_dim, layers, page ids). Every
  /// begun request ends with finish() or abort(), after an on_error too, so it is forgotten.
  virtual void begin(const std::string& request, std::vector<TransferDescriptor> destinations,
                     std::vector<int32_t> src_pages) = 0;
  /// Streams this rank's heads of layer `layer` for prompt tokens `tokens` (default: all).
  /// Layers go in any order, interleaved; each layer's ranges follow on without gap or
  /// overlap (tokens.begin is where the layer's previous call ended, 0 at first) until the
  /// layer reaches num_tokens. A no-op once the request failed. Throws
  /// Error(kInvalidArgument) on a layer or range that breaks these rules.
  virtual void send_layer(const std::string& request, int64_t layer, TokenRange tokens = {}) = 0;
  /// The whole of layer `layer` of several requests at once (the prefill forward's hook: every
  /// prompt that ends in this step); a device backend moves them in one launch. Returns the
  /// indices of the requests send_layer would have refused (they moved nothing); the others
  /// went out. The default calls send_layer for each.
  virtual std::vector<size_t> send_layers(const std::vector<std::string>& requests, int64_t layer) {
    std::vector<size_t> refused;
    for (size_t i = 0; i < requests.size(); ++i) {
      try {
        send_layer(requests[i], layer);
      } catch (const std::exception&) {
        refused.push_back(i);
      }
    }
    return refused;
  }
  /// Ends the request after its last send_layer: every destination gets the first sampled
  /// token and its logprob. Throws Error(kInvalidArgument) if a layer is not whole.
  virtual void finish(const std::string& request, int32_t first_token, float logprob) = 0;
  /// finish() for a hybrid model's request: `state` (descriptor state_elems floats, the
  /// sequence's recurrent state after the prompt) goes with the first token. A receiver whose
  /// descriptor has state_elems > 0 fails the request without it.
  void finish_with_state(const std::string& request, int32_t first_token, float logprob,
                         std::vector<float> state) {
    finish_with(request, first_token, logprob, {std::move(state), {}});
  }
  /// finish() with what one sending rank carries beyond the token (FinishPayload: the recurrent
  /// state, the prompt's hidden states). A receiver whose descriptor asks for either fails the
  /// request when every sender finished without it. Throws Error(kInvalidArgument) on a part
  /// the descriptor does not ask for or of another size, Error(kUnsupported) where the backend
  /// carries no payload (the default, for a non-empty one).
  virtual void finish_with(const std::string& request, int32_t first_token, float logprob,
                           FinishPayload payload) {
    TANDEM_CHECK_KIND(kUnsupported, payload.empty(), "KV transfer of request '", request,
                      "': this transfer backend does not carry a recurrent state or hidden states");
    finish(request, first_token, logprob);
  }
  /// Device backends (TransferBackend::carries_device_state): copies this rank's state slot
  /// `src_slot` (the cache's device state slot, state_elems floats: the whole state) into each
  /// destination's reserved slot (descriptor dst_state_slot), device to device, after the
  /// model's work enqueued so far on its stream (call it after the prompt's last forward, before
  /// finish()); the model's stream waits for the copy, so the slot may be reused by the next
  /// forward. The receiver completes the request only once a FINISH says the state was copied.
  /// Throws Error(kInvalidArgument) on a slot out of range or a size other than the
  /// descriptor's, Error(kUnsupported) where the backend copies no device state (the default).
  virtual void send_state(const std::string& request, int32_t src_slot) {
    TANDEM_THROW(kUnsupported, "KV transfer of request '", request, "' (state slot ", src_slot,
                 "): this transfer backend does not copy device state slots");
  }
  /// As send_state, from a device buffer of `elems` floats instead of a slot of the cache (a
  /// prefill TP rank's whole state gathered from the ranks' parts on its device:
  /// Model::gather_state_device), on the cache's device; the buffer may be reused once the
  /// model's stream passes the copy. Throws as send_state (a null buffer or another size than
  /// the descriptor's: kInvalidArgument).
  virtual void send_state_from(const std::string& request, const float* src, int64_t elems) {
    (void)src;
    TANDEM_THROW(kUnsupported, "KV transfer of request '", request, "' (a device state of ", elems,
                 " floats): this transfer backend does not copy device states");
  }
  /// Drops the request (e.g. the client went away); no callback follows. The destinations
  /// see the transfer fail and report it there.
  virtual void abort(const std::string& request) = 0;
};

/// The decode side of one rank, writing into a KvCache the engine owns. Thread-safe;
/// callbacks run on the backend's thread.
class TransferReceiver {
 public:
  virtual ~TransferReceiver() = default;
  /// Where senders reach this receiver ("host:port"), for TransferDescriptor::dst_address.
  virtual std::string address() const = 0;
  /// Registers a request whose pages are reserved (before the descriptor leaves this rank).
  /// Throws Error(kInvalidArgument) naming the request when the descriptor does not fit this
  /// cache (page id out of range or repeated, too few pages, head range or geometry
  /// mismatch) or the request is already expected. Exactly one callback follows unless the
  /// request is cancelled.
  virtual void expect(const TransferDescriptor& descriptor) = 0;
  /// Forgets an expected request (abort). When it returns true, no write to its pages and no
  /// callback for it happens any more; false means it was not expected (any more): its one
  /// callback has fired or is firing.
  virtual bool cancel(const std::string& request) = 0;
  /// Progress of an expected request; nullopt when not expected (any more).
  virtual std::optional<TransferProgress> progress(const std::string& request) const = 0;
};

/// Creates the two halves of one transport.
class TransferBackend {
 public:
  virtual ~TransferBackend() = default;
  virtual std::string_view name() const = 0;
  /// True when its FINISH carries the prompt's hidden states (TransferDescriptor::hidden_size):
  /// a decode instance asks for them only then.
  virtual bool carries_prompt_hidden() const { return false; }
  /// True when it copies a hybrid's recurrent state between device state slots
  /// (TransferSender::send_state, TransferDescriptor::dst_state_slot) instead of carrying it
  /// in the FINISH: a decode instance then reserves the slot with the pages.
  virtual bool carries_device_state() const { return false; }
  /// The sender of prefill rank `rank` of an instance sharded as `sharding`, reading `cache`
  /// (which holds sharding.held(rank).size() heads; it must outlive the sender).
  virtual std::unique_ptr<TransferSender> make_sender(const KvCache& cache,
                                                      const KvSharding& sharding, int rank,
                                                      SenderCallbacks callbacks) = 0;
  /// A receiver writing into `cache` (which must outlive it).
  virtual std::unique_ptr<TransferReceiver> make_receiver(KvCache& cache,
                                                          ReceiverCallbacks callbacks) = 0;
};

}  // namespace tandem::transfer
