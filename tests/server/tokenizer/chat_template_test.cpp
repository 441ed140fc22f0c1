// Chat templates: byte-identical renders against transformers' apply_chat_template, the
// Jinja subset's semantics, and clear errors (never a crash) for everything else.
#include "server/tokenizer/chat_template.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <map>
#include <random>

#include "core/error.h"
#include "server/tokenizer/jinja_ast.h"
#include "tokenizer_test_util.h"

namespace tandem {
namespace {

using testing::load_fixture;

const nlohmann::ordered_json& fixture() {
  static const nlohmann::ordered_json j = load_fixture("chat_template_cases.json");
  return j;
}

const ChatTemplate& fixture_template(const std::string& name) {
  static std::map<std::string, ChatTemplate> cache;
  auto it = cache.find(name);
  if (it == cache.end()) {
    it = cache.emplace(name, ChatTemplate(fixture()["templates"][name].get<std::string>())).first;
  }
  return it->second;
}

ChatTemplateInputs inputs_from(const nlohmann::ordered_json& j) {
  ChatTemplateInputs in;
  in.messages = j["messages"];
  in.tools = j["tools"];
  in.add_generation_prompt = j["add_generation_prompt"].get<bool>();
  in.kwargs = j["kwargs"];
  in.special_tokens = j["special_tokens"];
  in.continue_final_message = j["continue_final_message"].get<std::string>();
  return in;
}

std::string render(std::string_view source,
                   const nlohmann::ordered_json& context = nlohmann::ordered_json::object()) {
  return ChatTemplate(source).render(context);
}

// Expects construction or rendering to throw Error(kInvalidArgument) mentioning `fragment`.
void expect_template_error(
    std::string_view source, const std::string& fragment,
    const nlohmann::ordered_json& context = nlohmann::ordered_json::object()) {
  SCOPED_TRACE(std::string("template: ") + std::string(source));
  try {
    render(source, context);
    ADD_FAILURE() << "expected an error mentioning '" << fragment << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(e.message().find("chat template"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find(fragment), std::string::npos) << e.message();
  }
}

TEST(ChatTemplate, RendersByteIdenticalToTransformers) {
  size_t count = 0;
  for (const auto& c : fixture()["cases"]) {
    const std::string name = c["template"].get<std::string>();
    SCOPED_TRACE("template " + name + ", inputs " + c["inputs"].dump().substr(0, 400));
    std::string rendered;
    ASSERT_NO_THROW(rendered = fixture_template(name).apply(inputs_from(c["inputs"])));
    EXPECT_EQ(rendered, c["expected"].get<std::string>());
    ++count;
  }
  EXPECT_GE(count, 80u);
}

TEST(ChatTemplate, FailsWhereTransformersFails) {
  for (const auto& c : fixture()["errors"]) {
    const std::string name = c["template"].get<std::string>();
    SCOPED_TRACE("template " + name + ", python: " + c["python_error"].get<std::string>());
    try {
      fixture_template(name).apply(inputs_from(c["inputs"]));
      ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      const std::string python = c["python_error"].get<std::string>();
      const std::string detail = python.substr(python.find(": ") + 2);
      EXPECT_NE(e.message().find(detail.substr(0, 20)), std::string::npos)
          << "ours: " << e.message() << "\npython: " << python;
    }
  }
}

TEST(ChatTemplate, Qwen3TemplateFromTheRealFiles) {
  TANDEM_REQUIRE_QWEN3(tok);
  ChatTemplate tmpl(tok->chat_template());
  ChatTemplateInputs in;
  in.messages = nlohmann::ordered_json::parse(R"([{"role": "user", "content": "Hi"}])");
  in.add_generation_prompt = true;
  in.special_tokens = tok->special_tokens_map();
  in.kwargs = {{"enable_thinking", false}};
  EXPECT_EQ(tmpl.apply(in),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  // The rendered prompt tokenizes with the control tokens as single ids.
  const auto ids = tok->encode(tmpl.apply(in));
  EXPECT_EQ(ids.front(), 151644);
}

TEST(ChatTemplate, ApplyValidatesInputs) {
  const ChatTemplate& tmpl = fixture_template("qwen3");
  ChatTemplateInputs in;
  EXPECT_THROW(tmpl.apply(in), Error);  // empty conversation
  in.messages = nlohmann::ordered_json::parse(R"([{"role": "user", "content": "x"}])");
  in.add_generation_prompt = true;
  in.continue_final_message = "content";
  EXPECT_THROW(tmpl.apply(in), Error);
  in.continue_final_message.clear();
  in.messages = nlohmann::ordered_json::parse(R"(["not an object"])");
  EXPECT_THROW(tmpl.apply(in), Error);
  in.messages = nlohmann::ordered_json::parse(R"([{"role": "user", "content": "x"}])");
  in.kwargs = {{"messages", 1}};
  EXPECT_THROW(tmpl.apply(in), Error);
}

TEST(ChatTemplate, FromDirPrefersChatTemplateJinja) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("tandem_chat_tmpl_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  EXPECT_EQ(ChatTemplate::from_dir(dir.string()), nullptr);
  std::ofstream(dir / "tokenizer_config.json") << R"({"chat_template": "config {{ x }}"})";
  auto t = ChatTemplate::from_dir(dir.string());
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->render(nlohmann::ordered_json{{"x", 1}}), "config 1");
  std::ofstream(dir / "chat_template.jinja") << "jinja {{ x }}\n";
  t = ChatTemplate::from_dir(dir.string());
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->render(nlohmann::json{{"x", 2}}), "jinja 2");
  std::ofstream(dir / "chat_template.jinja") << "{% if %}";
  EXPECT_THROW(ChatTemplate::from_dir(dir.string()), Error);
  std::filesystem::remove_all(dir);
}

TEST(ChatTemplate, PlainJsonContextSortsKeys) {
  const nlohmann::json ctx = nlohmann::json::parse(R"({"d": {"b": 1, "a": 2}})");
  EXPECT_EQ(ChatTemplate("{{ d|tojson }}").render(ctx), R"({"a": 2, "b": 1})");
  const auto octx = nlohmann::ordered_json::parse(R"({"d": {"b": 1, "a": 2}})");
  EXPECT_EQ(ChatTemplate("{{ d|tojson }}").render(octx), R"({"b": 1, "a": 2})");
}

TEST(ChatTemplate, JinjaSemantics) {
  EXPECT_EQ(render("{{ 'a' ~ 'b' }}|{{ x }}|{{ x is defined }}"), "ab||False");
  EXPECT_EQ(render("{% for i in range(3) %}{{ i }}{% if not loop.last %},{% endif %}{% endfor %}"),
            "0,1,2");
  EXPECT_EQ(render("{% set ns = namespace(n=0) %}{% for i in [1,2,3] %}{% set ns.n = ns.n + i %}{% "
                   "endfor %}{{ ns.n }}"),
            "6");
  EXPECT_EQ(render("{% set n = 0 %}{% for i in [1,2,3] %}{% set n = n + i %}{% endfor %}{{ n }}"),
            "0");
  EXPECT_EQ(render("{{ [1,2,3][::-1] }} {{ 'abc'[-1] }} {{ [1,2,3][-2:] }}"), "[3, 2, 1] c [2, 3]");
  EXPECT_EQ(render("{{ 10 // 3 }} {{ 10 % 3 }} {{ 2 ** 3 }} {{ 1 / 4 }}"), "3 1 8 0.25");
  EXPECT_EQ(render("{{ {'a': [1, 'x']}|tojson }}"), R"({"a": [1, "x"]})");
  EXPECT_EQ(render("{% macro m(a, b='d') %}{{ a }}{{ b }}{% endmacro %}{{ m(1) }}{{ m(2, b=3) }}"),
            "1d23");
  EXPECT_EQ(render("{%- if true -%}\n  x  \n{%- endif -%}"), "x");
  EXPECT_EQ(render("a\n{% if true %}\nb\n{% endif %}\nc\n"),
            "a\nb\nc");  // trim/lstrip blocks, trailing \n dropped
  EXPECT_EQ(render("{{ 'x' if false }}|{{ none }}|{{ none is none }}"), "|None|True");
  EXPECT_EQ(render("{{ '\\u00e9\\n\\x41' }}"), "\xc3\xa9\nA");
}

TEST(ChatTemplate, UnsupportedOrBrokenSyntaxIsAClearError) {
  expect_template_error("{% include 'other.jinja' %}", "'include' tag is not supported");
  expect_template_error("{% extends 'base' %}", "'extends' tag is not supported");
  expect_template_error("{% call foo() %}x{% endcall %}", "'call' tag is not supported");
  expect_template_error("{{ x|frobnicate }}", "no filter named 'frobnicate'");
  expect_template_error("{{ x is frobnicated }}", "no test named 'frobnicated'");
  expect_template_error("{% for x in %}{% endfor %}", "line 1");
  expect_template_error("line 1\n{% if x %}\nunclosed", "unexpected end of template");
  expect_template_error("{{ x", "unexpected end of template");
  expect_template_error("{% endfor %}", "unknown tag 'endfor'");
  expect_template_error("{% for x in y recursive %}{% endfor %}", "recursive");
  expect_template_error("{{ 'unterminated }}", "unterminated string");
  expect_template_error("{{ a[1, 2] }}", "tuple subscripts");
  expect_template_error("{# unclosed comment", "missing end of comment");
  expect_template_error("{% raw %} no end", "missing end of raw");
  expect_template_error("{{ 1 + }}", "expected an expression");
  expect_template_error("{% break %}", "outside of a loop");
  expect_template_error("{{ (1 }}", "unexpected '}'");
  expect_template_error("{{ x $ y }}", "unexpected char");
  expect_template_error("{% set 1 = 2 %}", "expected a name");
  expect_template_error("\n\n{% frobnicate %}", "line 3");
}

TEST(ChatTemplate, RuntimeErrorsAreClear) {
  expect_template_error("{{ raise_exception('Only user and assistant roles are supported!') }}",
                        "Only user and assistant roles are supported!");
  expect_template_error("{{ none + 1 }}",
                        "unsupported operand type(s) for +: 'NoneType' and 'int'");
  expect_template_error("{{ 'a' + 1 }}", "can only concatenate str");
  expect_template_error("{{ missing.attr }}", "'missing' is undefined");
  expect_template_error("{{ m.content.strip() }}", "has no attribute 'content'",
                        {{"m", nlohmann::ordered_json::object()}});
  expect_template_error("{{ range(1000000)|length }}", "Range too big");
  expect_template_error("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "nested too deeply");
  expect_template_error("{{ missing|tojson }}", "not JSON serializable");
  expect_template_error("{{ 1 // 0 }}", "division or modulo by zero");
  expect_template_error("{{ 'a' < 1 }}", "'<' not supported");
  expect_template_error("{% set ns = 1 %}{% set ns.a = 2 %}", "not a namespace");
  expect_template_error("{{ [1].append(2) }}", "unsafe");
  expect_template_error("{% for a, b in [[1, 2, 3]] %}{% endfor %}", "too many values to unpack");
  expect_template_error("{{ 5 in none }}", "argument of type 'NoneType' is not iterable");
  expect_template_error("{% for x in 5 %}{% endfor %}", "'int' object is not iterable");
  expect_template_error("{{ x() }}", "'x' is undefined");
  expect_template_error("{{ 'abc'.format(1) }}", "not supported");
  expect_template_error("{{ 'a %s' % 1 }}", "not supported");
}

TEST(ChatTemplate, DeepNestingIsAnErrorNotACrash) {
  std::string deep_template;
  for (int i = 0; i < 5000; ++i) deep_template += "{% if true %}";
  expect_template_error(deep_template, "nested too deeply");
  expect_template_error("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}",
                        "nested too deeply");
  std::string deep_json;
  for (int i = 0; i < 20000; ++i) deep_json += "[";
  for (int i = 0; i < 20000; ++i) deep_json += "]";
  // The deep value is parsed (iteratively) straight into its place and only ever moved: a copy
  // of it recurses 20000 levels deep, which overflows the stack under ASan (a test bug found by
  // tools/ci_security.sh asan, not one of the template's).
  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  context["x"] = nlohmann::ordered_json::parse(deep_json);
  expect_template_error("{{ x }}", "nested too deeply", context);
  ChatTemplateInputs in;
  in.messages = nlohmann::ordered_json::array({{{"role", "user"}, {"content", "hi"}}});
  in.kwargs = std::move(context);
  EXPECT_THROW(fixture_template("qwen3").apply(in), Error);
}

// A macro's callable lives in the frame it closes over (a shared_ptr cycle): the renderer
// empties those frames when it ends, so a render with macros frees its scopes and values (each
// such render leaked them; found by LeakSanitizer in tools/ci_security.sh asan).
TEST(ChatTemplate, RenderWithMacrosFreesItsScopes) {
  const auto program = jinja::parse(
      "{% macro outer(x) %}{% macro inner(y) %}{{ y }}{% endmacro %}{{ inner(x) }}{% endmacro %}"
      "{% for i in range(3) %}{% macro m() %}{{ i }}{% endmacro %}{{ m() }}{% endfor %}"
      "{{ outer(1) }}");
  auto globals = std::make_shared<jinja::Frame>();
  jinja::install_globals(*globals);
  std::weak_ptr<jinja::Frame> weak_globals = globals;
  std::weak_ptr<jinja::Frame> weak_root;
  std::string out;
  {
    auto root = std::make_shared<jinja::Frame>();
    root->parent = std::move(globals);
    weak_root = root;
    jinja::Renderer r(std::move(root));
    r.render_body(program->body, out);
    EXPECT_FALSE(weak_root.expired());
  }
  EXPECT_EQ(out, "0121");
  EXPECT_TRUE(weak_root.expired());
  EXPECT_TRUE(weak_globals.expired());
}

// Random and mutated templates must render or throw tandem::Error, never crash or hang.
TEST(ChatTemplate, FuzzedTemplatesNeverCrash) {
  static const char* kPieces[] = {
      "{{",      "}}",       "{%",         "%}",         "{#",    "#}",       "{%-",
      "-%}",     "{{-",      "-}}",        " if ",       " for ", " in ",     " else ",
      " endif ", " endfor ", " set ",      " = ",        "x",     "messages", "loop.index",
      "[",       "]",        "(",          ")",          "'s'",   "\"q\"",    "|",
      "tojson",  "length",   " is ",       " defined ",  " not ", " and ",    " or ",
      "1",       "-2",       ".5",         ",",          ":",     "::-1",     "~",
      "+",       "*",        "//",         "%",          "**",    "==",       "!=",
      "<",       " macro ",  " endmacro ", "namespace(", "ns.a",  "\n",       " ",
      "raw",     "endraw",   "{",          "}",          "\\",    "é",        "\xf0\x9f\x98\x80",
      "none",    "true",     ".",
  };
  std::mt19937 rng(42);
  const auto ctx = nlohmann::ordered_json::parse(
      R"({"messages": [{"role": "user", "content": "hi"}], "x": [1, {"a": null}], "ns": 3})");
  size_t rendered = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string source;
    const int n = 1 + static_cast<int>(rng() % 24);
    for (int k = 0; k < n; ++k) source += kPieces[rng() % std::size(kPieces)];
    try {
      render(source, ctx);
      ++rendered;
    } catch (const Error&) {
    }
  }
  const std::string qwen = fixture()["templates"]["qwen3"].get<std::string>();
  const auto qctx = nlohmann::ordered_json::parse(
      R"({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
          {"role": "assistant", "content": "<think>r</think>a", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
          {"role": "tool", "content": "t"}], "tools": [{"name": "f"}], "add_generation_prompt": true})");
  for (int i = 0; i < 400; ++i) {
    std::string source = qwen;
    const int cuts = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < cuts; ++k) {
      const size_t at = rng() % source.size();
      source.erase(at, 1 + rng() % 6);
    }
    try {
      render(source, qctx);
      ++rendered;
    } catch (const Error&) {
    }
  }
  EXPECT_GT(rendered, 0u);
}

}  // namespace
}  // namespace tandem
