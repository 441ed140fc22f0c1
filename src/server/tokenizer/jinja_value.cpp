#include "server/tokenizer/jinja_value.h"

#include <utf8proc.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "server/tokenizer/utf8.h"

namespace tandem::jinja {

void fail(std::string message) { throw TemplateError{std::move(message), 0}; }

Value Value::undefined(std::string hint) {
  Value v;
  v.s_ = std::move(hint);
  return v;
}

Value Value::none() {
  Value v;
  v.type_ = Type::kNone;
  return v;
}

Value Value::list(ValueList items) {
  Value v;
  v.type_ = Type::kList;
  v.list_ = std::make_shared<ValueList>(std::move(items));
  return v;
}

Value Value::tuple(ValueList items) {
  Value v = list(std::move(items));
  v.type_ = Type::kTuple;
  return v;
}

Value Value::generator(ValueList items) {
  Value v = list(std::move(items));
  v.s_ = "generator";
  return v;
}

Value Value::view(ValueList items, std::string kind) {
  Value v = list(std::move(items));
  v.s_ = std::move(kind);
  return v;
}

Value Value::dict(std::shared_ptr<Dict> d) {
  Value v;
  v.type_ = Type::kDict;
  v.dict_ = std::move(d);
  return v;
}

Value Value::make_namespace(std::shared_ptr<Dict> d) {
  Value v = dict(std::move(d));
  v.type_ = Type::kNamespace;
  return v;
}

Value Value::callable(std::string name, std::function<Value(Renderer&, CallArgs&)> fn) {
  Value v;
  v.type_ = Type::kCallable;
  v.fn_ = std::make_shared<Callable>(Callable{std::move(name), std::move(fn)});
  return v;
}

Value Value::from_json(const nlohmann::ordered_json& j, int depth) {
  if (depth > kMaxJsonDepth) fail("template context is nested too deeply");
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return none();
    case nlohmann::ordered_json::value_t::boolean: return Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u <= static_cast<uint64_t>(INT64_MAX)) return Value(static_cast<int64_t>(u));
      return Value(static_cast<double>(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      ValueList items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json(e, depth + 1));
      return list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      auto d = std::make_shared<Dict>();
      d->entries.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it)
        d->entries.emplace_back(it.key(), from_json(it.value(), depth + 1));
      return dict(std::move(d));
    }
    default: fail("unsupported JSON value in the template context");
  }
}

const void* Value::identity() const {
  if (dict_) return dict_.get();
  if (list_) return list_.get();
  if (fn_) return fn_.get();
  return nullptr;
}

const Value* Dict::find(std::string_view key) const {
  for (const auto& [k, v] : entries) {
    if (k == key) return &v;
  }
  return nullptr;
}

void Dict::set(const std::string& key, Value value) {
  for (auto& [k, v] : entries) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  entries.emplace_back(key, std::move(value));
}

Value CallArgs::get(size_t index, std::string_view name, Value fallback) const {
  if (index < positional.size()) return positional[index];
  for (const auto& [k, v] : keyword) {
    if (k == name) return v;
  }
  return fallback;
}

void CallArgs::check(std::string_view function, size_t max_positional,
                     std::initializer_list<std::string_view> names) const {
  if (positional.size() > max_positional) {
    fail(std::string(function) + "() takes at most " + std::to_string(max_positional) +
         " positional arguments (" + std::to_string(positional.size()) + " given)");
  }
  for (const auto& [k, v] : keyword) {
    if (std::find(names.begin(), names.end(), k) == names.end()) {
      fail(std::string(function) + "() got an unexpected keyword argument '" + k + "'");
    }
  }
}

bool truthy(const Value& v) {
  switch (v.type()) {
    case Type::kUndefined:
    case Type::kNone: return false;
    case Type::kBool: return v.as_bool();
    case Type::kInt: return v.as_int() != 0;
    case Type::kFloat: return v.as_float() != 0.0;
    case Type::kString: return !v.str().empty();
    case Type::kList:
    case Type::kTuple: return v.is_generator() || !v.items().empty();
    case Type::kDict: return !v.entries().entries.empty();
    case Type::kNamespace:
    case Type::kCallable: return true;
  }
  return false;
}

