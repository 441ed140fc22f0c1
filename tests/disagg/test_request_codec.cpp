// The GenRequest codec (disagg/protocol) carries every SamplingParams field, logit_bias
// included, the constraint's spec and the speculation opt-out, and refuses a truncated
// message; a decode rank's report carries its engine counters (MTP ones included), and
// EngineStats::add sums them.
#include <gtest/gtest.h>

#include "core/error.h"
#include "disagg/protocol.h"

namespace tandem {
namespace {

TEST(RequestCodec, RoundTripsEverySamplingField) {
  GenRequest r;
  r.id = "req-7";
  r.prompt_ids = {1, 2, 3};
  SamplingParams& s = r.sampling;
  s.temperature = 0.7f;
  s.top_p = 0.9f;
  s.top_k = 40;
  s.min_p = 0.05f;
  s.repetition_penalty = 1.1f;
  s.presence_penalty = 0.25f;
  s.frequency_penalty = -0.5f;
  s.seed = 1234567890123ull;
  s.logprobs = 5;
  s.prompt_logprobs = 2;
  s.logit_bias = {{17, -100.0f}, {3, 2.5f}};
  r.max_tokens = 99;
  r.min_tokens = 4;
  r.stop_token_ids = {8, 9};
  r.ignore_eos = true;
  r.allow_speculation = false;
  r.constraint_spec = R"({"grammar": "a spec the engine does not read"})";

  ByteWriter w;
  put_request(w, r);
  ByteReader rd(w.bytes());
  const GenRequest g = get_request(rd);
  EXPECT_EQ(rd.left(), 0u);
  EXPECT_EQ(g.id, r.id);
  EXPECT_EQ(g.prompt_ids, r.prompt_ids);
  EXPECT_EQ(g.sampling.temperature, s.temperature);
  EXPECT_EQ(g.sampling.top_p, s.top_p);
  EXPECT_EQ(g.sampling.top_k, s.top_k);
  EXPECT_EQ(g.sampling.min_p, s.min_p);
  EXPECT_EQ(g.sampling.repetition_penalty, s.repetition_penalty);
  EXPECT_EQ(g.sampling.presence_penalty, s.presence_penalty);
  EXPECT_EQ(g.sampling.frequency_penalty, s.frequency_penalty);
  EXPECT_EQ(g.sampling.seed, s.seed);
  EXPECT_EQ(g.sampling.logprobs, s.logprobs);
  EXPECT_EQ(g.sampling.prompt_logprobs, s.prompt_logprobs);
  ASSERT_EQ(g.sampling.logit_bias.size(), 2u);
  EXPECT_EQ(g.sampling.logit_bias[0].id, 17);
  EXPECT_EQ(g.sampling.logit_bias[0].bias, -100.0f);
  EXPECT_EQ(g.sampling.logit_bias[1].id, 3);
  EXPECT_EQ(g.sampling.logit_bias[1].bias, 2.5f);
  EXPECT_EQ(g.max_tokens, r.max_tokens);
  EXPECT_EQ(g.min_tokens, r.min_tokens);
  EXPECT_EQ(g.stop_token_ids, r.stop_token_ids);
  EXPECT_EQ(g.ignore_eos, r.ignore_eos);
  EXPECT_EQ(g.allow_speculation, false);
  EXPECT_EQ(g.constraint_spec, r.constraint_spec);
  EXPECT_EQ(g.constraint, nullptr);  // the object stays in its process

  // No seed, no biases.
  r.sampling.seed.reset();
  r.sampling.logit_bias.clear();
  ByteWriter w2;
  put_request(w2, r);
  ByteReader rd2(w2.bytes());
  const GenRequest g2 = get_request(rd2);
  EXPECT_FALSE(g2.sampling.seed.has_value());
  EXPECT_TRUE(g2.sampling.logit_bias.empty());

  // A truncated message is an error, not garbage.
  std::vector<uint8_t> cut(w.bytes().begin(), w.bytes().end() - 3);
  ByteReader rd3(cut);
  EXPECT_THROW(get_request(rd3), Error);
}

EngineStats some_stats(int64_t base, size_t k) {
  EngineStats s;
  s.running = base + 1;
  s.waiting = base + 2;
  s.kv_pages_total = base + 3;
  s.kv_pages_free = base + 4;
  s.prefix_cache_queries = base + 5;
  s.prefix_cache_hits = base + 6;
  s.prompt_tokens = base + 7;
  s.generation_tokens = base + 8;
  s.preemptions = base + 9;
  s.spec_num_drafts = base + 10;
  s.spec_num_draft_tokens = base + 11;
  s.spec_num_accepted_tokens = base + 12;
  for (size_t i = 0; i < k; ++i) s.spec_accepted_per_pos.push_back(base + 20 + int64_t(i));
  s.queue_time.observe(kQueueTimeBounds, 0.2 + double(base));
  s.iteration_tokens.observe(kIterationTokensBounds, 7 + double(base));
  return s;
}

TEST(StatsCodec, DecodeReportCarriesTheEngineCounters) {
  DecodeReport rep;
  rep.batch = 3;
  rep.stats = some_stats(100, 3);
  const DecodeReport back = decode_decode_report(encode_decode_report(rep));
  const EngineStats& a = rep.stats;
  const EngineStats& b = back.stats;
  EXPECT_EQ(back.batch, 3);
  for (auto f :
       {&EngineStats::running, &EngineStats::waiting, &EngineStats::kv_pages_total,
        &EngineStats::kv_pages_free, &EngineStats::prefix_cache_queries,
        &EngineStats::prefix_cache_hits, &EngineStats::prompt_tokens,
        &EngineStats::generation_tokens, &EngineStats::preemptions, &EngineStats::spec_num_drafts,
        &EngineStats::spec_num_draft_tokens, &EngineStats::spec_num_accepted_tokens}) {
    EXPECT_EQ(b.*f, a.*f);
  }
  EXPECT_EQ(b.spec_accepted_per_pos, a.spec_accepted_per_pos);
  EXPECT_EQ(b.queue_time.buckets, a.queue_time.buckets);
  EXPECT_EQ(b.iteration_tokens.count, 1u);
  EXPECT_DOUBLE_EQ(b.queue_time.sum, a.queue_time.sum);
  // Truncated anywhere in the counters: an error, not garbage.
  std::vector<uint8_t> bytes = encode_decode_report(rep);
  bytes.resize(bytes.size() - 5);
  EXPECT_THROW(decode_decode_report(bytes), Error);
}

TEST(StatsCodec, AddSumsEveryCounter) {
  EngineStats sum = some_stats(0, 2);
  sum.add(some_stats(100, 3));  // a rank speculating deeper grows the per-position list
  EXPECT_EQ(sum.running, 1 + 101);
  EXPECT_EQ(sum.preemptions, 9 + 109);
  EXPECT_EQ(sum.spec_num_drafts, 10 + 110);
  EXPECT_EQ(sum.spec_num_accepted_tokens, 12 + 112);
  EXPECT_EQ(sum.spec_accepted_per_pos, (std::vector<int64_t>{20 + 120, 21 + 121, 122}));
  EXPECT_EQ(sum.queue_time.count, 2u);
  EXPECT_EQ(sum.iteration_tokens.count, 2u);
}

}  // namespace
}  // namespace tandem

