#include "model/mtp_input.h"

#include <cstring>

#include "backend/cpu/ops.h"
#include "core/error.h"

namespace tandem {

FlatBatch mtp_flat_batch(const ModelConfig& c, const ForwardBatch& batch, const KvCache& kv) {
  TANDEM_CHECK(kv.geometry().num_layers == 1 &&
                   kv.geometry().num_kv_heads == c.num_key_value_heads &&
                   kv.geometry().head_dim == c.head_dim,
               "MTP KV cache geometry does not match the model");
  FlatBatch f = flatten_batch(batch, kv.geometry().page_size);
  for (const int32_t id : f.ids) {
    TANDEM_CHECK_KIND(kInvalidArgument, id >= 0 && id < c.vocab_size, "token id ", id,
                      " is out of range [0, ", c.vocab_size, ")");
  }
  return f;
}

std::vector<float> cpu_mtp_input(const ModelConfig& c, const float* embed, const float* norm_e,
                                 const float* norm_h, const float* fc, const int32_t* ids,
                                 const float* hidden, int64_t n) {
  const int64_t h = c.hidden_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  auto buf = [](int64_t elems) { return std::vector<float>(static_cast<size_t>(elems)); };
  std::vector<float> e = buf(n * h), hn = buf(n * h);  // [n, hidden]
  std::vector<float> cat = buf(n * 2 * h);             // [n, 2 hidden]
  cpu::embedding({ids, embed, e.data(), n, h, c.vocab_size});
  cpu::rms_norm({e.data(), norm_e, e.data(), n, h, eps});
  cpu::rms_norm({hidden, norm_h, hn.data(), n, h, eps});
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(cat.data() + i * 2 * h, e.data() + i * h, sizeof(float) * h);
    std::memcpy(cat.data() + i * 2 * h + h, hn.data() + i * h, sizeof(float) * h);
  }
  std::vector<float> x = buf(n * h);
  cpu::gemm({cat.data(), fc, x.data(), n, h, 2 * h});
  return x;
}

}  // namespace tandem
