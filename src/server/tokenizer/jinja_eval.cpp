// Evaluation of the Jinja syntax tree (expressions, statements, scopes, loops, macros).
#include <cmath>

#include "core/error.h"
#include "server/tokenizer/jinja.h"
#include "server/tokenizer/jinja_ast.h"

namespace tandem::jinja {
namespace {

// Restores the renderer's scope when leaving a block.
class ScopeGuard {
 public:
  ScopeGuard(Renderer& r, std::shared_ptr<Frame> scope) : r_(r), saved_(std::move(r.frame)) {
    r_.frame = std::move(scope);
  }
  ~ScopeGuard() { r_.frame = std::move(saved_); }
  ScopeGuard(const ScopeGuard&) = delete;
  ScopeGuard& operator=(const ScopeGuard&) = delete;

 private:
  Renderer& r_;
  std::shared_ptr<Frame> saved_;
};

std::shared_ptr<Frame> child_of(const std::shared_ptr<Frame>& parent) {
  auto f = std::make_shared<Frame>();
  f->parent = parent;
  return f;
}

[[noreturn]] void fail_undefined(const Value& v) {
  fail(v.str().empty() ? std::string("value is undefined") : v.str());
}

void assign(Renderer& r, const Target& target, const Value& value) {
  if (!target.attribute.empty()) {
    const Value ns = r.lookup(target.names[0]);
    if (ns.type() != Type::kNamespace) {
      fail("cannot assign attribute '" + target.attribute + "' on '" + target.names[0] +
           "': not a namespace object");
    }
    if (target.attribute[0] == '_') {
      fail("chat templates cannot store underscore-prefixed attributes on a namespace");
    }
    ns.namespace_entries().set(target.attribute, value);
    return;
  }
  if (!target.unpack) {
    r.frame->set(target.names[0], value);
    return;
  }
  const ValueList items = iterate(value);
  if (items.size() != target.names.size()) {
    fail(items.size() > target.names.size()
             ? "too many values to unpack (expected " + std::to_string(target.names.size()) + ")"
             : "not enough values to unpack (expected " + std::to_string(target.names.size()) +
                   ", got " + std::to_string(items.size()) + ")");
  }
  for (size_t i = 0; i < items.size(); ++i) r.frame->set(target.names[i], items[i]);
}

std::string render_to_string(Renderer& r, const Body& body) {
  std::string out;
  r.render_body(body, out);
  return out;
}

Value apply_filters(Renderer& r, const std::vector<FilterCall>& filters, Value value) {
  for (const FilterCall& f : filters) {
    CallArgs args = f.args.eval(r);
    value = r.filter(f.name, value, args);
  }
  return value;
}

}  // namespace

// ---- scopes and renderer ----

const Value* Frame::find(std::string_view name) const {
  for (const Frame* f = this; f != nullptr; f = f->parent.get()) {
    for (const auto& [k, v] : f->vars) {
      if (k == name) return &v;
    }
  }
  return nullptr;
}

void Frame::set(const std::string& name, Value value) {
  for (auto& [k, v] : vars) {
    if (k == name) {
      v = std::move(value);
      return;
    }
  }
  vars.emplace_back(name, std::move(value));
}

Renderer::Renderer(std::shared_ptr<Frame> globals) : frame(std::move(globals)) {}

Renderer::~Renderer() {
  for (auto& f : closures_) {
    auto vars = std::move(f->vars);  // destroyed here, the callables and their closures with it
    f->vars.clear();
  }
}

void Renderer::keep_closure(std::shared_ptr<Frame> frame) { closures_.push_back(std::move(frame)); }

void Renderer::render_body(const Body& body, std::string& out) {
  for (const StmtPtr& stmt : body) {
    try {
      stmt->render(*this, out);
    } catch (TemplateError& e) {
      if (e.line == 0) e.line = stmt->line;
      throw;
    }
    if (signal != Signal::kNone) return;
  }
}

Value Renderer::lookup(const std::string& name) const {
  if (const Value* v = frame->find(name)) return *v;
  return Value::undefined("'" + name + "' is undefined");
}

Value Renderer::call(const Value& callee, CallArgs& args) {
  if (callee.type() == Type::kCallable) return callee.fn().function(*this, args);
  if (callee.is_undefined()) fail_undefined(callee);
  fail("'" + type_name(callee) + "' object is not callable");
}

Value Renderer::filter(const std::string& name, const Value& input, CallArgs& args) {
  return apply_filter(*this, name, input, args);
}

bool Renderer::test(const std::string& name, const Value& input, CallArgs& args) {
  return apply_test(*this, name, input, args);
}

void Renderer::tick() {
  if (++steps_ > kMaxSteps) fail("template exceeded its work limit (runaway loop?)");
}

void Renderer::check_output(const std::string& out) const {
  if (out.size() > kMaxOutputBytes) fail("template output exceeds the size limit");
}

CallArgs ArgExprs::eval(Renderer& r) const {
  CallArgs args;
  args.positional.reserve(positional.size());
  for (const ExprPtr& e : positional) args.positional.push_back(e->eval(r));
  if (star) {
    for (Value& v : iterate(star->eval(r))) args.positional.push_back(std::move(v));
  }
  for (const auto& [k, e] : keyword) args.keyword.emplace_back(k, e->eval(r));
  if (star_star) {
    const Value d = star_star->eval(r);
    if (!d.is_dict()) fail("argument after ** must be a mapping, not " + type_name(d));
    for (const auto& [k, v] : d.entries().entries) args.keyword.emplace_back(k, v);
  }
  return args;
}

// ---- expressions ----

Value LiteralExpr::eval(Renderer&) const { return value; }

Value NameExpr::eval(Renderer& r) const { return r.lookup(name); }

Value GetAttrExpr::eval(Renderer& r) const {
  const Value obj = object->eval(r);
  if (obj.is_undefined()) fail_undefined(obj);
  return get_attribute(obj, attribute);
}

Value GetItemExpr::eval(Renderer& r) const {
  const Value obj = object->eval(r);
  if (obj.is_undefined()) fail_undefined(obj);
  return get_item(obj, index->eval(r));
}

Value SliceExpr::eval(Renderer& r) const {
  const Value obj = object->eval(r);
  if (obj.is_undefined()) fail_undefined(obj);
  auto part = [&](const ExprPtr& e) { return e ? e->eval(r) : Value::none(); };
  return slice(obj, part(start), part(stop), part(step));
}

Value CallExpr::eval(Renderer& r) const {
  const Value fn = callee->eval(r);
  CallArgs a = args.eval(r);
  return r.call(fn, a);
}

Value FilterExpr::eval(Renderer& r) const {
  const Value in = input->eval(r);
  CallArgs a = filter.args.eval(r);
  return r.filter(filter.name, in, a);
}

Value TestExpr::eval(Renderer& r) const {
  const Value in = input->eval(r);
  CallArgs a = args.eval(r);
  return Value(r.test(name, in, a) != negated);
}

Value UnaryExpr::eval(Renderer& r) const {
  const Value v = operand->eval(r);
  if (v.is_undefined()) fail_undefined(v);
  if (v.is_int()) return op == '-' ? Value(-v.as_int()) : Value(v.as_int());
  if (v.type() == Type::kFloat) return op == '-' ? Value(-v.as_float()) : v;
  fail(std::string("bad operand type for unary ") + op + ": '" + type_name(v) + "'");
}

Value NotExpr::eval(Renderer& r) const { return Value(!truthy(operand->eval(r))); }

Value BinaryExpr::eval(Renderer& r) const {
  const Value a = left->eval(r);
  const Value b = right->eval(r);
  return binary_op(op, a, b);
}

Value LogicExpr::eval(Renderer& r) const {
  Value a = left->eval(r);
  if (is_and) return truthy(a) ? right->eval(r) : a;
  return truthy(a) ? a : right->eval(r);
}

Value CompareExpr::eval(Renderer& r) const {
  Value a = first->eval(r);
  for (const auto& [op, expr] : rest) {
    Value b = expr->eval(r);
    bool ok = false;
    switch (op) {
      case Op::kEq: ok = equals(a, b); break;
      case Op::kNe: ok = !equals(a, b); break;
      case Op::kLt: ok = compare(a, b) < 0; break;
      case Op::kLe: ok = compare(a, b) <= 0; break;
      case Op::kGt: ok = compare(a, b) > 0; break;
      case Op::kGe: ok = compare(a, b) >= 0; break;
      case Op::kIn: ok = contains(b, a); break;
      case Op::kNotIn: ok = !contains(b, a); break;
    }
    if (!ok) return Value(false);
    a = std::move(b);
  }
  return Value(true);
}

Value CondExpr::eval(Renderer& r) const {
  if (truthy(condition->eval(r))) return then_value->eval(r);
  if (else_value) return else_value->eval(r);
  return Value::undefined(
      "the inline if-expression evaluated to false and no else section was defined");
}

Value ListExpr::eval(Renderer& r) const {
  ValueList values;
  values.reserve(items.size());
  for (const ExprPtr& e : items) values.push_back(e->eval(r));
  return tuple ? Value::tuple(std::move(values)) : Value::list(std::move(values));
}

Value DictExpr::eval(Renderer& r) const {
  auto d = std::make_shared<Dict>();
  for (const auto& [k, v] : items) {
    const Value key = k->eval(r);
    if (!key.is_string())
      fail("dict keys must be strings in chat templates, got " + type_name(key));
    d->set(key.str(), v->eval(r));
  }
  return Value::dict(std::move(d));
}

// ---- statements ----

void TextStmt::render(Renderer& r, std::string& out) const {
  out += text;
  r.check_output(out);
}

void OutputStmt::render(Renderer& r, std::string& out) const {
  out += to_str(expr->eval(r));
  r.check_output(out);
}

void IfStmt::render(Renderer& r, std::string& out) const {
  for (const auto& [cond, body] : branches) {
    if (truthy(cond->eval(r))) {
      r.render_body(body, out);
      return;
    }
  }
  r.render_body(else_body, out);
}

void ForStmt::render(Renderer& r, std::string& out) const {
  ValueList items = iterate(iterable->eval(r));
  if (condition) {
    ValueList kept;
    for (Value& item : items) {
      ScopeGuard scope(r, child_of(r.frame));
      assign(r, target, item);
      r.tick();
      if (truthy(condition->eval(r))) kept.push_back(std::move(item));
    }
    items = std::move(kept);
  }
  if (items.empty()) {
    ScopeGuard scope(r, child_of(r.frame));
    r.render_body(else_body, out);
    return;
  }
  const auto n = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < n; ++i) {
    r.tick();
    ScopeGuard scope(r, child_of(r.frame));
    assign(r, target, items[static_cast<size_t>(i)]);
    auto loop = std::make_shared<Dict>();
    loop->entries = {
        {"index", Value(i + 1)},
        {"index0", Value(i)},
        {"revindex", Value(n - i)},
        {"revindex0", Value(n - i - 1)},
        {"first", Value(i == 0)},
        {"last", Value(i == n - 1)},
        {"length", Value(n)},
        {"depth", Value(1)},
        {"depth0", Value(0)},
        {"previtem",
         i > 0 ? items[static_cast<size_t>(i - 1)] : Value::undefined("there is no previous item")},
        {"nextitem",
         i + 1 < n ? items[static_cast<size_t>(i + 1)] : Value::undefined("there is no next item")},
        {"cycle",
         Value::callable("loop.cycle",
                         [i](Renderer&, CallArgs& a) -> Value {
                           if (a.positional.empty()) fail("no items for cycling given");
                           return a.positional[static_cast<size_t>(i) % a.positional.size()];
                         })},
    };
    r.frame->set("loop", Value::dict(std::move(loop)));
    r.render_body(body, out);
    if (r.signal == Renderer::Signal::kBreak) {
      r.signal = Renderer::Signal::kNone;
      break;
    }
    r.signal = Renderer::Signal::kNone;
  }
}

