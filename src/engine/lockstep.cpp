#include "engine/lockstep.h"

namespace tandem {

bool agree_any(comm::Communicator& comm, bool mine) {
  return sum_over_ranks(comm, mine ? 1 : 0) > 0;
}

int64_t sum_over_ranks(comm::Communicator& comm, int64_t mine) {
  comm.all_reduce_sum(&mine, 1, DType::kI64);
  return mine;
}

void broadcast_bytes(comm::Communicator& comm, std::vector<uint8_t>& bytes, int root) {
  int64_t n = static_cast<int64_t>(bytes.size());
  comm.broadcast(&n, 1, DType::kI64, root);
  // NOTE: sent as int32 words (no byte dtype in the communicator); the tail is padding.
  const int64_t words = (n + 3) / 4;
  bytes.resize(static_cast<size_t>(words * 4));
  if (words > 0) comm.broadcast(bytes.data(), words, DType::kI32, root);
  bytes.resize(static_cast<size_t>(n));
}

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
  w.put(r.max_tokens);
  w.put(r.min_tokens);
  w.put_vec(r.stop_token_ids);
  w.put<uint8_t>(r.ignore_eos ? 1 : 0);
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
  r.max_tokens = rd.get<int32_t>();
  r.min_tokens = rd.get<int32_t>();
  r.stop_token_ids = rd.get_vec<int32_t>();
  r.ignore_eos = rd.get<uint8_t>() != 0;
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
  return d;
}

}  // namespace tandem
