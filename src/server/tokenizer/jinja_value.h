// Values of the Jinja interpreter behind ChatTemplate, with Python semantics (str(), repr(),
// ==, <, truthiness, json.dumps) so rendered text matches transformers byte for byte.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tandem::jinja {

class Renderer;
class Value;
struct Dict;
struct Callable;
struct CallArgs;

/// A sequence of values (Python list or tuple).
using ValueList = std::vector<Value>;

/// Thrown by the interpreter; Template::render turns it into tandem::Error with the line.
struct TemplateError {
  std::string message;  ///< what went wrong, Python/Jinja style
  int line = 0;         ///< template line, 0 until a statement attaches it
};

/// Throws TemplateError(message).
[[noreturn]] void fail(std::string message);

/// Python-level type of a Value.
enum class Type : uint8_t {
  kUndefined,  // Jinja Undefined: falsy, prints as "", most operations fail
  kNone,
  kBool,
  kInt,
  kFloat,
  kString,
  kList,
  kTuple,
  kDict,
  kNamespace,  // namespace(): a dict whose attributes can be assigned
  kCallable,
};

/// One immutable value (lists, dicts and callables are shared, never mutated, except
/// namespace attributes).
class Value {
 public:
  /// An Undefined without a hint.
  Value() = default;
  /// A bool.
  Value(bool b) : type_(Type::kBool), b_(b) {}  // NOLINT(google-explicit-constructor)
  /// An int.
  Value(int64_t i) : type_(Type::kInt), i_(i) {}  // NOLINT
  /// An int.
  Value(int i) : type_(Type::kInt), i_(i) {}  // NOLINT
  /// A float.
  Value(double f) : type_(Type::kFloat), f_(f) {}  // NOLINT
  /// A str (UTF-8).
  Value(std::string s) : type_(Type::kString), s_(std::move(s)) {}  // NOLINT
  /// A str (UTF-8).
  Value(const char* s) : type_(Type::kString), s_(s) {}  // NOLINT
  /// A str (UTF-8).
  Value(std::string_view s) : type_(Type::kString), s_(s) {}  // NOLINT

  /// Undefined carrying the message used if it is misused (e.g. "'x' is undefined").
  static Value undefined(std::string hint);
  /// Python None.
  static Value none();
  /// A list.
  static Value list(ValueList items);
  /// A tuple.
  static Value tuple(ValueList items);
  /// What jinja2's lazy filters (map, select, unique, ...) return: iterable, always true,
  /// no len(), prints as "<generator object>".
  static Value generator(ValueList items);
  /// A dict view (`kind` is "dict_items", "dict_keys" or "dict_values").
  static Value view(ValueList items, std::string kind);
  /// A dict.
  static Value dict(std::shared_ptr<Dict> d);
  /// A namespace() object.
  static Value make_namespace(std::shared_ptr<Dict> d);
  /// A callable.
  static Value callable(std::string name, std::function<Value(Renderer&, CallArgs&)> fn);
  /// Converts JSON (object key order kept). Fails beyond kMaxJsonDepth levels of nesting.
  static Value from_json(const nlohmann::ordered_json& j, int depth = 0);
  /// Deepest JSON nesting accepted in a render context.
  static constexpr int kMaxJsonDepth = 256;

  /// The type.
  Type type() const { return type_; }
  /// True for Undefined.
  bool is_undefined() const { return type_ == Type::kUndefined; }
  /// True for None.
  bool is_none() const { return type_ == Type::kNone; }
  /// True for str.
  bool is_string() const { return type_ == Type::kString; }
  /// True for int or bool (Python bool is an int).
  bool is_int() const { return type_ == Type::kInt || type_ == Type::kBool; }
  /// True for int, bool or float.
  bool is_number() const { return is_int() || type_ == Type::kFloat; }
  /// True for list or tuple (also generators and dict views, which hold items too).
  bool is_sequence() const { return type_ == Type::kList || type_ == Type::kTuple; }
  /// True for a generator().
  bool is_generator() const { return type_ == Type::kList && s_ == "generator"; }
  /// "" for a plain list; "generator" or the dict view's name otherwise.
  const std::string& list_kind() const { return s_; }
  /// True for a list value that is a plain list or tuple (no generator, no view).
  bool is_plain_sequence() const { return is_sequence() && s_.empty(); }
  /// True for dict.
  bool is_dict() const { return type_ == Type::kDict; }

