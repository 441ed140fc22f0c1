#!/usr/bin/env python3
"""Golden fixtures for Tandem: tiny random Qwen3-MoE checkpoints + transformers' fp32 greedy output.

Usage:
    python3 tools/make_fixtures.py [--out tests/data/fixtures] [--only NAME ...] [--check]

--check regenerates into a temporary folder and compares with the committed fixtures (token ids
equal, top-5 logprobs within 1e-4, every other file byte-identical); exit status 1 on a mismatch.

Each fixture is a directory <out>/<name>/ holding
    config.json             in the Hugging Face hub spelling (num_experts, top-level rope_theta,
                            torch_dtype: as Qwen/Qwen3-30B-A3B ships it) or in the transformers-5
                            spelling (num_local_experts, rope_parameters{}, dtype: as
                            transformers 5 save_pretrained writes it)
    generation_config.json  bos / eos (an int or a list) / pad ids
    model.safetensors       or model-0000i-of-0000n.safetensors + model.safetensors.index.json;
                            hub tensor names, one tensor per expert:
                            model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight
    golden.json             {"cases": [{"prompt_ids", "max_tokens", "output_ids",
                                        "top_logprobs", "token_logprobs", ...}], ...}

Everything is computed in fp32 on the CPU with attn_implementation="eager" (and the eager experts
loop where the transformers version has a choice), from full forwards without a KV cache (checked
against generate() with its cache). Weights are drawn with a larger std than transformers' default
so next-token distributions are peaked; every greedy step has a top1-top2 logit margin above
MIN_LOGIT_MARGIN and every routed token a k-th / (k+1)-th router logit gap above MIN_ROUTER_MARGIN
(else the prompt, then the weights, are redrawn), so an fp32 implementation with another summation
order reproduces the tokens exactly. A plain-torch reference forward that reads only the written
safetensors (hub names) is checked against transformers too.

No network access; runs with torch >= 2.4 and transformers >= 5.0 (tested: 5.24 / torch 2.15).
"""
import argparse
import json
import math
import os
import shutil
import sys

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, Qwen3MoeForCausalLM

MAX_TOKENS = 12
TOP_N = 5
MIN_LOGIT_MARGIN = 1e-2   # top1 - top2 logit at every greedy step
MIN_ROUTER_MARGIN = 1e-3  # k-th minus (k+1)-th router logit, every token, every MoE layer
MIN_DISTINCT = 5          # outputs that loop on one or two tokens test too little
SIZE_LIMIT = 10 * 1000 * 1000

