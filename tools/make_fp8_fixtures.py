#!/usr/bin/env python3
"""Golden fixtures for Tandem's block-FP8 loading: tiny Qwen3-MoE checkpoints in the layout Qwen
publishes (Qwen/Qwen3-30B-A3B-FP8) + transformers' fp32 greedy output over the dequantized weights.

Usage:
    python3 tools/make_fp8_fixtures.py [--out tests/data/fixtures_fp8] [--check]

Each fixture directory holds
    config.json             hub spelling (as make_fixtures.py) plus
                            "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128],
                            "modules_to_not_convert": [...]}
    generation_config.json
    model.safetensors       every quantized linear (attention q/k/v/o, dense MLP and expert
                            gate/up/down) as `weight` F8_E4M3 [out, in] + `weight_scale_inv` F32
                            [ceil(out/128), ceil(in/128)]; embedding, norms, router, lm_head and the
                            modules_to_not_convert linears in bf16
    golden.json             as make_fixtures.py; the golden comes from the checkpoint *reloaded* with
                            Qwen3MoeForCausalLM.from_pretrained(dtype=float32) on the CPU (transformers
                            dequantizes FP8 at load there: W = float(q) * scale_inv in fp32)

Quantization per 128x128 block, as DeepSeek / Qwen do: scale_inv = amax(|w|) / 448,
q = float8_e4m3fn(clamp(w / scale_inv, -448, 448)). Weights, prompts and margins follow
make_fixtures.py (whose helpers this script imports). Everything runs on the CPU.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen3MoeForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402

BLOCK = 128
SIZE_LIMIT = 3 * 1000 * 1000

FIXTURES = [
    dict(
        name="hub_fp8_block128",
        about="Block-scaled FP8 as Qwen publishes it (quant_method fp8, fmt e4m3, dynamic activations, "
              "weight_block_size [128, 128]): F8_E4M3 weights + F32 weight_scale_inv per 128x128 block for "
              "attention and MLP/expert linears, bf16 embedding / norms / router / lm_head; "
              "modules_to_not_convert keeps lm_head and layer 2's o_proj in bf16. Hub spelling; vocab 256, "
              "hidden 128, 3 layers (layer 0 dense via mlp_only_layers, intermediate 256), GQA 4 q / 2 kv x 64 "
              "(a KV projection is 128 rows: TP=2 splits one scale block, TP=4 replicates 64-row heads), "
              "8 experts top-2 of width 128, norm_topk_prob true; rope_theta 1e6; prompts of 3 / 40 / 150 tokens.",
        spelling="hub", dtype="bfloat16", shards=1,
        vocab=256, hidden=128, layers=3, heads=4, kv_heads=2, head_dim=64,
        experts=8, top_k=2, moe_inter=128, inter=256, norm_topk=True,
        mlp_only=[0], sparse_step=1, tie=False, theta=1e6, max_pos=1024, eps=1e-6,
        eos="single", sampling_defaults=False, prompt_lens=[3, 40, 150], seed=14,
        not_convert=["lm_head", "model.layers.2.self_attn.o_proj"],
    ),
]

LINEAR_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_quantized(name, spec):
    """True for a linear weight (hub name) the checkpoint stores in FP8."""
    if not name.endswith(".weight"):
        return False
    module = name[: -len(".weight")]
    if module.split(".")[-1] not in LINEAR_LEAVES:
        return False
    return not any(module == m or module.startswith(m + ".") for m in spec["not_convert"])


def quantize_block(w):
    """[out, in] fp32 -> (float8_e4m3fn [out, in], fp32 scale_inv [ceil(out/128), ceil(in/128)])."""
    rows, cols = w.shape
    sr, sc = -(-rows // BLOCK), -(-cols // BLOCK)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(sr, sc, dtype=torch.float32)
    for i in range(sr):
        for j in range(sc):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            amax = float(blk.abs().max())
            scale = torch.tensor(amax / 448.0 if amax > 0 else 1.0, dtype=torch.float32)
            s[i, j] = scale
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = \
                (blk / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, s


def dequantize_block(q, s):
    rows, cols = q.shape
    full = s.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return q.to(torch.float32) * full


def quantized_state(model, spec):
    """Hub-named tensors to write: FP8 + scales for the quantized linears, bf16 for the rest, and the
    fp32 values the model computes with (dequantized / bf16-rounded)."""
    sd = mf.hub_state_dict(model, spec)
    disk, values = {}, {}
    for k, v in sd.items():
        if is_quantized(k, spec):
            q, s = quantize_block(v)
            disk[k] = q
            disk[k + "_scale_inv"] = s
            values[k] = dequantize_block(q, s)
        else:
            b = v.to(torch.bfloat16)
            disk[k] = b
            values[k] = b.to(torch.float32)
    return disk, values


def load_hub_values(model, spec, values):
    """Copies hub-named fp32 values into the (transformers 5, fused-expert) model."""
    E, I = spec["experts"], spec["moe_inter"]
    with torch.no_grad():
        for k, p in model.state_dict().items():
            if spec["tie"] and k == "lm_head.weight":
                continue
            if k.endswith("mlp.experts.gate_up_proj"):
                pre = k[: -len("gate_up_proj")]
                for e in range(E):
                    p[e, :I].copy_(values[f"{pre}{e}.gate_proj.weight"])
                    p[e, I:].copy_(values[f"{pre}{e}.up_proj.weight"])
            elif k.endswith("mlp.experts.down_proj"):
                pre = k[: -len("down_proj")]
                for e in range(E):
                    p[e].copy_(values[f"{pre}{e}.down_proj.weight"])
            else:
                p.copy_(values[k])


def fp8_config(spec):
    c = mf.hub_config(spec)
    c["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "modules_to_not_convert": list(spec["not_convert"]),
        "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK],
    }
    return c


def make_fixture(spec, outdir):
    d = os.path.join(outdir, spec["name"])
    print(f"== {spec['name']}")
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(fp8_config(spec), f, indent=2)
        f.write("\n")
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump(mf.generation_config(spec), f, indent=2)
        f.write("\n")
    config = transformers.Qwen3MoeConfig(**{k: v for k, v in mf.hub_config(spec).items()
                                             if k not in ("transformers_version", "model_type")})

    rng = torch.Generator()
    for wattempt in range(8):
        wseed = spec["seed"] * 1000 + wattempt
        model = Qwen3MoeForCausalLM(config).to(torch.float32)
        mf.force_eager(model)
        model.eval()
        mf.init_weights(model, spec, wseed)
        disk, values = quantized_state(model, spec)
        load_hub_values(model, spec, values)  # the model now computes with what goes on disk
        cases, ok = [], True
        for ci, plen in enumerate(spec["prompt_lens"]):
            for pattempt in range(40):
                rng.manual_seed(wseed * 100003 + ci * 1009 + pattempt)
                prompt = torch.randint(0, spec["vocab"] - 3, (plen,), generator=rng).tolist()
                try:
                    cases.append(mf.greedy_case(model, spec, prompt))
                    break
                except mf.Retry as e:
                    print(f"  weights {wseed} case {ci} prompt attempt {pattempt}: retry ({e})")
            else:
                ok = False
                break
        if ok:
            break
    else:
        raise RuntimeError(f"{spec['name']}: could not find well-conditioned weights/prompts")

    save_file({k: v.contiguous() for k, v in disk.items()}, os.path.join(d, "model.safetensors"),
              metadata={"format": "pt"})
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        on_disk = {k: f.get_tensor(k) for k in f.keys()}
    want = mf.expected_names(spec)
    scales = {k + "_scale_inv" for k in want if is_quantized(k, spec)}
    assert set(on_disk) == want | scales, set(on_disk) ^ (want | scales)
    for k, v in on_disk.items():
        if k.endswith("_scale_inv"):
            w = on_disk[k[: -len("_scale_inv")]]
            assert v.dtype == torch.float32 and tuple(v.shape) == (-(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK))
        else:
            assert v.dtype == (torch.float8_e4m3fn if is_quantized(k, spec) else torch.bfloat16), (k, v.dtype)

    # Load it as a user would: from_pretrained on the CPU dequantizes the FP8 weights
    # (W = float(q) * scale_inv, fp32). Its parameters must be exactly our dequantized values
    # and its logits those of the model the cases came from.
    kw = dict(dtype=torch.float32, attn_implementation="eager")
    try:
        re = Qwen3MoeForCausalLM.from_pretrained(d, experts_implementation="eager", **kw)
    except (TypeError, ValueError):
        re = Qwen3MoeForCausalLM.from_pretrained(d, **kw)
    mf.force_eager(re)
    re.eval()
    ref_sd = model.state_dict()
    for k, v in re.state_dict().items():
        assert v.dtype == torch.float32, (k, v.dtype)
        assert torch.equal(v, ref_sd[k]), f"reloaded {k} differs by {(v - ref_sd[k]).abs().max()}"
    longest = max(cases, key=lambda c: len(c["prompt_ids"]))
    seq = torch.tensor([longest["prompt_ids"] + longest["output_ids"]])
    with torch.no_grad():
        a = model(seq, use_cache=False).logits
        b = re(seq, use_cache=False).logits
    assert torch.equal(a, b), f"reloaded model differs: max |d| = {(a - b).abs().max()}"
    golden_cases = [mf.greedy_case(re, spec, c["prompt_ids"]) for c in cases]
    for c, g in zip(cases, golden_cases):
        assert g["output_ids"] == c["output_ids"]

    # Independent plain-torch forward over the safetensors alone, dequantized here.
    deq = {}
    for k, v in on_disk.items():
        if k.endswith("_scale_inv"):
            continue
        deq[k] = dequantize_block(v, on_disk[k + "_scale_inv"]) if v.dtype == torch.float8_e4m3fn else v.float()
    for c in golden_cases:
        ids = c["prompt_ids"] + c["output_ids"][:-1]
        ref = mf.reference_logits(deq, spec, ids)
        with torch.no_grad():
            hf = re(torch.tensor([ids]), use_cache=False).logits[0]
        err = float((ref - hf).abs().max())
        assert err < 1e-3, f"reference forward differs from transformers by {err}"
        assert ref[len(c["prompt_ids"]) - 1:].argmax(-1).tolist() == c["output_ids"]
        print(f"  case len {len(c['prompt_ids'])}: out {c['output_ids']} "
              f"min margin {c['min_logit_margin']:.3f} router {c['min_router_margin']} ref err {err:.1e}")

    _, eos = mf.special_ids(spec)
    golden = {
        "fixture": spec["name"],
        "description": spec["about"],
        "generated_by": "tools/make_fp8_fixtures.py",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "compute_dtype": "float32",
        "weights_dtype": "float8_e4m3fn (128x128 block scales) + bfloat16",
        "attn_implementation": "eager",
        "eos_token_ids": eos,
        "top_n": mf.TOP_N,
        "cases": golden_cases,
    }
    mf.write_golden(os.path.join(d, "golden.json"), golden)
    for fn in os.listdir(d):
        os.chmod(os.path.join(d, fn), 0o644)
    size = sum(os.path.getsize(os.path.join(d, x)) for x in os.listdir(d))
    print(f"  wrote {d} ({size / 1e6:.2f} MB)")
    return size


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data",
                                                  "fixtures_fp8"))
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temporary folder and compare with --out instead of writing it")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    outdir = os.path.abspath(args.out)
    committed = None
    if args.check:
        committed, outdir = outdir, tempfile.mkdtemp(prefix="fixtures-fp8-check-")
    os.makedirs(outdir, exist_ok=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for s in FIXTURES:
        make_fixture(s, outdir)
    if committed:
        bad = mf.check_against(committed, outdir, [s["name"] for s in FIXTURES])
        shutil.rmtree(outdir)
        sys.exit(1 if bad else 0)
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(outdir) for f in fs)
    print(f"total size of {outdir}: {total / 1e6:.2f} MB")
    assert total < SIZE_LIMIT, "FP8 fixtures exceed their 3 MB budget"


if __name__ == "__main__":
    main()
