// Lexer and parser of the Jinja subset, following jinja2's lexer.py/parser.py with
// transformers' environment (trim_blocks=True, lstrip_blocks=True, loopcontrols).
#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "server/tokenizer/jinja_ast.h"
#include "server/tokenizer/utf8.h"

namespace tandem::jinja {
namespace {

enum class Tok {
  kText,
  kVarBegin,
  kVarEnd,
  kBlockBegin,
  kBlockEnd,
  kName,
  kString,
  kInt,
  kFloat,
  kOp,
  kEof
};

struct Token {
  Tok type;
  std::string value;  // text, name, decoded string, operator
  int64_t int_value = 0;
  double float_value = 0;
  int line = 1;
};

[[noreturn]] void syntax_error(int line, const std::string& message) {
  throw TemplateError{"syntax error: " + message, line};
}

// Python's str.isspace() at text[pos]; sets *len to the character's byte length.
bool space_at(std::string_view text, size_t pos, size_t* len) {
  const auto c = static_cast<uint8_t>(text[pos]);
  if (c < 0x80) {
    *len = 1;
    return utf8::is_python_space(c);
  }
  size_t p = pos;
  const char32_t cp = utf8::next(text, &p);
  *len = p - pos;
  return utf8::is_python_space(cp);
}

// Python str.rstrip() (Unicode whitespace).
std::string_view rstrip_space(std::string_view text) {
  size_t end = text.size();
  while (end > 0) {
    size_t begin = end - 1;
    while (begin > 0 && (static_cast<uint8_t>(text[begin]) & 0xC0) == 0x80) --begin;
    size_t len = 0;
    if (!space_at(text, begin, &len)) break;
    end = begin;
  }
  return text.substr(0, end);
}

// Length of the run of Python whitespace at text[pos...].
size_t skip_space(std::string_view text, size_t pos) {
  size_t p = pos;
  size_t len = 0;
  while (p < text.size() && space_at(text, p, &len)) p += len;
  return p - pos;
}

bool all_space(std::string_view text) {
  size_t pos = 0;
  size_t len = 0;
  while (pos < text.size()) {
    if (!space_at(text, pos, &len)) return false;
    pos += len;
  }
  return true;
}

bool is_name_start(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
         static_cast<uint8_t>(c) >= 0x80;
}
bool is_name_char(char c) { return is_name_start(c) || (c >= '0' && c <= '9'); }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

// Decodes a string literal body like Python's "unicode-escape" codec (as Jinja does).
std::string unescape(std::string_view body, int line) {
  std::string out;
  out.reserve(body.size());
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    if (c != '\\' || i + 1 >= body.size()) {
      out.push_back(c);
      continue;
    }
    const char e = body[++i];
    auto hex = [&](size_t digits) -> char32_t {
      char32_t v = 0;
      for (size_t k = 1; k <= digits; ++k) {
        if (i + k >= body.size()) syntax_error(line, "truncated escape in string literal");
        const char h = body[i + k];
        v <<= 4;
        if (h >= '0' && h <= '9')
          v |= static_cast<char32_t>(h - '0');
        else if (h >= 'a' && h <= 'f')
          v |= static_cast<char32_t>(h - 'a' + 10);
        else if (h >= 'A' && h <= 'F')
          v |= static_cast<char32_t>(h - 'A' + 10);
        else
          syntax_error(line, "bad escape in string literal");
      }
      i += digits;
      return v;
    };
    switch (e) {
      case '\n': break;  // line continuation
      case '\\': out.push_back('\\'); break;
      case '\'': out.push_back('\''); break;
      case '"': out.push_back('"'); break;
      case 'a': out.push_back('\a'); break;
      case 'b': out.push_back('\b'); break;
      case 'f': out.push_back('\f'); break;
      case 'n': out.push_back('\n'); break;
      case 'r': out.push_back('\r'); break;
      case 't': out.push_back('\t'); break;
      case 'v': out.push_back('\v'); break;
      case 'x': utf8::append(out, hex(2)); break;
      case 'u': utf8::append(out, hex(4)); break;
      case 'U': {
        const char32_t cp = hex(8);
        if (cp > 0x10FFFF) syntax_error(line, "illegal Unicode character in string literal");
        utf8::append(out, cp);
        break;
      }
      default:
        if (e >= '0' && e <= '7') {
          char32_t v = static_cast<char32_t>(e - '0');
          for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7';
               ++k) {
            v = v * 8 + static_cast<char32_t>(body[++i] - '0');
          }
          utf8::append(out, v);
        } else {
          out.push_back('\\');  // unknown escapes are kept as written
          out.push_back(e);
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) {
    // Newlines normalized to \n; one trailing newline dropped (keep_trailing_newline=False).
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_.push_back('\n');
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_.push_back(source[i]);
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  std::vector<Token> run() {
    std::string_view s = src_;
    while (pos_ < s.size()) {
      size_t tag = find_tag(pos_);
      if (tag == std::string_view::npos) {
        emit_text(s.substr(pos_));
        pos_ = s.size();
        break;
      }
      const char kind = s[tag + 1];  // '{', '%' or '#'
      char sign = tag + 2 < s.size() ? s[tag + 2] : '\0';
      if (sign != '-' && sign != '+') sign = '\0';
      // A raw block: {% raw %} ... {% endraw %}
      size_t raw_end = 0;
      const bool raw = kind == '%' && match_raw_begin(tag, &raw_end);
      std::string_view text = s.substr(pos_, tag - pos_);
      emit_text(strip_text(text, sign, kind != '{'));
      count_lines(pos_, tag);
      if (raw) {
        line_starting_ = s[raw_end - 1] == '\n';
        count_lines(tag, raw_end);
        lex_raw_body(raw_end);
        continue;
      }
      const size_t open = tag + 2 + (sign ? 1 : 0);
      if (kind == '#') {
        lex_comment(open);
      } else {
        lex_tag(open, kind == '%');
      }
    }
    tokens_.push_back({Tok::kEof, "", 0, 0, line_});
    return std::move(tokens_);
  }

 private:
  size_t find_tag(size_t from) const {
    size_t p = from;
    while ((p = src_.find('{', p)) != std::string::npos) {
      if (p + 1 < src_.size() && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#')) {
        return p;
      }
      ++p;
    }
    return std::string::npos;
  }

  void count_lines(size_t from, size_t to) {
    line_ += static_cast<int>(std::count(src_.begin() + static_cast<std::ptrdiff_t>(from),
                                         src_.begin() + static_cast<std::ptrdiff_t>(to), '\n'));
  }

  // The whitespace control applied to text before a tag (Jinja's OptionalLStrip).
  std::string_view strip_text(std::string_view text, char sign, bool lstrip_allowed) const {
    if (sign == '-') return rstrip_space(text);
    if (sign != '+' && lstrip_allowed) {
      const size_t nl = text.rfind('\n');
      const size_t l_pos = nl == std::string_view::npos ? 0 : nl + 1;
      if ((l_pos > 0 || line_starting_) && l_pos < text.size() && all_space(text.substr(l_pos))) {
        return text.substr(0, l_pos);
      }
    }
    return text;
  }

  void emit_text(std::string_view text) {
    if (!text.empty()) tokens_.push_back({Tok::kText, std::string(text), 0, 0, line_});
  }

  // {%[-+]?\s*raw\s*(-%}\s*|%}) at `tag`.
  bool match_raw_begin(size_t tag, size_t* end) const {
    std::string_view s = src_;
    size_t p = tag + 2;
    if (p < s.size() && (s[p] == '-' || s[p] == '+')) ++p;
    p += skip_space(s, p);
    if (s.compare(p, 3, "raw") != 0) return false;
    p += 3;
    if (p < s.size() && is_name_char(s[p])) return false;
    p += skip_space(s, p);
    if (s.compare(p, 3, "-%}") == 0) {
      p += 3;
      p += skip_space(s, p);
    } else if (s.compare(p, 2, "%}") == 0) {
      p += 2;
    } else {
      return false;
    }
    *end = p;
    return true;
  }

  void lex_raw_body(size_t from) {
    std::string_view s = src_;
    size_t p = from;
    while ((p = s.find("{%", p)) != std::string_view::npos) {
      size_t q = p + 2;
      char sign = '\0';
      if (q < s.size() && (s[q] == '-' || s[q] == '+')) sign = s[q++];
      q += skip_space(s, q);
      if (s.compare(q, 6, "endraw") != 0) {
        ++p;
        continue;
      }
      q += 6;
      q += skip_space(s, q);
      size_t end = 0;
      if (s.compare(q, 3, "+%}") == 0) {
        end = q + 3;
      } else if (s.compare(q, 3, "-%}") == 0) {
        end = q + 3;
        end += skip_space(s, end);
      } else if (s.compare(q, 2, "%}") == 0) {
        end = q + 2;
        if (end < s.size() && s[end] == '\n') ++end;
      } else {
        ++p;
        continue;
      }
      emit_text(strip_text(s.substr(from, p - from), sign, true));
      count_lines(from, end);
      line_starting_ = s[end - 1] == '\n';
      pos_ = end;
      return;
    }
    syntax_error(line_, "missing end of raw directive");
  }

  void lex_comment(size_t from) {
    std::string_view s = src_;
    size_t p = s.find("#}", from);
    if (p == std::string_view::npos) syntax_error(line_, "missing end of comment tag");
    size_t end = p + 2;
    if (p > from && s[p - 1] == '-') {
      end += skip_space(s, end);
    } else if (p > from && s[p - 1] == '+') {
      // no trimming
    } else if (end < s.size() && s[end] == '\n') {
      ++end;
    }
    count_lines(from, end);
    line_starting_ = s[end - 1] == '\n';
    pos_ = end;
  }

  void lex_tag(size_t from, bool block) {
    std::string_view s = src_;
    tokens_.push_back({block ? Tok::kBlockBegin : Tok::kVarBegin, "", 0, 0, line_});
    std::vector<char> balance;
    size_t p = from;
    while (true) {
      if (p >= s.size()) {
        syntax_error(line_, std::string("unexpected end of template, expected '") +
                                (block ? "%}" : "}}") + "'");
      }
      if (balance.empty()) {
        size_t end = 0;
        if (block) {
          if (s.compare(p, 3, "+%}") == 0) {
            end = p + 3;
          } else if (s.compare(p, 3, "-%}") == 0) {
            end = p + 3;
            end += skip_space(s, end);
          } else if (s.compare(p, 2, "%}") == 0) {
            end = p + 2;
            if (end < s.size() && s[end] == '\n') ++end;
          }
        } else {
          if (s.compare(p, 3, "-}}") == 0) {
            end = p + 3;
            end += skip_space(s, end);
          } else if (s.compare(p, 2, "}}") == 0) {
            end = p + 2;
          }
        }
        if (end != 0) {
          tokens_.push_back({block ? Tok::kBlockEnd : Tok::kVarEnd, "", 0, 0, line_});
          count_lines(p, end);
          line_starting_ = s[end - 1] == '\n';
          pos_ = end;
          return;
        }
      }
      size_t len = 0;
      if (space_at(s, p, &len)) {
        if (s[p] == '\n') ++line_;
        p += len;
        continue;
      }
      const char c = s[p];
      if (is_digit(c)) {
        p = lex_number(p);
        continue;
      }
      if (is_name_start(c)) {
        size_t q = p;
        while (q < s.size() && is_name_char(s[q])) ++q;
        tokens_.push_back({Tok::kName, std::string(s.substr(p, q - p)), 0, 0, line_});
        p = q;
        continue;
      }
      if (c == '\'' || c == '"') {
        size_t q = p + 1;
        while (q < s.size() && s[q] != c) q += s[q] == '\\' ? 2 : 1;
        if (q >= s.size()) syntax_error(line_, "unterminated string literal");
        const int start_line = line_;
        count_lines(p, q);
        tokens_.push_back(
            {Tok::kString, unescape(s.substr(p + 1, q - p - 1), start_line), 0, 0, start_line});
        p = q + 1;
        continue;
      }
      static constexpr const char* kOps2[] = {"//", "**", "==", "!=", ">=", "<="};
      std::string op;
      for (const char* o : kOps2) {
        if (s.compare(p, 2, o) == 0) op = o;
      }
      if (op.empty() && std::strchr("+-/*%~[](){}><=.:|,;", c) != nullptr) op = std::string(1, c);
      if (op.empty()) {
        syntax_error(line_, "unexpected char " + repr_string(std::string(1, c)));
      }
      if (op == "(" || op == "[" || op == "{") {
        balance.push_back(op == "(" ? ')' : op == "[" ? ']' : '}');
      } else if (op == ")" || op == "]" || op == "}") {
        if (balance.empty()) syntax_error(line_, "unexpected '" + op + "'");
        if (balance.back() != op[0]) {
          syntax_error(
              line_, "unexpected '" + op + "', expected '" + std::string(1, balance.back()) + "'");
        }
        balance.pop_back();
      }
      tokens_.push_back({Tok::kOp, op, 0, 0, line_});
      p += op.size();
    }
  }

  size_t lex_number(size_t p) {
    std::string_view s = src_;
    auto digits = [&](size_t q) {
      while (q < s.size() &&
             (is_digit(s[q]) || (s[q] == '_' && q + 1 < s.size() && is_digit(s[q + 1]))))
        ++q;
      return q;
    };
    if (s[p] == '0' && p + 1 < s.size() && std::strchr("xXoObB", s[p + 1]) != nullptr) {
      const int base = (s[p + 1] == 'x' || s[p + 1] == 'X')   ? 16
                       : (s[p + 1] == 'o' || s[p + 1] == 'O') ? 8
                                                              : 2;
      size_t q = p + 2;
      int64_t v = 0;
      while (q < s.size()) {
        const char h = s[q];
        int d = -1;
        if (h >= '0' && h <= '9')
          d = h - '0';
        else if (h >= 'a' && h <= 'f')
          d = h - 'a' + 10;
        else if (h >= 'A' && h <= 'F')
          d = h - 'A' + 10;
        else if (h == '_') {
          ++q;
          continue;
        }
        if (d < 0 || d >= base) break;
        v = v * base + d;
        ++q;
      }
      tokens_.push_back({Tok::kInt, std::string(s.substr(p, q - p)), v, 0, line_});
      return q;
    }
    size_t q = digits(p);
    bool is_float = false;
    if (q + 1 < s.size() && s[q] == '.' && is_digit(s[q + 1]) && !(p > 0 && s[p - 1] == '.')) {
      q = digits(q + 1);
      is_float = true;
    }
    if (q < s.size() && (s[q] == 'e' || s[q] == 'E')) {
      size_t r = q + 1;
      if (r < s.size() && (s[r] == '+' || s[r] == '-')) ++r;
      if (r < s.size() && is_digit(s[r])) {
        q = digits(r);
        is_float = true;
      }
    }
    std::string text;
    for (size_t i = p; i < q; ++i) {
      if (s[i] != '_') text.push_back(s[i]);
    }
    Token t{is_float ? Tok::kFloat : Tok::kInt, text, 0, 0, line_};
    if (is_float) {
      t.float_value = std::strtod(text.c_str(), nullptr);
    } else {
      errno = 0;
      t.int_value = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == ERANGE) syntax_error(line_, "integer literal too large: " + text);
    }
    tokens_.push_back(std::move(t));
    return q;
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;
  std::vector<Token> tokens_;
};

// ---- parser ----

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  std::unique_ptr<Program> parse_program() {
    auto program = std::make_unique<Program>();
    std::string end;
    program->body = parse_body({}, &end);
    // Like jinja2, unknown filters and tests are compile errors only where they are reached
    // unconditionally; inside if / conditional expressions / and-or they fail when evaluated.
    for (const Unknown& u : unknown_) {
      if (!u.soft)
        syntax_error(u.line, "no " + u.what + " (not supported by this chat template engine)");
    }
    return program;
  }

 private:
  static constexpr int kMaxNesting = 200;

  struct DepthGuard {
    Parser* p;
    explicit DepthGuard(Parser* parser) : p(parser) {
      if (++p->nesting_ > kMaxNesting) syntax_error(p->cur().line, "expression nested too deeply");
    }
    ~DepthGuard() { --p->nesting_; }
  };

  const Token& cur() const { return tokens_[pos_]; }
  const Token& peek(size_t n = 1) const { return tokens_[std::min(pos_ + n, tokens_.size() - 1)]; }
  void advance() {
    if (pos_ + 1 < tokens_.size()) ++pos_;
  }
  bool is_op(const char* op) const { return cur().type == Tok::kOp && cur().value == op; }
  bool is_name(const char* name) const { return cur().type == Tok::kName && cur().value == name; }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    advance();
    return true;
  }
  bool skip_name(const char* name) {
    if (!is_name(name)) return false;
    advance();
    return true;
  }

