// Syntax tree and tree-walking renderer of the Jinja subset used by chat templates.
// Internal to ChatTemplate; see jinja.h for the entry point.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "server/tokenizer/jinja_value.h"

namespace tandem::jinja {

/// An expression node.
struct Expr {
  int line = 0;  ///< template line
  virtual ~Expr() = default;
  /// Evaluates the expression.
  virtual Value eval(Renderer& r) const = 0;
};
using ExprPtr = std::unique_ptr<Expr>;

/// A statement node.
struct Stmt {
  int line = 0;  ///< template line
  virtual ~Stmt() = default;
  /// Appends the statement's output to `out`.
  virtual void render(Renderer& r, std::string& out) const = 0;
};
using StmtPtr = std::unique_ptr<Stmt>;
/// A list of statements.
using Body = std::vector<StmtPtr>;

/// Arguments as written at a call site.
struct ArgExprs {
  std::vector<ExprPtr> positional;                       ///< in order
  std::vector<std::pair<std::string, ExprPtr>> keyword;  ///< name = expr
  ExprPtr star;                                          ///< *args, or null
  ExprPtr star_star;                                     ///< **kwargs, or null
  /// Evaluates every argument.
  CallArgs eval(Renderer& r) const;
};

/// `| name(args)` applied to a value (also used by filter blocks).
struct FilterCall {
  std::string name;  ///< filter name
  ArgExprs args;     ///< its arguments
};

// ---- expressions ----

/// A constant.
struct LiteralExpr : Expr {
  Value value;  ///< the constant
  Value eval(Renderer& r) const override;
};
/// A variable reference.
struct NameExpr : Expr {
  std::string name;  ///< variable name
  Value eval(Renderer& r) const override;
};
/// `obj.attr`.
struct GetAttrExpr : Expr {
  ExprPtr object;         ///< the value accessed
  std::string attribute;  ///< attribute name
  Value eval(Renderer& r) const override;
};
/// `obj[index]`.
struct GetItemExpr : Expr {
  ExprPtr object;  ///< the value accessed
  ExprPtr index;   ///< the key or index
  Value eval(Renderer& r) const override;
};
/// `obj[start:stop:step]` (null parts omitted).
struct SliceExpr : Expr {
  ExprPtr object;             ///< the sequence sliced
  ExprPtr start, stop, step;  ///< slice bounds (null when omitted)
  Value eval(Renderer& r) const override;
};
/// `callee(args)`.
struct CallExpr : Expr {
  ExprPtr callee;  ///< the function, method or macro
  ArgExprs args;   ///< call arguments
  Value eval(Renderer& r) const override;
};
/// `input | filter`.
struct FilterExpr : Expr {
  ExprPtr input;      ///< the filtered value
  FilterCall filter;  ///< the filter and its arguments
  Value eval(Renderer& r) const override;
};
/// `input is [not] test(args)`.
struct TestExpr : Expr {
  ExprPtr input;         ///< the tested value
  std::string name;      ///< test name
  ArgExprs args;         ///< test arguments
  bool negated = false;  ///< `is not`
  Value eval(Renderer& r) const override;
};
/// Unary minus / plus.
struct UnaryExpr : Expr {
  char op = '-';    ///< '-' or '+'
  ExprPtr operand;  ///< the operand
  Value eval(Renderer& r) const override;
};
/// `not x`.
struct NotExpr : Expr {
  ExprPtr operand;  ///< the negated expression
  Value eval(Renderer& r) const override;
};
/// Arithmetic and `~`.
struct BinaryExpr : Expr {
  /// The operator: + - * / // % ** ~
  enum class Op { kAdd, kSub, kMul, kDiv, kFloorDiv, kMod, kPow, kConcat } op = Op::kAdd;
  ExprPtr left, right;  ///< operands
  Value eval(Renderer& r) const override;
};
/// `and` / `or` (short-circuit, returning an operand as Python does).
struct LogicExpr : Expr {
  bool is_and = true;   ///< `and` (else `or`)
  ExprPtr left, right;  ///< operands
  Value eval(Renderer& r) const override;
};
/// Chained comparison `a < b <= c`, `in`, `not in`.
struct CompareExpr : Expr {
  /// A comparison operator.
  enum class Op { kEq, kNe, kLt, kLe, kGt, kGe, kIn, kNotIn };
  ExprPtr first;                             ///< leftmost operand
  std::vector<std::pair<Op, ExprPtr>> rest;  ///< (operator, operand) pairs, left to right
  Value eval(Renderer& r) const override;
};
/// `a if cond else b`.
struct CondExpr : Expr {
  ExprPtr condition;   ///< the test
  ExprPtr then_value;  ///< value when true
  ExprPtr else_value;  ///< value when false (null: Undefined)
  Value eval(Renderer& r) const override;
};
/// `[a, b]` or `(a, b)`.
struct ListExpr : Expr {
  std::vector<ExprPtr> items;  ///< elements
  bool tuple = false;          ///< a tuple literal
  Value eval(Renderer& r) const override;
};
/// `{k: v}`.
struct DictExpr : Expr {
  std::vector<std::pair<ExprPtr, ExprPtr>> items;  ///< (key, value) pairs
  Value eval(Renderer& r) const override;
};

// ---- statements ----

/// Literal template text.
struct TextStmt : Stmt {
  std::string text;  ///< output verbatim
  void render(Renderer& r, std::string& out) const override;
};
/// `{{ expr }}`.
struct OutputStmt : Stmt {
  ExprPtr expr;  ///< value printed with str()
  void render(Renderer& r, std::string& out) const override;
};
/// if / elif / else.
struct IfStmt : Stmt {
  std::vector<std::pair<ExprPtr, Body>> branches;  ///< if and elif: (condition, body)
  Body else_body;                                  ///< else body (may be empty)
  void render(Renderer& r, std::string& out) const override;
};
/// Assignment target: a name, a tuple of names, or `ns.attr`.
struct Target {
  std::vector<std::string> names;  ///< one name, or several for unpacking
  bool unpack = false;             ///< a tuple target
  std::string attribute;           ///< non-empty for `names[0].attribute`
};
/// for ... in ... [if ...] / else.
struct ForStmt : Stmt {
  Target target;      ///< loop variable(s)
  ExprPtr iterable;   ///< what is iterated
  ExprPtr condition;  ///< `if` filter of the items, or null
  Body body;          ///< loop body
  Body else_body;     ///< rendered when nothing was iterated
  void render(Renderer& r, std::string& out) const override;
};
/// `set target = value`.
struct SetStmt : Stmt {
  Target target;  ///< what is assigned
  ExprPtr value;  ///< the value
  void render(Renderer& r, std::string& out) const override;
};
/// `set target %}...{% endset`.
struct SetBlockStmt : Stmt {
  Target target;                    ///< what is assigned
  std::vector<FilterCall> filters;  ///< filters applied to the rendered body
  Body body;                        ///< rendered to give the value
  void render(Renderer& r, std::string& out) const override;
};
/// `macro name(params)`.
struct MacroStmt : Stmt {
  std::string name;                 ///< macro name
  std::vector<std::string> params;  ///< parameter names
  std::vector<ExprPtr> defaults;    ///< default per parameter (null: none)
  Body body;                        ///< rendered on each call
  void render(Renderer& r, std::string& out) const override;
};
/// `filter f %}...{% endfilter`.
struct FilterBlockStmt : Stmt {
  std::vector<FilterCall> filters;  ///< filters applied to the rendered body
  Body body;                        ///< the filtered content
  void render(Renderer& r, std::string& out) const override;
};
/// `with a = 1 %}...{% endwith`.
struct WithStmt : Stmt {
  std::vector<std::pair<std::string, ExprPtr>> assignments;  ///< scoped variables
  Body body;                                                 ///< the scope's content
  void render(Renderer& r, std::string& out) const override;
};
/// `break` / `continue`.
struct LoopControlStmt : Stmt {
  bool is_break = true;  ///< break (else continue)
  void render(Renderer& r, std::string& out) const override;
};
/// A body rendered as is (`generation` blocks of transformers).
struct BlockStmt : Stmt {
  Body body;  ///< the content
  void render(Renderer& r, std::string& out) const override;
};

/// A parsed template.
struct Program {
  Body body;  ///< top-level statements
};

/// Parses template source (Jinja lexing rules with trim_blocks and lstrip_blocks, as
/// transformers configures them). Throws TemplateError with a line on bad syntax.
std::unique_ptr<Program> parse(std::string_view source);

/// Variables visible at one scope level.
struct Frame {
  std::vector<std::pair<std::string, Value>> vars;  ///< name -> value
  std::shared_ptr<Frame> parent;                    ///< enclosing scope, or null

