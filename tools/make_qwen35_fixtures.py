#!/usr/bin/env python3
"""Golden fixtures for Tandem's Qwen3.5 hybrid MoE: tiny random checkpoints + transformers' fp32
greedy output.

Usage:
    python3 tools/make_qwen35_fixtures.py [--out tests/data/fixtures] [--only NAME ...] [--check]

Each fixture <out>/qwen35_*/ is written by transformers' save_pretrained (config.json, one
model.safetensors with per-expert tensors, as the hub ships them), then, where the spec asks for
it, edited the way published checkpoints differ from what save_pretrained writes: the extra
config fields the hub config.json carries (attn_output_gate, mtp_num_hidden_layers,
mamba_ssm_dtype, mrope_section / mrope_interleaved, full_attention_interval), the experts fused
into 3D experts.gate_up_proj / experts.down_proj, mtp.* tensors, bf16 weights. The golden
output comes from the checkpoint re-loaded with from_pretrained (eager attention, fp32, full
forwards without a cache, checked against generate() with its cache). golden.json has the
format of tools/make_fixtures.py (see tools/README.md).

Weights and prompts are redrawn until every greedy step has a top1-top2 logit margin above
MIN_LOGIT_MARGIN, every routed token a k-th / (k+1)-th router logit gap above
MIN_ROUTER_MARGIN, no eos is generated and the output has at least MIN_DISTINCT tokens.

No network access; tested with transformers 5.24 / torch 2.15 on the CPU.
"""
import argparse
import json
import math
import os
import shutil
import sys
import tempfile

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM,
                          Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeTextConfig)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import write_golden  # noqa: E402  (same golden.json layout)

MAX_TOKENS = 12
TOP_N = 5
MIN_LOGIT_MARGIN = 1e-2
MIN_ROUTER_MARGIN = 2e-4  # fp32 router logits agree to ~1e-6; 300-token prompts x 4 layers
MIN_DISTINCT = 5
SIZE_LIMIT = 5 * 1000 * 1000  # all qwen35_* fixtures together

FIXTURES = [
    dict(
        name="qwen35_text_hd64_int2_fused",
        about="qwen3_5_moe_text (Qwen3_5MoeForCausalLM, weights under model.*); vocab 256, hidden 64, "
              "4 layers, full_attention_interval 2 (linear, full, linear, full: layer_types written); "
              "gated attention 4 q / 2 kv heads x head_dim 64, partial RoPE 0.25 (16 dims), rope_theta 1e4; "
              "DeltaNet 2 key / 4 value heads x 16, conv kernel 4; 8 experts top-2 x 32 + shared expert 32; "
              "untied lm_head; experts fused 3D (experts.gate_up_proj / experts.down_proj); fp32; "
              "prompts of 3 / 40 / 300 tokens.",
        layout="text", dtype="float32", fused=True, extra_fields=False, mtp=False,
        vocab=256, hidden=64, layers=4, interval=2, heads=4, kv_heads=2, head_dim=64,
        lk_heads=2, lv_heads=4, lk_dim=16, lv_dim=16, experts=8, top_k=2, moe_inter=32,
        shared_inter=32, tie=False, theta=1e4, max_pos=1024, eps=1e-6,
        prompt_lens=[3, 40, 300], seed=11,
    ),
    dict(
        name="qwen35_vl_hd256_int4_tied_bf16",
        about="qwen3_5_moe (Qwen3_5MoeForConditionalGeneration: language model under text_config and "
              "model.language_model.*, a tiny vision tower under model.visual.*, mtp.* tensors); the "
              "published config fields attn_output_gate, mtp_num_hidden_layers, mamba_ssm_dtype, "
              "full_attention_interval, rope_parameters.mrope_section / mrope_interleaved; vocab 320, "
              "hidden 64, 4 layers, full_attention_interval 4 (3 linear then 1 full); gated attention "
              "4 q / 2 kv heads x head_dim 256 (RoPE on 64 dims), rope_theta 1e7; DeltaNet 1 key / 2 "
              "value heads x 32; 8 experts top-2 x 32 + shared expert 48; tied embeddings; per-expert "
              "tensors (hub layout); bf16 weights (golden in fp32 from the upcast weights); prompts of "
              "3 / 40 / 310 tokens.",
        layout="vl", dtype="bfloat16", fused=False, extra_fields=True, mtp=True,
        vocab=320, hidden=64, layers=4, interval=4, heads=4, kv_heads=2, head_dim=256,
        lk_heads=1, lv_heads=2, lk_dim=32, lv_dim=32, experts=8, top_k=2, moe_inter=32,
        shared_inter=48, tie=True, theta=1e7, max_pos=1024, eps=1e-6,
        prompt_lens=[3, 40, 310], seed=12,
    ),
]