  static std::string describe(const Token& t) {
    switch (t.type) {
      case Tok::kText: return "template data";
      case Tok::kVarBegin: return "'{{'";
      case Tok::kVarEnd: return "end of print statement";
      case Tok::kBlockBegin: return "'{%'";
      case Tok::kBlockEnd: return "end of statement block";
      case Tok::kName: return "'" + t.value + "'";
      case Tok::kString: return "string";
      case Tok::kInt:
      case Tok::kFloat: return "number";
      case Tok::kOp: return "'" + t.value + "'";
      case Tok::kEof: return "end of template";
    }
    return "token";
  }

  [[noreturn]] void unexpected(const std::string& expected) const {
    syntax_error(cur().line, "expected " + expected + ", got " + describe(cur()));
  }
  void expect_op(const char* op) {
    if (!skip_op(op)) unexpected(std::string("'") + op + "'");
  }
  void expect(Tok type, const char* what) {
    if (cur().type != type) unexpected(what);
    advance();
  }
  std::string expect_name() {
    if (cur().type != Tok::kName) unexpected("a name");
    std::string n = cur().value;
    advance();
    return n;
  }
  void expect_block_end() { expect(Tok::kBlockEnd, "end of statement block"); }

  template <typename T>
  std::unique_ptr<T> make(int line) {
    auto node = std::make_unique<T>();
    node->line = line;
    return node;
  }

