#!/usr/bin/env python3
"""Sampling as a PyTorch user (or a framework's torch fallback) runs it, at bench_sampling's
shapes: rows x 151936 fp32 logits, N(0, 2^2) plus 8 tokens per row raised by 8.

Cases (bench_sampling's names): greedy (argmax), temperature (softmax + multinomial), top_p0.9
(sort, softmax, cumsum, mask, multinomial), top_k20+top_p0.95 at temperature 0.7 (topk, then
the same over the 20). CUDA events, median of 15 after 3 warm-ups, each call on the next of
enough logits sets to exceed 3x the L2 (as bench_sampling), so the logits come from HBM.

    python3 bench/cuda/sampling_torch_baseline.py [--ours BENCH_SAMPLING_CSV] [--csv PATH]
        [--rows 128,256]

With --ours (the CSV bench_sampling writes to $TANDEM_BENCH_CSV) each row adds our time (the
path the CUDA models use: multi-CTA up to 64 rows, single-CTA above) and torch / ours.
"""
import argparse
import csv
import math

import torch

VOCAB = 151936
ROWS = [1, 32, 128, 256]


def make_sets(rows):
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    set_bytes = rows * VOCAB * 4
    sets = max(1, min(64, math.ceil(3.0 * l2 / set_bytes)))
    g = torch.Generator(device="cuda").manual_seed(20261130)
    out = []
    for _ in range(sets):
        x = torch.randn(rows, VOCAB, device="cuda", generator=g) * 2.0
        idx = torch.randint(0, VOCAB, (rows, 8), device="cuda", generator=g)
        x.scatter_add_(1, idx, torch.full((rows, 8), 8.0, device="cuda"))
        out.append(x)
    return out


def greedy(x):
    return torch.argmax(x, dim=-1)


def temperature(x):
    return torch.multinomial(torch.softmax(x, dim=-1), 1)


def top_p(x, p=0.9):
    sx, idx = torch.sort(x, dim=-1, descending=True)
    probs = sx.softmax(dim=-1)
    cum = probs.cumsum(dim=-1)
    sx = sx.masked_fill(cum - probs > p, float("-inf"))
    t = torch.multinomial(sx.softmax(dim=-1), 1)
    return idx.gather(-1, t)


def top_k_top_p(x, k=20, p=0.95, temp=0.7):
    v, idx = torch.topk(x / temp, k, dim=-1)
    probs = v.softmax(dim=-1)
    cum = probs.cumsum(dim=-1)
    v = v.masked_fill(cum - probs > p, float("-inf"))
    t = torch.multinomial(v.softmax(dim=-1), 1)
    return idx.gather(-1, t)


CASES = [("greedy", greedy), ("temperature", temperature), ("top_p0.9", top_p),
         ("top_k20+top_p0.95", top_k_top_p)]


def time_us(fn, sets):
    for i in range(3):
        fn(sets[i % len(sets)])
    torch.cuda.synchronize()
    times = []
    for i in range(15):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        x = sets[i % len(sets)]
        a.record()
        fn(x)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def read_ours(path):
    ours = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            rows = int(r["rows"])
            want = "multi" if rows <= 64 else "single"  # the path sample_launch takes
            if r["path"] == want:
                ours[(r["case"], rows)] = (float(r["us"]), float(r["bound_us"]))
    return ours


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", help="bench_sampling's CSV ($TANDEM_BENCH_CSV)")
    ap.add_argument("--csv", help="write the table here")
    ap.add_argument("--rows", default=",".join(str(r) for r in ROWS),
                    help="row counts, comma-separated (default 1,32,128,256)")
    args = ap.parse_args()
    ours = read_ours(args.ours) if args.ours else {}
    print(f"== torch {torch.__version__} sampling, vocab {VOCAB} fp32, {torch.cuda.get_device_name(0)}")
    print(f"{'case':<20} {'rows':>5} {'torch_us':>10} {'ours_us':>9} {'bound_us':>9} "
          f"{'torch/ours':>10} {'ours%bound':>10}")
    out = []
    for rows in [int(r) for r in args.rows.split(",")]:
        sets = make_sets(rows)
        for name, fn in CASES:
            t = time_us(fn, sets)
            o, bound = ours.get((name, rows), (float("nan"), float("nan")))
            print(f"{name:<20} {rows:>5} {t:>10.1f} {o:>9.1f} {bound:>9.1f} {t / o:>10.2f} "
                  f"{100.0 * bound / o:>9.1f}%", flush=True)
            out.append((name, rows, t, o, bound))
        del sets
        torch.cuda.empty_cache()
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("case,rows,torch_us,ours_us,bound_us\n")
            for r in out:
                f.write(",".join(str(v) for v in r) + "\n")


if __name__ == "__main__":
    main()
