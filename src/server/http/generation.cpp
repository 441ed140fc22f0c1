#include "server/http/generation.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "core/error.h"
#include "server/http/api_handler.h"
#include "server/http/json_util.h"
#include "server/tokenizer/detokenizer.h"
#include "server/tokenizer/tokenizer.h"

namespace tandem::openai {

namespace {

using json = Json;
using Clock = std::chrono::steady_clock;

/// Python-style string length (code points), as OpenAI's text_offset counts.
int64_t codepoints(const std::string& s) {
  int64_t n = 0;
  for (unsigned char ch : s) n += (ch & 0xC0) != 0x80;
  return n;
}

/// JSON has no infinities: -inf becomes -9999 (as vLLM does).
double finite_logprob(float lp) { return std::isfinite(lp) ? double(lp) : -9999.0; }

json utf8_bytes(const std::string& s) {
  json b = json::array();
  for (unsigned char ch : s) b.push_back(int(ch));
  return b;
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

/// "call_" and 24 random letters and digits (OpenAI's shape).
std::string new_tool_call_id() {
  static constexpr char kChars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  thread_local std::mt19937_64 rng{std::random_device{}()};
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += kChars[rng() % (sizeof(kChars) - 1)];
  return id;
}

}  // namespace

struct Generation::Choice {
  size_t index = 0;
  size_t prompt = 0;
  std::string engine_id;
  std::unique_ptr<IncrementalDetokenizer> detok;  // null without a tokenizer
  StopStringMatcher stops;
  bool submitted = false;
  bool finished = false;
  bool got_output = false;
  bool started = false;  // streaming: the first chunk went out
  std::string finish_reason;
  json stop_reason = nullptr;
  int32_t cached_tokens = 0;
  std::vector<int32_t> ids;  // output tokens kept
  size_t ids_sent = 0;       // streaming: ids already sent in chunks
  // Output not yet sent (streaming) or all output (non-streaming).
  std::string text;
  json logprobs = nullptr;  // chat: {"content": [...]}; completions: the four arrays
  int64_t text_offset = 0;  // completions logprobs: code points before the next token
  json prompt_logprobs = nullptr;
  Clock::time_point last_token_time;
  bool has_token = false;
  // Chat parsing (reasoning, tool calls); null for plain content.
  std::unique_ptr<parsers::ChatParser> parser;
  bool parser_done = false;
  std::string reasoning;  // like `text`: not yet sent (streaming) or all of it
  struct Call {
    std::string id;
    std::string name;
    std::string arguments;
    bool failed = false;  // malformed after its header: its text is content
  };
  std::vector<Call> calls;
  std::vector<parsers::ToolCallDelta> pending_calls;  // streaming: not yet sent
  int32_t valid_calls() const {
    int32_t n = 0;
    for (const Call& call : calls) n += !call.failed;
    return n;
  }
};

Generation::Generation(GenerationSetup setup, GenerationContext ctx,
                       const std::shared_ptr<Connection>& conn)
    : setup_(std::move(setup)), ctx_(std::move(ctx)), conn_(conn) {}

Generation::~Generation() = default;

void Generation::start() {
  start_time_ = Clock::now();
  const GenerationParams& p = setup_.params;
  EngineClient& engine = ctx_.gate->engine();
  const int64_t max_len = engine.max_model_len();

  // Lengths first, so that nothing is submitted for a request that fails.
  std::vector<int32_t> max_tokens(setup_.prompts.size());
  int64_t prompt_tokens = 0;
  for (size_t i = 0; i < setup_.prompts.size(); ++i) {
    const int64_t plen = int64_t(setup_.prompts[i].ids.size());
    prompt_tokens += plen;
    if (plen == 0) throw bad_request("the prompt is empty (0 tokens)", "prompt");
    if (p.max_tokens) {
      if (plen + *p.max_tokens > max_len) {
        throw bad_request("This model's maximum context length is " + std::to_string(max_len) +
                              " tokens. However, you requested " +
                              std::to_string(plen + *p.max_tokens) + " tokens (" +
                              std::to_string(plen) + " in the prompt, " +
                              std::to_string(*p.max_tokens) +
                              " for the completion). Please reduce the prompt or max_tokens.",
                          setup_.chat ? "messages" : "prompt");
      }
      max_tokens[i] = *p.max_tokens;
    } else {
      if (plen >= max_len) {
        throw bad_request("This model's maximum context length is " + std::to_string(max_len) +
                              " tokens. However, the prompt is " + std::to_string(plen) +
                              " tokens, which leaves no room for the completion.",
                          setup_.chat ? "messages" : "prompt");
      }
      max_tokens[i] = int32_t(max_len - plen);
    }
    max_tokens_param_ = std::max(max_tokens_param_, max_tokens[i]);
    if (p.min_tokens > max_tokens[i]) {
      throw bad_request("'min_tokens' (" + std::to_string(p.min_tokens) +
                            ") is larger than the tokens left for the completion (" +
                            std::to_string(max_tokens[i]) + ")",
                        "min_tokens");
    }
  }

  if (setup_.parser && ctx_.tokenizer && p.skip_special_tokens) {
    std::vector<const char*> tags;
    if (setup_.parser->reasoning) tags = {"<think>", "</think>"};
    if (setup_.parser->tools_format != parsers::ToolFormat::kNone) {
      tags.insert(tags.end(), {"<tool_call>", "</tool_call>"});
    }
    for (const char* tag : tags) {
      std::optional<int32_t> id = ctx_.tokenizer->token_to_id(tag);
      if (id && ctx_.tokenizer->is_special(*id)) parser_tags_.emplace_back(*id, tag);
    }
  }

  SamplingParams sampling = p.sampling;
  sampling.logprobs = p.logprobs;
  sampling.prompt_logprobs = p.prompt_logprobs;
  if (p.echo && p.logprobs >= 0) sampling.prompt_logprobs = std::max(p.prompt_logprobs, p.logprobs);

  for (size_t pi = 0; pi < setup_.prompts.size(); ++pi) {
    for (int32_t i = 0; i < p.n; ++i) {
      auto c = std::make_unique<Choice>();
      c->index = choices_.size();
      c->prompt = pi;
      c->engine_id = setup_.id + "-" + std::to_string(c->index);
      if (ctx_.tokenizer) {
        c->detok = std::make_unique<IncrementalDetokenizer>(*ctx_.tokenizer, p.skip_special_tokens);
      }
      c->stops = StopStringMatcher(p.stop, p.include_stop_str_in_output);
      if (setup_.parser) c->parser = std::make_unique<parsers::ChatParser>(*setup_.parser);
      if (p.logprobs >= 0) {
        c->logprobs = setup_.chat ? json{{"content", json::array()}}
                                  : json{{"tokens", json::array()},
                                         {"token_logprobs", json::array()},
                                         {"top_logprobs", json::array()},
                                         {"text_offset", json::array()}};
      }
      choices_.push_back(std::move(c));
    }
  }

  auto self = shared_from_this();
  for (auto& cp : choices_) {
    Choice& c = *cp;
    GenRequest r;
    r.id = c.engine_id;
    r.prompt_ids = setup_.prompts[c.prompt].ids;
    r.sampling = sampling;
    // NOTE: n > 1 with a seed gives each choice its own stream (seed + i), not n copies.
    if (r.sampling.seed && p.n > 1) *r.sampling.seed += uint64_t(c.index % size_t(p.n));
    r.max_tokens = max_tokens[c.prompt];
    r.min_tokens = p.min_tokens;
    r.stop_token_ids = p.stop_token_ids;
    r.ignore_eos = p.ignore_eos;
    if (setup_.make_constraint) r.constraint = setup_.make_constraint();
    r.constraint_spec = setup_.constraint_spec;

    std::shared_ptr<EngineGate> gate = ctx_.gate;
    std::weak_ptr<Connection> conn = conn_;
    size_t index = c.index;
    std::string id = c.engine_id;
    gate->track(id);
    try {
      engine.submit(std::move(r), [gate, conn, self, index, id](const StepOutput& o) {
        StepOutput out = gate->on_engine_output(id, o);  // (untracks a finished one)
        gate->post(conn, [self, index, out] { self->on_output(index, out); });
      });
    } catch (...) {
      gate->untrack(id);
      done_ = true;
      abort_all();
      try {
        throw;
      } catch (const Error& e) {
        if (e.kind() == ErrorKind::kInvalidArgument) throw bad_request(e.message());
        if (e.kind() == ErrorKind::kOutOfResources) {
          throw ApiError(429, "The server is busy (" + e.message() + "); retry later.",
                         "rate_limit_error", "", "queue_full");
        }
        if (e.kind() == ErrorKind::kIo) {  // e.g. no instance reachable behind a router
          throw ApiError(503, "The server is unavailable (" + e.message() + "); retry later.",
                         "server_error", "", "service_unavailable");
        }
        throw ApiError(500, e.message(), "server_error");
      }
    }
    c.submitted = true;
  }
  if (ctx_.metrics) ctx_.metrics->add_prompt_tokens(prompt_tokens);

  auto conn = conn_.lock();
  if (!conn) {
    on_disconnect();
    return;
  }
  conn->log.prompt_tokens = prompt_tokens;
  if (p.stream) conn->stream_begin();
  conn->on_disconnect([self] { self->on_disconnect(); });
}

std::string Generation::token_text(int32_t id) const {
  if (ctx_.tokenizer == nullptr || setup_.params.return_tokens_as_token_ids) {
    return "token_id:" + std::to_string(id);
  }
  return ctx_.tokenizer->decode(std::vector<int32_t>{id}, /*skip_special=*/false);
}

json Generation::token_bytes(int32_t id) const {
  if (ctx_.tokenizer == nullptr || setup_.params.return_tokens_as_token_ids) {
    return utf8_bytes(token_text(id));
  }
  // The token's raw bytes, which may be part of a UTF-8 character (the text shows U+FFFD).
  return utf8_bytes(std::string(ctx_.tokenizer->token_bytes(id)));
}

json Generation::chat_logprob_entry(int32_t id, float logprob,
                                    const std::vector<TokenLogprob>* top) const {
  json entry = {{"token", token_text(id)},
                {"logprob", finite_logprob(logprob)},
                {"bytes", token_bytes(id)},
                {"top_logprobs", json::array()}};
  if (top) {
    size_t n = std::min(top->size(), size_t(std::max(setup_.params.logprobs, 0)));
    for (size_t i = 0; i < n; ++i) {
      const int32_t tid = (*top)[i].id;
      entry["top_logprobs"].push_back({{"token", token_text(tid)},
                                       {"logprob", finite_logprob((*top)[i].logprob)},
                                       {"bytes", token_bytes(tid)}});
    }
  }
  return entry;
}

void Generation::add_completion_logprob(Choice& c, int32_t id, std::optional<float> logprob,
                                        const std::vector<TokenLogprob>* top,
                                        bool include_sampled) {
  std::string t = token_text(id);
  json& lp = c.logprobs;
  lp["tokens"].push_back(t);
  lp["token_logprobs"].push_back(logprob ? json(finite_logprob(*logprob)) : json(nullptr));
  if (!logprob && !top) {
    lp["top_logprobs"].push_back(nullptr);
  } else {
    json d = json::object();
    if (top) {
      size_t n = std::min(top->size(), size_t(std::max(setup_.params.logprobs, 0)));
      for (size_t i = 0; i < n; ++i) {
        d[token_text((*top)[i].id)] = finite_logprob((*top)[i].logprob);
      }
    }
    // OpenAI: the sampled token is always listed, so there may be logprobs + 1 entries.
    if (logprob && include_sampled && !d.contains(t)) d[t] = finite_logprob(*logprob);
    lp["top_logprobs"].push_back(std::move(d));
  }
  lp["text_offset"].push_back(c.text_offset);
  c.text_offset += codepoints(t);
}

json Generation::vllm_prompt_logprobs(const Choice& c, const StepOutput& out) const {
  const std::vector<int32_t>& ids = setup_.prompts[c.prompt].ids;
  const int32_t n = setup_.params.prompt_logprobs;
  json result = json::array();
  result.push_back(nullptr);  // the first prompt token has no logprob
  for (size_t j = 1; j < ids.size(); ++j) {
    if (j - 1 >= out.prompt_token_logprobs.size()) {
      result.push_back(nullptr);
      continue;
    }
    const float actual = out.prompt_token_logprobs[j - 1];
    const std::vector<TokenLogprob>* top =
        j - 1 < out.prompt_top_logprobs.size() ? &out.prompt_top_logprobs[j - 1] : nullptr;
    const size_t m = top ? std::min(top->size(), size_t(std::max(n, 0))) : 0;
    // The prompt token first (as vLLM), then the top-n. NOTE: the engine reports only the
    // top-N, so the rank of a token outside them is not known: null.
    json rank = nullptr;
    for (size_t i = 0; top && i < top->size(); ++i) {
      if ((*top)[i].id == ids[j]) {
        rank = int64_t(i) + 1;
        break;
      }
    }
    json d = json::object();
    d[std::to_string(ids[j])] = {
        {"logprob", finite_logprob(actual)}, {"rank", rank}, {"decoded_token", token_text(ids[j])}};
    for (size_t i = 0; i < m; ++i) {
      std::string key = std::to_string((*top)[i].id);
      if (d.contains(key)) continue;
      d[key] = {{"logprob", finite_logprob((*top)[i].logprob)},
                {"rank", int64_t(i) + 1},
                {"decoded_token", token_text((*top)[i].id)}};
    }
    result.push_back(std::move(d));
  }
  return result;
}

void Generation::on_output(size_t index, const StepOutput& out) {
  if (done_ || index >= choices_.size()) return;
  Choice& c = *choices_[index];
  if (c.finished) return;  // e.g. the abort that follows a stop-string match
  if (out.finish_reason == FinishReason::kError) {
    fail(out.error.empty() ? "the engine failed this request" : out.error, out.retry_after_s);
    return;
  }
  const GenerationParams& p = setup_.params;
  if (!c.got_output) {
    c.got_output = true;
    c.cached_tokens = out.num_cached_prompt_tokens;
    if (p.prompt_logprobs >= 0) c.prompt_logprobs = vllm_prompt_logprobs(c, out);
    if (p.echo && !setup_.chat) {
      const GenerationSetup::Prompt& prompt = setup_.prompts[c.prompt];
      if (p.logprobs >= 0) {
        for (size_t j = 0; j < prompt.ids.size(); ++j) {
          std::optional<float> lp;
          const std::vector<TokenLogprob>* top = nullptr;
          if (j > 0 && j - 1 < out.prompt_token_logprobs.size()) {
            lp = out.prompt_token_logprobs[j - 1];
          }
          if (j > 0 && j - 1 < out.prompt_top_logprobs.size())
            top = &out.prompt_top_logprobs[j - 1];
          add_completion_logprob(c, prompt.ids[j], lp, top, /*include_sampled=*/true);
        }
      }
      c.text += prompt.text;
      c.text_offset = codepoints(prompt.text);
    }
  }

  if (!out.token_ids.empty() && !c.has_token) {
    auto conn = conn_.lock();
    if (conn && conn->log.ttft_s < 0) conn->log.ttft_s = seconds_since(start_time_);
  }
  if (!out.token_ids.empty() && ctx_.metrics) {
    const auto now = Clock::now();
    if (!c.has_token) {
      ctx_.metrics->ttft().observe(seconds_since(start_time_));
    } else {
      const double dt = std::chrono::duration<double>(now - c.last_token_time).count() /
                        double(out.token_ids.size());
      for (size_t k = 0; k < out.token_ids.size(); ++k)
        ctx_.metrics->inter_token_latency().observe(dt);
    }
    c.has_token = true;
    c.last_token_time = now;
  }

  for (size_t k = 0; k < out.token_ids.size() && !c.finished; ++k) add_token(c, out, k);

  if (out.finished && !c.finished) {
    if (c.detok) push_text(c, c.stops.push(c.detok->flush()));
    if (c.stops.stopped()) {
      finish_choice(c, "stop", c.stops.matched());
    } else {
      push_text(c, c.stops.flush());
      switch (out.finish_reason) {
        case FinishReason::kLength: finish_choice(c, "length", nullptr); break;
        case FinishReason::kAbort: finish_choice(c, "abort", nullptr); break;
        default: {
          json stop_reason = nullptr;
          if (std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), out.stop_token_id) !=
              p.stop_token_ids.end()) {
            stop_reason = out.stop_token_id;
          }
          finish_choice(c, "stop", stop_reason);
        }
      }
    }
  }
  if (p.stream) emit_chunk(c);
  if (num_finished_ == choices_.size()) complete();
}