  // ---- statements ----

  // Parses statements until a block tag named in `ends`; consumes "{% end_name" and stores
  // it in *found (the caller parses the rest of that tag).
  Body parse_body(std::initializer_list<const char*> ends, std::string* found) {
    Body body;
    while (true) {
      const Token& t = cur();
      switch (t.type) {
        case Tok::kText: {
          auto node = make<TextStmt>(t.line);
          node->text = t.value;
          body.push_back(std::move(node));
          advance();
          break;
        }
        case Tok::kVarBegin: {
          const int line = t.line;
          advance();
          auto node = make<OutputStmt>(line);
          node->expr = parse_tuple(true, {}, false);
          expect(Tok::kVarEnd, "end of print statement");
          body.push_back(std::move(node));
          break;
        }
        case Tok::kBlockBegin: {
          const Token& name = peek();
          if (name.type != Tok::kName) {
            advance();
            unexpected("a tag name");
          }
          for (const char* e : ends) {
            if (name.value == e) {
              advance();
              advance();
              *found = e;
              return body;
            }
          }
          advance();
          body.push_back(parse_statement());
          break;
        }
        case Tok::kEof: {
          if (ends.size() != 0) {
            std::string names;
            for (const char* e : ends)
              names += (names.empty() ? "'" : " or '") + std::string(e) + "'";
            syntax_error(t.line, "unexpected end of template; was looking for " + names);
          }
          return body;
        }
        default: unexpected("template data or a tag");
      }
    }
  }

