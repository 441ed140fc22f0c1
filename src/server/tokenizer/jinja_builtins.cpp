// Built-ins of the Jinja interpreter: attribute/item access, Python str/dict/list methods,
// operators, filters, tests and globals, with Jinja 3.1 / Python semantics.
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <limits>

#include "server/tokenizer/jinja_ast.h"
#include "server/tokenizer/utf8.h"

namespace tandem::jinja {
namespace {

constexpr int64_t kMaxRange = 100000;  // jinja2.sandbox.MAX_RANGE

// ---- string helpers (code points, Python semantics) ----

char32_t lower_cp(char32_t c) {
  return static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c)));
}
char32_t upper_cp(char32_t c) {
  return static_cast<char32_t>(utf8proc_toupper(static_cast<utf8proc_int32_t>(c)));
}
bool is_alpha_cp(char32_t c) {
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO: return true;
    default: return false;
  }
}
bool is_digit_cp(char32_t c) {
  return utf8proc_category(static_cast<utf8proc_int32_t>(c)) == UTF8PROC_CATEGORY_ND;
}
bool is_numeric_cp(char32_t c) {
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_ND || cat == UTF8PROC_CATEGORY_NL || cat == UTF8PROC_CATEGORY_NO;
}
bool is_cased_upper(char32_t c) { return lower_cp(c) != c; }
bool is_cased_lower(char32_t c) { return upper_cp(c) != c; }

// Unconditional one-to-many mappings of Unicode SpecialCasing.txt that Python applies.
const char* special_upper(char32_t c) {
  switch (c) {
    case 0x00DF: return "SS";
    case 0x0149: return "\u02BCN";
    case 0x01F0: return "J\u030C";
    case 0x0390: return "\u0399\u0308\u0301";
    case 0x03B0: return "\u03A5\u0308\u0301";
    case 0x0587: return "\u0535\u0552";
    case 0x1E96: return "H\u0331";
    case 0x1E97: return "T\u0308";
    case 0x1E98: return "W\u030A";
    case 0x1E99: return "Y\u030A";
    case 0x1E9A: return "A\u02BE";
    case 0xFB00: return "FF";
    case 0xFB01: return "FI";
    case 0xFB02: return "FL";
    case 0xFB03: return "FFI";
    case 0xFB04: return "FFL";
    case 0xFB05:
    case 0xFB06: return "ST";
    default: return nullptr;
  }
}

std::string py_lower(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (pos < s.size()) {
    const char32_t c = utf8::next(s, &pos);
    if (c == 0x0130) {
      out += "i\u0307";  // LATIN CAPITAL LETTER I WITH DOT ABOVE
    } else {
      utf8::append(out, lower_cp(c));
    }
  }
  return out;
}

std::string py_upper(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (pos < s.size()) {
    const char32_t c = utf8::next(s, &pos);
    if (const char* special = special_upper(c)) {
      out += special;
    } else {
      utf8::append(out, upper_cp(c));
    }
  }
  return out;
}

// Python str.isupper() (upper = true) / str.islower(): some cased character, and none of
// the other case.
bool py_is_cased(std::string_view s, bool upper) {
  bool any_cased = false;
  size_t pos = 0;
  while (pos < s.size()) {
    const char32_t c = utf8::next(s, &pos);
    const bool up = is_cased_upper(c);
    const bool low = is_cased_lower(c);
    if ((upper && low) || (!upper && up)) return false;
    any_cased = any_cased || up || low;
  }
  return any_cased;
}

std::string py_capitalize(std::string_view s) {
  std::u32string u = utf8::to_u32(s);
  for (size_t i = 0; i < u.size(); ++i) u[i] = i == 0 ? upper_cp(u[i]) : lower_cp(u[i]);
  return utf8::from_u32(u);
}

std::string py_title(std::string_view s) {
  std::u32string u = utf8::to_u32(s);
  bool prev_cased = false;
  for (char32_t& c : u) {
    const bool cased = is_cased_upper(c) || is_cased_lower(c) || is_alpha_cp(c);
    c = prev_cased ? lower_cp(c) : upper_cp(c);
    prev_cased = cased;
  }
  return utf8::from_u32(u);
}

// Jinja's title filter: capitalize the pieces split at runs of [-\s({\[<].
std::string jinja_title(std::string_view s) {
  std::u32string u = utf8::to_u32(s);
  bool start = true;
  for (char32_t& c : u) {
    const bool sep =
        c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || utf8::is_python_space(c);
    if (sep) {
      start = true;
      continue;
    }
    c = start ? upper_cp(c) : lower_cp(c);
    start = false;
  }
  return utf8::from_u32(u);
}

// Python str.strip family; `chars` null means whitespace.
std::string py_strip(std::string_view s, const Value& chars, bool left, bool right) {
  std::u32string u = utf8::to_u32(s);
  std::u32string set;
  const bool by_space = chars.is_none() || chars.is_undefined();
  if (!by_space) {
    if (!chars.is_string()) fail("strip arg must be None or str");
    set = utf8::to_u32(chars.str());
  }
  auto strip_it = [&](char32_t c) {
    return by_space ? utf8::is_python_space(c) : set.find(c) != std::u32string::npos;
  };
  size_t b = 0;
  size_t e = u.size();
  if (left) {
    while (b < e && strip_it(u[b])) ++b;
  }
  if (right) {
    while (e > b && strip_it(u[e - 1])) --e;
  }
  return utf8::from_u32(std::u32string_view(u).substr(b, e - b));
}

ValueList py_split(std::string_view s, const Value& sep, int64_t maxsplit, bool from_right) {
  ValueList out;
  if (sep.is_none() || sep.is_undefined()) {
    std::u32string u = utf8::to_u32(s);
    std::vector<std::pair<size_t, size_t>> words;
    size_t i = 0;
    while (i < u.size()) {
      while (i < u.size() && utf8::is_python_space(u[i])) ++i;
      if (i >= u.size()) break;
      size_t j = i;
      while (j < u.size() && !utf8::is_python_space(u[j])) ++j;
      words.emplace_back(i, j);
      i = j;
    }
    if (maxsplit >= 0 && static_cast<int64_t>(words.size()) > maxsplit + 1) {
      if (!from_right) {
        const auto keep = static_cast<size_t>(maxsplit);
        size_t rest = words[keep].first;
        size_t end = u.size();
        while (end > rest && utf8::is_python_space(u[end - 1])) --end;
        words.resize(keep);
        words.emplace_back(rest, end);
      } else {
        const size_t first_kept = words.size() - static_cast<size_t>(maxsplit);
        size_t begin = 0;
        while (begin < u.size() && utf8::is_python_space(u[begin])) ++begin;
        std::vector<std::pair<size_t, size_t>> w{{begin, words[first_kept - 1].second}};
        w.insert(w.end(), words.begin() + static_cast<std::ptrdiff_t>(first_kept), words.end());
        words = std::move(w);
      }
    }
    for (const auto& [b, e] : words)
      out.emplace_back(utf8::from_u32(std::u32string_view(u).substr(b, e - b)));
    return out;
  }
  if (!sep.is_string()) fail("must be str or None, not " + type_name(sep));
  const std::string& d = sep.str();
  if (d.empty()) fail("empty separator");
  std::vector<std::string> parts;
  if (!from_right) {
    size_t start = 0;
    int64_t n = 0;
    size_t p;
    while ((maxsplit < 0 || n < maxsplit) && (p = s.find(d, start)) != std::string_view::npos) {
      parts.emplace_back(s.substr(start, p - start));
      start = p + d.size();
      ++n;
    }
    parts.emplace_back(s.substr(start));
  } else {
    size_t end = s.size();
    int64_t n = 0;
    while (maxsplit < 0 || n < maxsplit) {
      if (end < d.size()) break;
      const size_t p = s.rfind(d, end - d.size());
      if (p == std::string_view::npos) break;
      parts.emplace_back(s.substr(p + d.size(), end - p - d.size()));
      end = p;
      ++n;
    }
    parts.emplace_back(s.substr(0, end));
    std::reverse(parts.begin(), parts.end());
  }
  for (std::string& p : parts) out.emplace_back(std::move(p));
  return out;
}