namespace tandem {
namespace {

// Peer-supplied counts are bounded by the bytes left before anything is allocated: a count
// whose byte size wraps 64 bits (2^62 int32s), a billion-page descriptor in a short message,
// a negative count: each is a clean Error(kIo), never an allocation of the claimed size.
TEST(CodecLimits, HugeOrWrappingCountsAreRefusedBeforeAllocating) {
  auto refused = [](const std::vector<uint8_t>& bytes, auto decode) {
    try {
      ByteReader r(bytes);
      decode(r);
    } catch (const Error& e) {
      return e.kind() == ErrorKind::kIo;
    }
    return false;
  };
  for (const int64_t n : {int64_t{1} << 62, int64_t{1} << 61, int64_t{1000000000}, int64_t{-1}}) {
    SCOPED_TRACE(n);
    ByteWriter w;
    w.put_str("req");
    w.put<int64_t>(n);  // the prompt ids' (or the pages') count
    w.put<int32_t>(7);
    EXPECT_TRUE(refused(w.bytes(), [](ByteReader& r) { get_request(r); }));
    ByteWriter d;
    d.put_str("req");
    d.put_str("10.0.0.1:1");
    d.put<int64_t>(n);
    d.put<int32_t>(3);
    EXPECT_TRUE(refused(d.bytes(), [](ByteReader& r) { get_descriptor(r); }));
    ByteWriter v;
    v.put<int64_t>(n);
    v.put<int64_t>(7);
    EXPECT_TRUE(refused(v.bytes(), [](ByteReader& r) { r.get_vec<uint64_t>(); }));
    EXPECT_TRUE(refused(v.bytes(), [](ByteReader& r) { r.get_vec<int32_t>(); }));
  }
}

}  // namespace
}  // namespace tandem