void Generation::add_token(Choice& c, const StepOutput& out, size_t k) {
  const GenerationParams& p = setup_.params;
  const int32_t id = out.token_ids[k];
  c.ids.push_back(id);
  if (p.logprobs >= 0) {
    const float lp = k < out.token_logprobs.size() ? out.token_logprobs[k] : 0.0f;
    const std::vector<TokenLogprob>* top =
        k < out.top_logprobs.size() ? &out.top_logprobs[k] : nullptr;
    if (setup_.chat) {
      c.logprobs["content"].push_back(chat_logprob_entry(id, lp, top));
    } else {
      add_completion_logprob(c, id, lp, top, /*include_sampled=*/true);
    }
  }
  // The EOS / stop id that ended the sequence adds no text (unless asked for).
  const bool final_stop_token = out.finished && k + 1 == out.token_ids.size() &&
                                out.finish_reason == FinishReason::kStop && id == out.stop_token_id;
  std::string piece;
  if (c.detok && !(final_stop_token && !p.include_stop_str_in_output)) {
    piece = c.detok->add(id);
    for (const auto& [tag_id, tag] : parser_tags_) {
      if (id == tag_id) {
        piece += c.detok->flush();  // as decode() would: held bytes of a broken character
        piece += tag;
      }
    }
  }
  push_text(c, c.stops.push(piece));
  if (c.stops.stopped()) {
    finish_choice(c, "stop", c.stops.matched());
    if (!out.finished) ctx_.gate->engine().abort(c.engine_id);
  }
}