bool is_line_break(char32_t c) {
  return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E ||
         c == 0x85 || c == 0x2028 || c == 0x2029;
}

std::vector<std::string> py_splitlines(std::string_view s, bool keepends) {
  std::u32string u = utf8::to_u32(s);
  std::vector<std::string> lines;
  size_t start = 0;
  size_t i = 0;
  while (i < u.size()) {
    if (!is_line_break(u[i])) {
      ++i;
      continue;
    }
    size_t eol = i + 1;
    if (u[i] == '\r' && eol < u.size() && u[eol] == '\n') ++eol;
    lines.push_back(
        utf8::from_u32(std::u32string_view(u).substr(start, (keepends ? eol : i) - start)));
    start = i = eol;
  }
  if (start < u.size()) lines.push_back(utf8::from_u32(std::u32string_view(u).substr(start)));
  return lines;
}

std::string py_replace(std::string_view s, std::string_view old_s, std::string_view new_s,
                       int64_t count) {
  std::string out;
  if (old_s.empty()) {
    // Python inserts `new` before every character and at the end.
    std::u32string u = utf8::to_u32(s);
    int64_t n = 0;
    for (char32_t c : u) {
      if (count < 0 || n < count) {
        out += new_s;
        ++n;
      }
      utf8::append(out, c);
    }
    if (count < 0 || n < count) out += new_s;
    return out;
  }
  size_t start = 0;
  int64_t n = 0;
  size_t p;
  while ((count < 0 || n < count) && (p = s.find(old_s, start)) != std::string_view::npos) {
    out.append(s.substr(start, p - start));
    out.append(new_s);
    start = p + old_s.size();
    ++n;
  }
  out.append(s.substr(start));
  return out;
}

int64_t cp_index(std::string_view s, size_t byte_pos) {
  return static_cast<int64_t>(utf8::length(s.substr(0, byte_pos)));
}

std::string html_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out.push_back(c);
    }
  }
  return out;
}

std::string str_arg(const Value& v, const char* what) {
  if (!v.is_string()) fail(std::string(what) + " must be str, not " + type_name(v));
  return v.str();
}

int64_t int_arg(const Value& v, const char* what) {
  if (!v.is_int()) fail(std::string(what) + " must be an integer, not " + type_name(v));
  return v.as_int();
}

int64_t py_len(const Value& v) {
  switch (v.type()) {
    case Type::kUndefined: return 0;
    case Type::kString: return static_cast<int64_t>(utf8::length(v.str()));
    case Type::kList:
    case Type::kTuple:
      if (v.is_generator()) fail("object of type 'generator' has no len()");
      return static_cast<int64_t>(v.items().size());
    case Type::kDict: return static_cast<int64_t>(v.entries().entries.size());
    default: fail("object of type '" + type_name(v) + "' has no len()");
  }
}