class Retry(Exception):
    pass


def special_ids(spec):
    v = spec["vocab"]
    return v - 2, [v - 1]  # bos, eos


def text_config_dict(spec):
    bos, eos = special_ids(spec)
    return dict(
        vocab_size=spec["vocab"], hidden_size=spec["hidden"], num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
        head_dim=spec["head_dim"], linear_num_key_heads=spec["lk_heads"],
        linear_num_value_heads=spec["lv_heads"], linear_key_head_dim=spec["lk_dim"],
        linear_value_head_dim=spec["lv_dim"], linear_conv_kernel_dim=4,
        moe_intermediate_size=spec["moe_inter"],
        shared_expert_intermediate_size=spec["shared_inter"], num_experts=spec["experts"],
        num_experts_per_tok=spec["top_k"], full_attention_interval=spec["interval"],
        max_position_embeddings=spec["max_pos"], rms_norm_eps=spec["eps"],
        rope_parameters={"rope_type": "default", "rope_theta": float(spec["theta"]),
                         "partial_rotary_factor": 0.25},
        tie_word_embeddings=spec["tie"], bos_token_id=bos, eos_token_id=eos[0],
    )


def build_model(spec, seed):
    torch.manual_seed(seed)
    tc = text_config_dict(spec)
    if spec["layout"] == "text":
        cfg = Qwen3_5MoeTextConfig(**tc)
        model = Qwen3_5MoeForCausalLM(cfg)
    else:
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=spec["hidden"],
                      num_position_embeddings=16, patch_size=4)
        cfg = Qwen3_5MoeConfig(text_config=tc, vision_config=vision, tie_word_embeddings=spec["tie"])
        model = Qwen3_5MoeForConditionalGeneration(cfg)
    model = model.to(torch.float32)
    set_eager(model)
    return model.eval()


def set_eager(model):
    model.set_attn_implementation("eager")
    if hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation("eager")
        except Exception as e:  # noqa: BLE001
            print(f"  note: set_experts_implementation('eager') failed: {e}")


def init_weights(model, spec, seed):
    """Peaked random init; zero-centred RMSNorm weights (1 + w) small, DeltaNet decays moderate."""
    g = torch.Generator().manual_seed(seed)
    h = spec["hidden"]

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "visual" in name:
                continue  # the vision tower keeps its (seeded) default init: text serving skips it
            fan_in = p.shape[-1]
            if name.endswith("language_model.norm.weight") or name == "model.norm.weight":
                # (1 + w); tied head: a final norm of random sign keeps the model from echoing
                # its input token (logits = norm(x) . E^T, x carries E[token]).
                val = normal(p.shape, 1.0, -1.0) if spec["tie"] else normal(p.shape, 0.1)
            elif name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: plain weight
                val = normal(p.shape, 0.1, 1.0)
            elif name.endswith("norm.weight"):  # zero-centred: input/post/q/k norms
                val = normal(p.shape, 0.1)
            elif name.endswith("A_log"):
                val = torch.log(torch.rand(p.shape, generator=g) * 0.95 + 0.05)
            elif name.endswith("dt_bias"):
                val = normal(p.shape, 0.5)
            elif name.endswith("conv1d.weight"):
                val = normal(p.shape, 0.5)
            elif "embed_tokens" in name:
                val = normal(p.shape, 1.0)
            elif "lm_head" in name:
                val = normal(p.shape, 5.0 / math.sqrt(h))
            elif name.endswith("mlp.gate.weight"):
                val = normal(p.shape, 3.0 / math.sqrt(h))
            elif any(x in name for x in ("self_attn", "linear_attn", "mlp")):
                val = normal(p.shape, 1.0 / math.sqrt(fan_in))
            else:
                raise RuntimeError(f"no init rule for {name}")
            p.copy_(val)
    if spec["dtype"] == "bfloat16":  # round to what goes on disk; compute stays fp32
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).to(torch.float32))


