#include "engine/speculative.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/error.h"

namespace tandem {

SpeculativeConfig parse_speculative_config(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  TANDEM_CHECK_KIND(kInvalidArgument, j.is_object(), "--speculative-config: not a JSON object: '",
                    text, "'");
  SpeculativeConfig c;
  for (const auto& [key, value] : j.items()) {
    if (key == "method") {
      TANDEM_CHECK_KIND(kInvalidArgument, value.is_string(),
                        "--speculative-config: \"method\" must be a string");
      c.method = value.get<std::string>();
    } else if (key == "num_speculative_tokens") {
      TANDEM_CHECK_KIND(kInvalidArgument, value.is_number_integer(),
                        "--speculative-config: \"num_speculative_tokens\" must be an integer");
      c.num_speculative_tokens = value.get<int64_t>();
    } else if (key == "model") {
      TANDEM_CHECK_KIND(kInvalidArgument, value.is_string() || value.is_null(),
                        "--speculative-config: \"model\" must be a directory (a string)");
      if (value.is_string()) c.model = value.get<std::string>();
    } else {
      TANDEM_THROW(kInvalidArgument, "--speculative-config: unknown field \"", key,
                   "\" (known: method, num_speculative_tokens, model)");
    }
  }
  TANDEM_CHECK_KIND(kInvalidArgument, c.method == "mtp", "--speculative-config: method \"",
                    c.method, "\" is not supported (only \"mtp\")");
  TANDEM_CHECK_KIND(
      kInvalidArgument,
      c.num_speculative_tokens >= 1 && c.num_speculative_tokens <= kMaxSpeculativeTokens,
      "--speculative-config: num_speculative_tokens must be in [1, ", kMaxSpeculativeTokens,
      "], not ", c.num_speculative_tokens);
  return c;
}

AcceptResult accept_draft(std::span<const float> p, std::span<const float> q, int32_t draft,
                          SamplerRng& rng) {
  TANDEM_CHECK(
      draft >= 0 && static_cast<size_t>(draft) < p.size() && (q.empty() || q.size() == p.size()),
      "accept_draft: draft ", draft, " or distributions out of range");
  const auto d = static_cast<size_t>(draft);
  const double pd = p[d];
  const double qd = q.empty() ? 1.0 : q[d];
  // u < p / q  <=>  u * q < p (q(d) > 0: the draft was drawn from q).
  if (uniform_draw(rng) * qd < pd) return {draft, true};
  std::vector<float> residual(p.size());  // max(0, p - q)
  for (size_t i = 0; i < p.size(); ++i) {
    const float qi = q.empty() ? (i == d ? 1.0f : 0.0f) : q[i];
    residual[i] = std::max(0.0f, p[i] - qi);
  }
  const int32_t t = sample_from_weights(residual, rng);
  if (t >= 0) return {t, false};
  // p <= q everywhere (rounding: p == q): rejection had probability ~0; draw from p.
  return {sample_from_weights(p, rng), false};
}

}  // namespace tandem