  /// Finds a variable here or in an enclosing scope.
  const Value* find(std::string_view name) const;
  /// Sets a variable in this scope.
  void set(const std::string& name, Value value);
};

/// Rendering state: scopes, loop control and resource limits.
class Renderer {
 public:
  /// Starts with `globals` as the outermost scope.
  explicit Renderer(std::shared_ptr<Frame> globals);
  /// Empties the frames that macros close over (see keep_closure).
  ~Renderer();
  Renderer(const Renderer&) = delete;
  Renderer& operator=(const Renderer&) = delete;

  /// Renders statements into `out`, stopping early on break/continue.
  void render_body(const Body& body, std::string& out);
  /// Looks a name up through the scopes (Undefined when absent).
  Value lookup(const std::string& name) const;
  /// Calls a callable value.
  Value call(const Value& callee, CallArgs& args);
  /// Applies a filter by name.
  Value filter(const std::string& name, const Value& input, CallArgs& args);
  /// Applies a test by name.
  bool test(const std::string& name, const Value& input, CallArgs& args);
  /// Counts one unit of work; fails past the limit (guards runaway loops).
  void tick();
  /// Fails when output grew past the limit.
  void check_output(const std::string& out) const;
  /// A macro's callable is stored in the frame it closes over (frame -> value -> closure ->
  /// frame, a shared_ptr cycle): the renderer keeps those frames and empties them when it ends,
  /// so that a render frees its scopes and values (every render with a macro leaked them).
  void keep_closure(std::shared_ptr<Frame> frame);