// Starts/ends-with with a str or a tuple of str.
bool affix_match(std::string_view s, const Value& affix, bool prefix) {
  auto one = [&](const Value& a) {
    const std::string x = str_arg(a, prefix ? "startswith arg" : "endswith arg");
    if (x.size() > s.size()) return false;
    return prefix ? s.compare(0, x.size(), x) == 0
                  : s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  if (affix.is_sequence()) {
    for (const Value& a : affix.items()) {
      if (one(a)) return true;
    }
    return false;
  }
  return one(affix);
}

// Python slice of `s` from code point `start` (after Python's index normalization).
std::string_view affix_range(std::string_view s, const CallArgs& a, size_t first_index) {
  const Value start = a.get(first_index, "start", Value::none());
  const Value end = a.get(first_index + 1, "end", Value::none());
  if (start.is_none() && end.is_none()) return s;
  const auto n = static_cast<int64_t>(utf8::length(s));
  auto norm = [&](const Value& v, int64_t fallback) {
    if (v.is_none() || v.is_undefined()) return fallback;
    int64_t i = int_arg(v, "slice index");
    if (i < 0) i = std::max<int64_t>(0, i + n);
    return std::min(i, n);
  };
  const int64_t b = norm(start, 0);
  const int64_t e = std::max(b, norm(end, n));
  std::u32string u = utf8::to_u32(s);
  static thread_local std::string storage;
  storage = utf8::from_u32(
      std::u32string_view(u).substr(static_cast<size_t>(b), static_cast<size_t>(e - b)));
  return storage;
}

Value method(std::string name, std::function<Value(Renderer&, CallArgs&)> fn) {
  return Value::callable(std::move(name), std::move(fn));
}

Value unsafe_method(const std::string& name, const std::string& type) {
  return method(name, [name, type](Renderer&, CallArgs&) -> Value {
    fail("access to attribute '" + name + "' of '" + type +
         "' object is unsafe (chat templates run in an immutable sandbox)");
  });
}

Value string_method(const std::string& s, const std::string& name) {
  auto m = [&](auto fn) { return method("str." + name, fn); };
  if (name == "startswith" || name == "endswith") {
    const bool prefix = name == "startswith";
    return m([s, prefix, name](Renderer&, CallArgs& a) -> Value {
      if (a.positional.empty()) fail(name + "() takes at least 1 argument (0 given)");
      return Value(affix_match(affix_range(s, a, 1), a.positional[0], prefix));
    });
  }
  if (name == "split" || name == "rsplit") {
    const bool right = name == "rsplit";
    return m([s, right](Renderer&, CallArgs& a) -> Value {
      a.check(right ? "rsplit" : "split", 2, {"sep", "maxsplit"});
      const Value maxsplit = a.get(1, "maxsplit", Value(-1));
      return Value::list(
          py_split(s, a.get(0, "sep", Value::none()), int_arg(maxsplit, "maxsplit"), right));
    });
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    const bool left = name != "rstrip";
    const bool right = name != "lstrip";
    return m([s, left, right, name](Renderer&, CallArgs& a) -> Value {
      a.check(name, 1, {});
      return Value(py_strip(s, a.get(0, "chars", Value::none()), left, right));
    });
  }
  if (name == "lower") return m([s](Renderer&, CallArgs&) -> Value { return Value(py_lower(s)); });
  if (name == "upper") return m([s](Renderer&, CallArgs&) -> Value { return Value(py_upper(s)); });
  if (name == "title") return m([s](Renderer&, CallArgs&) -> Value { return Value(py_title(s)); });
  if (name == "capitalize")
    return m([s](Renderer&, CallArgs&) -> Value { return Value(py_capitalize(s)); });
  if (name == "replace") {
    return m([s](Renderer&, CallArgs& a) -> Value {
      a.check("replace", 3, {"count"});
      if (a.positional.size() < 2) fail("replace() takes at least 2 arguments");
      return Value(py_replace(s, str_arg(a.positional[0], "replace() argument 1"),
                              str_arg(a.positional[1], "replace() argument 2"),
                              int_arg(a.get(2, "count", Value(-1)), "count")));
    });
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex") {
    return m([s, name](Renderer&, CallArgs& a) -> Value {
      if (a.positional.empty()) fail(name + "() takes at least 1 argument (0 given)");
      const std::string sub = str_arg(a.positional[0], "substring");
      const bool right = name[0] == 'r';
      const size_t p = right ? s.rfind(sub) : s.find(sub);
      if (p == std::string::npos) {
        if (name.find("index") != std::string::npos) fail("substring not found");
        return Value(-1);
      }
      return Value(cp_index(s, p));
    });
  }
  if (name == "count") {
    return m([s](Renderer&, CallArgs& a) -> Value {
      if (a.positional.empty()) fail("count() takes at least 1 argument (0 given)");
      const std::string sub = str_arg(a.positional[0], "substring");
      if (sub.empty()) return Value(static_cast<int64_t>(utf8::length(s)) + 1);
      int64_t n = 0;
      for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
      return Value(n);
    });
  }
  if (name == "join") {
    return m([s](Renderer&, CallArgs& a) -> Value {
      if (a.positional.size() != 1) fail("join() takes exactly one argument");
      std::string out;
      const ValueList items = iterate(a.positional[0]);
      for (size_t i = 0; i < items.size(); ++i) {
        if (!items[i].is_string()) {
          fail("sequence item " + std::to_string(i) + ": expected str instance, " +
               type_name(items[i]) + " found");
        }
        if (i > 0) out += s;
        out += items[i].str();
      }
      return Value(std::move(out));
    });
  }
  if (name == "splitlines") {
    return m([s](Renderer&, CallArgs& a) -> Value {
      ValueList out;
      for (std::string& l : py_splitlines(s, truthy(a.get(0, "keepends", Value(false)))))
        out.emplace_back(std::move(l));
      return Value::list(std::move(out));
    });
  }
  if (name == "removeprefix" || name == "removesuffix") {
    const bool prefix = name == "removeprefix";
    return m([s, prefix](Renderer&, CallArgs& a) -> Value {
      if (a.positional.size() != 1) fail("takes exactly one argument");
      const std::string x = str_arg(a.positional[0], "argument");
      if (prefix && s.compare(0, x.size(), x) == 0) return Value(s.substr(x.size()));
      if (!prefix && x.size() <= s.size() && s.compare(s.size() - x.size(), x.size(), x) == 0) {
        return Value(s.substr(0, s.size() - x.size()));
      }
      return Value(s);
    });
  }
  if (name == "isdigit" || name == "isalpha" || name == "isalnum" || name == "isspace" ||
      name == "isupper" || name == "islower" || name == "isnumeric" || name == "isdecimal") {
    return m([s, name](Renderer&, CallArgs&) -> Value {
      const std::u32string u = utf8::to_u32(s);
      if (u.empty()) return Value(false);
      if (name == "isupper" || name == "islower") {
        bool any_cased = false;
        for (char32_t c : u) {
          const bool up = is_cased_upper(c);
          const bool low = is_cased_lower(c);
          if ((name == "isupper" && low) || (name == "islower" && up)) return Value(false);
          any_cased = any_cased || up || low;
        }
        return Value(any_cased);
      }
      for (char32_t c : u) {
        bool ok = false;
        if (name == "isdigit" || name == "isdecimal")
          ok = is_digit_cp(c);
        else if (name == "isnumeric")
          ok = is_numeric_cp(c);
        else if (name == "isalpha")
          ok = is_alpha_cp(c);
        else if (name == "isalnum")
          ok = is_alpha_cp(c) || is_numeric_cp(c);
        else
          ok = utf8::is_python_space(c);
        if (!ok) return Value(false);
      }
      return Value(true);
    });
  }
  if (name == "format") {
    return m([](Renderer&, CallArgs&) -> Value {
      fail("str.format() is not supported by this chat template engine");
    });
  }
  return Value::undefined("'str object' has no attribute '" + name + "'");
}

Value dict_method(const Value& obj, const std::string& name) {
  if (name == "items") {
    return method("dict.items", [obj](Renderer&, CallArgs&) -> Value {
      ValueList out;
      for (const auto& [k, v] : obj.entries().entries) out.push_back(Value::tuple({Value(k), v}));
      return Value::view(std::move(out), "dict_items");
    });
  }
  if (name == "keys") {
    return method("dict.keys", [obj](Renderer&, CallArgs&) -> Value {
      ValueList out;
      for (const auto& [k, v] : obj.entries().entries) out.emplace_back(k);
      return Value::view(std::move(out), "dict_keys");
    });
  }
  if (name == "values") {
    return method("dict.values", [obj](Renderer&, CallArgs&) -> Value {
      ValueList out;
      for (const auto& [k, v] : obj.entries().entries) out.push_back(v);
      return Value::view(std::move(out), "dict_values");
    });
  }
  if (name == "get") {
    return method("dict.get", [obj](Renderer&, CallArgs& a) -> Value {
      if (a.positional.empty() || a.positional.size() > 2) fail("get expected 1 or 2 arguments");
      const Value& key = a.positional[0];
      if (key.is_string()) {
        if (const Value* v = obj.entries().find(key.str())) return *v;
      }
      return a.positional.size() > 1 ? a.positional[1] : Value::none();
    });
  }
  if (name == "copy") {
    return method("dict.copy", [obj](Renderer&, CallArgs&) -> Value {
      return Value::dict(std::make_shared<Dict>(obj.entries()));
    });
  }
  return Value();
}

bool is_dict_method(const std::string& name) {
  return name == "items" || name == "keys" || name == "values" || name == "get" || name == "copy" ||
         name == "update" || name == "pop" || name == "popitem" || name == "setdefault" ||
         name == "clear";
}

// ---- filter helpers ----

Value attribute_path(const Value& v, const Value& attribute) {
  if (attribute.is_int()) return get_item(v, attribute);
  const std::string path = to_str(attribute);
  Value cur = v;
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    const std::string part =
        path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    bool numeric = !part.empty() && std::all_of(part.begin(), part.end(),
                                                [](char c) { return c >= '0' && c <= '9'; });
    cur = numeric ? get_item(cur, Value(static_cast<int64_t>(std::stoll(part))))
                  : get_item(cur, Value(part));
    if (dot == std::string::npos) return cur;
    start = dot + 1;
  }
}