  StmtPtr parse_statement() {
    DepthGuard guard(this);
    const Token& t = cur();
    const int line = t.line;
    const std::string name = t.value;
    advance();
    if (name == "if") return parse_if(line);
    if (name == "for") return parse_for(line);
    if (name == "set") return parse_set(line);
    if (name == "macro") return parse_macro(line);
    if (name == "filter") return parse_filter_block(line);
    if (name == "with") return parse_with(line);
    if (name == "generation") {
      expect_block_end();
      auto node = make<BlockStmt>(line);
      std::string end;
      node->body = parse_body({"endgeneration"}, &end);
      expect_block_end();
      return node;
    }
    if (name == "break" || name == "continue") {
      if (loop_depth_ == 0) syntax_error(line, "'" + name + "' outside of a loop");
      auto node = make<LoopControlStmt>(line);
      node->is_break = name == "break";
      expect_block_end();
      return node;
    }
    static constexpr const char* kKnownUnsupported[] = {"call",    "include", "import",     "from",
                                                        "extends", "block",   "autoescape", "do",
                                                        "print",   "trans"};
    for (const char* u : kKnownUnsupported) {
      if (name == u)
        syntax_error(line, "the '" + name + "' tag is not supported by this chat template engine");
    }
    syntax_error(line, "unknown tag '" + name + "'");
  }

