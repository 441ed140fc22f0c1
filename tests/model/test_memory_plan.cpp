// model/memory_plan.h: weight bytes per rank by the shard plan and the loaders' formats, hand
// computed on small configs; the published Qwen3 / Qwen3.5 shapes against their parameter
// counts; the KV / state arithmetic and the refusals.
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "model/hybrid_state.h"
#include "model/memory_plan.h"

namespace tandem {
namespace {

// A Qwen3-MoE config with every layer MoE.
ModelConfig qwen3(int64_t h, int64_t layers, int64_t experts, int64_t inter, int64_t qh,
                  int64_t kvh, int64_t d, int64_t vocab) {
  ModelConfig c;
  c.model_type = "qwen3_moe";
  c.hidden_size = h;
  c.num_hidden_layers = layers;
  c.num_experts = experts;
  c.num_experts_per_tok = 8;
  c.moe_intermediate_size = inter;
  c.intermediate_size = 4 * inter;
  c.num_attention_heads = qh;
  c.num_key_value_heads = kvh;
  c.head_dim = d;
  c.vocab_size = vocab;
  c.max_position_embeddings = 40960;
  return c;
}

// A Qwen3.5 config (3 DeltaNet layers then 1 gated-attention layer, repeated), as
// tools/make_random_checkpoint's presets.
ModelConfig qwen35(int64_t h, int64_t layers, int64_t experts, int64_t top_k, int64_t inter,
                   int64_t qh, int64_t lin_v_heads) {
  ModelConfig c = qwen3(h, layers, experts, inter, qh, 2, 256, 248320);
  c.model_type = "qwen3_5_moe_text";
  c.num_experts_per_tok = top_k;
  c.shared_expert_intermediate_size = inter;
  c.attn_output_gate = true;
  c.weight_prefix = "model.language_model.";
  for (int64_t l = 0; l < layers; ++l) {
    c.layer_types.push_back((l + 1) % 4 == 0 ? ModelConfig::LayerType::kFullAttention
                                             : ModelConfig::LayerType::kLinearAttention);
  }
  c.linear_num_key_heads = 16;
  c.linear_num_value_heads = lin_v_heads;
  c.linear_key_head_dim = 128;
  c.linear_value_head_dim = 128;
  c.linear_conv_kernel_dim = 4;
  c.max_position_embeddings = 262144;
  return c;
}

ModelConfig qwen35_35b() { return qwen35(2048, 40, 256, 8, 512, 16, 32); }
ModelConfig qwen35_122b() { return qwen35(3072, 48, 256, 8, 1024, 32, 64); }
ModelConfig qwen35_397b() { return qwen35(4096, 60, 512, 10, 1024, 32, 64); }

ModelConfig block_fp8(ModelConfig c) {
  c.quant.method = WeightQuant::kFp8Block;
  c.quant.block_rows = c.quant.block_cols = 128;
  return c;
}

MemoryPlanOptions opts(ShardMode mode, int ranks) {
  MemoryPlanOptions o;
  o.mode = mode;
  o.ranks = ranks;
  o.max_model_len = 8192;
  return o;
}

TEST(MemoryPlan, SmallQwen3ByHand) {
  // h 64, 2 layers, 4 experts of 32, 4 q / 2 KV heads of 16, vocab 100, untied, bf16.
  const ModelConfig c = qwen3(64, 2, 4, 32, 4, 2, 16, 100);
  const MemoryPlan one = plan_memory(c, opts(ShardMode::kSingle, 1));
  EXPECT_EQ(one.weights.embedding, 100 * 64 * 2);
  EXPECT_EQ(one.weights.lm_head, 100 * 64 * 2);
  EXPECT_EQ(one.weights.attention, 2 * ((4 + 4) * 16 * 64 * 2 + 64 * 64 * 2 + 2 * 16 * 2));
  EXPECT_EQ(one.weights.experts, 2 * 4 * 3 * 32 * 64 * 2);
  EXPECT_EQ(one.weights.router, 2 * 4 * 64 * 2);
  EXPECT_EQ(one.weights.norms, 64 * 2 + 2 * 2 * 64 * 2);
  EXPECT_EQ(one.weights.total(), 174848);
  EXPECT_EQ(one.weights_all_ranks, 174848);
  EXPECT_EQ(one.kv_bytes_per_token, 2 * 2 * 2 * 16 * 2);  // layers x (k, v) x heads x d x bf16

  // Prefill TP 2: rank 0 holds 2 q heads, 1 KV head, 2 experts, 50 vocab rows.
  const MemoryPlan tp = plan_memory(c, opts(ShardMode::kPrefillTpEp, 2));
  EXPECT_EQ(tp.weights.attention, 2 * ((2 + 2) * 16 * 64 * 2 + 64 * 32 * 2 + 2 * 16 * 2));
  EXPECT_EQ(tp.weights.experts, 2 * 2 * 3 * 32 * 64 * 2);
  EXPECT_EQ(tp.weights.lm_head, 50 * 64 * 2);
  EXPECT_EQ(tp.weights.embedding, 100 * 64 * 2);  // every rank embeds
  EXPECT_EQ(tp.weights.total(), 94720);
  EXPECT_EQ(tp.kv_bytes_per_token, 2 * 2 * 1 * 16 * 2);
  // Decode DP/EP 2: attention and lm_head whole, experts halved.
  const MemoryPlan dp = plan_memory(c, opts(ShardMode::kDecodeDpEp, 2));
  EXPECT_EQ(dp.weights.attention, one.weights.attention);
  EXPECT_EQ(dp.weights.lm_head, one.weights.lm_head);
  EXPECT_EQ(dp.weights.experts, one.weights.experts / 2);
  EXPECT_EQ(dp.weights_all_ranks, 2 * one.weights.total() - one.weights.experts);
  EXPECT_EQ(dp.kv_bytes_per_token, one.kv_bytes_per_token);
  // FP8 KV cache: half the bytes.
  MemoryPlanOptions o8 = opts(ShardMode::kSingle, 1);
  o8.kv_cache_bytes_per_elem = 1;
  EXPECT_EQ(plan_memory(c, o8).kv_bytes_per_token, one.kv_bytes_per_token / 2);
}

TEST(MemoryPlan, QuantizedFormats) {
  QuantConfig none, fp8, mx;
  fp8.method = WeightQuant::kFp8Block;
  mx.method = WeightQuant::kMxfp8;
  EXPECT_EQ(linear_bytes(256, 300, none, false), 256 * 300 * 2);
  EXPECT_EQ(linear_bytes(256, 300, fp8, false), 256 * 300 + 256 * 3 * 4);  // ceil(300/128) = 3
  EXPECT_EQ(linear_bytes(256, 300, mx, false), 256 * 300 * 2);             // dequantized by default
  EXPECT_EQ(linear_bytes(256, 300, mx, true), 256 * 300 + 256 * 10);       // ceil(300/32) = 10

  // Block FP8: linears 1 byte + fp32 per row and 128 columns; router, norms, embedding bf16.
  ModelConfig c = block_fp8(qwen3(128, 2, 4, 64, 4, 2, 32, 100));
  const MemoryPlan m = plan_memory(c, opts(ShardMode::kSingle, 1));
  const int64_t qkv = (4 + 4) * 32;
  EXPECT_EQ(m.weights.attention, 2 * (qkv * 128 + qkv * 4 + 128 * 128 + 128 * 4 + 2 * 32 * 2));
  EXPECT_EQ(m.weights.experts, 2 * 4 * ((2 * 64 * 128 + 2 * 64 * 4) + (128 * 64 + 128 * 4)));
  EXPECT_EQ(m.weights.router, 2 * 4 * 128 * 2);
  EXPECT_EQ(m.weights.embedding, 100 * 128 * 2);
  // modules_to_not_convert keeps a module (and the fused q/k/v it belongs to) in bf16.
  c.quant.not_converted = {"model.layers.1.self_attn.k_proj"};
  const MemoryPlan k = plan_memory(c, opts(ShardMode::kSingle, 1));
  EXPECT_EQ(k.weights.attention,
            m.weights.attention / 2 + qkv * 128 * 2 + 128 * 128 + 128 * 4 + 2 * 32 * 2);
  // A shape the FP8 kernels do not take (k % 16 != 0) stays bf16.
  const MemoryPlan odd =
      plan_memory(block_fp8(qwen3(72, 1, 4, 64, 4, 2, 32, 100)), opts(ShardMode::kSingle, 1));
  // (gate_up's k = 72 does not take FP8, so neither expert GEMM does; o_proj [72, 128] does.)
  EXPECT_EQ(odd.weights.experts, 4 * 3 * 64 * 72 * 2);
  EXPECT_EQ(odd.weights.attention, (4 + 4) * 32 * 72 * 2 + 72 * 128 + 72 * 4 + 2 * 32 * 2);
}

TEST(MemoryPlan, HybridStateAndDeltaNetSplit) {
  const ModelConfig c = qwen35_35b();
  const MemoryPlan one = plan_memory(c, opts(ShardMode::kSingle, 1));
  // 30 DeltaNet layers: conv window 3 x 8192 channels + 32 x 128 x 128 fp32 each.
  EXPECT_EQ(one.state_bytes_per_seq, 30 * (3 * 8192 + 32 * 128 * 128) * 4);
  EXPECT_EQ(one.state_bytes_per_seq, HybridStateLayout::full(c).slot_elems() * 4);
  EXPECT_EQ(one.state_slots_per_seq, 2);  // running + prefix-cache checkpoint
  // 10 attention layers x (k, v) x 2 KV heads x 256 x bf16.
  EXPECT_EQ(one.kv_bytes_per_token, 10 * 2 * 2 * 256 * 2);
  // One DeltaNet layer by hand: in_proj_qkv 8192 x 2048, z 4096 x 2048, b / a 32 x 2048 (bf16),
  // conv1d 8192 x 4 bf16, A_log / dt_bias 32 + norm 128 fp32, out_proj 2048 x 4096.
  const int64_t layer =
      (8192 + 4096 + 64) * 2048 * 2 + 8192 * 4 * 2 + (64 + 128) * 4 + 2048 * 4096 * 2;
  EXPECT_EQ(one.weights.deltanet, 30 * layer);
  // Prefill TP 2: DeltaNet heads halved (8 key, 16 value heads), the state slot too.
  const MemoryPlan tp = plan_memory(c, opts(ShardMode::kPrefillTpEp, 2));
  const int64_t half =
      (4096 + 2048 + 32) * 2048 * 2 + 4096 * 4 * 2 + (32 + 128) * 4 + 2048 * 2048 * 2;
  EXPECT_EQ(tp.weights.deltanet, 30 * half);
  EXPECT_EQ(tp.state_bytes_per_seq, one.state_bytes_per_seq / 2);
  EXPECT_EQ(tp.weights.shared_expert, 40 * (3 * 256 * 2048 * 2 + 2048 * 2));
  EXPECT_EQ(tp.kv_bytes_per_token, one.kv_bytes_per_token / 2);  // 1 of 2 KV heads
  // Decode DP: every DeltaNet head and the whole state per rank.
  const MemoryPlan dp = plan_memory(c, opts(ShardMode::kDecodeDpEp, 4));
  EXPECT_EQ(dp.weights.deltanet, one.weights.deltanet);
  EXPECT_EQ(dp.state_bytes_per_seq, one.state_bytes_per_seq);
}

TEST(MemoryPlan, Qwen35Fp8DenseLinearsAsTheCudaLoaderKeepsThem) {
  // Qwen35MoeCuda keeps its dense linears FP8 as Qwen3MoeCuda does: 1 byte a weight + an fp32
  // scale per row and 128 columns, the DeltaNet in_proj as one matrix (q | k | v | z | b | a
  // rows, padded to a multiple of 8; b / a quantized at load).
  const ModelConfig c = qwen35_35b();
  const int64_t h = c.hidden_size, L = c.num_hidden_layers;
  int64_t linear_layers = 0;
  for (const auto t : c.layer_types) linear_layers += t == ModelConfig::LayerType::kLinearAttention;
  const int64_t attn_layers = L - linear_layers;
  const int64_t hv = c.linear_num_value_heads, dv = c.linear_value_head_dim;
  const int64_t conv = 2 * c.linear_num_key_heads * c.linear_key_head_dim + hv * dv;
  const int64_t in_rows = (conv + hv * dv + 2 * hv + 7) / 8 * 8;
  auto fp8 = [](int64_t n, int64_t k) { return n * k + n * ((k + 127) / 128) * 4; };
  const MemoryPlan bf = plan_memory(c, opts(ShardMode::kSingle, 1));
  const MemoryPlan f8 = plan_memory(block_fp8(c), opts(ShardMode::kSingle, 1));
  const int64_t conv_w = conv * c.linear_conv_kernel_dim * 2, per_head = (2 * hv + dv) * 4;
  EXPECT_EQ(f8.weights.deltanet,
            linear_layers * (fp8(in_rows, h) + conv_w + per_head + fp8(h, hv * dv)));
  EXPECT_EQ(bf.weights.deltanet, linear_layers * ((conv + hv * dv + 2 * hv) * h * 2 + conv_w +
                                                  per_head + h * hv * dv * 2));
  const int64_t d = c.head_dim, qh = c.num_attention_heads, kvh = c.num_key_value_heads;
  EXPECT_EQ(f8.weights.attention,
            attn_layers * (fp8((2 * qh + 2 * kvh) * d, h) + fp8(h, qh * d) + 2 * d * 2));
  const int64_t si = c.shared_expert_intermediate_size;
  EXPECT_EQ(f8.weights.shared_expert, L * (fp8(2 * si, h) + fp8(h, si) + h * 2));
  EXPECT_LT(2 * f8.weights.deltanet, bf.weights.deltanet + bf.weights.deltanet / 4);
  EXPECT_EQ(f8.kv_state_bytes, f8.budget - f8.weights.total() - f8.activations);
  // Decode DP/EP: the same dense linears on every rank.
  const MemoryPlan dp = plan_memory(block_fp8(c), opts(ShardMode::kDecodeDpEp, 4));
  EXPECT_EQ(dp.weights.deltanet, f8.weights.deltanet);
  EXPECT_EQ(dp.weights.attention, f8.weights.attention);
}

TEST(MemoryPlan, PublishedShapesMatchParameterCounts) {
  struct Case {
    ModelConfig c;
    double params;  // published, billions (Qwen3.5: with the vision tower and MTP layer)
    double tol;
  };
  const Case cases[] = {{qwen3(2048, 48, 128, 768, 32, 4, 128, 151936), 30.5, 0.02},
                        {qwen3(4096, 94, 128, 1536, 64, 4, 128, 151936), 235.0, 0.02},
                        {qwen35_35b(), 35.0, 0.03},
                        {qwen35_122b(), 122.0, 0.03},
                        {qwen35_397b(), 397.0, 0.03}};
  for (const Case& k : cases) {
    const MemoryPlan bf = plan_memory(k.c, opts(ShardMode::kSingle, 1));
    const double params = static_cast<double>(bf.weights.total()) / 2 / 1e9;  // ~all bf16
    EXPECT_NEAR(params / k.params, 1.0, k.tol) << k.c.model_type << " " << params << "B";
    // Block FP8: linears about 1 byte (+3% row scales), so between half and 0.6 of bf16.
    const MemoryPlan f8 = plan_memory(block_fp8(k.c), opts(ShardMode::kSingle, 1));
    const double ratio =
        static_cast<double>(f8.weights.total()) / static_cast<double>(bf.weights.total());
    EXPECT_GT(ratio, 0.5) << k.c.model_type;
    EXPECT_LT(ratio, 0.56) << k.c.model_type;
    // Sharding loses nothing: prefill ranks hold disjoint experts and heads; what they repeat
    // is the embedding, the router and the norms (and KV heads fewer than the ranks).
    const MemoryPlan tp4 = plan_memory(k.c, opts(ShardMode::kPrefillTpEp, 4));
    const WeightBytes& w = bf.weights;
    EXPECT_GE(tp4.weights_all_ranks, w.total() + 3 * (w.embedding + w.router + w.norms));
    EXPECT_LT(tp4.weights_all_ranks,
              w.total() + 3 * (w.embedding + w.router + w.norms) + w.total() / 500);
  }
}

TEST(MemoryPlan, KvArithmeticByHand) {
  const ModelConfig c = qwen3(64, 2, 4, 32, 4, 2, 16, 100);
  MemoryPlanOptions o = opts(ShardMode::kSingle, 1);
  o.max_model_len = 100;  // 7 pages of 16 tokens
  o.max_num_seqs = 2;
  o.gpu_memory_utilization = 1.0;
  const MemoryPlan probe = plan_memory(c, o);
  const int64_t page = 16 * 256, seq = 7 * page;
  ASSERT_EQ(probe.page_bytes, page);
  // Exactly 3 sequences and 100 bytes after the weights and activations.
  o.gpu_memory_bytes =
      static_cast<double>(probe.weights.total() + probe.activations + 3 * seq + 100);
  const MemoryPlan m = plan_memory(c, o);
  EXPECT_TRUE(m.fits) << m.refusal;
  EXPECT_EQ(m.kv_state_bytes, 3 * seq + 100);
  EXPECT_EQ(m.max_batch, 3);
  EXPECT_EQ(m.max_context, (3 * seq + 100) / page * 16);
  EXPECT_EQ(m.num_pages, (3 * seq + 100) / page);

  // A hybrid's state slots count per sequence.
  ModelConfig h = qwen35(256, 4, 4, 2, 32, 4, 2);
  h.vocab_size = 100;
  h.linear_num_key_heads = 1;
  h.linear_key_head_dim = h.linear_value_head_dim = 16;
  MemoryPlanOptions oh = o;
  oh.max_num_seqs = 1;
  const MemoryPlan hp = plan_memory(h, oh);
  const int64_t state = 3 * ((2 * 16 + 2 * 16) * 3 + 2 * 16 * 16) * 4;  // 3 DeltaNet layers
  ASSERT_EQ(hp.state_bytes_per_seq, state);
  const int64_t hseq = 7 * hp.page_bytes + 2 * state;
  oh.gpu_memory_bytes = static_cast<double>(hp.weights.total() + hp.activations + 2 * hseq);
  const MemoryPlan h2 = plan_memory(h, oh);
  EXPECT_EQ(h2.max_batch, 2);
  EXPECT_EQ(h2.max_context, (2 * hseq - 2 * state) / hp.page_bytes * 16);
  oh.gpu_memory_bytes -= 1;
  EXPECT_EQ(plan_memory(h, oh).max_batch, 1);
}

TEST(MemoryPlan, RefusesWhatCannotFit) {
  // Qwen3.5-397B-A17B in bf16 on one H200: ~793 GB of weights.
  const MemoryPlan m = plan_memory(qwen35_397b(), opts(ShardMode::kSingle, 1));
  EXPECT_FALSE(m.fits);
  EXPECT_NE(m.refusal.find("exceed the rank's budget"), std::string::npos) << m.refusal;
  EXPECT_NE(m.refusal.find(" by "), std::string::npos) << m.refusal;
  EXPECT_GT(m.weights.total(), int64_t{790} * 1000 * 1000 * 1000);
  // A context no rank can hold: refused naming max-model-len and the shortfall.
  MemoryPlanOptions o = opts(ShardMode::kDecodeDpEp, 16);
  o.max_model_len = 100'000'000;
  const MemoryPlan big = plan_memory(block_fp8(qwen35_397b()), o);
  EXPECT_FALSE(big.fits);
  EXPECT_NE(big.refusal.find("max-model-len 100000000"), std::string::npos) << big.refusal;
  // A layout that does not split is an error (ShardPlan::make's message).
  EXPECT_THROW((void)plan_memory(qwen35_397b(), opts(ShardMode::kDecodeDpEp, 3)), Error);
  EXPECT_THROW((void)plan_memory(qwen35_397b(), opts(ShardMode::kSingle, 2)), Error);
}

TEST(MemoryPlan, SeedLayoutsFitOnH200) {
  // Qwen3.5-397B-A17B FP8: prefill TP4, decode EP8 and EP16 on 141 GB GPUs.
  const ModelConfig c = block_fp8(qwen35_397b());
  for (auto [mode, ranks] :
       {std::pair{ShardMode::kPrefillTpEp, 4}, std::pair{ShardMode::kDecodeDpEp, 8},
        std::pair{ShardMode::kDecodeDpEp, 16}}) {
    const MemoryPlan m = plan_memory(c, opts(mode, ranks));
    EXPECT_TRUE(m.fits) << shard_mode_name(mode) << " " << ranks << ": " << m.refusal;
    EXPECT_GT(m.max_batch, 0);
  }
  // EP16 holds half EP8's experts: more room for KV.
  EXPECT_GT(plan_memory(c, opts(ShardMode::kDecodeDpEp, 16)).max_batch,
            plan_memory(c, opts(ShardMode::kDecodeDpEp, 8)).max_batch);
}

}  // namespace
}  // namespace tandem