void Generation::push_text(Choice& c, const std::string& text) {
  if (!c.parser) {
    c.text += text;
    return;
  }
  if (text.empty() || c.parser_done) return;
  apply_delta(c, c.parser->feed(text));
}

void Generation::apply_delta(Choice& c, parsers::ChatDelta&& d) {
  c.text += d.content;
  c.reasoning += d.reasoning;
  for (parsers::ToolCallDelta& t : d.tool_calls) {
    if (t.header) c.calls.push_back({new_tool_call_id(), t.name, "", false});
    const size_t i = size_t(t.index);
    if (i >= c.calls.size()) continue;  // NOTE: cannot happen (the header comes first)
    c.calls[i].arguments += t.arguments;
    if (setup_.params.stream) c.pending_calls.push_back(std::move(t));
  }
  for (int32_t i : d.failed_calls) {
    if (size_t(i) < c.calls.size()) c.calls[size_t(i)].failed = true;
  }
}

void Generation::finish_choice(Choice& c, const std::string& reason, json stop_reason) {
  if (c.finished) return;
  if (c.parser && !c.parser_done) {
    apply_delta(c, c.parser->finish());
    c.parser_done = true;
  }
  c.finished = true;
  c.finish_reason = reason == "stop" && c.valid_calls() > 0 ? "tool_calls" : reason;
  c.stop_reason = std::move(stop_reason);
  ++num_finished_;
  if (ctx_.metrics) {
    ctx_.metrics->count_sequence(reason);
    ctx_.metrics->add_generation_tokens(int64_t(c.ids.size()));
    ctx_.metrics->e2e_latency().observe(seconds_since(start_time_));
    ctx_.metrics->observe_sequence(int64_t(setup_.prompts[c.prompt].ids.size()),
                                   int64_t(c.ids.size()));
    if (num_finished_ == choices_.size()) {
      int64_t most = 0;
      for (const auto& o : choices_) most = std::max(most, int64_t(o->ids.size()));
      ctx_.metrics->observe_request_params(setup_.params.n, max_tokens_param_, most);
    }
  }
}