  StmtPtr parse_if(int line) {
    SoftGuard soft(soft_);
    auto node = make<IfStmt>(line);
    ExprPtr cond = parse_tuple(false, {}, false);
    expect_block_end();
    while (true) {
      std::string end;
      Body body = parse_body({"elif", "else", "endif"}, &end);
      node->branches.emplace_back(std::move(cond), std::move(body));
      if (end == "elif") {
        cond = parse_tuple(false, {}, false);
        expect_block_end();
        continue;
      }
      if (end == "else") {
        expect_block_end();
        node->else_body = parse_body({"endif"}, &end);
      }
      expect_block_end();
      return node;
    }
  }

  Target parse_target(bool with_namespace, std::initializer_list<const char*> extra_end) {
    Target target;
    if (with_namespace && cur().type == Tok::kName && peek().type == Tok::kOp &&
        peek().value == ".") {
      target.names.push_back(expect_name());
      advance();
      target.attribute = expect_name();
      return target;
    }
    const bool paren = skip_op("(");
    while (true) {
      target.names.push_back(expect_name());
      if (!skip_op(",")) break;
      target.unpack = true;
      bool end = (paren && is_op(")")) || cur().type == Tok::kBlockEnd || is_op("=");
      for (const char* e : extra_end) end = end || is_name(e);
      if (end) break;
    }
    if (paren) {
      expect_op(")");
      target.unpack = true;
    }
    for (const std::string& n : target.names) {
      if (n == "true" || n == "false" || n == "none" || n == "True" || n == "False" ||
          n == "None") {
        syntax_error(cur().line, "cannot assign to '" + n + "'");
      }
    }
    return target;
  }

  StmtPtr parse_for(int line) {
    auto node = make<ForStmt>(line);
    node->target = parse_target(false, {"in"});
    if (!skip_name("in")) unexpected("'in'");
    node->iterable = parse_tuple(false, {"recursive"}, false);
    if (skip_name("if")) node->condition = parse_expression(true);
    if (is_name("recursive")) syntax_error(cur().line, "recursive for loops are not supported");
    expect_block_end();
    ++loop_depth_;
    std::string end;
    node->body = parse_body({"endfor", "else"}, &end);
    --loop_depth_;
    if (end == "else") {
      expect_block_end();
      node->else_body = parse_body({"endfor"}, &end);
    }
    expect_block_end();
    return node;
  }

