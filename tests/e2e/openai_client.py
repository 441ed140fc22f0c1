"""The official `openai` Python client against a running `tandem serve` (demo model).

Usage: python openai_client.py BASE_URL. Exits non-zero on any mismatch."""
import json
import os
import re
import sys

from openai import OpenAI

base = sys.argv[1]
if os.environ.get("TANDEM_CA_FILE"):  # HTTPS: trust exactly the test's self-signed certificate
    import ssl
    import openai
    assert base.startswith("https://"), base
    tls = ssl.create_default_context(cafile=os.environ["TANDEM_CA_FILE"])
    client = OpenAI(base_url=base + "/v1", api_key="unused",
                    http_client=openai.DefaultHttpxClient(verify=tls))
else:
    client = OpenAI(base_url=base + "/v1", api_key="unused")

models = client.models.list()
assert [m.id for m in models.data] == ["demo"], models

# Streaming chat completion, with the usage chunk. The demo thinks first (Qwen3's default,
# enable_thinking): the reasoning arrives as delta.reasoning_content, then the answer as content.
text, reasoning, usage = "", "", None
for chunk in client.chat.completions.create(
        model="demo", stream=True, max_tokens=64, temperature=0,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Who is Mr. Darcy?"}]):
    if chunk.choices:
        text += chunk.choices[0].delta.content or ""
        reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
    if chunk.usage:
        usage = chunk.usage
assert usage is not None and usage.completion_tokens > 0, usage
assert len(text.strip()) > 0, (reasoning, text)
assert len(reasoning.strip()) > 0, (reasoning, text)

# The same request without streaming gives the same text and reasoning (greedy).
resp = client.chat.completions.create(
    model="demo", max_tokens=64, temperature=0,
    messages=[{"role": "user", "content": "Who is Mr. Darcy?"}])
assert resp.choices[0].message.content == text, (resp.choices[0].message.content, text)
assert getattr(resp.choices[0].message, "reasoning_content", None) == reasoning, (resp, reasoning)

# Completions with logprobs; errors come back as the client's typed exceptions.
comp = client.completions.create(model="demo", prompt="It is a truth", max_tokens=5,
                                 temperature=0, logprobs=2)
assert len(comp.choices[0].logprobs.tokens) == comp.usage.completion_tokens
try:
    client.completions.create(model="demo", prompt="x", max_tokens=5, temperature=-1)
    raise AssertionError("temperature -1 accepted")
except Exception as e:  # openai.BadRequestError
    assert getattr(e, "status_code", None) == 400, e

# Reasoning: with thinking on (the default) the demo writes a plan in a think block: it is split
# off into reasoning_content (checked above), and the content does not start with its newlines.
# With enable_thinking false the template's empty think block is split off: reasoning_content
# null, and nothing of it streams.
msg = resp.choices[0].message
assert not msg.content.startswith("\n"), repr(msg.content)
off = {"chat_template_kwargs": {"enable_thinking": False}}
msg = client.chat.completions.create(
    model="demo", max_tokens=24, temperature=0, extra_body=off,
    messages=[{"role": "user", "content": "Who is Mr. Darcy?"}]).choices[0].message
assert msg.content and not msg.content.startswith("\n"), repr(msg.content)
assert getattr(msg, "reasoning_content", "missing") is None, msg
streamed_reasoning = ""
for chunk in client.chat.completions.create(
        model="demo", stream=True, max_tokens=24, temperature=0, extra_body=off,
        messages=[{"role": "user", "content": "Who is Mr. Darcy?"}]):
    if chunk.choices:
        streamed_reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
assert streamed_reasoning == "", repr(streamed_reasoning)

# Tools: whatever the model chooses, the requests and replies must have OpenAI's shapes; a named tool_choice starts the reply inside that function's call.
tools = [{"type": "function", "function": {
    "name": "count_chapters", "description": "Chapters in a novel",
    "parameters": {"type": "object", "properties": {"book": {"type": "string"}},
                   "required": ["book"]}}}]
for choice in ["auto", "required", {"type": "function", "function": {"name": "count_chapters"}}]:
    r = client.chat.completions.create(model="demo", max_tokens=16, temperature=0, tools=tools,
                                       tool_choice=choice,
                                       messages=[{"role": "user", "content": "How long is Emma?"}])
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls"), c
    for call in c.message.tool_calls or []:
        assert call.id.startswith("call_") and call.type == "function", call
        assert call.function.name == "count_chapters", call
    # Streaming assembles to the same reply.
    content, calls = "", {}
    for chunk in client.chat.completions.create(
            model="demo", max_tokens=16, temperature=0, tools=tools, tool_choice=choice,
            stream=True, messages=[{"role": "user", "content": "How long is Emma?"}]):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            entry = calls.setdefault(t.index, {"name": "", "arguments": ""})
            if t.function and t.function.name:
                entry["name"] = t.function.name
            if t.function and t.function.arguments:
                entry["arguments"] += t.function.arguments
    assert content == (c.message.content or ""), (content, c.message.content)
    want = [{"name": x.function.name, "arguments": x.function.arguments}
            for x in c.message.tool_calls or []]
    assert [calls[i] for i in sorted(calls)][:len(want)] == want, (calls, want)
# A tool-call turn and its result in the next request.
r = client.chat.completions.create(model="demo", max_tokens=8, temperature=0, tools=tools,
                                   messages=[
    {"role": "user", "content": "How long is Emma?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "count_chapters", "arguments": "{\"book\": \"Emma\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "55"}])
assert r.choices[0].message.role == "assistant"
for bad in [{"tool_choice": "bogus", "tools": tools}, {"tool_choice": "required"},
            {"tools": [{"type": "function", "function": {"description": "no name"}}]},
            {"extra_body": {"guided_json": {"type": "no such type"}}},
            {"extra_body": {"structured_outputs": {"regex": "(unclosed"}}},
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": {"type": 5}}}}]:
    try:
        client.chat.completions.create(model="demo", max_tokens=4,
                                       messages=[{"role": "user", "content": "x"}], **bad)
        raise AssertionError(f"accepted: {bad}")
    except Exception as e:  # openai.BadRequestError
        assert getattr(e, "status_code", None) == 400, (bad, e)

# Structured outputs (xgrammar): json_schema replies validate (jsonschema from PyPI when the
# venv has it), tool_choice required / named give calls whose arguments validate, regex and
# choice match; streamed equals non-streamed.
try:
    import jsonschema

    def validate(obj, schema):
        jsonschema.validate(obj, schema)
except ImportError:  # (TANDEM_OPENAI_PYTHON without jsonschema): the checks below suffice
    def validate(obj, schema):
        assert isinstance(obj, dict) and set(obj) <= set(schema["properties"]), (obj, schema)
        for k in schema.get("required", []):
            assert k in obj, (obj, k)
person = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "age", "color"]}
for seed in (1, 2, 3):
    kw = dict(model="demo", max_tokens=80, temperature=1.0, seed=seed,
              messages=[{"role": "user", "content": "Describe Emma as JSON."}],
              response_format={"type": "json_schema",
                               "json_schema": {"name": "person", "schema": person,
                                               "strict": True}})
    r = client.chat.completions.create(**kw)
    obj = json.loads(r.choices[0].message.content)
    validate(obj, person)
    assert obj["color"] in ("red", "green", "blue") and 0 <= obj["age"] <= 120, obj
    streamed = "".join(ch.choices[0].delta.content or ""
                       for ch in client.chat.completions.create(stream=True, **kw) if ch.choices)
    assert streamed == r.choices[0].message.content, (streamed, r.choices[0].message.content)
book_tool = [{"type": "function", "function": {
    "name": "count_chapters", "description": "Chapters in a novel",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"book": {"enum": ["Emma", "Persuasion"]},
                                  "volume": {"type": "integer", "minimum": 1, "maximum": 3}},
                   "required": ["book", "volume"]}}}]
for choice in ["required", {"type": "function", "function": {"name": "count_chapters"}}]:
    r = client.chat.completions.create(model="demo", max_tokens=200, temperature=1.0, seed=4,
                                       tools=book_tool, tool_choice=choice,
                                       messages=[{"role": "user", "content": "How long is Emma?"}])
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
    call = c.message.tool_calls[0]
    assert call.function.name == "count_chapters", call
    validate(json.loads(call.function.arguments), book_tool[0]["function"]["parameters"])
r = client.completions.create(model="demo", prompt="The date:", max_tokens=20, temperature=1.0,
                              extra_body={"structured_outputs": {"regex": "[0-9]{4}-[0-9]{2}"}})
assert re.fullmatch(r"[0-9]{4}-[0-9]{2}", r.choices[0].text), r.choices[0].text
r = client.chat.completions.create(model="demo", max_tokens=64, temperature=1.0,
                                   messages=[{"role": "user", "content": "Emma or Anne?"}],
                                   extra_body={"guided_choice": ["Emma", "Anne"],
                                               "chat_template_kwargs": {"enable_thinking": False}})
assert r.choices[0].message.content in ("Emma", "Anne"), r.choices[0].message.content

# logit_bias: a +100 bias makes greedy pick that token.
forced = client.completions.create(model="demo", prompt="It is a truth", max_tokens=3,
                                   temperature=0, logit_bias={"65": 100})
assert len(forced.choices[0].text) > 0

# The Responses API.
r = client.responses.create(model="demo", input="Who is Mr. Darcy?", instructions="Be brief.",
                            max_output_tokens=64, temperature=0)
assert r.status in ("completed", "incomplete"), r
assert len(r.output_text) > 0 and not r.output_text.startswith("\n"), repr(r.output_text)
deltas, final = "", None
for ev in client.responses.create(model="demo", input="Who is Mr. Darcy?",
                                  instructions="Be brief.", max_output_tokens=64,
                                  temperature=0, stream=True):
    if ev.type == "response.output_text.delta":
        deltas += ev.delta
    if ev.type in ("response.completed", "response.incomplete"):
        final = ev.response
assert final is not None and final.output_text == deltas == r.output_text, (deltas, r.output_text)
r = client.responses.create(model="demo", max_output_tokens=8, temperature=0,
                            tools=[{"type": "function", "name": "count_chapters",
                                    "parameters": tools[0]["function"]["parameters"]}],
                            input=[{"role": "user", "content": "How long is Emma?"},
                                   {"type": "function_call", "call_id": "call_1",
                                    "name": "count_chapters", "arguments": "{\"book\": \"Emma\"}"},
                                   {"type": "function_call_output", "call_id": "call_1",
                                    "output": "55"}])
assert r.status in ("completed", "incomplete"), r
print("openai client: ok:", repr(text[:60]))