JsonOptions json_options(const CallArgs& a) {
  a.check("tojson", 4, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonOptions o;
  o.ensure_ascii = truthy(a.get(0, "ensure_ascii", Value(false)));
  const Value indent = a.get(1, "indent", Value::none());
  if (!indent.is_none()) {
    o.has_indent = true;
    if (indent.is_string()) {
      o.indent = indent.str();
    } else {
      o.indent =
          std::string(static_cast<size_t>(std::max<int64_t>(0, int_arg(indent, "indent"))), ' ');
    }
    o.item_separator = ",";
  }
  const Value seps = a.get(2, "separators", Value::none());
  if (!seps.is_none()) {
    if (!seps.is_sequence() || seps.items().size() != 2)
      fail("separators must be a (item, key) pair");
    o.item_separator = str_arg(seps.items()[0], "separator");
    o.key_separator = str_arg(seps.items()[1], "separator");
  }
  o.sort_keys = truthy(a.get(3, "sort_keys", Value(false)));
  return o;
}

// Remaining positional arguments from `first` on, for select/map style filters.
CallArgs tail_args(const CallArgs& a, size_t first) {
  CallArgs rest;
  for (size_t i = first; i < a.positional.size(); ++i) rest.positional.push_back(a.positional[i]);
  rest.keyword = a.keyword;
  return rest;
}

Value select_like(Renderer& r, const Value& input, const CallArgs& a, bool select, bool by_attr) {
  ValueList out;
  size_t test_index = by_attr ? 1 : 0;
  Value attr;
  if (by_attr) {
    if (a.positional.empty()) fail("missing attribute for selectattr/rejectattr");
    attr = a.positional[0];
  }
  const bool has_test = a.positional.size() > test_index;
  std::string test_name = has_test ? str_arg(a.positional[test_index], "test name") : std::string();
  CallArgs test_args = tail_args(a, test_index + 1);
  for (const Value& item : iterate(input)) {
    const Value subject = by_attr ? attribute_path(item, attr) : item;
    const bool ok = has_test ? r.test(test_name, subject, test_args) : truthy(subject);
    if (ok == select) out.push_back(item);
  }
  return Value::generator(std::move(out));
}

Value int_filter(const Value& v, const Value& fallback, int64_t base) {
  if (v.is_int()) return Value(v.as_int());
  if (v.type() == Type::kFloat) {
    const double f = v.as_float();
    if (!std::isfinite(f)) return fallback;
    return Value(static_cast<int64_t>(std::trunc(f)));
  }
  if (v.is_string()) {
    std::string s;
    for (char c : py_strip(v.str(), Value::none(), true, true)) {
      if (c != '_') s.push_back(c);
    }
    if (s.empty()) return fallback;
    errno = 0;
    char* end = nullptr;
    const long long x = std::strtoll(s.c_str(), &end, static_cast<int>(base));
    if (errno == 0 && end != nullptr && *end == '\0') return Value(static_cast<int64_t>(x));
    end = nullptr;
    const double f = std::strtod(s.c_str(), &end);
    if (end != nullptr && *end == '\0' && std::isfinite(f))
      return Value(static_cast<int64_t>(std::trunc(f)));
  }
  return fallback;
}

Value float_filter(const Value& v, const Value& fallback) {
  if (v.is_number()) return Value(v.as_float());
  if (v.is_string()) {
    const std::string s = py_strip(v.str(), Value::none(), true, true);
    char* end = nullptr;
    const double f = std::strtod(s.c_str(), &end);
    if (!s.empty() && end != nullptr && *end == '\0') return Value(f);
  }
  return fallback;
}

std::string indent_filter(std::string s, const Value& width, bool first, bool blank) {
  const std::string indention =
      width.is_string()
          ? width.str()
          : std::string(static_cast<size_t>(std::max<int64_t>(0, int_arg(width, "width"))), ' ');
  s += "\n";
  std::vector<std::string> lines = py_splitlines(s, false);
  std::string rv;
  if (blank) {
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i > 0) rv += "\n" + indention;
      rv += lines[i];
    }
  } else {
    rv = lines.empty() ? std::string() : lines[0];
    for (size_t i = 1; i < lines.size(); ++i)
      rv += "\n" + (lines[i].empty() ? lines[i] : indention + lines[i]);
  }
  if (first) rv = indention + rv;
  return rv;
}

Value sorted_values(ValueList items, bool reverse, bool case_sensitive, const Value& attribute) {
  std::vector<std::pair<Value, Value>> keyed;
  for (Value& v : items) {
    Value key = attribute.is_none() || attribute.is_undefined() ? v : attribute_path(v, attribute);
    keyed.emplace_back(std::move(key), std::move(v));
  }
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
    const int c = compare(x.first, y.first, !case_sensitive);
    return reverse ? c > 0 : c < 0;
  });
  ValueList out;
  for (auto& kv : keyed) out.push_back(std::move(kv.second));
  return Value::list(std::move(out));
}

using FilterFn = Value (*)(Renderer&, const Value&, CallArgs&);
using TestFn = bool (*)(Renderer&, const Value&, CallArgs&);

Value f_length(Renderer&, const Value& v, CallArgs&) { return Value(py_len(v)); }