  /// The bool (valid for kBool).
  bool as_bool() const { return b_; }
  /// The integer value of an int or bool.
  int64_t as_int() const { return type_ == Type::kBool ? (b_ ? 1 : 0) : i_; }
  /// The numeric value of an int, bool or float.
  double as_float() const { return type_ == Type::kFloat ? f_ : static_cast<double>(as_int()); }
  /// The string of a str, or the hint of an Undefined.
  const std::string& str() const { return s_; }
  /// Items of a list or tuple.
  const ValueList& items() const { return *list_; }
  /// Entries of a dict or namespace.
  const Dict& entries() const { return *dict_; }
  /// Mutable entries of a namespace.
  Dict& namespace_entries() const { return *dict_; }
  /// The callable.
  const Callable& fn() const { return *fn_; }
  /// Identity of shared objects (namespace, callable) for `is sameas`.
  const void* identity() const;

 private:
  Type type_ = Type::kUndefined;
  bool b_ = false;
  int64_t i_ = 0;
  double f_ = 0;
  std::string s_;
  std::shared_ptr<ValueList> list_;
  std::shared_ptr<Dict> dict_;
  std::shared_ptr<Callable> fn_;
};

/// A dict in insertion order (keys are strings, as in JSON).
struct Dict {
  std::vector<std::pair<std::string, Value>> entries;  ///< in insertion order

  /// The value of `key`, or nullptr.
  const Value* find(std::string_view key) const;
  /// Inserts or replaces (keeping the position of an existing key).
  void set(const std::string& key, Value value);
};

/// Arguments of a call: positional, then keyword.
struct CallArgs {
  std::vector<Value> positional;                       ///< in order
  std::vector<std::pair<std::string, Value>> keyword;  ///< name = value, in order

  /// Argument by position or keyword name, or `fallback` when neither was given.
  Value get(size_t index, std::string_view name, Value fallback = Value()) const;
  /// Fails when more than `max_positional` positional arguments or keywords outside
  /// `names` were given to `function`.
  void check(std::string_view function, size_t max_positional,
             std::initializer_list<std::string_view> names) const;
};

/// A built-in function, bound method or macro.
struct Callable {
  std::string name;                                     ///< for messages
  std::function<Value(Renderer&, CallArgs&)> function;  ///< the body
};

/// Python truthiness (Undefined is false).
bool truthy(const Value& v);
/// Python str() (Undefined gives "").
std::string to_str(const Value& v);
/// Python repr().
std::string repr(const Value& v);
/// Python repr() of a str.
std::string repr_string(std::string_view s);
/// Python repr() of a float ("1.0", "1e-05", "inf").
std::string format_float(double f);
/// Python type name for messages ("str", "int", "NoneType", "dict", ...).
std::string type_name(const Value& v);
/// Python ==.
bool equals(const Value& a, const Value& b);
/// Python ordering: negative, zero or positive; fails (TypeError) for unordered types.
/// With `case_insensitive`, strings compare lower-cased (Jinja's sort filters).
int compare(const Value& a, const Value& b, bool case_insensitive = false);

/// Options of Python's json.dumps (transformers' tojson filter).
struct JsonOptions {
  bool ensure_ascii = false;          ///< escape non-ASCII as \uXXXX
  bool has_indent = false;            ///< pretty-print
  std::string indent;                 ///< the indent unit when has_indent
  std::string item_separator = ", ";  ///< between items (", " or "," with indent)
  std::string key_separator = ": ";   ///< between key and value
  bool sort_keys = false;             ///< sort dict keys
};
/// Python json.dumps(v, ...). Fails for Undefined, callables and namespaces.
std::string to_json(const Value& v, const JsonOptions& options);

}  // namespace tandem::jinja
