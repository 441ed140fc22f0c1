#include "comm/moe_dispatch.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace tandem::comm {

MoeAllToAll::MoeAllToAll(Communicator& comm, int64_t num_experts, int64_t hidden, int64_t top_k)
    : comm_(comm), num_experts_(num_experts), hidden_(hidden), top_k_(top_k) {
  const int w = comm.world_size();
  TANDEM_CHECK_KIND(kInvalidArgument, num_experts > 0 && num_experts % w == 0,
                    "expert parallelism: ", num_experts, " experts do not split evenly over ", w,
                    " ranks");
  TANDEM_CHECK_KIND(kInvalidArgument, hidden > 0 && top_k > 0 && top_k <= num_experts,
                    "MoeAllToAll: bad hidden ", hidden, " or top_k ", top_k);
  experts_per_rank_ = num_experts / w;
  tokens_sent_.assign(static_cast<size_t>(w), 0);
  pairs_sent_.assign(static_cast<size_t>(w), 0);
  pairs_recv_.assign(static_cast<size_t>(w), 0);
  expert_offsets_.assign(static_cast<size_t>(experts_per_rank_ + 1), 0);
}

void MoeAllToAll::dispatch(const float* x, const int32_t* topk_ids, const float* topk_weights,
                           int64_t num_tokens) {
  const int w = comm_.world_size();
  const int64_t k = top_k_, h = hidden_, row = h + k;
  num_tokens_ = num_tokens;
  topk_ids_.assign(topk_ids, topk_ids + num_tokens * k);
  for (int64_t i = 0; i < num_tokens * k; ++i) {
    TANDEM_CHECK(
        topk_ids_[static_cast<size_t>(i)] >= 0 && topk_ids_[static_cast<size_t>(i)] < num_experts_,
        "expert id ", topk_ids_[static_cast<size_t>(i)], " out of range");
  }
  auto dest_of = [&](int64_t t, int64_t j) {
    return static_cast<int>(topk_ids_[static_cast<size_t>(t * k + j)] / experts_per_rank_);
  };

  // 1. Count what goes where: a token is sent once to each rank holding one of its experts.
  std::fill(tokens_sent_.begin(), tokens_sent_.end(), 0);
  std::fill(pairs_sent_.begin(), pairs_sent_.end(), 0);
  std::vector<char> hit(static_cast<size_t>(w));
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::fill(hit.begin(), hit.end(), 0);
    for (int64_t j = 0; j < k; ++j) {
      const int r = dest_of(t, j);
      ++pairs_sent_[static_cast<size_t>(r)];
      if (!hit[static_cast<size_t>(r)]) {
        hit[static_cast<size_t>(r)] = 1;
        ++tokens_sent_[static_cast<size_t>(r)];
      }
    }
  }
  int64_t total_sent = 0;
  for (int64_t c : tokens_sent_) total_sent += c;

  // 2. Pack per destination rank, in token order: [x | weights] floats and expert ids, with
  //    -1 / 0 in the slots whose expert lives elsewhere.
  send_f_.resize(static_cast<size_t>(total_sent * row));
  send_i_.resize(static_cast<size_t>(total_sent * k));
  int64_t s = 0;
  for (int r = 0; r < w; ++r) {
    for (int64_t t = 0; t < num_tokens; ++t) {
      bool any = false;
      for (int64_t j = 0; j < k && !any; ++j) any = dest_of(t, j) == r;
      if (!any) continue;
      float* f = send_f_.data() + s * row;
      int32_t* ids = send_i_.data() + s * k;
      std::memcpy(f, x + t * h, sizeof(float) * static_cast<size_t>(h));
      for (int64_t j = 0; j < k; ++j) {
        const bool here = dest_of(t, j) == r;
        f[h + j] = here ? topk_weights[t * k + j] : 0.f;
        ids[j] = here ? topk_ids_[static_cast<size_t>(t * k + j)] : -1;
      }
      ++s;
    }
  }

  // 3. Exchange token counts, then the rows and the ids.
  std::vector<int64_t> tokens_recv(static_cast<size_t>(w));
  comm_.all_to_all(tokens_sent_.data(), tokens_recv.data(), 1, DType::kI64);
  std::vector<int64_t> send_counts(static_cast<size_t>(w)), recv_counts(static_cast<size_t>(w));
  int64_t total_recv = 0;
  for (size_t r = 0; r < static_cast<size_t>(w); ++r) total_recv += tokens_recv[r];
  recv_f_.resize(static_cast<size_t>(total_recv * row));
  recv_i_.resize(static_cast<size_t>(total_recv * k));
  for (size_t r = 0; r < static_cast<size_t>(w); ++r) {
    send_counts[r] = tokens_sent_[r] * row;
    recv_counts[r] = tokens_recv[r] * row;
  }
  comm_.all_to_all_v(send_f_.data(), send_counts, recv_f_.data(), recv_counts, DType::kF32);
  for (size_t r = 0; r < static_cast<size_t>(w); ++r) {
    send_counts[r] = tokens_sent_[r] * k;
    recv_counts[r] = tokens_recv[r] * k;
  }
  comm_.all_to_all_v(send_i_.data(), send_counts, recv_i_.data(), recv_counts, DType::kI32);

  // 4. Unpack into one row per pair, grouped by local expert; remember the order the pairs
  //    go back in (source rank, its token order, slot order).
  const int64_t e0 = expert_begin();
  std::fill(expert_offsets_.begin(), expert_offsets_.end(), 0);
  for (int64_t i = 0; i < total_recv * k; ++i) {
    const int32_t id = recv_i_[static_cast<size_t>(i)];
    if (id < 0) continue;
    TANDEM_CHECK(id >= e0 && id < e0 + experts_per_rank_, "expert ", id,
                 " dispatched to the wrong rank ", comm_.rank());
    ++expert_offsets_[static_cast<size_t>(id - e0 + 1)];
  }
  for (size_t e = 1; e < expert_offsets_.size(); ++e) expert_offsets_[e] += expert_offsets_[e - 1];
  const int64_t num_pairs = expert_offsets_.back();
  pair_x_.resize(static_cast<size_t>(num_pairs * h));
  pair_expert_.resize(static_cast<size_t>(num_pairs));
  pair_weight_.resize(static_cast<size_t>(num_pairs));
  pair_out_.resize(static_cast<size_t>(num_pairs * h));
  return_order_.clear();
  std::vector<int64_t> cursor(expert_offsets_.begin(), expert_offsets_.end() - 1);
  int64_t i = 0;
  for (int src = 0; src < w; ++src) {
    pairs_recv_[static_cast<size_t>(src)] = 0;
    for (int64_t n = 0; n < tokens_recv[static_cast<size_t>(src)]; ++n, ++i) {
      const float* f = recv_f_.data() + i * row;
      const int32_t* ids = recv_i_.data() + i * k;
      for (int64_t j = 0; j < k; ++j) {
        if (ids[j] < 0) continue;
        const int64_t p = cursor[static_cast<size_t>(ids[j] - e0)]++;
        std::memcpy(pair_x_.data() + p * h, f, sizeof(float) * static_cast<size_t>(h));
        pair_expert_[static_cast<size_t>(p)] = ids[j];
        pair_weight_[static_cast<size_t>(p)] = f[h + j];
        return_order_.push_back(p);
        ++pairs_recv_[static_cast<size_t>(src)];
      }
    }
  }
}

