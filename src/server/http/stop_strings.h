// Stop strings on streamed text: a stop string may span token boundaries, so text that could
// still be the start of one is held back until it is known not to be.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace tandem::openai {

class StopStringMatcher {
 public:
  /// stops: non-empty strings. include_stop: a matched stop string stays in the output.
  explicit StopStringMatcher(std::vector<std::string> stops = {}, bool include_stop = false);

  /// Appends generated text (complete UTF-8) and returns the text that is now safe to emit.
  /// After a match stopped() is true, the output ends before (or after, with include_stop)
  /// the stop string, and later calls return "".
  std::string push(std::string_view text);

  /// End of generation without a match: returns the text still held back.
  std::string flush();

  bool stopped() const { return stopped_; }
  /// The stop string that matched ("" before a match).
  const std::string& matched() const { return matched_; }
  /// Bytes currently held back.
  size_t held_back() const { return pending_.size(); }

 private:
  std::vector<std::string> stops_;
  bool include_stop_;
  std::string pending_;  // text not emitted yet: a suffix that may start a stop string
  bool stopped_ = false;
  std::string matched_;
};

}  // namespace tandem::openai
