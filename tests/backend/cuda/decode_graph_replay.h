// The decode attention's graph-replay check, shared by test_attention_cuda (bf16 pages) and
// test_kv_fp8_cuda (FP8 pages): paged_attention_launch(p) captured once in a CUDA graph at a
// fixed capacity (p.num_tokens sequences, each a decode token, up to p.max_pages_per_seq pages),
// then replayed with other lengths, block tables and queries, as the model's decode steps.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/check.h"
#include "core/error.h"
#include "cuda_test_util.h"

namespace tandem::cuda::test_util {

// One replay's inputs: the queries (bf16 bits) and the block table / sequence / position arrays.
struct DecodeReplayInputs {
  Bits q;
  std::vector<int32_t> table, token_seq, positions;
};

// For each of four sets of sequence lengths (1 to 1024 tokens): a shuffled block table over
// `num_pages` pages (0x3fffffff past each sequence's pages), fresh queries from make_q(), uploaded
// into p's buffers (d_q, d_table, d_seq, d_pos), the output poisoned (NaN), the graph replayed,
// then check(inputs) compares d_out with the caller's reference. p.num_tokens is 4.
template <typename QBuf, typename IBuf, typename OBuf, typename MakeQ, typename Check>
void replay_decode_graph(PagedAttentionParams const& p, int64_t num_pages, cudaStream_t stream,
                         std::mt19937& rng, QBuf& d_q, IBuf& d_table, IBuf& d_seq, IBuf& d_pos,
                         OBuf& d_out, MakeQ make_q, Check check) {
  const int64_t seqs = p.num_tokens, max_pages = p.max_pages_per_seq, ps = p.page_size;
  TANDEM_CHECK(seqs == 4, "replay_decode_graph: 4 sequences");
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TANDEM_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  paged_attention_launch(p, stream);
  TANDEM_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  TANDEM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const std::vector<std::vector<int32_t>> lens = {
      {1, 16, 500, 1024}, {1024, 1, 200, 17}, {3, 3, 3, 3}, {700, 900, 1, 64}};
  for (auto const& len : lens) {
    SCOPED_TRACE("lens " + std::to_string(len[0]) + " " + std::to_string(len[1]) + " " +
                 std::to_string(len[2]) + " " + std::to_string(len[3]));
    std::vector<int32_t> perm(static_cast<size_t>(num_pages));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    DecodeReplayInputs in;
    in.table.assign(static_cast<size_t>(seqs * max_pages), 0x3fffffff);
    in.token_seq.resize(static_cast<size_t>(seqs));
    in.positions.resize(static_cast<size_t>(seqs));
    size_t next = 0;
    for (int64_t s = 0; s < seqs; ++s) {
      for (int64_t pg = 0; pg < (len[s] + ps - 1) / ps; ++pg) {
        in.table[s * max_pages + pg] = perm[next++];
      }
      in.token_seq[s] = static_cast<int32_t>(s);
      in.positions[s] = len[s] - 1;
    }
    in.q = make_q();
    d_q.upload(in.q);
    d_table.upload(in.table);
    d_seq.upload(in.token_seq);
    d_pos.upload(in.positions);
    d_out.poison(0xff);
    TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));
    check(in);
  }
  TANDEM_CUDA_CHECK(cudaGraphExecDestroy(exec));
  TANDEM_CUDA_CHECK(cudaGraphDestroy(graph));
}

}  // namespace tandem::cuda::test_util