# ---------------------------------------------------------------------------------------------
# Fixture specs. Special ids sit at the top of the vocab: eos = V-1, (second eos = V-3), bos = V-2.
# ---------------------------------------------------------------------------------------------
FIXTURES = [
    dict(
        name="hub_gqa_top2",
        about="Hub config spelling; vocab 256, hidden 64, 2 layers; GQA 8 q / 2 kv heads with head_dim == hidden/heads (8); "
              "16 experts top-2, norm_topk_prob true; rope_theta 1e6; fp32 single file; "
              "generation_config with Qwen3-style sampling defaults (golden is greedy anyway); "
              "prompts of 3 / 41 / 300 tokens.",
        spelling="hub", dtype="float32", shards=1,
        vocab=256, hidden=64, layers=2, heads=8, kv_heads=2, head_dim=8,
        experts=16, top_k=2, moe_inter=16, inter=128, norm_topk=True,
        mlp_only=[], sparse_step=1, tie=False, theta=1e6, max_pos=1024, eps=1e-6,
        eos="single", sampling_defaults=True, prompt_lens=[3, 41, 300], seed=1,
    ),
    dict(
        name="tf5_mqa_top1_tied",
        about="transformers-5 config spelling; vocab 512, hidden 64, 2 layers; MQA 4 q / 1 kv head, head_dim 32 != hidden/heads "
              "(16); 8 experts top-1, norm_topk_prob false; tie_word_embeddings true (no lm_head "
              "tensor; final norm weight of random sign); rope_theta 1e4; fp32; prompts of 1 / 40 tokens.",
        spelling="tf5", dtype="float32", shards=1,
        vocab=512, hidden=64, layers=2, heads=4, kv_heads=1, head_dim=32,
        experts=8, top_k=1, moe_inter=16, inter=128, norm_topk=False,
        mlp_only=[], sparse_step=1, tie=True, theta=1e4, max_pos=512, eps=1e-6,
        eos="single", sampling_defaults=False, prompt_lens=[1, 40], seed=2,
    ),
    dict(
        name="hub_top8_mlponly_bf16",
        about="Hub config spelling; bf16 weights on disk (golden computed in fp32 from the "
              "upcast weights); vocab 256, hidden 128, 3 layers, GQA 4 q / 2 kv, head_dim 64; 16 experts top-8, "
              "norm_topk_prob false; layer 0 dense via mlp_only_layers [0] (intermediate 128); "
              "rope_theta 1e4; prompts of 5 / 38 tokens.",
        spelling="hub", dtype="bfloat16", shards=1,
        vocab=256, hidden=128, layers=3, heads=4, kv_heads=2, head_dim=64,
        experts=16, top_k=8, moe_inter=16, inter=128, norm_topk=False,
        mlp_only=[0], sparse_step=1, tie=False, theta=1e4, max_pos=2048, eps=1e-6,
        eos="single", sampling_defaults=False, prompt_lens=[5, 38], seed=3,
    ),
    dict(
        name="tf5_step2_sharded",
        about="transformers-5 config spelling; vocab 320, hidden 64, 4 layers with decoder_sparse_step 2 (layers 0, 2 "
              "dense, intermediate 96; 1, 3 MoE); GQA 4 q / 2 kv, head_dim 32; 8 experts top-2, "
              "norm_topk_prob false; rope_theta 1e6; fp32 sharded into 3 files + "
              "model.safetensors.index.json (shard borders fall inside layers); eos list of 2 "
              "ids in generation_config.json; prompts of 4 / 42 / 310 tokens.",
        spelling="tf5", dtype="float32", shards=3,
        vocab=320, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=32,
        experts=8, top_k=2, moe_inter=16, inter=96, norm_topk=False,
        mlp_only=[], sparse_step=2, tie=False, theta=1e6, max_pos=1024, eps=1e-6,
        eos="list", sampling_defaults=False, prompt_lens=[4, 42, 310], seed=4,
    ),
    dict(
        name="hub_mqa_hd128",
        about="Hub config spelling; vocab 256, hidden 64, 2 layers; MQA 2 q / 1 kv head with head_dim 128 (as Qwen3); 12 experts (not a "
              "power of two) top-2, norm_topk_prob true; rms_norm_eps 1e-5; rope_theta 1e4; "
              "fp32; eos list; prompts of 2 / 45 tokens.",
        spelling="hub", dtype="float32", shards=1,
        vocab=256, hidden=64, layers=2, heads=2, kv_heads=1, head_dim=128,
        experts=12, top_k=2, moe_inter=16, inter=128, norm_topk=True,
        mlp_only=[], sparse_step=1, tie=False, theta=1e4, max_pos=512, eps=1e-5,
        eos="list", sampling_defaults=False, prompt_lens=[2, 45], seed=5,
    ),
    dict(
        name="tf5_qwen3like_top8",
        about="transformers-5 config spelling; shaped like Qwen3-30B-A3B in miniature: GQA 8 q / "
              "2 kv, head_dim 16 (q width 2x hidden), 16 experts top-8, norm_topk_prob true, "
              "rope_theta 1e6; vocab 256, hidden 64, 2 layers; fp32; prompts of 3 / 40 / 300 tokens.",
        spelling="tf5", dtype="float32", shards=1,
        vocab=256, hidden=64, layers=2, heads=8, kv_heads=2, head_dim=16,
        experts=16, top_k=8, moe_inter=16, inter=128, norm_topk=True,
        mlp_only=[], sparse_step=1, tie=False, theta=1e6, max_pos=1024, eps=1e-6,
        eos="single", sampling_defaults=False, prompt_lens=[3, 40, 300], seed=6,
    ),
    dict(
        name="hub_gqa8_hd128_top8_bf16",
        about="Hub config spelling; shaped like Qwen3-235B-A22B in miniature and within the GPU "
              "kernels' shapes: GQA 16 q / 2 kv (group 8), head_dim 128, 32 experts top-8, "
              "norm_topk_prob true, rope_theta 1e6; vocab 384, hidden 128, 2 layers; bf16 "
              "weights; margins wider than the fp32 fixtures (top1-top2 logit > 0.05, router "
              "k-th / (k+1)-th gap > 0.002) for bf16 compute; prompts of 3 / 24 / 64 tokens.",
        spelling="hub", dtype="bfloat16", shards=1,
        vocab=384, hidden=128, layers=2, heads=16, kv_heads=2, head_dim=128,
        experts=32, top_k=8, moe_inter=32, inter=256, norm_topk=True,
        mlp_only=[], sparse_step=1, tie=False, theta=1e6, max_pos=1024, eps=1e-6,
        eos="single", sampling_defaults=False, prompt_lens=[3, 24, 64], seed=7,
        min_logit_margin=0.05, min_router_margin=0.002,
    ),
]


