#!/usr/bin/env python3
"""The MoE block as a PyTorch user would write it, timed at the shapes of bench_moe_layer.

softmax top-k router (renormalised), tokens sorted by expert, torch._grouped_mm for gate/up and
down, SiLU-multiply, weighted index_add_ back into token order. bf16, CUDA events, median of 20
after 5 warm-ups (eager; the host-side bincount/sort sync is part of what such code pays).

    python3 bench/cuda/moe_torch_baseline.py [--csv PATH]

Prints one row per (model, tokens): us per call.
"""
import argparse
import sys

import torch

SHAPES = {
    "qwen3-30b-a3b": dict(hidden=2048, inter=768, experts=128, top_k=8),
    "qwen3-235b-a22b": dict(hidden=4096, inter=1536, experts=128, top_k=8),
}
TOKENS = [1, 8, 32, 128, 256, 2048, 8192]


def moe(x, router, w_gate_up, w_down, top_k):
    # x [T, H]; router [E, H]; w_gate_up [E, H, 2I] (grouped_mm wants [E, K, N]); w_down [E, I, H]
    logits = x @ router.t()
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat, minlength=router.shape[0])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[token_of]
    gu = torch._grouped_mm(xs, w_gate_up, offs=offs)
    inter = gu.shape[-1] // 2
    act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    y = torch._grouped_mm(act, w_down, offs=offs)
    y = y * w.flatten()[order].unsqueeze(-1).to(y.dtype)
    out = torch.zeros_like(x)
    out.index_add_(0, token_of, y)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    dev = "cuda"
    rows = []
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'model':18} {'tokens':>7} {'us':>10}")
    for name, s in SHAPES.items():
        h, i, e, k = s["hidden"], s["inter"], s["experts"], s["top_k"]
        g = torch.Generator(device=dev).manual_seed(0)
        router = torch.randn(e, h, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        w_gu = torch.randn(e, h, 2 * i, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        w_dn = torch.randn(e, i, h, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        for t in TOKENS:
            x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=g)
            for _ in range(5):
                moe(x, router, w_gu, w_dn, k)
            times = []
            for _ in range(20):
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record()
                moe(x, router, w_gu, w_dn, k)
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) * 1e3)
            us = sorted(times)[len(times) // 2]
            rows.append((name, t, us))
            print(f"{name:18} {t:7d} {us:10.1f}", flush=True)
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("model,tokens,torch_us\n")
            for r in rows:
                f.write(f"{r[0]},{r[1]},{r[2]:.2f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
