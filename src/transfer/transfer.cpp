#include "transfer/transfer.h"

#include "core/error.h"

namespace tandem::transfer {

void TransferDescriptor::validate() const {
  TANDEM_CHECK_KIND(kInvalidArgument, !request_id.empty(),
                    "KV transfer descriptor without a request id");
  const std::string where = "KV transfer descriptor of request '" + request_id + "': ";
  TANDEM_CHECK_KIND(kInvalidArgument, !dst_address.empty(), where, "no destination address");
  try {
    src.validate();
  } catch (const Error& e) {
    TANDEM_THROW(kInvalidArgument, where, "prefill sharding: ", e.message());
  }
  TANDEM_CHECK_KIND(kInvalidArgument,
                    !dst_heads.empty() && dst_heads.begin >= 0 && dst_heads.end <= src.num_kv_heads,
                    where, "head range mismatch: destination heads ", dst_heads.str(),
                    " are not a non-empty part of the model's [0, ", src.num_kv_heads, ")");
  TANDEM_CHECK_KIND(kInvalidArgument,
                    num_tokens >= 1 && page_size >= 1 && head_dim >= 1 && num_layers >= 1, where,
                    "needs num_tokens, page_size, head_dim, num_layers >= 1, got ", num_tokens,
                    ", ", page_size, ", ", head_dim, ", ", num_layers);
  // A bound on the FINISH body a receiver accepts: 1 GiB of state (Qwen3.5-397B's is ~0.2 GB).
  TANDEM_CHECK_KIND(kInvalidArgument, state_elems >= 0 && state_elems <= (int64_t{1} << 28), where,
                    "state_elems ", state_elems, " out of range [0, 2^28]");
  TANDEM_CHECK_KIND(kInvalidArgument,
                    dst_state_slot >= -1 && (dst_state_slot < 0 || state_elems > 0), where,
                    "dst_state_slot ", dst_state_slot, " needs a recurrent state (state_elems ",
                    state_elems, ") and an id >= 0");
  // Likewise for the prompt's hidden states (1 GiB of floats at most).
  TANDEM_CHECK_KIND(kInvalidArgument,
                    hidden_size >= 0 && hidden_size <= (int64_t{1} << 20) &&
                        (hidden_size == 0 || num_tokens <= (int64_t{1} << 28) / hidden_size),
                    where, "hidden_size ", hidden_size, " out of range for ", num_tokens,
                    " tokens ([0, 2^20], and at most 2^28 floats in all)");
  // (not (num_tokens + page_size - 1) / page_size: a peer's num_tokens near 2^63 would overflow)
  const int64_t need = num_tokens / page_size + (num_tokens % page_size != 0 ? 1 : 0);
  TANDEM_CHECK_KIND(kInvalidArgument, static_cast<int64_t>(dst_pages.size()) >= need, where,
                    dst_pages.size(), " destination pages cannot hold ", num_tokens,
                    " tokens at page_size ", page_size, " (", need, " needed)");
}

}  // namespace tandem::transfer