const std::vector<std::pair<std::string_view, FilterFn>>& filters() {
  static const std::vector<std::pair<std::string_view, FilterFn>> table = {
      {"abs",
       [](Renderer&, const Value& v, CallArgs&) -> Value {
         if (v.is_int()) return Value(v.as_int() < 0 ? -v.as_int() : v.as_int());
         if (v.type() == Type::kFloat) return Value(std::fabs(v.as_float()));
         fail("bad operand type for abs(): '" + type_name(v) + "'");
       }},
      {"attr",
       [](Renderer&, const Value& v, CallArgs& a) -> Value {
         return get_attribute(v, str_arg(a.get(0, "name"), "attribute name"));
       }},
      {"capitalize",
       [](Renderer&, const Value& v, CallArgs&) -> Value {
         return Value(py_capitalize(to_str(v)));
       }},
      {"count", f_length},
      {"default",
       [](Renderer&, const Value& v, CallArgs& a) -> Value {
         a.check("default", 2, {"default_value", "boolean"});
         const bool boolean = truthy(a.get(1, "boolean", Value(false)));
         if (v.is_undefined() || (boolean && !truthy(v)))
           return a.get(0, "default_value", Value(""));
         return v;
       }},
      {"d", nullptr},  // alias of default, resolved below
      {"dictsort",
       [](Renderer&, const Value& v, CallArgs& a) -> Value {
         a.check("dictsort", 3, {"case_sensitive", "by", "reverse"});
         if (!v.is_dict()) fail("dictsort requires a dict, got " + type_name(v));
         const bool cs = truthy(a.get(0, "case_sensitive", Value(false)));
         const std::string by = to_str(a.get(1, "by", Value("key")));
         if (by != "key" && by != "value") fail("You can only sort by either 'key' or 'value'");
         const bool reverse = truthy(a.get(2, "reverse", Value(false)));
         ValueList items;
         for (const auto& [k, val] : v.entries().entries)
           items.push_back(Value::tuple({Value(k), val}));
         return sorted_values(std::move(items), reverse, cs,
                              Value(static_cast<int64_t>(by == "key" ? 0 : 1)));
       }},
      {"escape",
       [](Renderer&, const Value& v, CallArgs&) -> Value { return Value(html_escape(to_str(v))); }},
      {"e", nullptr},
      {"first",
       [](Renderer&, const Value& v, CallArgs&) -> Value {
         const ValueList items = iterate(v);
         if (items.empty()) return Value::undefined("No first item, sequence was empty.");
         return items.front();
       }},
      {"float",
       [](Renderer&, const Value& v, CallArgs& a) -> Value {
         if (v.is_undefined()) fail(v.str().empty() ? "value is undefined" : v.str());
         return float_filter(v, a.get(0, "default", Value(0.0)));
       }},
      {"indent",
       [](Renderer&, const Value& v, CallArgs& a) -> Value {
         a.check("indent", 3, {"width", "first", "blank"});
         if (!v.is_string())
           binary_op(BinaryExpr::Op::kAdd, v, Value("\n"));  // fails like `s += "\n"`
         return Value(indent_filter(to_str(v), a.get(0, "width", Value(4)),
                                    truthy(a.get(1, "first", Value(false))),
                                    truthy(a.get(2, "blank", Value(false)))));
       }},
      {"int",
       [](Renderer&, const Value& v, CallArgs& a) -> Value {
         if (v.is_undefined()) fail(v.str().empty() ? "value is undefined" : v.str());
         return int_filter(v, a.get(0, "default", Value(0)),
                           int_arg(a.get(1, "base", Value(10)), "base"));
       }},
      {"items",
       [](Renderer&, const Value& v, CallArgs&) -> Value {
         if (v.is_undefined()) return Value::list({});
         if (!v.is_dict()) fail("Can only get item pairs from a mapping, got " + type_name(v));
         ValueList out;
         for (const auto& [k, val] : v.entries().entries)
           out.push_back(Value::tuple({Value(k), val}));
         return Value::generator(std::move(out));
       }},
      {"join",
       [](Renderer&, const Value& v, CallArgs& a) -> Value {
         a.check("join", 2, {"d", "attribute"});
         const std::string sep = to_str(a.get(0, "d", Value("")));
         const Value attribute = a.get(1, "attribute", Value::none());
         std::string out;
         bool first = true;
         for (const Value& item : iterate(v)) {
           if (!first) out += sep;
           first = false;
           out += to_str(attribute.is_none() ? item : attribute_path(item, attribute));
         }
         return Value(std::move(out));
       }},
      {"last",
       [](Renderer&, const Value& v, CallArgs&) -> Value {
         if (v.is_generator()) fail("'generator' object is not reversible");
         const ValueList items = iterate(v);
         if (items.empty()) return Value::undefined("No last item, sequence was empty.");
         return items.back();
       }},
      {"length", f_length},
      {"list",
       [](Renderer&, const Value& v, CallArgs&) -> Value { return Value::list(iterate(v)); }},
      {"lower",
       [](Renderer&, const Value& v, CallArgs&) -> Value { return Value(py_lower(to_str(v))); }},
      {"map",
       [](Renderer& r, const Value& v, CallArgs& a) -> Value {
         ValueList out;
         const Value attribute = a.get(99, "attribute", Value());
         if (!attribute.is_undefined()) {
           const Value fallback = a.get(99, "default", Value());
           for (const Value& item : iterate(v)) {
             Value x = attribute_path(item, attribute);
             out.push_back(x.is_undefined() && !fallback.is_undefined() ? fallback : x);
           }
           return Value::generator(std::move(out));
         }
         if (a.positional.empty()) fail("map requires a filter name or attribute=");
         const std::string name = str_arg(a.positional[0], "filter name");
         CallArgs rest = tail_args(a, 1);
         for (const Value& item : iterate(v)) out.push_back(r.filter(name, item, rest));
         return Value::generator(std::move(out));
       }},
      {"max",
       [](Renderer&, const Value& v, CallArgs& a) -> Value {
         const Value sorted =
             sorted_values(iterate(v), true, truthy(a.get(0, "case_sensitive", Value(false))),
                           a.get(1, "attribute", Value::none()));
         if (sorted.items().empty())
           return Value::undefined("No aggregated item, sequence was empty.");
         return sorted.items().front();
       }},
      {"min",
       [](Renderer&, const Value& v, CallArgs& a) -> Value {
         const Value sorted =
             sorted_values(iterate(v), false, truthy(a.get(0, "case_sensitive", Value(false))),
                           a.get(1, "attribute", Value::none()));
         if (sorted.items().empty())
           return Value::undefined("No aggregated item, sequence was empty.");
         return sorted.items().front();
       }},
      {"reject",
       [](Renderer& r, const Value& v, CallArgs& a) -> Value {
         return select_like(r, v, a, false, false);
       }},
      {"rejectattr",
       [](Renderer& r, const Value& v, CallArgs& a) -> Value {
         return select_like(r, v, a, false, true);
       }},
      {"replace",
       [](Renderer&, const Value& v, CallArgs& a) -> Value {
         a.check("replace", 3, {"old", "new", "count"});
         const Value count = a.get(2, "count", Value::none());
         return Value(py_replace(to_str(v), to_str(a.get(0, "old")), to_str(a.get(1, "new")),
                                 count.is_none() ? -1 : int_arg(count, "count")));
       }},
      {"reverse",
       [](Renderer&, const Value& v, CallArgs&) -> Value {
         if (v.is_string()) {
           std::u32string u = utf8::to_u32(v.str());
           std::reverse(u.begin(), u.end());
           return Value(utf8::from_u32(u));
         }
         ValueList items = iterate(v);
         std::reverse(items.begin(), items.end());
         // jinja2 returns reversed(value), an iterator, when the value supports it.
         return v.is_plain_sequence() ? Value::generator(std::move(items))
                                      : Value::list(std::move(items));
       }},
      {"round",
       [](Renderer&, const Value& v, CallArgs& a) -> Value {
         a.check("round", 2, {"precision", "method"});
         const int64_t precision = int_arg(a.get(0, "precision", Value(0)), "precision");
         const std::string m = to_str(a.get(1, "method", Value("common")));
         if (!v.is_number()) fail("round filter needs a number, got " + type_name(v));
         if (v.is_int() && m == "common" && precision >= 0)
           return Value(v.as_int());  // Python round(int)
         if (m != "common" && m != "ceil" && m != "floor")
           fail("method must be common, ceil or floor");
         if (m == "common" && precision >= 0 && precision < 300) {
           // Python's round(): correctly rounded on the exact binary value, ties to even
           // (glibc's printf rounds the same way).
           char buf[512];
           std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(precision), v.as_float());
           return Value(std::strtod(buf, nullptr));
         }
         const double scale = std::pow(10.0, static_cast<double>(precision));
         const double x = v.as_float() * scale;
         const double y = m == "ceil"    ? std::ceil(x)
                          : m == "floor" ? std::floor(x)
                                         : std::nearbyint(x);
         return Value(y / scale);
       }},
      {"safe", [](Renderer&, const Value& v, CallArgs&) -> Value { return v; }},
      {"select",
       [](Renderer& r, const Value& v, CallArgs& a) -> Value {
         return select_like(r, v, a, true, false);
       }},
      {"selectattr",
       [](Renderer& r, const Value& v, CallArgs& a) -> Value {
         return select_like(r, v, a, true, true);
       }},
      {"sort",
       [](Renderer&, const Value& v, CallArgs& a) -> Value {
         a.check("sort", 3, {"reverse", "case_sensitive", "attribute"});
         return sorted_values(iterate(v), truthy(a.get(0, "reverse", Value(false))),
                              truthy(a.get(1, "case_sensitive", Value(false))),
                              a.get(2, "attribute", Value::none()));
       }},
      {"string", [](Renderer&, const Value& v, CallArgs&) -> Value { return Value(to_str(v)); }},
      {"sum",
       [](Renderer&, const Value& v, CallArgs& a) -> Value {
         a.check("sum", 2, {"attribute", "start"});
         const Value attribute = a.get(0, "attribute", Value::none());
         Value total = a.get(1, "start", Value(0));
         for (const Value& item : iterate(v)) {
           total = binary_op(BinaryExpr::Op::kAdd, total,
                             attribute.is_none() ? item : attribute_path(item, attribute));
         }
         return total;
       }},
      {"title",
       [](Renderer&, const Value& v, CallArgs&) -> Value { return Value(jinja_title(to_str(v))); }},
      {"tojson",
       [](Renderer&, const Value& v, CallArgs& a) -> Value {
         return Value(to_json(v, json_options(a)));
       }},
      {"trim",
       [](Renderer&, const Value& v, CallArgs& a) -> Value {
         return Value(py_strip(to_str(v), a.get(0, "chars", Value::none()), true, true));
       }},
      {"unique",
       [](Renderer&, const Value& v, CallArgs& a) -> Value {
         a.check("unique", 2, {"case_sensitive", "attribute"});
         const bool cs = truthy(a.get(0, "case_sensitive", Value(false)));
         const Value attribute = a.get(1, "attribute", Value::none());
         ValueList out;
         ValueList seen;
         for (const Value& item : iterate(v)) {
           Value key = attribute.is_none() ? item : attribute_path(item, attribute);
           if (!cs && key.is_string()) key = Value(py_lower(key.str()));
           bool dup = false;
           for (const Value& s : seen) dup = dup || equals(s, key);
           if (!dup) {
             seen.push_back(key);
             out.push_back(item);
           }
         }
         return Value::generator(std::move(out));
       }},
      {"upper",
       [](Renderer&, const Value& v, CallArgs&) -> Value { return Value(py_upper(to_str(v))); }},
      {"wordcount",
       [](Renderer&, const Value& v, CallArgs&) -> Value {
         const std::u32string u = utf8::to_u32(to_str(v));
         int64_t n = 0;
         bool in_word = false;
         for (char32_t c : u) {
           const bool w = c == '_' || is_alpha_cp(c) || is_numeric_cp(c);
           if (w && !in_word) ++n;
           in_word = w;
         }
         return Value(n);
       }},
  };
  return table;
}

