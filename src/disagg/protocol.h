// The messages the roles exchange, one codec each, in one place: between the ranks of an
// instance (the prefill step broadcast, the decode commands and reports) and between the
// router and an instance's rank 0 (disagg/instance_api frames carry these bodies). Host byte
// order: the peers of a message share a machine type.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "engine/request.h"
#include "engine/scheduler.h"
#include "model/forward_batch.h"
#include "transfer/transfer.h"

namespace tandem {

/// Appends plain values, vectors and strings to a byte buffer (host byte order: the ranks of
/// one instance share a machine type).
class ByteWriter {
 public:
  template <typename T>
  void put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    buf_.insert(buf_.end(), p, p + sizeof(T));
  }
  template <typename T>
  void put_vec(const T* data, int64_t n) {
    put<int64_t>(n);
    const auto* p = reinterpret_cast<const uint8_t*>(data);
    buf_.insert(buf_.end(), p, p + n * static_cast<int64_t>(sizeof(T)));
  }
  template <typename T>
  void put_vec(const std::vector<T>& v) {
    put_vec(v.data(), static_cast<int64_t>(v.size()));
  }
  void put_str(const std::string& s) { put_vec(s.data(), static_cast<int64_t>(s.size())); }
  std::vector<uint8_t>& bytes() { return buf_; }

 private:
  std::vector<uint8_t> buf_;
};

/// Reads what ByteWriter wrote; throws Error(kIo) on a short buffer.
class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  explicit ByteReader(const std::vector<uint8_t>& b) : ByteReader(b.data(), b.size()) {}

  template <typename T>
  T get() {
    T v;
    take(&v, sizeof(T));
    return v;
  }
  template <typename T>
  std::vector<T> get_vec() {
    const int64_t n = get<int64_t>();
    // NOTE: n / left() compared by division: a count near 2^62 must not wrap the product.
    TANDEM_CHECK_KIND(kIo, n >= 0 && static_cast<uint64_t>(n) <= left() / sizeof(T),
                      "truncated message");
    std::vector<T> v(static_cast<size_t>(n));
    take(v.data(), v.size() * sizeof(T));
    return v;
  }
  std::string get_str() {
    std::vector<char> v = get_vec<char>();
    return std::string(v.begin(), v.end());
  }
  size_t left() const { return static_cast<size_t>(end_ - p_); }

 private:
  void take(void* dst, size_t n) {
    TANDEM_CHECK_KIND(kIo, n <= left(), "truncated message");
    if (n) std::memcpy(dst, p_, n);
    p_ += n;
  }
  const uint8_t* p_;
  const uint8_t* end_;
};

void put_step_output(ByteWriter& w, const StepOutput& out);
StepOutput get_step_output(ByteReader& r);
std::vector<uint8_t> encode_step_output(const StepOutput& out);
StepOutput decode_step_output(const uint8_t* data, size_t size);
void put_request(ByteWriter& w, const GenRequest& r);
GenRequest get_request(ByteReader& r);
void put_descriptor(ByteWriter& w, const transfer::TransferDescriptor& d);
transfer::TransferDescriptor get_descriptor(ByteReader& r);
void put_histogram(ByteWriter& w, const HistogramCounts& h);
HistogramCounts get_histogram(ByteReader& r);
/// An engine's counters (a decode rank's report to rank 0, an instance's load to the router).
void put_stats(ByteWriter& w, const EngineStats& s);
EngineStats get_stats(ByteReader& r);

// ---- Prefill: the step rank 0 broadcasts to its ranks. ----

/// How a prompt's transfer ends at every rank: finished with token 1, or aborted.
struct TransferEnd {
  std::string id;
  bool ok = false;  // finish with the token, else abort
  int32_t token = 0;
  float logprob = 0;
};

/// One prefill step as every rank sees it: the transfers that end, the batch, where finished
/// prompts' KV goes.
struct PrefillStep {
  struct Seq {
    std::string id;
    std::vector<int32_t> tokens;  // this chunk
    std::vector<int32_t> table;   // block table (rank 0's page ids; every rank mirrors them)
    int64_t start = 0;
    LogitsMode logits = LogitsMode::kNone;
    bool last = false;                 // the prompt's last chunk: its KV goes out now
    transfer::TransferDescriptor dst;  // when last
    int32_t state_slot = -1;           // hybrid models: rank 0's state slot (every rank mirrors it)
  };
  bool stop = false;
  std::vector<TransferEnd> ends;
  std::vector<Seq> seqs;
  // Hybrid models' prefix cache, in the order rank 0 made the copies: the checkpoints saved
  // after the previous step's forward, then the checkpoints restored before this one.
  std::vector<StateCopy> state_saves;
  std::vector<StateCopy> state_restores;

  /// The batch to forward (pointers into this step's vectors).
  ForwardBatch forward() const;
};
std::vector<uint8_t> encode_prefill_step(const PrefillStep& step);
PrefillStep decode_prefill_step(const std::vector<uint8_t>& bytes);

// ---- Decode (one process per rank): rank 0's commands and each rank's report. ----

/// A client call rank 0 forwards to the decode rank that owns the request.
struct DecodeCommand {
  enum Kind : uint8_t { kReserve = 0, kAdmit = 1, kRelease = 2, kAbort = 3 };
  Kind kind = kReserve;
  int32_t rank = 0;  // the rank that applies it (every rank receives every command)
  std::string id;
  int64_t num_tokens = 0;      // kReserve: prompt tokens to reserve pages for
  transfer::KvSharding src;    // kReserve: the prefill instance's sharding
  bool speculate = true;       // kReserve: the request may speculate (its prompt's hidden states)
  GenRequest req;              // kAdmit
  std::vector<int32_t> pages;  // kAdmit, kRelease
  int32_t token = 0;           // kAdmit: the prefill's first token and its logprob
  float logprob = 0;
  bool cancel = false;  // kRelease: cancel the expected transfer too
};
/// One lockstep iteration's broadcast: stop, or the commands since the last one.
struct DecodeCommands {
  bool stop = false;
  std::vector<DecodeCommand> cmds;
};
std::vector<uint8_t> encode_decode_commands(const DecodeCommands& c);
DecodeCommands decode_decode_commands(const std::vector<uint8_t>& bytes);

/// What a decode rank produced in one iteration, gathered by rank 0.
struct DecodeReport {
  struct Reservation {
    std::string id;
    bool ok = false;
    std::string error;
    transfer::TransferDescriptor d;  // when ok
  };
  struct KvEvent {
    std::string id;
    bool ok = false;
    std::string error;
  };
  int64_t batch = 0;       // running + waiting + reserved
  int64_t free_pages = 0;  // KV pages free
  std::vector<Reservation> reserved;
  std::vector<KvEvent> kv_events;
  std::vector<StepOutput> outputs;
  EngineStats stats;  // the rank's engine counters after this iteration
};
std::vector<uint8_t> encode_decode_report(const DecodeReport& r);
DecodeReport decode_decode_report(const std::vector<uint8_t>& bytes);

}  // namespace tandem