void Generation::abort_all() {
  for (auto& c : choices_) {
    if (c->submitted && !c->finished) ctx_.gate->engine().abort(c->engine_id);
  }
}

void Generation::on_disconnect() {
  if (done_) return;
  done_ = true;
  if (auto conn = conn_.lock()) conn->log.output_tokens = output_tokens();
  abort_all();
  for (auto& c : choices_) finish_choice(*c, "abort", nullptr);
}

void Generation::fail(const std::string& message, int32_t retry_after_s) {
  done_ = true;
  abort_all();
  bool started = false;
  for (auto& c : choices_) {
    started = started || c->started || c->got_output;
    if (!c->finished) {
      c->finished = true;
      if (ctx_.metrics) ctx_.metrics->count_sequence("error");
    }
  }
  auto conn = conn_.lock();
  if (!conn || !conn->is_open()) return;
  conn->log.output_tokens = output_tokens();
  if (retry_after_s > 0 && !started) {
    // Never started for lack of capacity (e.g. a router queue timeout): 429, even for a
    // stream (the transport has not sent its head yet).
    HttpResponse r = ApiHandler::error_response(
        ApiError(429, "The server is busy (" + message + "); retry later.", "rate_limit_error", "",
                 "queue_full"));
    for (auto& [k, v] : r.headers) {
      if (k == "Retry-After") v = std::to_string(retry_after_s);
    }
    conn->respond(std::move(r));
    return;
  }
  ApiError err(500, message, "server_error");
  if (setup_.params.stream && setup_.responses) {
    responses_event(
        *conn,
        {{"type", "error"}, {"code", "server_error"}, {"message", message}, {"param", nullptr}});
    conn->stream_end();
  } else if (setup_.params.stream) {
    conn->stream_write("data: " + dump_json(err.to_json()) + "\n\n");
    conn->stream_write("data: [DONE]\n\n");
    conn->stream_end();
  } else {
    conn->respond({500, "application/json", dump_json(err.to_json()), {}});
  }
}