std::string format_float(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f < 0 ? "-inf" : "inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), f, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<size_t>(res.ptr - buf));
  std::string out;
  size_t pos = 0;
  if (sci[0] == '-') {
    out.push_back('-');
    pos = 1;
  }
  const size_t e_pos = sci.find('e');
  std::string digits;
  for (size_t i = pos; i < e_pos; ++i) {
    if (sci[i] != '.') digits.push_back(sci[i]);
  }
  int exp = 0;
  std::from_chars(sci.data() + e_pos + 1 + (sci[e_pos + 1] == '+' ? 1 : 0), sci.data() + sci.size(),
                  exp);
  const int n = static_cast<int>(digits.size());
  if (exp >= -4 && exp <= 15) {  // Python repr switches to exponents outside this
    const int decpt = exp + 1;
    if (decpt <= 0) {
      out += "0." + std::string(static_cast<size_t>(-decpt), '0') + digits;
    } else if (decpt >= n) {
      out += digits + std::string(static_cast<size_t>(decpt - n), '0') + ".0";
    } else {
      out += digits.substr(0, static_cast<size_t>(decpt)) + "." +
             digits.substr(static_cast<size_t>(decpt));
    }
  } else {
    out += digits.substr(0, 1);
    if (n > 1) out += "." + digits.substr(1);
    char e[16];
    std::snprintf(e, sizeof(e), "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    out += e;
  }
  return out;
}

namespace {

bool is_printable(char32_t cp) {
  if (cp == ' ') return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS: return false;
    default: return true;
  }
}

void append_json_string(std::string_view s, bool ensure_ascii, std::string& out) {
  out.push_back('"');
  size_t pos = 0;
  char hex[16];
  while (pos < s.size()) {
    const auto c = static_cast<uint8_t>(s[pos]);
    if (c < 0x80) {
      ++pos;
      switch (c) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        case '\b': out += "\\b"; break;
        case '\f': out += "\\f"; break;
        default:
          if (c < 0x20 || (ensure_ascii && c == 0x7F)) {
            std::snprintf(hex, sizeof(hex), "\\u%04x", c);
            out += hex;
          } else {
            out.push_back(static_cast<char>(c));
          }
      }
      continue;
    }
    const size_t begin = pos;
    const char32_t cp = utf8::next(s, &pos);
    if (!ensure_ascii) {
      out.append(s.substr(begin, pos - begin));
    } else if (cp < 0x10000) {
      std::snprintf(hex, sizeof(hex), "\\u%04x", static_cast<unsigned>(cp));
      out += hex;
    } else {
      const char32_t v = cp - 0x10000;
      std::snprintf(hex, sizeof(hex), "\\u%04x\\u%04x", static_cast<unsigned>(0xD800 + (v >> 10)),
                    static_cast<unsigned>(0xDC00 + (v & 0x3FF)));
      out += hex;
    }
  }
  out.push_back('"');
}

void dump_json(const Value& v, const JsonOptions& o, int level, std::string& out) {
  auto newline = [&](int lvl) {
    if (!o.has_indent) return;
    out.push_back('\n');
    for (int i = 0; i < lvl; ++i) out += o.indent;
  };
  switch (v.type()) {
    case Type::kNone: out += "null"; return;
    case Type::kBool: out += v.as_bool() ? "true" : "false"; return;
    case Type::kInt: out += std::to_string(v.as_int()); return;
    case Type::kFloat: {
      const double f = v.as_float();
      if (std::isnan(f))
        out += "NaN";
      else if (std::isinf(f))
        out += f < 0 ? "-Infinity" : "Infinity";
      else
        out += format_float(f);
      return;
    }
    case Type::kString: append_json_string(v.str(), o.ensure_ascii, out); return;
    case Type::kList:
    case Type::kTuple: {
      if (!v.is_plain_sequence())
        fail("Object of type " + type_name(v) + " is not JSON serializable");
      const ValueList& items = v.items();
      if (items.empty()) {
        out += "[]";
        return;
      }
      out.push_back('[');
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0) out += o.item_separator;
        newline(level + 1);
        dump_json(items[i], o, level + 1, out);
      }
      newline(level);
      out.push_back(']');
      return;
    }
    case Type::kDict: {
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& e : v.entries().entries) entries.push_back(&e);
      if (entries.empty()) {
        out += "{}";
        return;
      }
      if (o.sort_keys) {
        std::stable_sort(entries.begin(), entries.end(),
                         [](const auto* a, const auto* b) { return a->first < b->first; });
      }
      out.push_back('{');
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i > 0) out += o.item_separator;
        newline(level + 1);
        append_json_string(entries[i]->first, o.ensure_ascii, out);
        out += o.key_separator;
        dump_json(entries[i]->second, o, level + 1, out);
      }
      newline(level);
      out.push_back('}');
      return;
    }
    default: fail("Object of type " + type_name(v) + " is not JSON serializable");
  }
}

}  // namespace

std::string repr_string(std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  size_t pos = 0;
  char hex[16];
  while (pos < s.size()) {
    const size_t begin = pos;
    const char32_t cp = utf8::next(s, &pos);
    if (cp == static_cast<char32_t>(quote) || cp == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(cp));
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp < 0x7F ? cp >= 0x20 : (cp != 0x7F && is_printable(cp))) {
      out.append(s.substr(begin, pos - begin));
    } else if (cp < 0x100) {
      std::snprintf(hex, sizeof(hex), "\\x%02x", static_cast<unsigned>(cp));
      out += hex;
    } else if (cp < 0x10000) {
      std::snprintf(hex, sizeof(hex), "\\u%04x", static_cast<unsigned>(cp));
      out += hex;
    } else {
      std::snprintf(hex, sizeof(hex), "\\U%08x", static_cast<unsigned>(cp));
      out += hex;
    }
  }
  out.push_back(quote);
  return out;
}

