#include "server/http/stop_strings.h"

#include <algorithm>

namespace tandem::openai {

StopStringMatcher::StopStringMatcher(std::vector<std::string> stops, bool include_stop)
    : stops_(std::move(stops)), include_stop_(include_stop) {
  std::erase_if(stops_, [](const std::string& s) { return s.empty(); });
}

std::string StopStringMatcher::push(std::string_view text) {
  if (stopped_) return {};
  if (stops_.empty()) return std::string(text);
  pending_.append(text);

  // NOTE: everything emitted so far ends before any possible stop-string start, so a match
  // can only begin inside pending_.
  size_t best = std::string::npos;
  const std::string* best_stop = nullptr;
  for (const auto& s : stops_) {
    size_t pos = pending_.find(s);
    if (pos != std::string::npos && (best == std::string::npos || pos < best)) {
      best = pos;
      best_stop = &s;
    }
  }
  if (best_stop != nullptr) {
    stopped_ = true;
    matched_ = *best_stop;
    std::string out = pending_.substr(0, include_stop_ ? best + best_stop->size() : best);
    pending_.clear();
    return out;
  }

  // Hold back the longest suffix that is a proper prefix of some stop string. The suffix
  // starts where a stop string (valid UTF-8) starts, so the cut is on a code point boundary.
  size_t hold = 0;
  for (const auto& s : stops_) {
    size_t max_k = std::min(pending_.size(), s.size() - 1);
    for (size_t k = max_k; k > hold; --k) {
      if (std::string_view(pending_).substr(pending_.size() - k) ==
          std::string_view(s).substr(0, k)) {
        hold = k;
        break;
      }
    }
  }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string StopStringMatcher::flush() {
  std::string out = std::move(pending_);
  pending_.clear();
  return out;
}

}  // namespace tandem::openai