json Generation::usage_json() const {
  int64_t prompt = 0;
  int64_t completion = 0;
  int64_t cached = 0;
  std::vector<int32_t> cached_by_prompt(setup_.prompts.size(), 0);
  for (const auto& pr : setup_.prompts) prompt += int64_t(pr.ids.size());
  for (const auto& c : choices_) {
    completion += int64_t(c->ids.size());
    cached_by_prompt[c->prompt] = std::max(cached_by_prompt[c->prompt], c->cached_tokens);
  }
  for (int32_t x : cached_by_prompt) cached += x;
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion},
          {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

json Generation::chunk_envelope() const {
  return {{"id", setup_.id},
          {"object", setup_.chat ? "chat.completion.chunk" : "text_completion"},
          {"created", setup_.created},
          {"model", setup_.model}};
}

void Generation::emit_chunk(Choice& c) {
  auto conn = conn_.lock();
  if (!conn || !conn->is_open()) return;
  if (setup_.responses) {
    emit_responses(c, *conn);
    return;
  }
  const GenerationParams& p = setup_.params;
  auto send = [&](json chunk) {
    if (p.include_usage) chunk["usage"] = p.continuous_usage ? usage_json() : json(nullptr);
    conn->stream_write("data: " + dump_json(chunk) + "\n\n");
  };

  if (setup_.chat && !c.started) {
    c.started = true;
    json chunk = chunk_envelope();
    chunk["choices"] = json::array({{{"index", c.index},
                                     {"delta", {{"role", "assistant"}, {"content", ""}}},
                                     {"logprobs", nullptr},
                                     {"finish_reason", nullptr}}});
    if (c.index == 0 || setup_.params.n == 1) {
      if (p.return_token_ids) chunk["prompt_token_ids"] = setup_.prompts[0].ids;
      if (p.prompt_logprobs >= 0) chunk["prompt_logprobs"] = c.prompt_logprobs;
    }
    send(std::move(chunk));
  }

  const bool new_ids = c.ids.size() > c.ids_sent;
  const bool first_completion_chunk = !setup_.chat && !c.started;
  const bool ids_matter = p.logprobs >= 0 || p.return_token_ids || ctx_.tokenizer == nullptr;
  const bool visible = !c.text.empty() || !c.reasoning.empty() || !c.pending_calls.empty();
  if (!visible && !c.finished && !(new_ids && ids_matter)) {
    return;  // nothing visible yet (held back by a stop string, a parser or a character)
  }

  json choice = {{"index", c.index}};
  if (setup_.chat) {
    choice["delta"] = delta_json(c);
  } else {
    choice["text"] = c.text;
  }
  choice["logprobs"] = c.logprobs;
  choice["finish_reason"] = c.finished ? json(c.finish_reason) : json(nullptr);
  choice["stop_reason"] = c.finished ? c.stop_reason : json(nullptr);
  if (p.return_token_ids) {
    choice["token_ids"] = std::vector<int32_t>(c.ids.begin() + c.ids_sent, c.ids.end());
    if (first_completion_chunk) choice["prompt_token_ids"] = setup_.prompts[c.prompt].ids;
  }
  if (first_completion_chunk && p.prompt_logprobs >= 0) {
    choice["prompt_logprobs"] = c.prompt_logprobs;
  }
  c.started = true;
  c.text.clear();
  c.reasoning.clear();
  c.pending_calls.clear();
  c.ids_sent = c.ids.size();
  if (!c.logprobs.is_null()) {
    for (auto& [key, arr] : c.logprobs.items()) arr = json::array();
  }
  json chunk = chunk_envelope();
  chunk["choices"] = json::array({std::move(choice)});
  send(std::move(chunk));
}

json Generation::delta_json(Choice& c) const {
  json delta = json::object();
  if (!c.reasoning.empty()) delta["reasoning_content"] = c.reasoning;
  const bool other = !c.reasoning.empty() || !c.pending_calls.empty();
  if (!c.text.empty() || (!c.finished && !other)) delta["content"] = c.text;
  if (!c.pending_calls.empty()) {
    json calls = json::array();
    for (const parsers::ToolCallDelta& t : c.pending_calls) {
      if (!t.header && !calls.empty() && calls.back()["index"] == t.index) {
        auto& args = calls.back()["function"]["arguments"];
        args = args.get<std::string>() + t.arguments;
        continue;
      }
      json call = {{"index", t.index}};
      if (t.header) {
        call["id"] = c.calls[size_t(t.index)].id;
        call["type"] = "function";
        call["function"] = {{"name", t.name}, {"arguments", t.arguments}};
      } else {
        call["function"] = {{"arguments", t.arguments}};
      }
      calls.push_back(std::move(call));
    }
    delta["tool_calls"] = std::move(calls);
  }
  return delta;
}

json Generation::message_json(const Choice& c) const {
  json m = {{"role", "assistant"}};
  const bool calls = c.valid_calls() > 0;
  // vLLM: content is null when the reply was all reasoning or tool calls.
  m["content"] =
      c.text.empty() && c.parser && (calls || !c.reasoning.empty()) ? json(nullptr) : json(c.text);
  if (setup_.parser && setup_.parser->reasoning) {
    m["reasoning_content"] = c.reasoning.empty() ? json(nullptr) : json(c.reasoning);
  }
  if (calls) {
    json list = json::array();
    for (const Choice::Call& call : c.calls) {
      if (call.failed) continue;
      list.push_back({{"id", call.id},
                      {"type", "function"},
                      {"function", {{"name", call.name}, {"arguments", call.arguments}}}});
    }
    m["tool_calls"] = std::move(list);
  }
  return m;
}

// ---- /v1/responses ----------------------------------------------------------------------

void Generation::responses_event(Connection& conn, json ev) {
  ev["sequence_number"] = resp_seq_++;
  const std::string type = ev["type"];
  conn.stream_write("event: " + type + "\ndata: " + dump_json(ev) + "\n\n");
}

json Generation::response_json(const std::string& status, json output) const {
  const json& b = setup_.responses_body;
  auto echo = [&](const char* key, json def) {
    auto it = b.find(key);
    return it == b.end() || it->is_null() ? def : *it;
  };
  int64_t input = 0;
  for (const auto& pr : setup_.prompts) input += int64_t(pr.ids.size());
  int64_t output_tokens = 0;
  int64_t cached = 0;
  for (const auto& c : choices_) {
    output_tokens += int64_t(c->ids.size());
    cached = std::max<int64_t>(cached, c->cached_tokens);
  }
  json r = {{"id", setup_.id},
            {"object", "response"},
            {"created_at", setup_.created},
            {"status", status},
            {"model", setup_.model},
            {"output", std::move(output)},
            {"error", nullptr},
            {"incomplete_details",
             status == "incomplete" ? json{{"reason", "max_output_tokens"}} : json(nullptr)},
            {"instructions", echo("instructions", nullptr)},
            {"max_output_tokens", echo("max_output_tokens", nullptr)},
            {"metadata", echo("metadata", json::object())},
            {"parallel_tool_calls", echo("parallel_tool_calls", true)},
            {"previous_response_id", nullptr},
            {"reasoning", echo("reasoning", json{{"effort", nullptr}, {"summary", nullptr}})},
            {"store", false},
            {"temperature", echo("temperature", 1.0)},
            {"text", echo("text", json{{"format", {{"type", "text"}}}})},
            {"tool_choice", echo("tool_choice", "auto")},
            {"tools", echo("tools", json::array())},
            {"top_p", echo("top_p", 1.0)},
            {"truncation", "disabled"},
            {"user", echo("user", nullptr)}};
  if (status != "in_progress") {
    r["usage"] = {{"input_tokens", input},
                  {"input_tokens_details", {{"cached_tokens", cached}}},
                  {"output_tokens", output_tokens},
                  {"output_tokens_details", {{"reasoning_tokens", 0}}},
                  {"total_tokens", input + output_tokens}};
  } else {
    r["usage"] = nullptr;
  }
  return r;
}

namespace {

std::string item_id(const std::string& prefix, const std::string& response_id, size_t i) {
  return prefix + response_id.substr(response_id.find('_') + 1) + std::to_string(i);
}

json reasoning_item(std::string id, const std::string& text, const char* status) {
  return {{"type", "reasoning"},
          {"id", std::move(id)},
          {"summary", json::array()},
          {"content", json::array({{{"type", "reasoning_text"}, {"text", text}}})},
          {"status", status}};
}

json message_item(std::string id, const std::string& text, const char* status) {
  json content = json::array();
  if (text.size() || std::string(status) == "completed") {
    content.push_back({{"type", "output_text"},
                       {"text", text},
                       {"annotations", json::array()},
                       {"logprobs", json::array()}});
  }
  return {{"type", "message"},
          {"id", std::move(id)},
          {"status", status},
          {"role", "assistant"},
          {"content", std::move(content)}};
}

json call_item(std::string id, const std::string& call_id, const std::string& name,
               const std::string& args, const char* status) {
  return {{"type", "function_call"}, {"id", std::move(id)}, {"call_id", call_id}, {"name", name},
          {"arguments", args},       {"status", status}};
}

}  // namespace

json Generation::responses_output(const Choice& c) const {
  json out = json::array();
  if (!c.reasoning.empty()) {
    out.push_back(reasoning_item(item_id("rs_", setup_.id, out.size()), c.reasoning, "completed"));
  }
  if (!c.text.empty() || c.valid_calls() == 0) {
    out.push_back(message_item(item_id("msg_", setup_.id, out.size()), c.text, "completed"));
  }
  for (const Choice::Call& call : c.calls) {
    if (call.failed) continue;
    out.push_back(call_item(item_id("fc_", setup_.id, out.size()), call.id, call.name,
                            call.arguments, "completed"));
  }
  return out;
}

void Generation::responses_close_item(Choice& c, Connection& conn) {
  if (!resp_open_) return;
  resp_open_ = false;
  json& item = resp_items_.back();
  const size_t index = resp_items_.size() - 1;
  const std::string type = item["type"];
  const json item_id = item["id"];
  if (type == "function_call") {
    const Choice::Call& call = c.calls.at(size_t(resp_open_call_));
    item["arguments"] = call.arguments;
    item["status"] = call.failed ? "incomplete" : "completed";
    responses_event(conn, {{"type", "response.function_call_arguments.done"},
                           {"item_id", item_id},
                           {"output_index", index},
                           {"name", call.name},
                           {"arguments", call.arguments}});
  } else {
    json& part = item["content"][0];
    const std::string text = part["text"];
    const bool reasoning = type == "reasoning";
    item["status"] = "completed";
    responses_event(
        conn, {{"type", reasoning ? "response.reasoning_text.done" : "response.output_text.done"},
               {"item_id", item_id},
               {"output_index", index},
               {"content_index", 0},
               {"text", text},
               {"logprobs", json::array()}});
    responses_event(conn, {{"type", "response.content_part.done"},
                           {"item_id", item_id},
                           {"output_index", index},
                           {"content_index", 0},
                           {"part", part}});
  }
  responses_event(conn,
                  {{"type", "response.output_item.done"}, {"output_index", index}, {"item", item}});
}

void Generation::emit_responses(Choice& c, Connection& conn) {
  if (!resp_started_) {
    resp_started_ = true;
    json r = response_json("in_progress", json::array());
    responses_event(conn, {{"type", "response.created"}, {"response", r}});
    responses_event(conn, {{"type", "response.in_progress"}, {"response", r}});
  }
  // A text item (reasoning or message): opened on its first delta.
  auto text_delta = [&](const std::string& type, const std::string& delta) {
    if (delta.empty()) return;
    if (!resp_open_ || resp_items_.back()["type"] != type) {
      responses_close_item(c, conn);
      const size_t index = resp_items_.size();
      const bool reasoning = type == "reasoning";
      json item = reasoning ? reasoning_item(item_id("rs_", setup_.id, index), "", "in_progress")
                            : message_item(item_id("msg_", setup_.id, index), "", "in_progress");
      json part = reasoning ? json{{"type", "reasoning_text"}, {"text", ""}}
                            : json{{"type", "output_text"},
                                   {"text", ""},
                                   {"annotations", json::array()},
                                   {"logprobs", json::array()}};
      json announced = item;
      announced["content"] = json::array();
      responses_event(
          conn,
          {{"type", "response.output_item.added"}, {"output_index", index}, {"item", announced}});
      responses_event(conn, {{"type", "response.content_part.added"},
                             {"item_id", item["id"]},
                             {"output_index", index},
                             {"content_index", 0},
                             {"part", part}});
      item["content"] = json::array({part});
      resp_items_.push_back(std::move(item));
      resp_open_ = true;
    }
    json& item = resp_items_.back();
    json& text = item["content"][0]["text"];
    text = text.get<std::string>() + delta;
    json ev = {{"type", type == "reasoning" ? "response.reasoning_text.delta"
                                            : "response.output_text.delta"},
               {"item_id", item["id"]},
               {"output_index", resp_items_.size() - 1},
               {"content_index", 0},
               {"delta", delta}};
    if (type != "reasoning") ev["logprobs"] = json::array();
    responses_event(conn, std::move(ev));
  };
  text_delta("reasoning", c.reasoning);
  text_delta("message", c.text);
  for (const parsers::ToolCallDelta& t : c.pending_calls) {
    if (t.header) {
      responses_close_item(c, conn);
      const size_t index = resp_items_.size();
      json item = call_item(item_id("fc_", setup_.id, index), c.calls.at(size_t(t.index)).id,
                            t.name, "", "in_progress");
      responses_event(
          conn, {{"type", "response.output_item.added"}, {"output_index", index}, {"item", item}});
      resp_items_.push_back(std::move(item));
      resp_open_ = true;
      resp_open_call_ = t.index;
    }
    if (!t.arguments.empty() && resp_open_ && resp_open_call_ == t.index) {
      responses_event(conn, {{"type", "response.function_call_arguments.delta"},
                             {"item_id", resp_items_.back()["id"]},
                             {"output_index", resp_items_.size() - 1},
                             {"delta", t.arguments}});
    }
  }
  c.text.clear();
  c.reasoning.clear();
  c.pending_calls.clear();
  c.started = true;
  c.ids_sent = c.ids.size();
  if (c.finished) {
    responses_close_item(c, conn);
    // The failed calls' items stay in the stream as "incomplete"; the final response lists
    // the items as streamed.
    const bool incomplete = c.finish_reason == "length";
    json r = response_json(incomplete ? "incomplete" : "completed", resp_items_);
    responses_event(conn, {{"type", incomplete ? "response.incomplete" : "response.completed"},
                           {"response", std::move(r)}});
  }
}

json Generation::final_choice_json(const Choice& c) const {
  const GenerationParams& p = setup_.params;
  json choice = {{"index", c.index}};
  if (setup_.chat) {
    choice["message"] = message_json(c);
  } else {
    choice["text"] = c.text;
  }
  choice["logprobs"] = c.logprobs;
  choice["finish_reason"] = c.finish_reason;
  choice["stop_reason"] = c.stop_reason;
  if (p.return_token_ids) {
    choice["token_ids"] = c.ids;
    if (!setup_.chat) choice["prompt_token_ids"] = setup_.prompts[c.prompt].ids;
  }
  if (!setup_.chat && p.prompt_logprobs >= 0) choice["prompt_logprobs"] = c.prompt_logprobs;
  return choice;
}

int64_t Generation::output_tokens() const {
  int64_t n = 0;
  for (const auto& c : choices_) n += int64_t(c->ids.size());
  return n;
}

void Generation::complete() {
  done_ = true;
  auto conn = conn_.lock();
  if (!conn || !conn->is_open()) return;
  conn->log.output_tokens = output_tokens();
  const GenerationParams& p = setup_.params;
  if (setup_.responses) {
    if (p.stream) {
      conn->stream_end();  // response.completed went out with the last output
    } else {
      const Choice& c = *choices_.at(0);
      conn->respond(
          {200,
           "application/json",
           dump_json(response_json(c.finish_reason == "length" ? "incomplete" : "completed",
                                   responses_output(c))),
           {}});
    }
    return;
  }
  if (p.stream) {
    if (p.include_usage) {
      json chunk = chunk_envelope();
      chunk["choices"] = json::array();
      chunk["usage"] = usage_json();
      conn->stream_write("data: " + dump_json(chunk) + "\n\n");
    }
    conn->stream_write("data: [DONE]\n\n");
    conn->stream_end();
    return;
  }
  json r = {{"id", setup_.id},
            {"object", setup_.chat ? "chat.completion" : "text_completion"},
            {"created", setup_.created},
            {"model", setup_.model},
            {"choices", json::array()}};
  for (const auto& c : choices_) r["choices"].push_back(final_choice_json(*c));
  r["usage"] = usage_json();
  if (setup_.chat && p.return_token_ids) r["prompt_token_ids"] = setup_.prompts[0].ids;
  if (setup_.chat && p.prompt_logprobs >= 0 && !choices_.empty()) {
    r["prompt_logprobs"] = choices_[0]->prompt_logprobs;
  }
  conn->respond({200, "application/json", dump_json(r), {}});
}

}  // namespace tandem::openai
