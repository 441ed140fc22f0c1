// The MoE dispatch / combine kernels' device code (src/comm/cuda/moe_kernels.cuh) run on CPU
// threads (tests/comm/cuda_emulation.h), checked against the CPU references of
// tests/comm/cuda/moe_reference.h without a GPU, in CI:
//   - decode (DP-EP): 2 and 3 ranks, dispatch_send / dispatch_recv / a stand-in expert /
//     combine_send / combine_recv back to back for several steps without any host-side
//     synchronisation between the ranks (only the kernels' flags), random, skewed, all-to-one-
//     rank and sparse routing, zero and one token, bf16 (bit-exact) and fp8 payloads, grids of
//     1..3 send blocks; dispatch-only loops (double-buffering); every packed row, its routing
//     metadata, the expert offsets and the combine output compared; rows past T untouched.
//   - prefill (EP): routing + gather + the local weighted sum, bit-exact.
// Built with -fsanitize=thread (test_comm_tsan) it also checks the flag protocol for data races.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <thread>
#include <vector>

#include "core/dtype.h"
// NOTE: the emulated built-ins must precede the device code.
// clang-format off
#include "cuda_emulation.h"
#include "comm/cuda/moe_kernels.cuh"
// clang-format on
#include "cuda/moe_reference.h"
// clang-format on