def router_modules(model):
    return [m for n, m in model.named_modules() if n.endswith("mlp.gate")]


def greedy_case(model, spec, prompt):
    _, eos = special_ids(spec)
    ids = list(prompt)
    out, tops, tlp, margins = [], [], [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].to(torch.float32)
            srt = torch.sort(logits, descending=True)
            margin = float(srt.values[0] - srt.values[1])
            if margin <= MIN_LOGIT_MARGIN:
                raise Retry(f"logit margin {margin:.2e}")
            tok = int(srt.indices[0])
            if tok in eos:
                raise Retry("eos generated")
            lp = torch.log_softmax(logits, dim=-1)
            tl = torch.topk(lp, TOP_N)
            tops.append([[int(i), float(v)] for v, i in zip(tl.values, tl.indices)])
            tlp.append(float(lp[tok]))
            margins.append(margin)
            out.append(tok)
            ids.append(tok)
        if len(set(out)) < MIN_DISTINCT:
            raise Retry(f"degenerate output {out}")
        # Router margins over every position that is ever fed (prompt + output[:-1]).
        captured = []
        hooks = [m.register_forward_hook(lambda mod, inp, o: captured.append(o[0].detach()))
                 for m in router_modules(model)]
        try:
            model(torch.tensor([list(prompt) + out[:-1]]), use_cache=False)
        finally:
            for hk in hooks:
                hk.remove()
        assert len(captured) == spec["layers"], len(captured)
        rmin = float("inf")
        for rl in captured:
            srt = torch.sort(rl.to(torch.float32), dim=-1, descending=True).values
            rmin = min(rmin, float((srt[:, spec["top_k"] - 1] - srt[:, spec["top_k"]]).min()))
        if rmin <= MIN_ROUTER_MARGIN:
            raise Retry(f"router margin {rmin:.2e}")
        # generate() with its cache (recurrent DeltaNet decode) must agree.
        gen = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS, min_new_tokens=0,
            eos_token_id=eos, pad_token_id=special_ids(spec)[0], return_dict_in_generate=True,
            output_logits=True, top_k=None, top_p=None, temperature=None,
        )
        gen_ids = gen.sequences[0, len(prompt):].tolist()
        assert gen_ids == out, f"generate() {gen_ids} != full-forward loop {out}"
        for step, lg in enumerate(gen.logits):
            lp = torch.log_softmax(lg[0].to(torch.float32), -1)
            d = abs(float(lp[out[step]]) - tlp[step])
            assert d < 1e-4, f"cached vs full-forward logprob differ by {d} at step {step}"
    return {
        "prompt_ids": list(prompt),
        "max_tokens": MAX_TOKENS,
        "output_ids": out,
        "top_logprobs": tops,
        "token_logprobs": tlp,
        "min_logit_margin": min(margins),
        "min_router_margin": rmin,
    }