def special_ids(spec):
    v = spec["vocab"]
    bos = v - 2
    eos = [v - 1] if spec["eos"] == "single" else [v - 1, v - 3]
    return bos, eos


def is_moe_layer(cfgd, layer):
    return (layer not in cfgd["mlp_only"]) and cfgd["experts"] > 0 and (layer + 1) % cfgd["sparse_step"] == 0


# ---------------------------------------------------------------------------------------------
# config.json in both spellings
# ---------------------------------------------------------------------------------------------
def hub_config(spec):
    """Key set and order of Qwen/Qwen3-30B-A3B's config.json (transformers 4.51 era)."""
    bos, eos = special_ids(spec)
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "decoder_sparse_step": spec["sparse_step"],
        "eos_token_id": eos[0],
        "head_dim": spec["head_dim"],
        "hidden_act": "silu",
        "hidden_size": spec["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": spec["inter"],
        "max_position_embeddings": spec["max_pos"],
        "max_window_layers": spec["layers"],
        "mlp_only_layers": list(spec["mlp_only"]),
        "model_type": "qwen3_moe",
        "moe_intermediate_size": spec["moe_inter"],
        "norm_topk_prob": spec["norm_topk"],
        "num_attention_heads": spec["heads"],
        "num_experts": spec["experts"],
        "num_experts_per_tok": spec["top_k"],
        "num_hidden_layers": spec["layers"],
        "num_key_value_heads": spec["kv_heads"],
        "output_router_logits": False,
        "rms_norm_eps": spec["eps"],
        "rope_scaling": None,
        "rope_theta": float(spec["theta"]),
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": spec["tie"],
        "torch_dtype": spec["dtype"],
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": spec["vocab"],
    }


def tf5_config(spec, tmpdir):
    """Key set and order of what transformers 5.24 save_pretrained writes for Qwen3-MoE.

    Spelled out (not taken from the running version) so that the committed files do not depend on
    the transformers version that regenerates them; a note is printed if this version differs.
    """
    bos, eos = special_ids(spec)
    d = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "decoder_sparse_step": spec["sparse_step"],
        "dtype": spec["dtype"],
        "eos_token_id": eos[0],
        "head_dim": spec["head_dim"],
        "hidden_act": "silu",
        "hidden_size": spec["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": spec["inter"],
        "max_position_embeddings": spec["max_pos"],
        "mlp_only_layers": list(spec["mlp_only"]),
        "model_type": "qwen3_moe",
        "moe_intermediate_size": spec["moe_inter"],
        "norm_topk_prob": spec["norm_topk"],
        "num_attention_heads": spec["heads"],
        "num_experts_per_tok": spec["top_k"],
        "num_hidden_layers": spec["layers"],
        "num_key_value_heads": spec["kv_heads"],
        "num_local_experts": spec["experts"],
        "output_router_logits": False,
        "pad_token_id": None,
        "rms_norm_eps": spec["eps"],
        "rope_parameters": {"rope_theta": float(spec["theta"]), "rope_type": "default"},
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": spec["tie"],
        "transformers_version": "5.24.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": spec["vocab"],
    }
    try:  # What does the running transformers write? (informational only)
        cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in d.items()
                                             if k not in ("transformers_version", "model_type")})
        cfg.save_pretrained(tmpdir)
        with open(os.path.join(tmpdir, "config.json")) as f:
            written = json.load(f)
        if set(written) != set(d):
            print(f"  note: transformers {transformers.__version__} writes config keys differing by "
                  f"{sorted(set(written) ^ set(d))}")
    except Exception as e:  # noqa: BLE001
        print(f"  note: could not save a Qwen3MoeConfig for comparison: {e}")
    return d


def generation_config(spec):
    bos, eos = special_ids(spec)
    g = {"bos_token_id": bos, "eos_token_id": eos[0] if len(eos) == 1 else eos, "pad_token_id": bos}
    if spec["sampling_defaults"]:
        g.update({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95})
    g["transformers_version"] = "4.51.0" if spec["spelling"] == "hub" else "5.24.0"
    return g


