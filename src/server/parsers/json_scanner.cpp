#include "server/parsers/json_scanner.h"

#include <nlohmann/json.hpp>

namespace tandem::parsers {

namespace {

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_hex(char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

}  // namespace

void JsonScanner::value_done(Step& s, bool by_this_char) {
  if (stack_.empty()) {
    state_ = State::kDone;
    s.status = Status::kDone;
    return;
  }
  state_ = State::kAfterValue;
  if (member_level()) (by_this_char ? s.value_end : s.value_ended_before) = true;
}

JsonScanner::Step JsonScanner::push(char c) {
  Step s;
  switch (state_) {
    case State::kDone:
      if (!is_ws(c)) return fail(s);
      s.status = Status::kDone;  // trailing whitespace
      return s;
    case State::kError: return fail(s);

    case State::kValue:
    case State::kValueOrClose: {
      if (is_ws(c)) return s;
      if (state_ == State::kValueOrClose && c == ']') {
        stack_.pop_back();
        value_done(s, true);
        return s;
      }
      s.value_begin = member_level();
      switch (c) {
        case '{':
        case '[':
          if (stack_.size() >= kMaxDepth) return fail(s);
          stack_.push_back(c);
          state_ = c == '{' ? State::kKeyOrClose : State::kValueOrClose;
          return s;
        case '"':
          string_is_key_ = false;
          state_ = State::kString;
          return s;
        case '-': num_ = Num::kSign; break;
        case '0': num_ = Num::kZero; break;
        case 't': literal_ = "rue"; break;
        case 'f': literal_ = "alse"; break;
        case 'n': literal_ = "ull"; break;
        default:
          if (c >= '1' && c <= '9') {
            num_ = Num::kInt;
            break;
          }
          return fail(s);
      }
      state_ = literal_ ? State::kLiteral : State::kNumber;
      return s;
    }

    case State::kKeyOrClose:
    case State::kKey:
      if (is_ws(c)) return s;
      if (state_ == State::kKeyOrClose && c == '}') {
        stack_.pop_back();
        value_done(s, true);
        return s;
      }
      if (c != '"') return fail(s);
      s.key_begin = member_level();
      string_is_key_ = true;
      state_ = State::kString;
      return s;

    case State::kColon:
      if (is_ws(c)) return s;
      if (c != ':') return fail(s);
      state_ = State::kValue;
      return s;

    case State::kAfterValue:
      if (is_ws(c)) return s;
      if (c == ',') {
        state_ = stack_.back() == '{' ? State::kKey : State::kValue;
        return s;
      }
      if ((c == '}' && stack_.back() == '{') || (c == ']' && stack_.back() == '[')) {
        stack_.pop_back();
        value_done(s, true);
        return s;
      }
      return fail(s);

    case State::kString:
      if (unicode_left_ > 0) {
        if (!is_hex(c)) return fail(s);
        --unicode_left_;
        return s;
      }
      if (escape_) {
        escape_ = false;
        if (c == 'u') {
          unicode_left_ = 4;
          return s;
        }
        if (std::string_view("\"\\/bfnrt").find(c) == std::string_view::npos) return fail(s);
        return s;
      }
      if (c == '\\') {
        escape_ = true;
        return s;
      }
      if (c == '"') {
        if (string_is_key_) {
          s.key_end = member_level();
          state_ = State::kColon;
        } else {
          value_done(s, true);
        }
        return s;
      }
      if (static_cast<unsigned char>(c) < 0x20) return fail(s);
      return s;

    case State::kNumber: {
      bool ended = false;
      switch (num_) {
        case Num::kSign:
          if (c == '0') {
            num_ = Num::kZero;
          } else if (is_digit(c)) {
            num_ = Num::kInt;
          } else {
            return fail(s);
          }
          return s;
        case Num::kZero:
        case Num::kInt:
        case Num::kFrac:
          if (is_digit(c) && num_ != Num::kZero) return s;
          if (c == '.' && num_ != Num::kFrac) {
            num_ = Num::kDot;
          } else if (c == 'e' || c == 'E') {
            num_ = Num::kExp;
          } else {
            ended = true;
          }
          break;
        case Num::kDot:
          if (!is_digit(c)) return fail(s);
          num_ = Num::kFrac;
          return s;
        case Num::kExp:
          if (c == '+' || c == '-') {
            num_ = Num::kExpSign;
          } else if (is_digit(c)) {
            num_ = Num::kExpDigits;
          } else {
            return fail(s);
          }
          return s;
        case Num::kExpSign:
          if (!is_digit(c)) return fail(s);
          num_ = Num::kExpDigits;
          return s;
        case Num::kExpDigits:
          if (is_digit(c)) return s;
          ended = true;
          break;
      }
      if (!ended) return s;
      // The number ended before c: c belongs to what follows.
      Step before;
      value_done(before, false);
      if (state_ == State::kDone) return is_ws(c) ? before : fail(before);
      Step after = push(c);
      after.value_ended_before = before.value_ended_before;
      return after;
    }

    case State::kLiteral:
      if (c != *literal_) return fail(s);
      ++literal_;
      if (*literal_ == '\0') {
        literal_ = nullptr;
        value_done(s, true);
      }
      return s;
  }
  return fail(s);
}

bool JsonScanner::finish() {
  if (state_ == State::kDone) return true;
  if (state_ == State::kNumber && stack_.empty()) {
    return num_ == Num::kZero || num_ == Num::kInt || num_ == Num::kFrac || num_ == Num::kExpDigits;
  }
  return false;
}

std::string json_escape(const std::string& s) {
  const std::string quoted =
      nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return quoted.substr(1, quoted.size() - 2);
}

}  // namespace tandem::parsers