FilterFn find_filter(std::string_view name) {
  if (name == "d") name = "default";
  if (name == "e") name = "escape";
  for (const auto& [n, fn] : filters()) {
    if (n == name) return fn;
  }
  return nullptr;
}

bool t_defined(Renderer&, const Value& v, CallArgs&) { return !v.is_undefined(); }

const std::vector<std::pair<std::string_view, TestFn>>& tests() {
  static const std::vector<std::pair<std::string_view, TestFn>> table = {
      {"boolean", [](Renderer&, const Value& v, CallArgs&) { return v.type() == Type::kBool; }},
      {"callable",
       [](Renderer&, const Value& v, CallArgs&) { return v.type() == Type::kCallable; }},
      {"defined", t_defined},
      {"undefined", [](Renderer&, const Value& v, CallArgs&) { return v.is_undefined(); }},
      {"divisibleby",
       [](Renderer&, const Value& v, CallArgs& a) {
         return equals(binary_op(BinaryExpr::Op::kMod, v, a.get(0, "num")), Value(0));
       }},
      {"eq", [](Renderer&, const Value& v, CallArgs& a) { return equals(v, a.get(0, "other")); }},
      {"ne", [](Renderer&, const Value& v, CallArgs& a) { return !equals(v, a.get(0, "other")); }},
      {"lt",
       [](Renderer&, const Value& v, CallArgs& a) { return compare(v, a.get(0, "other")) < 0; }},
      {"le",
       [](Renderer&, const Value& v, CallArgs& a) { return compare(v, a.get(0, "other")) <= 0; }},
      {"gt",
       [](Renderer&, const Value& v, CallArgs& a) { return compare(v, a.get(0, "other")) > 0; }},
      {"ge",
       [](Renderer&, const Value& v, CallArgs& a) { return compare(v, a.get(0, "other")) >= 0; }},
      {"escaped", [](Renderer&, const Value&, CallArgs&) { return false; }},
      {"even",
       [](Renderer&, const Value& v, CallArgs&) {
         return equals(binary_op(BinaryExpr::Op::kMod, v, Value(2)), Value(0));
       }},
      {"odd",
       [](Renderer&, const Value& v, CallArgs&) {
         return equals(binary_op(BinaryExpr::Op::kMod, v, Value(2)), Value(1));
       }},
      {"false", [](Renderer&, const Value& v,
                   CallArgs&) { return v.type() == Type::kBool && !v.as_bool(); }},
      {"true",
       [](Renderer&, const Value& v, CallArgs&) { return v.type() == Type::kBool && v.as_bool(); }},
      {"filter", [](Renderer&, const Value& v,
                    CallArgs&) { return v.is_string() && find_filter(v.str()) != nullptr; }},
      {"test", [](Renderer&, const Value& v,
                  CallArgs&) { return v.is_string() && is_known_test(v.str()); }},
      {"float", [](Renderer&, const Value& v, CallArgs&) { return v.type() == Type::kFloat; }},
      {"integer", [](Renderer&, const Value& v, CallArgs&) { return v.type() == Type::kInt; }},
      {"number", [](Renderer&, const Value& v, CallArgs&) { return v.is_number(); }},
      {"in", [](Renderer&, const Value& v, CallArgs& a) { return contains(a.get(0, "seq"), v); }},
      {"iterable",
       [](Renderer&, const Value& v, CallArgs&) {
         return v.is_string() || v.is_sequence() || v.is_dict() || v.is_undefined();
       }},
      {"sequence",
       [](Renderer&, const Value& v, CallArgs&) {
         return v.is_string() || v.is_plain_sequence() || v.is_dict() || v.is_undefined();
       }},
      {"mapping", [](Renderer&, const Value& v, CallArgs&) { return v.is_dict(); }},
      {"none", [](Renderer&, const Value& v, CallArgs&) { return v.is_none(); }},
      {"string", [](Renderer&, const Value& v, CallArgs&) { return v.is_string(); }},
      {"lower", [](Renderer&, const Value& v, CallArgs&) { return py_is_cased(to_str(v), false); }},
      {"upper", [](Renderer&, const Value& v, CallArgs&) { return py_is_cased(to_str(v), true); }},
      {"sameas",
       [](Renderer&, const Value& v, CallArgs& a) {
         const Value o = a.get(0, "other");
         if (v.type() != o.type()) return false;
         if (v.is_none() || v.is_undefined()) return true;
         if (v.type() == Type::kBool) return v.as_bool() == o.as_bool();
         return v.identity() != nullptr && v.identity() == o.identity();
       }},
  };
  return table;
}

TestFn find_test(std::string_view name) {
  static constexpr std::array<std::pair<std::string_view, std::string_view>, 11> kAliases = {{
      {"==", "eq"},
      {"equalto", "eq"},
      {"!=", "ne"},
      {"<", "lt"},
      {"lessthan", "lt"},
      {"<=", "le"},
      {">", "gt"},
      {"greaterthan", "gt"},
      {">=", "ge"},
      {"divisible_by", "divisibleby"},
      {"sameas", "sameas"},
  }};
  for (const auto& [alias, target] : kAliases) {
    if (name == alias) name = target;
  }
  for (const auto& [n, fn] : tests()) {
    if (n == name) return fn;
  }
  return nullptr;
}

// Integer arithmetic that fails on overflow (Python ints are unbounded; ours are not).
template <typename F>
Value checked(F&& op, int64_t a, int64_t b) {
  int64_t r = 0;
  if (op(a, b, &r)) fail("integer overflow in template arithmetic");
  return Value(r);
}
bool add_overflow(int64_t a, int64_t b, int64_t* r) { return __builtin_add_overflow(a, b, r); }
bool sub_overflow(int64_t a, int64_t b, int64_t* r) { return __builtin_sub_overflow(a, b, r); }
bool mul_overflow(int64_t a, int64_t b, int64_t* r) { return __builtin_mul_overflow(a, b, r); }

int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

