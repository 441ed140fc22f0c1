"""The official `openai` Python client against a running `tandem serve` (demo model).

Usage: python openai_client.py BASE_URL. Exits non-zero on any mismatch."""
import sys

from openai import OpenAI

base = sys.argv[1]
client = OpenAI(base_url=base + "/v1", api_key="unused")

models = client.models.list()
assert [m.id for m in models.data] == ["demo"], models

# Streaming chat completion, with the usage chunk.
text, usage = "", None
for chunk in client.chat.completions.create(
        model="demo", stream=True, max_tokens=24, temperature=0,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Who is Mr. Darcy?"}]):
    if chunk.choices:
        text += chunk.choices[0].delta.content or ""
    if chunk.usage:
        usage = chunk.usage
assert usage is not None and usage.completion_tokens > 0, usage
assert len(text.strip()) > 0, repr(text)

# The same request without streaming gives the same text (greedy).
resp = client.chat.completions.create(
    model="demo", max_tokens=24, temperature=0,
    messages=[{"role": "user", "content": "Who is Mr. Darcy?"}])
assert resp.choices[0].message.content == text, (resp.choices[0].message.content, text)

# Completions with logprobs; errors come back as the client's typed exceptions.
comp = client.completions.create(model="demo", prompt="It is a truth", max_tokens=5,
                                 temperature=0, logprobs=2)
assert len(comp.choices[0].logprobs.tokens) == comp.usage.completion_tokens
try:
    client.completions.create(model="demo", prompt="x", max_tokens=5, temperature=-1)
    raise AssertionError("temperature -1 accepted")
except Exception as e:  # openai.BadRequestError
    assert getattr(e, "status_code", None) == 400, e
print("openai client: ok:", repr(text[:60]))