  StmtPtr parse_set(int line) {
    Target target = parse_target(true, {});
    if (skip_op("=")) {
      auto node = make<SetStmt>(line);
      node->target = std::move(target);
      node->value = parse_tuple(true, {}, false);
      expect_block_end();
      return node;
    }
    auto node = make<SetBlockStmt>(line);
    if (target.unpack) syntax_error(line, "a block set needs a single target");
    node->target = std::move(target);
    while (skip_op("|")) node->filters.push_back(parse_filter_call());
    expect_block_end();
    std::string end;
    node->body = parse_body({"endset"}, &end);
    expect_block_end();
    return node;
  }

  StmtPtr parse_macro(int line) {
    auto node = make<MacroStmt>(line);
    node->name = expect_name();
    expect_op("(");
    while (!is_op(")")) {
      if (!node->params.empty()) expect_op(",");
      if (is_op(")")) break;
      node->params.push_back(expect_name());
      if (skip_op("=")) {
        node->defaults.push_back(parse_expression(true));
      } else {
        node->defaults.push_back(nullptr);
      }
    }
    expect_op(")");
    expect_block_end();
    std::string end;
    const int saved = loop_depth_;
    loop_depth_ = 0;
    node->body = parse_body({"endmacro"}, &end);
    loop_depth_ = saved;
    if (cur().type == Tok::kName) advance();  // `endmacro name` is tolerated
    expect_block_end();
    return node;
  }

  StmtPtr parse_filter_block(int line) {
    auto node = make<FilterBlockStmt>(line);
    node->filters.push_back(parse_filter_call());
    while (skip_op("|")) node->filters.push_back(parse_filter_call());
    expect_block_end();
    std::string end;
    node->body = parse_body({"endfilter"}, &end);
    expect_block_end();
    return node;
  }

  StmtPtr parse_with(int line) {
    auto node = make<WithStmt>(line);
    while (cur().type != Tok::kBlockEnd) {
      if (!node->assignments.empty()) expect_op(",");
      std::string name = expect_name();
      expect_op("=");
      node->assignments.emplace_back(std::move(name), parse_expression(true));
    }
    expect_block_end();
    std::string end;
    node->body = parse_body({"endwith"}, &end);
    expect_block_end();
    return node;
  }

  // ---- expressions ----

  bool is_tuple_end(std::initializer_list<const char*> extra_end) const {
    if (cur().type == Tok::kVarEnd || cur().type == Tok::kBlockEnd || is_op(")")) return true;
    for (const char* e : extra_end) {
      if (is_name(e)) return true;
    }
    return false;
  }

  ExprPtr parse_tuple(bool with_condexpr, std::initializer_list<const char*> extra_end,
                      bool explicit_parentheses) {
    const int line = cur().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",");
      if (is_tuple_end(extra_end)) break;
      items.push_back(parse_expression(with_condexpr));
      if (is_op(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parentheses) unexpected("an expression");
    }
    auto node = make<ListExpr>(line);
    node->items = std::move(items);
    node->tuple = true;
    return node;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    DepthGuard guard(this);
    if (!with_condexpr) return parse_or();
    const size_t mark = unknown_.size();
    ExprPtr expr = parse_or();
    while (is_name("if")) {
      soften(mark);
      SoftGuard soft(soft_);
      const int line = cur().line;
      advance();
      auto node = make<CondExpr>(line);
      node->condition = parse_or();
      if (skip_name("else")) node->else_value = parse_expression(true);
      node->then_value = std::move(expr);
      expr = std::move(node);
    }
    return expr;
  }

  ExprPtr parse_or() {
    const size_t mark = unknown_.size();
    ExprPtr left = parse_and();
    while (is_name("or")) {
      soften(mark);
      SoftGuard soft(soft_);
      auto node = make<LogicExpr>(cur().line);
      advance();
      node->is_and = false;
      node->left = std::move(left);
      node->right = parse_and();
      left = std::move(node);
    }
    return left;
  }

  ExprPtr parse_and() {
    const size_t mark = unknown_.size();
    ExprPtr left = parse_not();
    while (is_name("and")) {
      soften(mark);
      SoftGuard soft(soft_);
      auto node = make<LogicExpr>(cur().line);
      advance();
      node->left = std::move(left);
      node->right = parse_not();
      left = std::move(node);
    }
    return left;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      DepthGuard guard(this);
      auto node = make<NotExpr>(cur().line);
      advance();
      node->operand = parse_not();
      return node;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const int line = cur().line;
    ExprPtr first = parse_math1();
    std::vector<std::pair<CompareExpr::Op, ExprPtr>> rest;
    while (true) {
      CompareExpr::Op op;
      if (is_op("=="))
        op = CompareExpr::Op::kEq;
      else if (is_op("!="))
        op = CompareExpr::Op::kNe;
      else if (is_op("<"))
        op = CompareExpr::Op::kLt;
      else if (is_op("<="))
        op = CompareExpr::Op::kLe;
      else if (is_op(">"))
        op = CompareExpr::Op::kGt;
      else if (is_op(">="))
        op = CompareExpr::Op::kGe;
      else if (is_name("in"))
        op = CompareExpr::Op::kIn;
      else if (is_name("not") && peek().type == Tok::kName && peek().value == "in") {
        advance();
        op = CompareExpr::Op::kNotIn;
      } else {
        break;
      }
      advance();
      rest.emplace_back(op, parse_math1());
    }
    if (rest.empty()) return first;
    auto node = make<CompareExpr>(line);
    node->first = std::move(first);
    node->rest = std::move(rest);
    return node;
  }