void SetStmt::render(Renderer& r, std::string&) const { assign(r, target, value->eval(r)); }

void SetBlockStmt::render(Renderer& r, std::string&) const {
  Value v(render_to_string(r, body));
  assign(r, target, apply_filters(r, filters, std::move(v)));
}

void MacroStmt::render(Renderer& r, std::string&) const {
  const MacroStmt* macro = this;
  std::shared_ptr<Frame> closure = r.frame;
  r.keep_closure(closure);
  r.frame->set(
      name, Value::callable(name, [macro, closure](Renderer& rr, CallArgs& args) -> Value {
        if (rr.depth >= Renderer::kMaxDepth) fail("macro calls nested too deeply (recursion?)");
        ++rr.depth;
        struct DepthRestore {
          Renderer& r;
          ~DepthRestore() { --r.depth; }
        } restore{rr};
        ScopeGuard scope(rr, child_of(closure));
        ValueList varargs;
        for (size_t i = 0; i < args.positional.size(); ++i) {
          if (i < macro->params.size()) {
            rr.frame->set(macro->params[i], args.positional[i]);
          } else {
            varargs.push_back(args.positional[i]);
          }
        }
        auto kwargs = std::make_shared<Dict>();
        for (const auto& [k, v] : args.keyword) {
          bool is_param = false;
          for (size_t i = 0; i < macro->params.size(); ++i) {
            if (macro->params[i] == k) {
              if (i < args.positional.size())
                fail("macro '" + macro->name + "' got multiple values for argument '" + k + "'");
              is_param = true;
            }
          }
          if (is_param) {
            rr.frame->set(k, v);
          } else {
            kwargs->set(k, v);
          }
        }
        for (size_t i = 0; i < macro->params.size(); ++i) {
          bool given = i < args.positional.size();
          for (const auto& kv : args.keyword) given = given || kv.first == macro->params[i];
          if (given) continue;
          rr.frame->set(macro->params[i], macro->defaults[i]
                                              ? macro->defaults[i]->eval(rr)
                                              : Value::undefined("parameter '" + macro->params[i] +
                                                                 "' was not provided"));
        }
        rr.frame->set("varargs", Value::tuple(std::move(varargs)));
        rr.frame->set("kwargs", Value::dict(std::move(kwargs)));
        return Value(render_to_string(rr, macro->body));
      }));
}