[[noreturn]] void operand_error(const char* op, const Value& a, const Value& b) {
  if (a.is_undefined()) fail(a.str().empty() ? "value is undefined" : a.str());
  if (b.is_undefined()) fail(b.str().empty() ? "value is undefined" : b.str());
  if (std::string_view(op) == "+" && a.is_string()) {
    fail("can only concatenate str (not \"" + type_name(b) + "\") to str");
  }
  fail(std::string("unsupported operand type(s) for ") + op + ": '" + type_name(a) + "' and '" +
       type_name(b) + "'");
}

}  // namespace

// ---- access ----

Value get_attribute(const Value& object, const std::string& name) {
  switch (object.type()) {
    case Type::kDict: {
      if (is_dict_method(name)) {
        Value m = dict_method(object, name);
        return m.is_undefined() ? unsafe_method(name, "dict") : m;
      }
      if (const Value* v = object.entries().find(name)) return *v;
      return Value::undefined("'dict object' has no attribute '" + name + "'");
    }
    case Type::kNamespace:
      if (const Value* v = object.entries().find(name)) return *v;
      return Value::undefined("'Namespace' object has no attribute '" + name + "'");
    case Type::kString: return string_method(object.str(), name);
    case Type::kList:
    case Type::kTuple: {
      if (name == "index" || name == "count") {
        const bool is_count = name == "count";
        return method(type_name(object) + "." + name,
                      [obj = object, is_count](Renderer&, CallArgs& a) -> Value {
                        if (a.positional.size() != 1) fail("takes exactly one argument");
                        int64_t n = 0;
                        for (size_t i = 0; i < obj.items().size(); ++i) {
                          if (equals(obj.items()[i], a.positional[0])) {
                            if (!is_count) return Value(static_cast<int64_t>(i));
                            ++n;
                          }
                        }
                        if (!is_count) fail(repr(a.positional[0]) + " is not in list");
                        return Value(n);
                      });
      }
      if (name == "append" || name == "extend" || name == "insert" || name == "pop" ||
          name == "remove" || name == "sort" || name == "reverse" || name == "clear") {
        return unsafe_method(name, type_name(object));
      }
      return Value::undefined("'" + type_name(object) + " object' has no attribute '" + name + "'");
    }
    default: return Value::undefined("'" + to_str(object) + "' has no attribute '" + name + "'");
  }
}

Value get_item(const Value& object, const Value& key) {
  switch (object.type()) {
    case Type::kList:
    case Type::kTuple:
    case Type::kString: {
      if (object.is_sequence() && !object.is_plain_sequence()) {
        return Value::undefined("'" + type_name(object) + "' object is not subscriptable");
      }
      if (!key.is_int()) {
        if (key.is_string() && !object.is_string()) return get_attribute(object, key.str());
        if (key.is_string()) return get_attribute(object, key.str());
        return Value::undefined(type_name(object) + " indices must be integers");
      }
      int64_t i = key.as_int();
      if (object.is_string()) {
        const std::u32string u = utf8::to_u32(object.str());
        const auto n = static_cast<int64_t>(u.size());
        if (i < 0) i += n;
        if (i < 0 || i >= n) return Value::undefined("string index out of range");
        std::string out;
        utf8::append(out, u[static_cast<size_t>(i)]);
        return Value(std::move(out));
      }
      const auto n = static_cast<int64_t>(object.items().size());
      if (i < 0) i += n;
      if (i < 0 || i >= n)
        return Value::undefined(type_name(object) + " object has no element " +
                                std::to_string(key.as_int()));
      return object.items()[static_cast<size_t>(i)];
    }
    case Type::kDict: {
      if (key.is_string()) {
        if (const Value* v = object.entries().find(key.str())) return *v;
        if (is_dict_method(key.str())) return get_attribute(object, key.str());
        return Value::undefined("'dict object' has no attribute '" + key.str() + "'");
      }
      return Value::undefined("'dict object' has no attribute " + repr(key));
    }
    default:
      if (key.is_string()) return get_attribute(object, key.str());
      return Value::undefined("'" + type_name(object) + "' object is not subscriptable");
  }
}

Value slice(const Value& object, const Value& start, const Value& stop, const Value& step) {
  auto opt = [](const Value& v) -> std::optional<int64_t> {
    if (v.is_none() || v.is_undefined()) return std::nullopt;
    if (!v.is_int()) fail("slice indices must be integers or None");
    return v.as_int();
  };
  const int64_t st = opt(step).value_or(1);
  if (st == 0) fail("slice step cannot be zero");
  auto pick = [&](int64_t n, auto&& emit) {
    const int64_t lower = st > 0 ? 0 : -1;
    const int64_t upper = st > 0 ? n : n - 1;
    auto adjust = [&](std::optional<int64_t> v, int64_t fallback) {
      if (!v) return fallback;
      int64_t x = *v;
      if (x < 0) {
        x += n;
        if (x < lower) x = lower;
      } else if (x > upper) {
        x = upper;
      }
      return x;
    };
    const int64_t b = adjust(opt(start), st > 0 ? lower : upper);
    const int64_t e = adjust(opt(stop), st > 0 ? upper : lower);
    for (int64_t i = b; st > 0 ? i < e : i > e; i += st) emit(static_cast<size_t>(i));
  };
  if (object.is_string()) {
    const std::u32string u = utf8::to_u32(object.str());
    std::string out;
    pick(static_cast<int64_t>(u.size()), [&](size_t i) { utf8::append(out, u[i]); });
    return Value(std::move(out));
  }
  if (object.is_plain_sequence()) {
    ValueList out;
    const ValueList& items = object.items();
    pick(static_cast<int64_t>(items.size()), [&](size_t i) { out.push_back(items[i]); });
    return object.type() == Type::kTuple ? Value::tuple(std::move(out))
                                         : Value::list(std::move(out));
  }
  fail("'" + type_name(object) + "' object is not subscriptable");
}

ValueList iterate(const Value& v) {
  switch (v.type()) {
    case Type::kUndefined: return {};
    case Type::kList:
    case Type::kTuple: return v.items();
    case Type::kDict: {
      ValueList keys;
      for (const auto& [k, val] : v.entries().entries) keys.emplace_back(k);
      return keys;
    }
    case Type::kString: {
      ValueList chars;
      const std::string& s = v.str();
      size_t pos = 0;
      while (pos < s.size()) {
        const size_t b = pos;
        utf8::next(s, &pos);
        chars.emplace_back(s.substr(b, pos - b));
      }
      return chars;
    }
    default: fail("'" + type_name(v) + "' object is not iterable");
  }
}

bool contains(const Value& container, const Value& item) {
  switch (container.type()) {
    case Type::kUndefined: return false;
    case Type::kString:
      if (!item.is_string())
        fail("'in <string>' requires string as left operand, not " + type_name(item));
      return container.str().find(item.str()) != std::string::npos;
    case Type::kList:
    case Type::kTuple:
      for (const Value& v : container.items()) {
        if (equals(v, item)) return true;
      }
      return false;
    case Type::kDict:
    case Type::kNamespace:
      return item.is_string() && container.entries().find(item.str()) != nullptr;
    default: fail("argument of type '" + type_name(container) + "' is not iterable");
  }
}

