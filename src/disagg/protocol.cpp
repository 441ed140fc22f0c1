#include "disagg/protocol.h"

namespace tandem {

// ---- StepOutput codec. ----

void put_step_output(ByteWriter& w, const StepOutput& o) {
  w.put_str(o.id);
  w.put_vec(o.token_ids);
  w.put_vec(o.token_logprobs);
  w.put<int64_t>(static_cast<int64_t>(o.top_logprobs.size()));
  for (const auto& row : o.top_logprobs) w.put_vec(row);
  w.put_vec(o.prompt_token_logprobs);
  w.put<int64_t>(static_cast<int64_t>(o.prompt_top_logprobs.size()));
  for (const auto& row : o.prompt_top_logprobs) w.put_vec(row);
  w.put<int32_t>(o.num_cached_prompt_tokens);
  w.put<uint8_t>(o.finished ? 1 : 0);
  w.put<int32_t>(static_cast<int32_t>(o.finish_reason));
  w.put<int32_t>(o.stop_token_id);
  w.put_str(o.error);
}

std::vector<uint8_t> encode_step_output(const StepOutput& o) {
  ByteWriter w;
  put_step_output(w, o);
  return std::move(w.bytes());
}

StepOutput decode_step_output(const uint8_t* data, size_t size) {
  ByteReader r(data, size);
  return get_step_output(r);
}

StepOutput get_step_output(ByteReader& r) {
  StepOutput o;
  o.id = r.get_str();
  o.token_ids = r.get_vec<int32_t>();
  o.token_logprobs = r.get_vec<float>();
  const int64_t nt = r.get<int64_t>();
  TANDEM_CHECK_KIND(kIo, nt >= 0 && static_cast<size_t>(nt) <= r.left(), "truncated message");
  for (int64_t i = 0; i < nt; ++i) o.top_logprobs.push_back(r.get_vec<TokenLogprob>());
  o.prompt_token_logprobs = r.get_vec<float>();
  const int64_t np = r.get<int64_t>();
  TANDEM_CHECK_KIND(kIo, np >= 0 && static_cast<size_t>(np) <= r.left(), "truncated message");
  for (int64_t i = 0; i < np; ++i) o.prompt_top_logprobs.push_back(r.get_vec<TokenLogprob>());
  o.num_cached_prompt_tokens = r.get<int32_t>();
  o.finished = r.get<uint8_t>() != 0;
  o.finish_reason = static_cast<FinishReason>(r.get<int32_t>());
  o.stop_token_id = r.get<int32_t>();
  o.error = r.get_str();
  return o;
}

// ---- GenRequest codec. ----

void put_request(ByteWriter& w, const GenRequest& r) {
  w.put_str(r.id);
  w.put_vec(r.prompt_ids);
  const SamplingParams& s = r.sampling;
  w.put(s.temperature);
  w.put(s.top_p);
  w.put(s.top_k);
  w.put(s.min_p);
  w.put(s.repetition_penalty);
  w.put(s.presence_penalty);
  w.put(s.frequency_penalty);
  w.put<uint8_t>(s.seed.has_value() ? 1 : 0);
  w.put<uint64_t>(s.seed.value_or(0));
  w.put(s.logprobs);
  w.put(s.prompt_logprobs);
  w.put_vec(s.logit_bias);
  w.put(r.max_tokens);
  w.put(r.min_tokens);
  w.put_vec(r.stop_token_ids);
  w.put<uint8_t>(r.ignore_eos ? 1 : 0);
  w.put<uint8_t>(r.allow_speculation ? 1 : 0);
  w.put_str(r.constraint_spec);  // (the constraint object stays in its process)
}

GenRequest get_request(ByteReader& rd) {
  GenRequest r;
  r.id = rd.get_str();
  r.prompt_ids = rd.get_vec<int32_t>();
  SamplingParams& s = r.sampling;
  s.temperature = rd.get<float>();
  s.top_p = rd.get<float>();
  s.top_k = rd.get<int32_t>();
  s.min_p = rd.get<float>();
  s.repetition_penalty = rd.get<float>();
  s.presence_penalty = rd.get<float>();
  s.frequency_penalty = rd.get<float>();
  const bool has_seed = rd.get<uint8_t>() != 0;
  const uint64_t seed = rd.get<uint64_t>();
  if (has_seed) s.seed = seed;
  s.logprobs = rd.get<int32_t>();
  s.prompt_logprobs = rd.get<int32_t>();
  s.logit_bias = rd.get_vec<LogitBias>();
  r.max_tokens = rd.get<int32_t>();
  r.min_tokens = rd.get<int32_t>();
  r.stop_token_ids = rd.get_vec<int32_t>();
  r.ignore_eos = rd.get<uint8_t>() != 0;
  r.allow_speculation = rd.get<uint8_t>() != 0;
  r.constraint_spec = rd.get_str();
  return r;
}

// ---- TransferDescriptor codec. ----

void put_descriptor(ByteWriter& w, const transfer::TransferDescriptor& d) {
  w.put_str(d.request_id);
  w.put_str(d.dst_address);
  w.put_vec(d.dst_pages);
  w.put(d.dst_heads.begin);
  w.put(d.dst_heads.end);
  w.put(d.src.num_kv_heads);
  w.put<int32_t>(d.src.tp);
  w.put(d.num_tokens);
  w.put(d.page_size);
  w.put(d.head_dim);
  w.put(d.num_layers);
  w.put(d.state_elems);
  w.put(d.dst_state_slot);
  w.put(d.hidden_size);
}

transfer::TransferDescriptor get_descriptor(ByteReader& r) {
  transfer::TransferDescriptor d;
  d.request_id = r.get_str();
  d.dst_address = r.get_str();
  d.dst_pages = r.get_vec<int32_t>();
  d.dst_heads.begin = r.get<int64_t>();
  d.dst_heads.end = r.get<int64_t>();
  d.src.num_kv_heads = r.get<int64_t>();
  d.src.tp = r.get<int32_t>();
  d.num_tokens = r.get<int64_t>();
  d.page_size = r.get<int64_t>();
  d.head_dim = r.get<int64_t>();
  d.num_layers = r.get<int64_t>();
  d.state_elems = r.get<int64_t>();
  d.dst_state_slot = r.get<int32_t>();
  d.hidden_size = r.get<int64_t>();
  return d;
}

// ---- Prefill step. ----

ForwardBatch PrefillStep::forward() const {
  ForwardBatch b;
  for (const Seq& s : seqs) {
    b.seqs.push_back({s.tokens.data(), static_cast<int64_t>(s.tokens.size()), s.start,
                      s.table.data(), static_cast<int64_t>(s.table.size()), s.logits,
                      s.state_slot});
  }
  return b;
}

std::vector<uint8_t> encode_prefill_step(const PrefillStep& st) {
  ByteWriter w;
  w.put<uint8_t>(st.stop ? 1 : 0);
  w.put<int64_t>(static_cast<int64_t>(st.ends.size()));
  for (const TransferEnd& e : st.ends) {
    w.put_str(e.id);
    w.put<uint8_t>(e.ok ? 1 : 0);
    w.put(e.token);
    w.put(e.logprob);
  }
  w.put<int64_t>(static_cast<int64_t>(st.seqs.size()));
  for (const PrefillStep::Seq& s : st.seqs) {
    w.put_str(s.id);
    w.put_vec(s.tokens);
    w.put_vec(s.table);
    w.put<int64_t>(s.start);
    w.put<uint8_t>(static_cast<uint8_t>(s.logits));
    w.put<uint8_t>(s.last ? 1 : 0);
    if (s.last) put_descriptor(w, s.dst);
    w.put<int32_t>(s.state_slot);
  }
  for (const auto* copies : {&st.state_saves, &st.state_restores}) {
    w.put<int64_t>(static_cast<int64_t>(copies->size()));
    for (const StateCopy& c : *copies) {
      w.put<int32_t>(c.src);
      w.put<int32_t>(c.dst);
    }
  }
  return std::move(w.bytes());
}

PrefillStep decode_prefill_step(const std::vector<uint8_t>& msg) {
  ByteReader r(msg);
  PrefillStep st;
  st.stop = r.get<uint8_t>() != 0;
  const int64_t ne = r.get<int64_t>();
  TANDEM_CHECK_KIND(kIo, ne >= 0 && static_cast<size_t>(ne) <= r.left(), "truncated message");
  for (int64_t i = 0; i < ne; ++i) {
    TransferEnd e;
    e.id = r.get_str();
    e.ok = r.get<uint8_t>() != 0;
    e.token = r.get<int32_t>();
    e.logprob = r.get<float>();
    st.ends.push_back(std::move(e));
  }
  const int64_t n = r.get<int64_t>();
  TANDEM_CHECK_KIND(kIo, n >= 0 && static_cast<size_t>(n) <= r.left(), "truncated message");
  for (int64_t i = 0; i < n; ++i) {
    PrefillStep::Seq s;
    s.id = r.get_str();
    s.tokens = r.get_vec<int32_t>();
    s.table = r.get_vec<int32_t>();
    s.start = r.get<int64_t>();
    s.logits = static_cast<LogitsMode>(r.get<uint8_t>());
    s.last = r.get<uint8_t>() != 0;
    if (s.last) s.dst = get_descriptor(r);
    s.state_slot = r.get<int32_t>();
    st.seqs.push_back(std::move(s));
  }
  for (auto* copies : {&st.state_saves, &st.state_restores}) {
    const int64_t nc = r.get<int64_t>();
    TANDEM_CHECK_KIND(kIo, nc >= 0 && static_cast<size_t>(nc) * 8 <= r.left(), "truncated message");
    for (int64_t i = 0; i < nc; ++i) {
      StateCopy c;
      c.src = r.get<int32_t>();
      c.dst = r.get<int32_t>();
      copies->push_back(c);
    }
  }
  return st;
}

// ---- Decode commands and reports. ----

std::vector<uint8_t> encode_decode_commands(const DecodeCommands& c) {
  ByteWriter w;
  w.put<uint8_t>(c.stop ? 1 : 0);
  w.put<int64_t>(static_cast<int64_t>(c.cmds.size()));
  for (const DecodeCommand& d : c.cmds) {
    w.put<int32_t>(d.rank);
    w.put<uint8_t>(d.kind);
    switch (d.kind) {
      case DecodeCommand::kReserve:
        w.put_str(d.id);
        w.put<int64_t>(d.num_tokens);
        w.put<int64_t>(d.src.num_kv_heads);
        w.put<int32_t>(d.src.tp);
        w.put<uint8_t>(d.speculate ? 1 : 0);
        break;
      case DecodeCommand::kAdmit:
        put_request(w, d.req);
        w.put_vec(d.pages);
        w.put<int32_t>(d.token);
        w.put<float>(d.logprob);
        break;
      case DecodeCommand::kRelease:
        w.put_str(d.id);
        w.put_vec(d.pages);
        w.put<uint8_t>(d.cancel ? 1 : 0);
        break;
      case DecodeCommand::kAbort: w.put_str(d.id); break;
    }
  }
  return std::move(w.bytes());
}

DecodeCommands decode_decode_commands(const std::vector<uint8_t>& bytes) {
  ByteReader r(bytes);
  DecodeCommands c;
  c.stop = r.get<uint8_t>() != 0;
  const int64_t n = r.get<int64_t>();
  TANDEM_CHECK_KIND(kIo, n >= 0 && static_cast<size_t>(n) <= r.left(), "truncated message");
  for (int64_t i = 0; i < n; ++i) {
    DecodeCommand d;
    d.rank = r.get<int32_t>();
    d.kind = static_cast<DecodeCommand::Kind>(r.get<uint8_t>());
    switch (d.kind) {
      case DecodeCommand::kReserve:
        d.id = r.get_str();
        d.num_tokens = r.get<int64_t>();
        d.src.num_kv_heads = r.get<int64_t>();
        d.src.tp = r.get<int32_t>();
        d.speculate = r.get<uint8_t>() != 0;
        break;
      case DecodeCommand::kAdmit:
        d.req = get_request(r);
        d.id = d.req.id;
        d.pages = r.get_vec<int32_t>();
        d.token = r.get<int32_t>();
        d.logprob = r.get<float>();
        break;
      case DecodeCommand::kRelease:
        d.id = r.get_str();
        d.pages = r.get_vec<int32_t>();
        d.cancel = r.get<uint8_t>() != 0;
        break;
      case DecodeCommand::kAbort: d.id = r.get_str(); break;
      default: TANDEM_THROW(kIo, "unknown decode command ", static_cast<int>(d.kind));
    }
    c.cmds.push_back(std::move(d));
  }
  return c;
}

// ---- EngineStats codec. ----

void put_histogram(ByteWriter& w, const HistogramCounts& h) {
  w.put_vec(h.buckets);
  w.put<double>(h.sum);
  w.put<uint64_t>(h.count);
}

HistogramCounts get_histogram(ByteReader& r) {
  HistogramCounts h;
  h.buckets = r.get_vec<uint64_t>();
  h.sum = r.get<double>();
  h.count = r.get<uint64_t>();
  return h;
}

void put_stats(ByteWriter& w, const EngineStats& s) {
  for (int64_t v : {s.running, s.waiting, s.kv_pages_total, s.kv_pages_free, s.prefix_cache_queries,
                    s.prefix_cache_hits, s.prompt_tokens, s.generation_tokens, s.preemptions}) {
    w.put<int64_t>(v);
  }
  put_histogram(w, s.queue_time);
  put_histogram(w, s.iteration_tokens);
  for (int64_t v : {s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens}) {
    w.put<int64_t>(v);
  }
  w.put_vec(s.spec_accepted_per_pos);
}

EngineStats get_stats(ByteReader& r) {
  EngineStats s;
  for (int64_t* v :
       {&s.running, &s.waiting, &s.kv_pages_total, &s.kv_pages_free, &s.prefix_cache_queries,
        &s.prefix_cache_hits, &s.prompt_tokens, &s.generation_tokens, &s.preemptions}) {
    *v = r.get<int64_t>();
  }
  s.queue_time = get_histogram(r);
  s.iteration_tokens = get_histogram(r);
  for (int64_t* v : {&s.spec_num_drafts, &s.spec_num_draft_tokens, &s.spec_num_accepted_tokens}) {
    *v = r.get<int64_t>();
  }
  s.spec_accepted_per_pos = r.get_vec<int64_t>();
  return s;
}

// ---- DecodeReport codec. ----

std::vector<uint8_t> encode_decode_report(const DecodeReport& rep) {
  ByteWriter w;
  w.put<int64_t>(rep.batch);
  w.put<int64_t>(rep.free_pages);
  w.put<int64_t>(static_cast<int64_t>(rep.reserved.size()));
  for (const auto& res : rep.reserved) {
    w.put_str(res.id);
    w.put<uint8_t>(res.ok ? 1 : 0);
    w.put_str(res.error);
    if (res.ok) put_descriptor(w, res.d);
  }
  w.put<int64_t>(static_cast<int64_t>(rep.kv_events.size()));
  for (const auto& e : rep.kv_events) {
    w.put_str(e.id);
    w.put<uint8_t>(e.ok ? 1 : 0);
    w.put_str(e.error);
  }
  w.put<int64_t>(static_cast<int64_t>(rep.outputs.size()));
  for (const auto& o : rep.outputs) put_step_output(w, o);
  put_stats(w, rep.stats);
  return std::move(w.bytes());
}

DecodeReport decode_decode_report(const std::vector<uint8_t>& bytes) {
  ByteReader r(bytes);
  DecodeReport rep;
  rep.batch = r.get<int64_t>();
  rep.free_pages = r.get<int64_t>();
  const int64_t nres = r.get<int64_t>();
  TANDEM_CHECK_KIND(kIo, nres >= 0 && static_cast<size_t>(nres) <= r.left(), "truncated message");
  for (int64_t i = 0; i < nres; ++i) {
    DecodeReport::Reservation res;
    res.id = r.get_str();
    res.ok = r.get<uint8_t>() != 0;
    res.error = r.get_str();
    if (res.ok) res.d = get_descriptor(r);
    rep.reserved.push_back(std::move(res));
  }
  const int64_t nkv = r.get<int64_t>();
  TANDEM_CHECK_KIND(kIo, nkv >= 0 && static_cast<size_t>(nkv) <= r.left(), "truncated message");
  for (int64_t i = 0; i < nkv; ++i) {
    DecodeReport::KvEvent e;
    e.id = r.get_str();
    e.ok = r.get<uint8_t>() != 0;
    e.error = r.get_str();
    rep.kv_events.push_back(std::move(e));
  }
  const int64_t nout = r.get<int64_t>();
  TANDEM_CHECK_KIND(kIo, nout >= 0 && static_cast<size_t>(nout) <= r.left(), "truncated message");
  for (int64_t i = 0; i < nout; ++i) rep.outputs.push_back(get_step_output(r));
  rep.stats = get_stats(r);
  return rep;
}

}  // namespace tandem