# ---------------------------------------------------------------------------------------------
# Model construction and weights
# ---------------------------------------------------------------------------------------------
def force_eager(model):
    model.set_attn_implementation("eager")
    if hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation("eager")
        except Exception as e:  # noqa: BLE001 - older versions: only one implementation anyway
            print(f"  note: set_experts_implementation('eager') failed: {e}")


def init_weights(model, spec, seed):
    """Peaked random init: std per tensor kind, RMSNorm weights 1 +- noise."""
    g = torch.Generator().manual_seed(seed)
    h = spec["hidden"]

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name == "model.norm.weight" and spec["tie"]:
                # Tied head: logits = norm(x) . E^T and x carries E[last token]; a norm weight
                # of random sign keeps the model from just repeating its input token.
                val = normal(p.shape, 1.0)
            elif name.endswith("norm.weight"):  # all RMSNorms incl. q_norm / k_norm
                val = normal(p.shape, 0.1, 1.0)
            elif "embed_tokens" in name:
                val = normal(p.shape, 1.0)
            elif "lm_head" in name:
                val = normal(p.shape, 5.0 / math.sqrt(h))
            elif name.endswith("mlp.gate.weight"):  # router
                val = normal(p.shape, 1.5 / math.sqrt(h))
            elif "self_attn" in name:
                fan_in = p.shape[-1]
                val = normal(p.shape, 1.0 / math.sqrt(fan_in))
            elif "mlp" in name:  # dense MLP and experts (fused or not); last dim is fan-in
                fan_in = p.shape[-1]
                val = normal(p.shape, 1.0 / math.sqrt(fan_in))
            else:
                raise RuntimeError(f"no init rule for {name}")
            p.copy_(val)
    if spec["dtype"] == "bfloat16":  # round to what goes on disk; compute stays fp32
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).to(torch.float32))


def hub_state_dict(model, spec):
    """State dict with the hub per-expert tensor names (splits fused expert tensors)."""
    E, I, H = spec["experts"], spec["moe_inter"], spec["hidden"]
    out = {}
    for k, v in model.state_dict().items():
        v = v.detach().to(torch.float32).contiguous()
        if spec["tie"] and k == "lm_head.weight":
            continue
        if k.endswith("mlp.experts.gate_up_proj"):
            # transformers 5: [E, 2I, H], gate rows first then up rows (chunk(2, -1) in forward,
            # MergeModulelist(dim=0) + Concatenate(dim=1) of [gate_proj, up_proj] in the
            # qwen2_moe conversion mapping); each [I, H] slice is an nn.Linear weight (out x in).
            assert tuple(v.shape) == (E, 2 * I, H), (k, tuple(v.shape))
            prefix = k[: -len("gate_up_proj")]
            for e in range(E):
                out[f"{prefix}{e}.gate_proj.weight"] = v[e, :I].clone()
                out[f"{prefix}{e}.up_proj.weight"] = v[e, I:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            assert tuple(v.shape) == (E, H, I), (k, tuple(v.shape))
            prefix = k[: -len("down_proj")]
            for e in range(E):
                out[f"{prefix}{e}.down_proj.weight"] = v[e].clone()
        elif k.endswith("mlp.experts.gate_proj") or k.endswith("mlp.experts.up_proj"):
            raise RuntimeError(f"unexpected split-fused expert layout: {k} {tuple(v.shape)}")
        else:
            out[k] = v.clone()
    return out


def expected_names(spec):
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not spec["tie"]:
        names.add("lm_head.weight")
    cfgd = dict(mlp_only=spec["mlp_only"], experts=spec["experts"], sparse_step=spec["sparse_step"])
    for l in range(spec["layers"]):
        p = f"model.layers.{l}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + f"self_attn.{x}.weight" for x in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        if is_moe_layer(cfgd, l):
            names.add(p + "mlp.gate.weight")
            for e in range(spec["experts"]):
                names |= {p + f"mlp.experts.{e}.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")}
        else:
            names |= {p + f"mlp.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")}
    return names