namespace tandem::comm::cuda {
namespace {

using moe_ref::RoutingKind;
using moe_ref::Tokens;

constexpr int kThreads = 32;  // per emulated block (>= top_k)

struct Aligned {
  std::vector<uint8_t> raw;
  uint8_t* p = nullptr;
  explicit Aligned(size_t n, uint8_t fill = 0) : raw(n + 256, fill) {
    p = raw.data() + (256 - reinterpret_cast<uintptr_t>(raw.data()) % 256) % 256;
  }
};

struct Shape {
  int world, experts, k, hidden, max_tokens;
  MoePayload payload;
  int send_blocks, recv_blocks;
};

// One emulated rank: its peer allocation and local outputs.
struct Rank {
  std::unique_ptr<Aligned> peer, out_x, eo;
  std::vector<int32_t> offsets, row_src, row_token, row_slot, row_expert, scratch;
  std::vector<float> row_weight;
  MoeDecodeParams p{};
};

struct Step {
  std::vector<Tokens> in;  // per rank
  bool combine = true;     // false: dispatch only
};

std::string where(const Shape& s, int step, int rank) {
  std::ostringstream os;
  os << "world " << s.world << " E " << s.experts << " k " << s.k << " H " << s.hidden
     << (s.payload == MoePayload::kFP8 ? " fp8" : " bf16") << " send_blocks " << s.send_blocks
     << " step " << step << " rank " << rank;
  return os.str();
}

void run_decode(const Shape& sh, const std::vector<Step>& steps) {
  const int N = sh.world, L = sh.experts / N, k = sh.k, H = sh.hidden;
  const MoeLayout layout = moe_layout(N, L, sh.max_tokens, k, H, sh.payload);
  const size_t rb = moe_row_bytes(sh.payload, H);
  const int max_rows = N * sh.max_tokens * std::min(k, L);
  std::vector<Rank> ranks(N);
  for (int r = 0; r < N; ++r) {
    Rank& R = ranks[r];
    R.peer = std::make_unique<Aligned>(layout.total, 0);
    R.out_x = std::make_unique<Aligned>(size_t(max_rows) * rb);
    R.eo = std::make_unique<Aligned>(size_t(max_rows) * H * 2);
    R.offsets.resize(L + 1);
    R.row_src.resize(max_rows);
    R.row_token.resize(max_rows);
    R.row_slot.resize(max_rows);
    R.row_expert.resize(max_rows);
    R.row_weight.resize(max_rows);
    R.scratch.resize(size_t(sh.max_tokens) * k);
  }
  for (int r = 0; r < N; ++r) {
    MoeDecodeParams& p = ranks[r].p;
    for (int q = 0; q < N; ++q) p.peer[q] = reinterpret_cast<char*>(ranks[q].peer->p);
    p.out_x = ranks[r].out_x->p;
    p.expert_offsets = ranks[r].offsets.data();
    p.row_src = ranks[r].row_src.data();
    p.row_token = ranks[r].row_token.data();
    p.row_slot = ranks[r].row_slot.data();
    p.row_expert = ranks[r].row_expert.data();
    p.row_weight = ranks[r].row_weight.data();
    p.rank_scratch = ranks[r].scratch.data();
    p.layout = layout;
    p.rank = r;
    p.world_size = N;
    p.num_experts = sh.experts;
    p.local_experts = L;
    p.top_k = k;
    p.hidden = H;
    p.max_tokens = sh.max_tokens;
    p.max_recv_rows = max_rows;
    p.payload = sh.payload;
    p.send_blocks = sh.send_blocks;
    p.timeout_ns = 120ull * 1000 * 1000 * 1000;
  }

  // Per step and rank: what was received (copied out right after dispatch_recv) and the output.
  struct Seen {
    std::vector<int32_t> offsets, src, token, slot, expert;
    std::vector<float> weight;
    std::vector<uint8_t> rows;
    std::vector<uint16_t> out;  // [max_tokens, H], poisoned with 0xffff first
  };
  std::vector<std::vector<Seen>> seen(steps.size(), std::vector<Seen>(N));
  std::vector<std::vector<int32_t>> counts(steps.size(), std::vector<int32_t>(N));
  for (size_t i = 0; i < steps.size(); ++i)
    for (int r = 0; r < N; ++r) counts[i][r] = steps[i].in[r].T;

  std::vector<std::thread> threads;
  for (int r = 0; r < N; ++r) {
    threads.emplace_back([&, r] {
      Rank& R = ranks[r];
      for (size_t i = 0; i < steps.size(); ++i) {
        const Tokens& in = steps[i].in[r];
        MoeDecodeParams p = R.p;
        p.x = in.x.data();
        p.topk_ids = in.ids.data();
        p.topk_weights = in.w.data();
        p.num_tokens = &counts[i][r];
        std::memset(R.out_x->p, 0xff, size_t(max_rows) * rb);  // poison
        std::fill(R.offsets.begin(), R.offsets.end(), -7);
        emu::launch(detail::moe_dispatch_send_kernel, sh.send_blocks, kThreads, kMoeSendSmemBytes,
                    p);
        emu::launch(detail::moe_dispatch_recv_kernel, sh.recv_blocks, kThreads, kMoeSmemBytes, p);
        Seen& s = seen[i][r];
        s.offsets = R.offsets;
        const int rows = std::max(0, R.offsets[L]);
        s.src.assign(R.row_src.begin(), R.row_src.begin() + std::min(rows, max_rows));
        s.token.assign(R.row_token.begin(), R.row_token.begin() + std::min(rows, max_rows));
        s.slot.assign(R.row_slot.begin(), R.row_slot.begin() + std::min(rows, max_rows));
        s.expert.assign(R.row_expert.begin(), R.row_expert.begin() + std::min(rows, max_rows));
        s.weight.assign(R.row_weight.begin(), R.row_weight.begin() + std::min(rows, max_rows));
        s.rows.assign(R.out_x->p, R.out_x->p + size_t(std::min(rows, max_rows)) * rb);
        if (!steps[i].combine) continue;
        detail::FakeExpertParams fp{R.out_x->p, R.offsets.data(), R.row_expert.data(), R.eo->p, L,
                                    H,          sh.payload};
        emu::launch(detail::fake_expert_kernel, 2, kThreads, 0, fp);
        s.out.assign(size_t(sh.max_tokens) * H, 0xffff);
        p.expert_out = R.eo->p;
        p.out = s.out.data();
        p.out_f32 = 0;
        emu::launch(detail::moe_combine_send_kernel, sh.send_blocks, kThreads, 0, p);
        emu::launch(detail::moe_combine_recv_kernel, sh.recv_blocks, kThreads, 1024, p);
      }
    });
  }
  for (auto& t : threads) t.join();

  for (size_t i = 0; i < steps.size(); ++i) {
    std::vector<moe_ref::DecodeRecv> ref(N);
    std::vector<std::vector<uint16_t>> eo(N);
    for (int d = 0; d < N; ++d) {
      ref[d] = moe_ref::decode_dispatch(steps[i].in, d, sh.experts, sh.payload);
      eo[d] = moe_ref::fake_expert(ref[d].rows.data(), ref[d].row_expert.data(), ref[d].num_rows(),
                                   H, sh.payload);
    }
    for (int r = 0; r < N; ++r) {
      const Seen& s = seen[i][r];
      const std::string w = where(sh, static_cast<int>(i), r);
      ASSERT_EQ(s.offsets, ref[r].offsets) << w;
      ASSERT_EQ(s.src, ref[r].row_src) << w;
      ASSERT_EQ(s.token, ref[r].row_token) << w;
      ASSERT_EQ(s.slot, ref[r].row_slot) << w;
      ASSERT_EQ(s.expert, ref[r].row_expert) << w;
      ASSERT_EQ(s.weight, ref[r].row_weight) << w;
      ASSERT_TRUE(s.rows == ref[r].rows) << w << ": packed rows differ";
      if (!steps[i].combine) continue;
      const auto want =
          moe_ref::to_bf16(moe_ref::decode_combine(steps[i].in, r, sh.experts, ref, eo));
      const int T = steps[i].in[r].T;
      for (size_t e = 0; e < want.size(); ++e)
        ASSERT_EQ(s.out[e], want[e]) << w << ": out element " << e << " (token " << e / H << ")";
      for (size_t e = size_t(T) * H; e < s.out.size(); ++e)
        ASSERT_EQ(s.out[e], 0xffff) << w << ": wrote row " << e / H << " past T " << T;
    }
  }
  // Counters agree and the per-kind block counters are back at 0.
  for (int r = 0; r < N; ++r) {
    auto* sig = reinterpret_cast<MoeSignal*>(ranks[r].peer->p);
    auto* sig0 = reinterpret_cast<MoeSignal*>(ranks[0].peer->p);
    for (int kind = 0; kind < 4; ++kind) {
      EXPECT_EQ(sig->calls[kind], sig0->calls[kind]) << "rank " << r << " kind " << kind;
      EXPECT_EQ(sig->done[kind], 0u);
    }
  }
}

Step make_step(const Shape& sh, const std::vector<int>& T, RoutingKind kind, uint64_t seed,
               bool combine = true) {
  Step st;
  st.combine = combine;
  for (int r = 0; r < sh.world; ++r)
    st.in.push_back(moe_ref::make_tokens(T[r], sh.max_tokens, sh.k, sh.hidden, sh.experts, kind,
                                         seed * 100 + r));
  return st;
}

TEST(MoeEmulated, DecodeTwoRanksMixed) {
  const Shape sh{2, 16, 4, 64, 12, MoePayload::kBF16, 3, 2};
  std::vector<Step> steps = {
      make_step(sh, {12, 7}, RoutingKind::kRandom, 1),
      make_step(sh, {5, 0}, RoutingKind::kSkewed, 2),  // zero tokens on rank 1
      make_step(sh, {1, 1}, RoutingKind::kRandom, 3),  // one token each
      make_step(sh, {9, 12}, RoutingKind::kAllFirst, 4),
      make_step(sh, {0, 0}, RoutingKind::kRandom, 5),  // nobody has tokens
      make_step(sh, {11, 3}, RoutingKind::kSparse, 6),
      make_step(sh, {12, 12}, RoutingKind::kRandom, 7),
  };
  run_decode(sh, steps);
}

TEST(MoeEmulated, DecodeThreeRanksOneSendBlock) {
  const Shape sh{3, 12, 3, 32, 8, MoePayload::kBF16, 1, 2};
  std::vector<Step> steps = {make_step(sh, {8, 2, 5}, RoutingKind::kRandom, 11),
                             make_step(sh, {0, 8, 1}, RoutingKind::kSkewed, 12),
                             make_step(sh, {4, 4, 4}, RoutingKind::kSparse, 13),
                             make_step(sh, {7, 0, 8}, RoutingKind::kAllFirst, 14)};
  run_decode(sh, steps);
}

TEST(MoeEmulated, DecodeDispatchOnlyLoopThenCombine) {
  // Dispatch-only steps back to back: the receive buffers alternate by call parity.
  const Shape sh{2, 8, 2, 32, 6, MoePayload::kBF16, 2, 1};
  std::vector<Step> steps;
  for (int i = 0; i < 5; ++i)
    steps.push_back(make_step(sh, {6 - i, i + 1}, RoutingKind::kRandom, 20 + i, false));
  steps.push_back(make_step(sh, {6, 6}, RoutingKind::kRandom, 30));
  run_decode(sh, steps);
}

TEST(MoeEmulated, DecodeMoreTokensThanOneBitmapWord) {
  // T > 32: the per-expert token bitmaps of dispatch_send span several words.
  const Shape sh{2, 8, 2, 16, 70, MoePayload::kBF16, 4, 3};
  std::vector<Step> steps = {make_step(sh, {70, 45}, RoutingKind::kRandom, 50),
                             make_step(sh, {33, 70}, RoutingKind::kSkewed, 51)};
  run_decode(sh, steps);
}

TEST(MoeEmulated, DecodeFp8Payload) {
  const Shape sh{2, 8, 3, 256, 5, MoePayload::kFP8, 2, 2};
  std::vector<Step> steps = {make_step(sh, {5, 3}, RoutingKind::kRandom, 40),
                             make_step(sh, {0, 5}, RoutingKind::kSkewed, 41)};
  run_decode(sh, steps);
}

TEST(MoeEmulated, PrefillRouteGatherCombine) {
  struct Case {
    int T, max_tokens, k, experts, world, rank;
    RoutingKind kind;
    bool device_count;
  };
  const Case cases[] = {{13, 16, 4, 16, 2, 0, RoutingKind::kRandom, true},
                        {16, 16, 4, 16, 2, 1, RoutingKind::kRandom, false},
                        {16, 16, 3, 12, 3, 0, RoutingKind::kAllFirst, true},
                        {16, 16, 3, 12, 3, 2, RoutingKind::kAllFirst, true},  // nothing local
                        {1, 4, 2, 8, 2, 1, RoutingKind::kSkewed, true},
                        {0, 4, 2, 8, 2, 0, RoutingKind::kRandom, true},
                        {40, 40, 5, 20, 2, 1, RoutingKind::kSparse, true},
                        {600, 640, 4, 16, 2, 1, RoutingKind::kRandom, true},  // three tiles
                        {513, 513, 2, 8, 2, 0, RoutingKind::kSkewed, false}};
  const int H = 16;
  uint64_t seed = 77;
  for (const Case& c : cases) {
    const int L = c.experts / c.world, begin = c.rank * L;
    const Tokens in = moe_ref::make_tokens(c.T, c.max_tokens, c.k, H, c.experts, c.kind, ++seed);
    const auto ref = moe_ref::prefill_dispatch(in, begin, L);
    const int max_rows = c.max_tokens * std::min(c.k, L);
    std::vector<uint16_t> out_x(size_t(max_rows) * H, 0xffff);
    std::vector<int32_t> offsets(L + 1, -7), row_token(max_rows, -7), row_slot(max_rows, -7),
        slot_row(size_t(c.max_tokens) * c.k, -7);
    std::vector<float> row_weight(max_rows, -7.f);
    std::vector<int32_t> scratch(moe_prefill_scratch_ints(c.max_tokens, c.k, L), -7);
    int32_t count = c.T;
    PrefillDispatchParams p{in.x.data(),
                            in.ids.data(),
                            in.w.data(),
                            c.device_count ? &count : nullptr,
                            out_x.data(),
                            offsets.data(),
                            row_token.data(),
                            row_slot.data(),
                            row_weight.data(),
                            slot_row.data(),
                            scratch.data(),
                            c.max_tokens,
                            c.k,
                            H,
                            begin,
                            L};
    if (!c.device_count) {
      ASSERT_EQ(c.T, c.max_tokens);
    }
    const int tiles = (c.max_tokens + kMoePrefillTile - 1) / kMoePrefillTile;
    emu::launch(detail::prefill_count_kernel, tiles, kThreads, kMoePrefillSmemBytes, p);
    emu::launch(detail::prefill_scan_kernel, 1, kThreads, size_t(L + 8 + kThreads) * 4, p);
    emu::launch(detail::prefill_gather_kernel, 3, kThreads, 1024, p);
    const int rows = ref.offsets[L];
    ASSERT_EQ(offsets, ref.offsets);
    ASSERT_EQ(std::vector<int32_t>(row_token.begin(), row_token.begin() + rows), ref.row_token);
    ASSERT_EQ(std::vector<int32_t>(row_slot.begin(), row_slot.begin() + rows), ref.row_slot);
    ASSERT_EQ(std::vector<float>(row_weight.begin(), row_weight.begin() + rows), ref.row_weight);
    ASSERT_EQ(slot_row, ref.slot_row);
    ASSERT_TRUE(std::equal(ref.rows.begin(), ref.rows.end(), out_x.begin()));
    // combine: random expert outputs per row, bf16 and fp32 partials
    const auto eo = moe_ref::random_bf16(size_t(std::max(rows, 1)) * H, seed + 1000);
    const auto want = moe_ref::prefill_combine(in, ref, eo);
    for (int f32 = 0; f32 < 2; ++f32) {
      std::vector<uint8_t> out(size_t(c.max_tokens) * H * (f32 ? 4 : 2), 0xff);
      PrefillCombineParams cp{eo.data(),
                              slot_row.data(),
                              in.ids.data(),
                              in.w.data(),
                              c.device_count ? &count : nullptr,
                              out.data(),
                              c.max_tokens,
                              c.k,
                              H,
                              f32};
      emu::launch(detail::prefill_combine_kernel, 2, kThreads, 1024, cp);
      for (size_t e = 0; e < want.size(); ++e) {
        if (f32) {
          float v;
          std::memcpy(&v, out.data() + 4 * e, 4);
          ASSERT_EQ(std::bit_cast<uint32_t>(v), std::bit_cast<uint32_t>(want[e])) << e;
        } else {
          uint16_t v;
          std::memcpy(&v, out.data() + 2 * e, 2);
          ASSERT_EQ(v, f32_to_bf16(want[e])) << "case T " << c.T << " element " << e;
        }
      }
    }
  }
}

// The prefill combine fused with the registered one-shot all-reduce: 2 and 3 ranks, several
// calls back to back (shared per-block epochs, end barrier), bf16 and fp32 partials, T < max.
void run_fused_prefill(int N, int grid) {
  const int H = 16, k = 3, E = 6 * N, L = E / N, max_tokens = 40;
  struct Mem {
    std::unique_ptr<Aligned> sig, reg;
  };
  std::vector<Mem> mem(N);
  for (int r = 0; r < N; ++r) {
    mem[r].sig = std::make_unique<Aligned>(sizeof(Signal), 0);
    mem[r].reg = std::make_unique<Aligned>(size_t(max_tokens) * H * 4, 0);
  }
  struct Call {
    Tokens in;
    int f32;
    std::vector<std::vector<uint16_t>> eo;   // per rank
    std::vector<std::vector<int32_t>> slot;  // per rank: slot_row
    std::vector<std::vector<uint8_t>> out;   // per rank
    std::vector<uint8_t> want;
  };
  std::vector<Call> calls;
  const int Ts[] = {40, 17, 0, 33, 1};
  for (int c = 0; c < 5; ++c) {
    Call call;
    call.in = moe_ref::make_tokens(Ts[c], max_tokens, k, H, E,
                                   c == 3 ? RoutingKind::kSkewed : RoutingKind::kRandom, 900 + c);
    call.f32 = c % 2;
    std::vector<float> acc(size_t(max_tokens) * H, 0.f);
    for (int q = 0; q < N; ++q) {
      const auto ref = moe_ref::prefill_dispatch(call.in, q * L, L);
      call.eo.push_back(moe_ref::random_bf16(size_t(std::max(1, ref.offsets[L])) * H, 77 * c + q));
      call.slot.push_back(ref.slot_row);
      const auto part = moe_ref::prefill_combine(call.in, ref, call.eo.back());
      for (size_t i = 0; i < acc.size(); ++i) {
        const float v = call.f32 ? part[i] : bf16_to_f32(f32_to_bf16(part[i]));
        acc[i] = q == 0 ? v : acc[i] + v;
      }
      call.out.emplace_back(size_t(max_tokens) * H * 4 + 16, 0xff);
    }
    call.want.resize(acc.size() * (call.f32 ? 4 : 2));
    for (size_t i = 0; i < acc.size(); ++i) {
      if (call.f32) {
        std::memcpy(call.want.data() + 4 * i, &acc[i], 4);
      } else {
        const uint16_t h = f32_to_bf16(acc[i]);
        std::memcpy(call.want.data() + 2 * i, &h, 2);
      }
    }
    calls.push_back(std::move(call));
  }
  std::vector<std::thread> ranks;
  std::vector<int32_t> counts(calls.size());
  for (size_t c = 0; c < calls.size(); ++c) counts[c] = calls[c].in.T;
  for (int r = 0; r < N; ++r) {
    ranks.emplace_back([&, r] {
      for (size_t c = 0; c < calls.size(); ++c) {
        Call& call = calls[c];
        AllReduceParams ar{};
        for (int q = 0; q < N; ++q) {
          ar.signals[q] = reinterpret_cast<Signal*>(mem[q].sig->p);
          ar.data[q] = mem[q].reg->p;
        }
        ar.output = call.out[r].data();
        ar.count = size_t(max_tokens) * H;
        ar.rank = r;
        ar.world_size = N;
        ar.timeout_ns = 120ull * 1000 * 1000 * 1000;
        PrefillCombineParams cp{call.eo[r].data(),
                                call.slot[r].data(),
                                call.in.ids.data(),
                                call.in.w.data(),
                                &counts[c],
                                nullptr,
                                max_tokens,
                                k,
                                H,
                                call.f32};
        emu::launch(
            [](const std::pair<PrefillCombineParams, AllReduceParams>& pa) {
              detail::prefill_combine_all_reduce_kernel(pa.first, pa.second);
            },
            grid, kThreads, 1024, std::make_pair(cp, ar));
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (size_t c = 0; c < calls.size(); ++c)
    for (int r = 0; r < N; ++r) {
      const auto& got = calls[c].out[r];
      ASSERT_TRUE(std::equal(calls[c].want.begin(), calls[c].want.end(), got.begin()))
          << "fused prefill combine, " << N << " ranks, call " << c << " rank " << r;
      for (size_t i = calls[c].want.size(); i < got.size(); ++i)
        ASSERT_EQ(got[i], 0xff) << "wrote past end";
    }
}

TEST(MoeEmulated, PrefillCombineFusedAllReduce) {
  run_fused_prefill(2, 3);
  run_fused_prefill(3, 2);
}

}  // namespace
}  // namespace tandem::comm::cuda