  std::shared_ptr<Frame> frame;                                           ///< current scope
  enum class Signal { kNone, kBreak, kContinue } signal = Signal::kNone;  ///< pending loop control
  int depth = 0;  ///< nesting of macro calls

  static constexpr int kMaxDepth = 64;                         ///< macro call nesting limit
  static constexpr size_t kMaxOutputBytes = size_t{64} << 20;  ///< output size limit
  static constexpr int64_t kMaxSteps = 50'000'000;             ///< loop iteration limit

 private:
  int64_t steps_ = 0;
  std::vector<std::shared_ptr<Frame>> closures_;
};

// ---- built-ins (jinja_builtins.cpp) ----

/// `obj.name`: dict item, namespace attribute, loop field or a bound method.
Value get_attribute(const Value& object, const std::string& name);
/// `obj[key]`: item, or attribute when the key is a string; Undefined when missing.
Value get_item(const Value& object, const Value& key);
/// `obj[start:stop:step]` for str, list and tuple.
Value slice(const Value& object, const Value& start, const Value& stop, const Value& step);
/// Applies a built-in filter.
Value apply_filter(Renderer& r, const std::string& name, const Value& input, CallArgs& args);
/// Applies a built-in test.
bool apply_test(Renderer& r, const std::string& name, const Value& input, CallArgs& args);
/// Items of an iterable (list/tuple items, dict keys, characters of a string).
ValueList iterate(const Value& v);
/// True when `name` is a filter this engine implements (checked at parse time).
bool is_known_filter(std::string_view name);
/// True when `name` is a test this engine implements (checked at parse time).
bool is_known_test(std::string_view name);
/// Adds range, namespace, dict, raise_exception and strftime_now to `globals`.
void install_globals(Frame& globals);
/// Python `a in b`.
bool contains(const Value& container, const Value& item);
/// Python `a + b`, `a - b`, ... for BinaryExpr.
Value binary_op(BinaryExpr::Op op, const Value& a, const Value& b);

}  // namespace tandem::jinja
