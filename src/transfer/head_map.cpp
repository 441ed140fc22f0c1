#include "transfer/head_map.h"

#include <algorithm>

#include "core/error.h"

namespace tandem::transfer {

std::string HeadRange::str() const {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

void KvSharding::validate() const {
  TANDEM_CHECK_KIND(kInvalidArgument, num_kv_heads >= 1 && tp >= 1, "KV sharding needs >= 1 head",
                    " and >= 1 rank, got ", num_kv_heads, " heads over ", tp, " ranks");
  TANDEM_CHECK_KIND(
      kInvalidArgument, tp <= num_kv_heads ? num_kv_heads % tp == 0 : tp % num_kv_heads == 0,
      num_kv_heads, " KV heads neither split over nor replicate evenly on ", tp, " ranks");
}

HeadRange KvSharding::held(int rank) const {
  validate();
  TANDEM_CHECK_KIND(kInvalidArgument, rank >= 0 && rank < tp, "rank ", rank,
                    " outside a TP group of ", tp);
  if (tp <= num_kv_heads) return {rank * num_kv_heads / tp, (rank + 1) * num_kv_heads / tp};
  const int64_t head = rank * num_kv_heads / tp;
  return {head, head + 1};
}

int KvSharding::owner(int64_t head) const {
  validate();
  TANDEM_CHECK_KIND(kInvalidArgument, head >= 0 && head < num_kv_heads, "KV head ", head,
                    " outside [0, ", num_kv_heads, ")");
  if (tp > num_kv_heads) return static_cast<int>(head * replicas());  // first replica
  return static_cast<int>(head / (num_kv_heads / tp));
}

std::string KvSharding::str() const {
  return "TP=" + std::to_string(tp) + " over " + std::to_string(num_kv_heads) + " KV heads";
}

std::optional<HeadSlice> plan_head_slice(const KvSharding& src, int src_rank, HeadRange dst) {
  const HeadRange mine = src.held(src_rank);  // validates sharding and rank
  TANDEM_CHECK_KIND(kInvalidArgument, dst.begin >= 0 && dst.end <= src.num_kv_heads && !dst.empty(),
                    "destination head range ", dst.str(), " is not a non-empty part of [0, ",
                    src.num_kv_heads, ")");
  if (!src.sends(src_rank)) return std::nullopt;
  const HeadRange run{std::max(mine.begin, dst.begin), std::min(mine.end, dst.end)};
  if (run.empty()) return std::nullopt;
  return HeadSlice{run, run.begin - mine.begin, run.begin - dst.begin};
}

std::vector<int> senders_for(const KvSharding& src, HeadRange dst) {
  std::vector<int> out;
  for (int r = 0; r < src.tp; ++r) {
    if (plan_head_slice(src, r, dst)) out.push_back(r);
  }
  return out;
}

}  // namespace tandem::transfer