def read_safetensors(path):
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def edit_checkpoint(d, spec):
    """Turns what save_pretrained wrote into the published variant the spec asks for."""
    path = os.path.join(d, "model.safetensors")
    sd = read_safetensors(path)
    root = "model.language_model." if spec["layout"] == "vl" else "model."
    E = spec["experts"]
    if spec["fused"]:
        for l in range(spec["layers"]):
            p = f"{root}layers.{l}.mlp.experts."
            gu = [torch.cat([sd.pop(f"{p}{e}.gate_proj.weight"), sd.pop(f"{p}{e}.up_proj.weight")], 0)
                  for e in range(E)]
            dn = [sd.pop(f"{p}{e}.down_proj.weight") for e in range(E)]
            sd[p + "gate_up_proj"] = torch.stack(gu).contiguous()  # [E, 2I, H]: gate rows, up rows
            sd[p + "down_proj"] = torch.stack(dn).contiguous()      # [E, H, I]
    if spec["mtp"]:  # published checkpoints carry the MTP head; serving ignores it for now
        g = torch.Generator().manual_seed(spec["seed"])
        h = spec["hidden"]
        sd["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=g)
        sd["mtp.norm.weight"] = torch.randn(h, generator=g)
        sd["mtp.layers.0.input_layernorm.weight"] = torch.randn(h, generator=g)
    dtype = torch.bfloat16 if spec["dtype"] == "bfloat16" else torch.float32
    sd = {k: v.to(dtype).contiguous() for k, v in sorted(sd.items())}
    save_file(sd, path, metadata={"format": "pt"})

    cfg_path = os.path.join(d, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    text = cfg["text_config"] if spec["layout"] == "vl" else cfg
    text["dtype"] = spec["dtype"]
    if spec["layout"] == "vl":
        cfg["dtype"] = spec["dtype"]
    if spec["extra_fields"]:
        text["attn_output_gate"] = True
        text["mtp_num_hidden_layers"] = 1
        text["mtp_use_dedicated_embeddings"] = False
        text["mamba_ssm_dtype"] = "float32"
        text["full_attention_interval"] = spec["interval"]
        text["rope_parameters"]["mrope_section"] = [11, 11, 10]
        text["rope_parameters"]["mrope_interleaved"] = True
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    bos, eos = special_ids(spec)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": eos[0], "pad_token_id": bos,
                   "transformers_version": transformers.__version__}, f, indent=2)
        f.write("\n")


def load_model(d, spec):
    cls = Qwen3_5MoeForCausalLM if spec["layout"] == "text" else Qwen3_5MoeForConditionalGeneration
    kw = dict(dtype=torch.float32, attn_implementation="eager")
    try:
        m, info = cls.from_pretrained(d, experts_implementation="eager", output_loading_info=True, **kw)
    except (TypeError, ValueError):
        m, info = cls.from_pretrained(d, output_loading_info=True, **kw)
    missing = [k for k in info.get("missing_keys", []) if not (spec["tie"] and k == "lm_head.weight")]
    assert not missing, f"from_pretrained: missing {missing}"
    bad = [k for k in info.get("unexpected_keys", []) if not k.startswith("mtp.")]
    assert not bad, f"from_pretrained: unexpected {bad}"
    set_eager(m)
    return m.eval()