Value binary_op(BinaryExpr::Op op, const Value& a, const Value& b) {
  using Op = BinaryExpr::Op;
  if (op == Op::kConcat) return Value(to_str(a) + to_str(b));
  const bool ints = a.is_int() && b.is_int();
  const bool nums = a.is_number() && b.is_number();
  switch (op) {
    case Op::kAdd:
      if (ints) return checked(add_overflow, a.as_int(), b.as_int());
      if (nums) return Value(a.as_float() + b.as_float());
      if (a.is_string() && b.is_string()) return Value(a.str() + b.str());
      if (a.is_sequence() && a.type() == b.type()) {
        ValueList out = a.items();
        out.insert(out.end(), b.items().begin(), b.items().end());
        return a.type() == Type::kTuple ? Value::tuple(std::move(out))
                                        : Value::list(std::move(out));
      }
      operand_error("+", a, b);
    case Op::kSub:
      if (ints) return checked(sub_overflow, a.as_int(), b.as_int());
      if (nums) return Value(a.as_float() - b.as_float());
      operand_error("-", a, b);
    case Op::kMul: {
      if (ints) return checked(mul_overflow, a.as_int(), b.as_int());
      if (nums) return Value(a.as_float() * b.as_float());
      const Value* seq = a.is_int() ? &b : &a;
      const Value* count = a.is_int() ? &a : &b;
      if (count->is_int() && (seq->is_string() || seq->is_sequence())) {
        const int64_t n = std::max<int64_t>(0, count->as_int());
        const size_t unit = seq->is_string() ? seq->str().size() : seq->items().size();
        if (unit * static_cast<size_t>(n) > Renderer::kMaxOutputBytes)
          fail("repetition result too large");
        if (seq->is_string()) {
          std::string out;
          for (int64_t i = 0; i < n; ++i) out += seq->str();
          return Value(std::move(out));
        }
        ValueList out;
        for (int64_t i = 0; i < n; ++i)
          out.insert(out.end(), seq->items().begin(), seq->items().end());
        return seq->type() == Type::kTuple ? Value::tuple(std::move(out))
                                           : Value::list(std::move(out));
      }
      operand_error("*", a, b);
    }
    case Op::kDiv:
      if (nums) {
        if (b.as_float() == 0.0) fail("division by zero");
        return Value(a.as_float() / b.as_float());
      }
      operand_error("/", a, b);
    case Op::kFloorDiv:
      if (ints) {
        if (b.as_int() == 0) fail("integer division or modulo by zero");
        return Value(floor_div(a.as_int(), b.as_int()));
      }
      if (nums) {
        if (b.as_float() == 0.0) fail("float floor division by zero");
        return Value(std::floor(a.as_float() / b.as_float()));
      }
      operand_error("//", a, b);
    case Op::kMod:
      if (ints) {
        if (b.as_int() == 0) fail("integer division or modulo by zero");
        return Value(a.as_int() - floor_div(a.as_int(), b.as_int()) * b.as_int());
      }
      if (nums) {
        if (b.as_float() == 0.0) fail("float modulo");
        double m = std::fmod(a.as_float(), b.as_float());
        if (m != 0 && ((m < 0) != (b.as_float() < 0))) m += b.as_float();
        return Value(m);
      }
      if (a.is_string())
        fail("printf-style '%' string formatting is not supported by this chat template engine");
      operand_error("%", a, b);
    case Op::kPow:
      if (ints && b.as_int() >= 0) {
        int64_t result = 1;
        for (int64_t i = 0; i < b.as_int(); ++i) {
          if (__builtin_mul_overflow(result, a.as_int(), &result))
            fail("integer overflow in template arithmetic");
        }
        return Value(result);
      }
      if (nums) return Value(std::pow(a.as_float(), b.as_float()));
      operand_error("**", a, b);
    case Op::kConcat: break;
  }
  return Value();
}

Value apply_filter(Renderer& r, const std::string& name, const Value& input, CallArgs& args) {
  FilterFn fn = find_filter(name);
  if (fn == nullptr)
    fail("no filter named '" + name + "' (not supported by this chat template engine)");
  return fn(r, input, args);
}

bool apply_test(Renderer& r, const std::string& name, const Value& input, CallArgs& args) {
  TestFn fn = find_test(name);
  if (fn == nullptr)
    fail("no test named '" + name + "' (not supported by this chat template engine)");
  return fn(r, input, args);
}

bool is_known_filter(std::string_view name) { return find_filter(name) != nullptr; }

bool is_known_test(std::string_view name) { return find_test(name) != nullptr; }

void install_globals(Frame& globals) {
  globals.set("range", Value::callable("range", [](Renderer&, CallArgs& a) -> Value {
                a.check("range", 3, {});
                int64_t start = 0;
                int64_t stop = 0;
                int64_t step = 1;
                if (a.positional.size() == 1) {
                  stop = int_arg(a.positional[0], "range() argument");
                } else if (a.positional.size() >= 2) {
                  start = int_arg(a.positional[0], "range() argument");
                  stop = int_arg(a.positional[1], "range() argument");
                  if (a.positional.size() == 3) step = int_arg(a.positional[2], "range() argument");
                } else {
                  fail("range expected at least 1 argument, got 0");
                }
                if (step == 0) fail("range() arg 3 must not be zero");
                const int64_t count = step > 0
                                          ? (stop > start ? (stop - start + step - 1) / step : 0)
                                          : (start > stop ? (start - stop - step - 1) / -step : 0);
                if (count > kMaxRange)
                  fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
                ValueList out;
                out.reserve(static_cast<size_t>(count));
                for (int64_t i = 0; i < count; ++i) out.emplace_back(start + i * step);
                return Value::list(std::move(out));
              }));
  auto make_dict = [](const CallArgs& a, const char* fn) {
    auto d = std::make_shared<Dict>();
    for (const Value& p : a.positional) {
      if (p.is_dict() || p.type() == Type::kNamespace) {
        for (const auto& [k, v] : p.entries().entries) d->set(k, v);
      } else if (p.is_sequence()) {
        for (const Value& pair : p.items()) {
          if (!pair.is_sequence() || pair.items().size() != 2 || !pair.items()[0].is_string()) {
            fail(std::string(fn) + "(): expected (str, value) pairs");
          }
          d->set(pair.items()[0].str(), pair.items()[1]);
        }
      } else {
        fail(std::string(fn) + "(): unsupported positional argument of type " + type_name(p));
      }
    }
    for (const auto& [k, v] : a.keyword) d->set(k, v);
    return d;
  };
  globals.set("namespace",
              Value::callable("namespace", [make_dict](Renderer&, CallArgs& a) -> Value {
                auto d = make_dict(a, "namespace");
                for (const auto& [k, v] : d->entries) {
                  if (!k.empty() && k[0] == '_') {
                    fail(
                        "chat templates cannot store underscore-prefixed attributes on a "
                        "namespace, but got '" +
                        k + "'");
                  }
                }
                return Value::make_namespace(std::move(d));
              }));
  globals.set("dict", Value::callable("dict", [make_dict](Renderer&, CallArgs& a) -> Value {
                return Value::dict(make_dict(a, "dict"));
              }));
  globals.set("raise_exception",
              Value::callable("raise_exception", [](Renderer&, CallArgs& a) -> Value {
                fail(to_str(a.get(0, "message", Value("raise_exception() called"))));
              }));
  globals.set("strftime_now", Value::callable("strftime_now", [](Renderer&, CallArgs& a) -> Value {
                const std::string format = str_arg(a.get(0, "format"), "format");
                const std::time_t now = std::time(nullptr);
                std::tm tm{};
                localtime_r(&now, &tm);
                char buf[512];
                const size_t n = std::strftime(buf, sizeof(buf), format.c_str(), &tm);
                return Value(std::string(buf, n));
              }));
}

}  // namespace tandem::jinja
