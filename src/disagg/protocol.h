// The messages the roles exchange, one codec each, in one place: between the ranks of an
// instance (the prefill step broadcast, the decode commands and reports) and between the
// router and an instance's rank 0 (disagg/instance_api frames carry these bodies). Each
// message's fields are listed once (protocol.cpp), for both directions (core/byte_codec.h).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "core/byte_codec.h"
#include "core/error.h"
#include "engine/request.h"
#include "engine/scheduler.h"
#include "model/forward_batch.h"
#include "transfer/transfer.h"

namespace tandem {

/// The roles' messages: i64 lengths and counts; a malformed one throws Error(kIo).
inline constexpr codec::Format kProtocolFormat{codec::LenWidth::kI64, ErrorKind::kIo, "message"};

/// Appends plain values, vectors and strings to a byte buffer (core/byte_codec.h's Writer in
/// the roles' format).
class ByteWriter : public codec::Writer {
 public:
  ByteWriter() : codec::Writer(kProtocolFormat) {}
};

/// Reads what ByteWriter wrote; throws Error(kIo) on a short buffer or a length past its end.
class ByteReader : public codec::Reader {
 public:
  ByteReader(const uint8_t* data, size_t size) : codec::Reader(data, size, kProtocolFormat) {}
  explicit ByteReader(const std::vector<uint8_t>& b) : ByteReader(b.data(), b.size()) {}
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

// ---- Each message's fields, once. ----
// codec::Writer runs them to encode, codec::Reader to decode (core/byte_codec.h). A nested
// message is its own fields(); a vector of records is a count then each record (seq /
// records: the count bounded by the bytes left at its records' least size). Messages that
// carry these (disagg/instance_api's control frames) call them.

template <class Io, codec::Is<transfer::KvSharding> M>
void fields(Io& io, M& s) {
  io(s.num_kv_heads);
  io.template as<int32_t>(s.tp);
}

template <class Io, codec::Is<transfer::TransferDescriptor> M>
void fields(Io& io, M& d) {
  io(d.request_id);
  io(d.dst_address);
  io(d.dst_pages);
  io(d.dst_heads.begin);
  io(d.dst_heads.end);
  fields(io, d.src);
  io(d.num_tokens);
  io(d.page_size);
  io(d.head_dim);
  io(d.num_layers);
  io(d.state_elems);
  io(d.dst_state_slot);
  io(d.hidden_size);
}

template <class Io, codec::Is<StepOutput> M>
void fields(Io& io, M& o) {
  auto rows = [](auto& io, auto& row) { io(row); };  // each row: a count, its (id, logprob)s
  io(o.id);
  io(o.token_ids);
  io(o.token_logprobs);
  io.seq(o.top_logprobs, rows, sizeof(int64_t));
  io(o.prompt_token_logprobs);
  io.seq(o.prompt_top_logprobs, rows, sizeof(int64_t));
  io(o.num_cached_prompt_tokens);
  io(o.finished);
  io.template as<int32_t>(o.finish_reason);
  io(o.stop_token_id);
  io(o.error);
}

template <class Io, codec::Is<GenRequest> M>
void fields(Io& io, M& r) {
  io(r.id);
  io(r.prompt_ids);
  auto& s = r.sampling;
  io(s.temperature);
  io(s.top_p);
  io(s.top_k);
  io(s.min_p);
  io(s.repetition_penalty);
  io(s.presence_penalty);
  io(s.frequency_penalty);
  io.opt(s.seed);
  io(s.logprobs);
  io(s.prompt_logprobs);
  io(s.logit_bias);
  io(r.max_tokens);
  io(r.min_tokens);
  io(r.stop_token_ids);
  io(r.ignore_eos);
  io(r.allow_speculation);
  io(r.constraint_spec);  // (the constraint object stays in its process)
}

template <class Io, codec::Is<HistogramCounts> M>
void fields(Io& io, M& h) {
  io(h.buckets);
  io(h.sum);
  io(h.count);
}

template <class Io, codec::Is<EngineStats> M>
void fields(Io& io, M& s) {
  for (auto* v :
       {&s.running, &s.waiting, &s.kv_pages_total, &s.kv_pages_free, &s.prefix_cache_queries,
        &s.prefix_cache_hits, &s.prompt_tokens, &s.generation_tokens, &s.preemptions}) {
    io(*v);
  }
  fields(io, s.queue_time);
  fields(io, s.iteration_tokens);
  for (auto* v : {&s.spec_num_drafts, &s.spec_num_draft_tokens, &s.spec_num_accepted_tokens}) {
    io(*v);
  }
  io(s.spec_accepted_per_pos);
}

template <class Io, codec::Is<TransferEnd> M>
void fields(Io& io, M& e) {
  io(e.id);
  io(e.ok);
  io(e.token);
  io(e.logprob);
}

template <class Io, codec::Is<StateCopy> M>
void fields(Io& io, M& c) {
  io(c.src);
  io(c.dst);
}

template <class Io, codec::Is<PrefillStep::Seq> M>
void fields(Io& io, M& s) {
  io(s.id);
  io(s.tokens);
  io(s.table);
  io(s.start);
  io.template as<uint8_t>(s.logits);
  io(s.last);
  if (s.last) fields(io, s.dst);
  io(s.state_slot);
}

template <class Io, codec::Is<PrefillStep> M>
void fields(Io& io, M& st) {
  io(st.stop);
  io.records(st.ends);
  io.records(st.seqs);
  io.records(st.state_saves, sizeof(StateCopy));
  io.records(st.state_restores, sizeof(StateCopy));
}

template <class Io, codec::Is<DecodeCommand> M>
void fields(Io& io, M& d) {
  io(d.rank);
  io.template as<uint8_t>(d.kind);
  switch (d.kind) {
    case DecodeCommand::kReserve:
      io(d.id);
      io(d.num_tokens);
      fields(io, d.src);
      io(d.speculate);
      break;
    case DecodeCommand::kAdmit:
      fields(io, d.req);
      if constexpr (Io::kReading) d.id = d.req.id;
      io(d.pages);
      io(d.token);
      io(d.logprob);
      break;
    case DecodeCommand::kRelease:
      io(d.id);
      io(d.pages);
      io(d.cancel);
      break;
    case DecodeCommand::kAbort: io(d.id); break;
    default:
      if constexpr (Io::kReading) io.fail("unknown decode command ", static_cast<int>(d.kind));
  }
}

template <class Io, codec::Is<DecodeCommands> M>
void fields(Io& io, M& c) {
  io(c.stop);
  io.records(c.cmds);
}

template <class Io, codec::Is<DecodeReport::Reservation> M>
void fields(Io& io, M& r) {
  io(r.id);
  io(r.ok);
  io(r.error);
  if (r.ok) fields(io, r.d);
}

template <class Io, codec::Is<DecodeReport::KvEvent> M>
void fields(Io& io, M& e) {
  io(e.id);
  io(e.ok);
  io(e.error);
}

template <class Io, codec::Is<DecodeReport> M>
void fields(Io& io, M& rep) {
  io(rep.batch);
  io(rep.free_pages);
  io.records(rep.reserved);
  io.records(rep.kv_events);
  io.records(rep.outputs);
  fields(io, rep.stats);
}

}  // namespace tandem