def make_fixture(spec, outdir):
    d = os.path.join(outdir, spec["name"])
    print(f"== {spec['name']}")
    if os.path.isdir(d):
        shutil.rmtree(d)
    rng = torch.Generator()
    for wattempt in range(8):
        wseed = spec["seed"] * 1000 + wattempt
        # Save, edit, re-load: the golden comes from what is on disk.
        model = build_model(spec, wseed)
        init_weights(model, spec, wseed)
        os.makedirs(d, exist_ok=True)
        model.save_pretrained(d)
        edit_checkpoint(d, spec)
        model = load_model(d, spec)
        cases, ok = [], True
        for ci, plen in enumerate(spec["prompt_lens"]):
            for pattempt in range(40):
                rng.manual_seed(wseed * 100003 + ci * 1009 + pattempt)
                prompt = torch.randint(0, spec["vocab"] - 3, (plen,), generator=rng).tolist()
                try:
                    cases.append(greedy_case(model, spec, prompt))
                    break
                except Retry as e:
                    print(f"  weights {wseed} case {ci} prompt attempt {pattempt}: retry ({e})")
            else:
                ok = False
                break
        if ok:
            break
        shutil.rmtree(d)
    else:
        raise RuntimeError(f"{spec['name']}: could not find well-conditioned weights/prompts")

    # A second reload regenerates the same tokens (the files are the whole story).
    again = load_model(d, spec)
    for c in cases:
        assert greedy_case(again, spec, c["prompt_ids"])["output_ids"] == c["output_ids"]
        print(f"  case len {len(c['prompt_ids'])}: out {c['output_ids']} "
              f"min margin {c['min_logit_margin']:.3f} router {c['min_router_margin']:.4f}")
    names = set(read_safetensors(os.path.join(d, "model.safetensors")))
    assert any(k.startswith("mtp.") for k in names) == spec["mtp"]
    assert any(k.endswith("experts.gate_up_proj") for k in names) == spec["fused"]
    assert any(".visual." in k or k.startswith("model.visual.") for k in names) == (spec["layout"] == "vl")

    golden = {
        "fixture": spec["name"],
        "description": spec["about"],
        "generated_by": "tools/make_qwen35_fixtures.py",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "compute_dtype": "float32",
        "weights_dtype": spec["dtype"],
        "attn_implementation": "eager",
        "eos_token_ids": special_ids(spec)[1],
        "top_n": TOP_N,
        "cases": cases,
    }
    write_golden(os.path.join(d, "golden.json"), golden)
    for fn in os.listdir(d):
        os.chmod(os.path.join(d, fn), 0o644)
    size = sum(os.path.getsize(os.path.join(d, x)) for x in os.listdir(d))
    print(f"  wrote {d} ({size / 1e6:.2f} MB: {sorted(os.listdir(d))})")
    return size


def check_against(committed, fresh, names):
    bad = 0
    for n in names:
        a, b = os.path.join(committed, n), os.path.join(fresh, n)
        if not os.path.isdir(a):
            print(f"{n}: not committed")
            bad += 1
            continue
        ga, gb = (json.load(open(os.path.join(x, "golden.json"))) for x in (a, b))
        ids_ok = [(x["prompt_ids"], x["output_ids"]) for x in ga["cases"]] == \
                 [(x["prompt_ids"], x["output_ids"]) for x in gb["cases"]]
        dmax = max((abs(p[1] - q[1]) for x, y in zip(ga["cases"], gb["cases"])
                    for s, t in zip(x["top_logprobs"], y["top_logprobs"]) for p, q in zip(s, t)), default=0.0)
        wa, wb = (read_safetensors(os.path.join(x, "model.safetensors")) for x in (a, b))
        w_ok = set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
        ok = ids_ok and dmax < 1e-4 and w_ok
        bad += not ok
        print(f"{n}: {'OK' if ok else 'MISMATCH'} (ids {'equal' if ids_ok else 'DIFFER'}, "
              f"max |d logprob| {dmax:.1e}, weights {'equal' if w_ok else 'DIFFER'})")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "fixtures"))
    ap.add_argument("--only", nargs="*", help="fixture names to (re)generate")
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temporary folder and compare with --out instead of writing it")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    outdir = os.path.abspath(args.out)
    committed = None
    if args.check:
        committed, outdir = outdir, tempfile.mkdtemp(prefix="qwen35-fixtures-check-")
    os.makedirs(outdir, exist_ok=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    specs = [s for s in FIXTURES if not args.only or s["name"] in args.only]
    if args.only and len(specs) != len(args.only):
        sys.exit(f"unknown fixture in {args.only}; have {[s['name'] for s in FIXTURES]}")
    for s in specs:
        make_fixture(s, outdir)
    if committed:
        bad = check_against(committed, outdir, [s["name"] for s in specs])
        shutil.rmtree(outdir)
        sys.exit(1 if bad else 0)
    total = sum(os.path.getsize(os.path.join(outdir, s["name"], f))
                for s in FIXTURES if os.path.isdir(os.path.join(outdir, s["name"]))
                for f in os.listdir(os.path.join(outdir, s["name"])))
    print(f"total size of the qwen35 fixtures: {total / 1e6:.2f} MB")
    assert total < SIZE_LIMIT, "qwen35 fixtures exceed their 5 MB budget"


if __name__ == "__main__":
    main()