def write_safetensors(sd, spec, d):
    dtype = torch.bfloat16 if spec["dtype"] == "bfloat16" else torch.float32
    sd = {k: v.to(dtype).contiguous() for k, v in sd.items()}
    meta = {"format": "pt"}
    if spec["shards"] == 1:
        save_file(sd, os.path.join(d, "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    # Split by byte size in a natural (layer-major) key order so borders fall inside layers.
    def order(k):
        parts = k.split(".")
        if k.startswith("model.layers."):
            return (1, int(parts[2]), k)
        return (0 if "embed" in k else 2, 0, k)

    keys = sorted(sd, key=order)
    total = sum(sd[k].numel() * sd[k].element_size() for k in keys)
    n = spec["shards"]
    groups, cur, acc = [], [], 0
    for k in keys:
        cur.append(k)
        acc += sd[k].numel() * sd[k].element_size()
        if len(groups) < n - 1 and acc >= total * (len(groups) + 1) / n:
            groups.append(cur)
            cur = []
    groups.append(cur)
    assert len(groups) == n and all(groups)
    files, weight_map = [], {}
    for i, g in enumerate(groups):
        fn = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: sd[k] for k in g}, os.path.join(d, fn), metadata=meta)
        files.append(fn)
        for k in g:
            weight_map[k] = fn
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    return files


def read_safetensors(d):
    out = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(d, fn), "pt") as f:
                for k in f.keys():
                    out[k] = f.get_tensor(k)
    return out