void FilterBlockStmt::render(Renderer& r, std::string& out) const {
  out += to_str(apply_filters(r, filters, Value(render_to_string(r, body))));
  r.check_output(out);
}

void WithStmt::render(Renderer& r, std::string& out) const {
  auto scope_frame = child_of(r.frame);
  for (const auto& [name, expr] : assignments) scope_frame->set(name, expr->eval(r));
  ScopeGuard scope(r, std::move(scope_frame));
  r.render_body(body, out);
}

void LoopControlStmt::render(Renderer& r, std::string&) const {
  r.signal = is_break ? Renderer::Signal::kBreak : Renderer::Signal::kContinue;
}

void BlockStmt::render(Renderer& r, std::string& out) const { r.render_body(body, out); }

// ---- Template ----

Template::Template(std::string_view source) {
  try {
    program_ = parse(source);
  } catch (const TemplateError& e) {
    TANDEM_THROW(kInvalidArgument, "chat template: line ", e.line, ": ", e.message);
  }
}

std::string Template::render(const nlohmann::ordered_json& context) const {
  TANDEM_CHECK_KIND(kInvalidArgument, context.is_object(),
                    "chat template: the render context must be a JSON object");
  std::string out;
  int line = 0;
  try {
    auto globals = std::make_shared<Frame>();
    install_globals(*globals);
    auto root = child_of(globals);
    for (auto it = context.begin(); it != context.end(); ++it) {
      root->set(it.key(), Value::from_json(it.value()));
    }
    Renderer r(root);
    r.render_body(program_->body, out);
  } catch (const TemplateError& e) {
    line = e.line;
    TANDEM_THROW(kInvalidArgument, "chat template: line ", line, ": ", e.message);
  }
  return out;
}

}  // namespace tandem::jinja