void MoeAllToAll::combine(float* out) {
  const int w = comm_.world_size();
  const int64_t k = top_k_, h = hidden_;
  // 1. Pair outputs back to their home ranks, in the order the home rank sent them.
  const int64_t num_pairs = static_cast<int64_t>(return_order_.size());
  send_f_.resize(static_cast<size_t>(num_pairs * h));
  for (int64_t i = 0; i < num_pairs; ++i) {
    std::memcpy(send_f_.data() + i * h,
                pair_out_.data() + return_order_[static_cast<size_t>(i)] * h,
                sizeof(float) * static_cast<size_t>(h));
  }
  std::vector<int64_t> send_counts(static_cast<size_t>(w)), recv_counts(static_cast<size_t>(w));
  int64_t total_back = 0;
  for (size_t r = 0; r < static_cast<size_t>(w); ++r) {
    send_counts[r] = pairs_recv_[r] * h;
    recv_counts[r] = pairs_sent_[r] * h;
    total_back += pairs_sent_[r];
  }
  recv_f_.resize(static_cast<size_t>(total_back * h));
  comm_.all_to_all_v(send_f_.data(), send_counts, recv_f_.data(), recv_counts, DType::kF32);

  // 2. Row of each (token, slot): destinations in rank order, tokens in order, slots in order.
  const int64_t n = num_tokens_;
  std::vector<int64_t> slot_row(static_cast<size_t>(n * k), -1);
  int64_t next = 0;
  for (int r = 0; r < w; ++r) {
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        if (topk_ids_[static_cast<size_t>(t * k + j)] / experts_per_rank_ == r) {
          slot_row[static_cast<size_t>(t * k + j)] = next++;
        }
      }
    }
  }
  TANDEM_CHECK(next == total_back, "combine: ", next, " pair rows expected, ", total_back,
               " received");

  // 3. out[t] = 0 + sum in ascending expert id (cpu::moe's accumulation order).
  std::vector<int64_t> order(static_cast<size_t>(k));
  for (int64_t t = 0; t < n; ++t) {
    const int32_t* ids = topk_ids_.data() + t * k;
    for (int64_t j = 0; j < k; ++j) order[static_cast<size_t>(j)] = j;
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
    float* o = out + t * h;
    std::fill(o, o + h, 0.f);
    for (int64_t j : order) {
      const float* c = recv_f_.data() + slot_row[static_cast<size_t>(t * k + j)] * h;
      for (int64_t d = 0; d < h; ++d) o[d] += c[d];
    }
  }
}

}  // namespace tandem::comm