# ---------------------------------------------------------------------------------------------
# Independent plain-torch reference forward over hub-named weights (documents the semantics)
# ---------------------------------------------------------------------------------------------
def reference_logits(W, spec, ids):
    W = {k: v.to(torch.float32) for k, v in W.items()}
    T, nq, nkv, hd, eps = len(ids), spec["heads"], spec["kv_heads"], spec["head_dim"], spec["eps"]
    cfgd = dict(mlp_only=spec["mlp_only"], experts=spec["experts"], sparse_step=spec["sparse_step"])

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, cos, sin):  # x [T, heads, hd]; rotate-half convention
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos[:, None] + torch.cat((-x2, x1), -1) * sin[:, None]

    inv = 1.0 / (spec["theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None]
    ang = torch.cat((ang, ang), -1)
    cos, sin = ang.cos(), ang.sin()
    mask = torch.full((T, T), float("-inf")).triu(1)

    x = W["model.embed_tokens.weight"][torch.tensor(ids)]
    for l in range(spec["layers"]):
        p = f"model.layers.{l}."
        h = rms(x, W[p + "input_layernorm.weight"])
        q = (h @ W[p + "self_attn.q_proj.weight"].T).view(T, nq, hd)
        k = (h @ W[p + "self_attn.k_proj.weight"].T).view(T, nkv, hd)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).view(T, nkv, hd)
        q = rope(rms(q, W[p + "self_attn.q_norm.weight"]), cos, sin)
        k = rope(rms(k, W[p + "self_attn.k_norm.weight"]), cos, sin)
        k = k.repeat_interleave(nq // nkv, dim=1)  # q head i reads kv head i // (nq / nkv)
        v = v.repeat_interleave(nq // nkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd) + mask
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(T, nq * hd)
        x = x + o @ W[p + "self_attn.o_proj.weight"].T
        h = rms(x, W[p + "post_attention_layernorm.weight"])

        def ffn(hh, pre):
            g = hh @ W[pre + "gate_proj.weight"].T
            u = hh @ W[pre + "up_proj.weight"].T
            return (torch.nn.functional.silu(g) * u) @ W[pre + "down_proj.weight"].T

        if is_moe_layer(cfgd, l):
            probs = (h @ W[p + "mlp.gate.weight"].T).softmax(-1)  # softmax over all experts
            topv, topi = probs.topk(spec["top_k"], dim=-1)          # then top-k
            if spec["norm_topk"]:
                topv = topv / topv.sum(-1, keepdim=True)            # renormalise (optional)
            y = torch.zeros_like(h)
            for t in range(T):
                for j in range(spec["top_k"]):
                    e = int(topi[t, j])
                    y[t] += topv[t, j] * ffn(h[t: t + 1], p + f"mlp.experts.{e}.")[0]
        else:
            y = ffn(h, p + "mlp.")
        x = x + y
    x = rms(x, W["model.norm.weight"])
    lm = W["model.embed_tokens.weight"] if spec["tie"] else W["lm_head.weight"]
    return x @ lm.T


# ---------------------------------------------------------------------------------------------
# Golden generation
# ---------------------------------------------------------------------------------------------
class Retry(Exception):
    pass


def greedy_case(model, spec, prompt):
    _, eos = special_ids(spec)
    ids = list(prompt)
    out, tops, tlp, margins = [], [], [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].to(torch.float32)
            srt = torch.sort(logits, descending=True)
            margin = float(srt.values[0] - srt.values[1])
            if margin <= spec.get("min_logit_margin", MIN_LOGIT_MARGIN):
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
        full = torch.tensor([list(prompt) + out[:-1]])
        r = model(full, use_cache=False, output_router_logits=True)
        rmin = float("inf")
        if spec["top_k"] < spec["experts"]:
            for rl in r.router_logits:
                srt = torch.sort(rl.to(torch.float32), dim=-1, descending=True).values
                gap = srt[:, spec["top_k"] - 1] - srt[:, spec["top_k"]]
                rmin = min(rmin, float(gap.min()))
            if rmin <= spec.get("min_router_margin", MIN_ROUTER_MARGIN):
                raise Retry(f"router margin {rmin:.2e}")
        # generate() with its KV cache must agree with the full-forward loop.
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
        "min_router_margin": None if rmin == float("inf") else rmin,
    }


def write_golden(path, golden):
    """JSON with one line per top-level key and per case field (diff-friendly, compact)."""
    lines = ["{"]
    items = list(golden.items())
    for i, (k, v) in enumerate(items):
        comma = "," if i + 1 < len(items) else ""
        if k != "cases":
            lines.append(f"  {json.dumps(k)}: {json.dumps(v)}{comma}")
            continue
        lines.append(f'  "cases": [')
        for j, c in enumerate(v):
            lines.append("    {")
            fields = list(c.items())
            for n, (ck, cv) in enumerate(fields):
                lines.append(f"      {json.dumps(ck)}: {json.dumps(cv)}" + ("," if n + 1 < len(fields) else ""))
            lines.append("    }" + ("," if j + 1 < len(v) else ""))
        lines.append("  ]" + comma)
    lines.append("}")
    text = "\n".join(lines) + "\n"
    assert json.loads(text) == golden
    with open(path, "w") as f:
        f.write(text)


def load_model(d, spec):
    kw = dict(dtype=torch.float32, attn_implementation="eager")
    try:
        m = Qwen3MoeForCausalLM.from_pretrained(d, experts_implementation="eager", **kw)
    except (TypeError, ValueError):
        m = Qwen3MoeForCausalLM.from_pretrained(d, **kw)
    force_eager(m)
    return m.eval()


def check_config_roundtrip(d, spec):
    c = AutoConfig.from_pretrained(d)
    assert c.model_type == "qwen3_moe"
    assert c.num_experts == spec["experts"], c.num_experts
    theta = c.rope_parameters["rope_theta"] if getattr(c, "rope_parameters", None) else c.rope_theta
    assert float(theta) == float(spec["theta"]), theta
    assert c.head_dim == spec["head_dim"] and c.num_key_value_heads == spec["kv_heads"]
    assert list(c.mlp_only_layers) == list(spec["mlp_only"])
    assert c.decoder_sparse_step == spec["sparse_step"]
    assert bool(c.tie_word_embeddings) == spec["tie"]
    assert bool(c.norm_topk_prob) == spec["norm_topk"] and c.num_experts_per_tok == spec["top_k"]
    assert abs(c.rms_norm_eps - spec["eps"]) < 1e-12
    return c


def make_fixture(spec, outdir):
    d = os.path.join(outdir, spec["name"])
    print(f"== {spec['name']}")
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    tmp = d + ".tmpcfg"
    os.makedirs(tmp, exist_ok=True)
    cfgjson = hub_config(spec) if spec["spelling"] == "hub" else tf5_config(spec, tmp)
    shutil.rmtree(tmp)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfgjson, f, indent=2)
        f.write("\n")
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump(generation_config(spec), f, indent=2)
        f.write("\n")
    if spec["spelling"] == "hub":
        assert "num_experts" in cfgjson and "rope_theta" in cfgjson and "torch_dtype" in cfgjson
        assert not {"num_local_experts", "rope_parameters", "dtype"} & set(cfgjson)
    else:
        assert "num_local_experts" in cfgjson and "rope_parameters" in cfgjson and "dtype" in cfgjson
        assert not {"num_experts", "rope_theta", "rope_scaling", "torch_dtype"} & set(cfgjson)
    config = check_config_roundtrip(d, spec)  # transformers loads this spelling

    rng = torch.Generator()
    for wattempt in range(8):
        wseed = spec["seed"] * 1000 + wattempt
        model = Qwen3MoeForCausalLM(config).to(torch.float32)
        force_eager(model)
        model.eval()
        init_weights(model, spec, wseed)
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
    else:
        raise RuntimeError(f"{spec['name']}: could not find well-conditioned weights/prompts")

    # Write the checkpoint with hub per-expert names, then check what is on disk.
    sd = hub_state_dict(model, spec)
    files = write_safetensors(sd, spec, d)
    on_disk = read_safetensors(d)
    assert set(on_disk) == expected_names(spec), set(on_disk) ^ expected_names(spec)
    want_dtype = torch.bfloat16 if spec["dtype"] == "bfloat16" else torch.float32
    assert all(t.dtype == want_dtype for t in on_disk.values())

    # Reload with from_pretrained: bit-identical logits to the model the golden came from.
    re = load_model(d, spec)
    longest = max(cases, key=lambda c: len(c["prompt_ids"]))
    seq = torch.tensor([longest["prompt_ids"] + longest["output_ids"]])
    with torch.no_grad():
        a = model(seq, use_cache=False).logits
        b = re(seq, use_cache=False).logits
    assert torch.equal(a, b), f"reloaded model differs: max |d| = {(a - b).abs().max()}"
    for c in cases:  # and the reloaded model regenerates every case
        assert greedy_case(re, spec, c["prompt_ids"])["output_ids"] == c["output_ids"]

    # Independent reference forward from the safetensors alone (hub names, plain torch).
    for c in cases:
        ids = c["prompt_ids"] + c["output_ids"][:-1]
        ref = reference_logits(on_disk, spec, ids)
        with torch.no_grad():
            hf = re(torch.tensor([ids]), use_cache=False).logits[0]
        err = float((ref - hf).abs().max())
        assert err < 1e-3, f"reference forward differs from transformers by {err}"
        assert ref[len(c["prompt_ids"]) - 1:].argmax(-1).tolist() == c["output_ids"]
        print(f"  case len {len(c['prompt_ids'])}: out {c['output_ids']} "
              f"min margin {c['min_logit_margin']:.3f} router {c['min_router_margin']} ref err {err:.1e}")

    _, eos = special_ids(spec)
    golden = {
        "fixture": spec["name"],
        "description": spec["about"],
        "generated_by": "tools/make_fixtures.py",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "compute_dtype": "float32",
        "weights_dtype": spec["dtype"],
        "attn_implementation": "eager",
        "eos_token_ids": eos,
        "top_n": TOP_N,
        "cases": cases,
    }
    write_golden(os.path.join(d, "golden.json"), golden)
    for fn in os.listdir(d):
        os.chmod(os.path.join(d, fn), 0o644)
    size = sum(os.path.getsize(os.path.join(d, x)) for x in os.listdir(d))
    print(f"  wrote {d} ({size / 1e6:.2f} MB, files {files})")
    return size


def check_against(committed, fresh, names):
    """--check: fresh fixtures must match the committed ones (ids exactly, logprobs within 1e-4)."""
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
        files = sorted(f for f in os.listdir(a) if f != "golden.json")
        differ = [f for f in files if not os.path.exists(os.path.join(b, f))
                  or open(os.path.join(a, f), "rb").read() != open(os.path.join(b, f), "rb").read()]
        ok = ids_ok and dmax < 1e-4 and not differ and sorted(os.listdir(a)) == sorted(os.listdir(b))
        bad += not ok
        print(f"{n}: {'OK' if ok else 'MISMATCH'} (token ids {'equal' if ids_ok else 'DIFFER'}, "
              f"max |d logprob| {dmax:.1e}, differing files {differ})")
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
        import tempfile
        committed, outdir = outdir, tempfile.mkdtemp(prefix="fixtures-check-")
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
    # This script's fixtures only (tools/make_qwen35_fixtures.py keeps its own budget).
    total = sum(os.path.getsize(os.path.join(r, f))
                for s in FIXTURES for r, _, fs in os.walk(os.path.join(outdir, s["name"])) for f in fs)
    print(f"total size of the {len(FIXTURES)} Qwen3-MoE fixtures in {outdir}: {total / 1e6:.2f} MB")
    assert total < SIZE_LIMIT, "fixtures exceed the 10 MB budget"


if __name__ == "__main__":
    main()