std::string repr(const Value& v) {
  switch (v.type()) {
    case Type::kString: return repr_string(v.str());
    case Type::kUndefined: return "Undefined";
    case Type::kList:
    case Type::kTuple: {
      if (v.is_generator()) return "<generator object>";
      if (!v.list_kind().empty()) return v.list_kind() + "(" + repr(Value::list(v.items())) + ")";
      const bool tuple = v.type() == Type::kTuple;
      std::string out = tuple ? "(" : "[";
      const ValueList& items = v.items();
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0) out += ", ";
        out += repr(items[i]);
      }
      if (tuple && items.size() == 1) out += ",";
      out += tuple ? ")" : "]";
      return out;
    }
    case Type::kDict:
    case Type::kNamespace: {
      std::string out = v.type() == Type::kNamespace ? "<Namespace {" : "{";
      bool first = true;
      for (const auto& [k, val] : v.entries().entries) {
        if (!first) out += ", ";
        first = false;
        out += repr_string(k) + ": " + repr(val);
      }
      out += v.type() == Type::kNamespace ? "}>" : "}";
      return out;
    }
    default: return to_str(v);
  }
}

std::string to_str(const Value& v) {
  switch (v.type()) {
    case Type::kUndefined: return "";
    case Type::kNone: return "None";
    case Type::kBool: return v.as_bool() ? "True" : "False";
    case Type::kInt: return std::to_string(v.as_int());
    case Type::kFloat: return format_float(v.as_float());
    case Type::kString: return v.str();
    case Type::kCallable: return "<function " + v.fn().name + ">";
    default: return repr(v);
  }
}

std::string type_name(const Value& v) {
  switch (v.type()) {
    case Type::kUndefined: return "Undefined";
    case Type::kNone: return "NoneType";
    case Type::kBool: return "bool";
    case Type::kInt: return "int";
    case Type::kFloat: return "float";
    case Type::kString: return "str";
    case Type::kList: return v.list_kind().empty() ? "list" : v.list_kind();
    case Type::kTuple: return "tuple";
    case Type::kDict: return "dict";
    case Type::kNamespace: return "Namespace";
    case Type::kCallable: return "function";
  }
  return "object";
}

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_int() && b.is_int()) return a.as_int() == b.as_int();
    return a.as_float() == b.as_float();
  }
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case Type::kUndefined:
    case Type::kNone: return true;
    case Type::kString: return a.str() == b.str();
    case Type::kList:
    case Type::kTuple: {
      if (a.list_kind() != b.list_kind()) return false;
      if (a.is_generator()) return a.identity() == b.identity();
      const ValueList& x = a.items();
      const ValueList& y = b.items();
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i) {
        if (!equals(x[i], y[i])) return false;
      }
      return true;
    }
    case Type::kDict: {
      const auto& x = a.entries().entries;
      const Dict& y = b.entries();
      if (x.size() != y.entries.size()) return false;
      for (const auto& [k, v] : x) {
        const Value* other = y.find(k);
        if (other == nullptr || !equals(v, *other)) return false;
      }
      return true;
    }
    default: return a.identity() == b.identity();
  }
}

namespace {

std::string lower_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (pos < s.size()) {
    utf8::append(out, static_cast<char32_t>(
                          utf8proc_tolower(static_cast<utf8proc_int32_t>(utf8::next(s, &pos)))));
  }
  return out;
}

}  // namespace

int compare(const Value& a, const Value& b, bool case_insensitive) {
  if (a.is_number() && b.is_number()) {
    if (a.is_int() && b.is_int()) return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int();
    const double x = a.as_float();
    const double y = b.as_float();
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  if (a.is_string() && b.is_string()) {
    if (case_insensitive) {
      const std::string x = lower_utf8(a.str());
      const std::string y = lower_utf8(b.str());
      return x.compare(y) < 0 ? -1 : (x.compare(y) > 0 ? 1 : 0);
    }
    const int c = a.str().compare(b.str());
    return c < 0 ? -1 : (c > 0 ? 1 : 0);
  }
  if (a.type() == b.type() && a.is_sequence()) {
    const ValueList& x = a.items();
    const ValueList& y = b.items();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!equals(x[i], y[i])) return compare(x[i], y[i], case_insensitive);
    }
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }
  fail("'<' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) + "'");
}

std::string to_json(const Value& v, const JsonOptions& options) {
  std::string out;
  dump_json(v, options, 0, out);
  return out;
}

}  // namespace tandem::jinja