  ExprPtr binary(BinaryExpr::Op op, ExprPtr left, ExprPtr right, int line) {
    auto node = make<BinaryExpr>(line);
    node->op = op;
    node->left = std::move(left);
    node->right = std::move(right);
    return node;
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      const auto op = is_op("+") ? BinaryExpr::Op::kAdd : BinaryExpr::Op::kSub;
      const int line = cur().line;
      advance();
      left = binary(op, std::move(left), parse_concat(), line);
    }
    return left;
  }

  ExprPtr parse_concat() {
    ExprPtr left = parse_math2();
    while (is_op("~")) {
      const int line = cur().line;
      advance();
      left = binary(BinaryExpr::Op::kConcat, std::move(left), parse_math2(), line);
    }
    return left;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (true) {
      BinaryExpr::Op op;
      if (is_op("*"))
        op = BinaryExpr::Op::kMul;
      else if (is_op("/"))
        op = BinaryExpr::Op::kDiv;
      else if (is_op("//"))
        op = BinaryExpr::Op::kFloorDiv;
      else if (is_op("%"))
        op = BinaryExpr::Op::kMod;
      else
        break;
      const int line = cur().line;
      advance();
      left = binary(op, std::move(left), parse_pow(), line);
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (is_op("**")) {
      const int line = cur().line;
      advance();
      left = binary(BinaryExpr::Op::kPow, std::move(left), parse_unary(true), line);
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    DepthGuard guard(this);
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      auto u = make<UnaryExpr>(cur().line);
      u->op = cur().value[0];
      advance();
      u->operand = parse_unary(false);
      node = std::move(u);
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    const int line = t.line;
    switch (t.type) {
      case Tok::kName: {
        auto literal = [&](Value v) {
          auto node = make<LiteralExpr>(line);
          node->value = std::move(v);
          advance();
          return node;
        };
        if (t.value == "true" || t.value == "True") return literal(Value(true));
        if (t.value == "false" || t.value == "False") return literal(Value(false));
        if (t.value == "none" || t.value == "None") return literal(Value::none());
        auto node = make<NameExpr>(line);
        node->name = t.value;
        advance();
        return node;
      }
      case Tok::kString: {
        std::string s;
        while (cur().type == Tok::kString) {
          s += cur().value;
          advance();
        }
        auto node = make<LiteralExpr>(line);
        node->value = Value(std::move(s));
        return node;
      }
      case Tok::kInt: {
        auto node = make<LiteralExpr>(line);
        node->value = Value(t.int_value);
        advance();
        return node;
      }
      case Tok::kFloat: {
        auto node = make<LiteralExpr>(line);
        node->value = Value(t.float_value);
        advance();
        return node;
      }
      case Tok::kOp: {
        if (t.value == "(") {
          advance();
          ExprPtr inner = parse_tuple(true, {}, true);
          expect_op(")");
          return inner;
        }
        if (t.value == "[") {
          advance();
          auto node = make<ListExpr>(line);
          while (!is_op("]")) {
            if (!node->items.empty()) expect_op(",");
            if (is_op("]")) break;
            node->items.push_back(parse_expression(true));
          }
          expect_op("]");
          return node;
        }
        if (t.value == "{") {
          advance();
          auto node = make<DictExpr>(line);
          while (!is_op("}")) {
            if (!node->items.empty()) expect_op(",");
            if (is_op("}")) break;
            ExprPtr key = parse_expression(true);
            expect_op(":");
            node->items.emplace_back(std::move(key), parse_expression(true));
          }
          expect_op("}");
          return node;
        }
        break;
      }
      default: break;
    }
    unexpected("an expression");
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (is_op(".") || is_op("[")) {
        node = parse_subscript(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op("|")) {
        const int line = cur().line;
        advance();
        auto f = make<FilterExpr>(line);
        f->input = std::move(node);
        f->filter = parse_filter_call();
        node = std::move(f);
      } else if (is_name("is")) {
        node = parse_test(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr node) {
    const int line = cur().line;
    if (skip_op(".")) {
      if (cur().type == Tok::kName) {
        auto attr = make<GetAttrExpr>(line);
        attr->object = std::move(node);
        attr->attribute = expect_name();
        return attr;
      }
      if (cur().type == Tok::kInt) {
        auto item = make<GetItemExpr>(line);
        item->object = std::move(node);
        auto index = make<LiteralExpr>(line);
        index->value = Value(cur().int_value);
        advance();
        item->index = std::move(index);
        return item;
      }
      unexpected("an attribute name");
    }
    expect_op("[");
    std::vector<ExprPtr> args;
    ExprPtr result;
    // One subscript (possibly a slice); several comma-separated ones make a tuple key.
    while (!is_op("]")) {
      if (!args.empty()) expect_op(",");
      if (is_op("]")) break;
      args.push_back(parse_subscribed(std::move(node), line));
      node = nullptr;
    }
    expect_op("]");
    if (args.size() != 1) syntax_error(line, "tuple subscripts are not supported");
    return std::move(args[0]);
  }

  // Parses `expr` or `start:stop:step` and applies it to `object`.
  ExprPtr parse_subscribed(ExprPtr object, int line) {
    ExprPtr parts[3];
    if (!is_op(":")) {
      parts[0] = parse_expression(true);
      if (!is_op(":")) {
        auto item = make<GetItemExpr>(line);
        item->object = std::move(object);
        item->index = std::move(parts[0]);
        return item;
      }
    }
    advance();  // ':'
    if (!is_op(":") && !is_op("]") && !is_op(",")) parts[1] = parse_expression(true);
    if (skip_op(":")) {
      if (!is_op("]") && !is_op(",")) parts[2] = parse_expression(true);
    }
    auto node = make<SliceExpr>(line);
    node->object = std::move(object);
    node->start = std::move(parts[0]);
    node->stop = std::move(parts[1]);
    node->step = std::move(parts[2]);
    return node;
  }

  ArgExprs parse_call_args() {
    expect_op("(");
    ArgExprs args;
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (skip_op("*")) {
        args.star = parse_expression(true);
      } else if (skip_op("**")) {
        args.star_star = parse_expression(true);
      } else if (cur().type == Tok::kName && peek().type == Tok::kOp && peek().value == "=") {
        std::string key = expect_name();
        advance();
        args.keyword.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!args.keyword.empty())
          syntax_error(cur().line, "positional argument follows keyword argument");
        args.positional.push_back(parse_expression(true));
      }
    }
    expect_op(")");
    return args;
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto node = make<CallExpr>(cur().line);
    node->callee = std::move(callee);
    node->args = parse_call_args();
    return node;
  }

  FilterCall parse_filter_call() {
    FilterCall f;
    const int line = cur().line;
    f.name = expect_name();
    while (is_op(".")) {
      advance();
      f.name += "." + expect_name();
    }
    if (!is_known_filter(f.name))
      unknown_.push_back({"filter named '" + f.name + "'", line, soft_ > 0});
    if (is_op("(")) f.args = parse_call_args();
    return f;
  }

  ExprPtr parse_test(ExprPtr node) {
    auto test = make<TestExpr>(cur().line);
    advance();  // 'is'
    if (skip_name("not")) test->negated = true;
    test->name = expect_name();
    while (is_op(".")) {
      advance();
      test->name += "." + expect_name();
    }
    if (!is_known_test(test->name))
      unknown_.push_back({"test named '" + test->name + "'", test->line, soft_ > 0});
    const Token& t = cur();
    const bool arg_start = t.type == Tok::kName || t.type == Tok::kString || t.type == Tok::kInt ||
                           t.type == Tok::kFloat || is_op("[") || is_op("{");
    if (is_op("(")) {
      test->args = parse_call_args();
    } else if (arg_start && !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) syntax_error(t.line, "you cannot chain multiple tests with is");
      ExprPtr arg = parse_postfix(parse_primary());
      test->args.positional.push_back(std::move(arg));
    }
    test->input = std::move(node);
    return test;
  }

  // A filter or test this engine does not know, found while parsing.
  struct Unknown {
    std::string what;  // "filter named 'x'"
    int line;
    bool soft;  // in a conditional context
  };
  void soften(size_t from) {
    for (size_t i = from; i < unknown_.size(); ++i) unknown_[i].soft = true;
  }
  struct SoftGuard {
    int& soft;
    explicit SoftGuard(int& s) : soft(s) { ++soft; }
    ~SoftGuard() { --soft; }
  };

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int nesting_ = 0;
  int loop_depth_ = 0;
  int soft_ = 0;
  std::vector<Unknown> unknown_;
};

}  // namespace

std::unique_ptr<Program> parse(std::string_view source) {
  Lexer lexer(source);
  Parser parser(lexer.run());
  return parser.parse_program();
}

}  // namespace tandem::jinja
