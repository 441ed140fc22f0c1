#!/usr/bin/env python3
"""Multi-GPU layouts of Qwen3.5-397B-A17B predicted from one-GPU measurements (issue #28).

    tools/predict_ep.py --csv FILE [--csv FILE ...] [--moe-csv FILE] [--check]

Reads the CSVs bench_qwen35_cuda wrote ($TANDEM_BENCH_CSV: op,tokens,shape,us,bound_us,bytes,
flops) over the slice checkpoints of tools/gpu_ep_predict.sh, and optionally bench_moe's CSV
($TANDEM_BENCH_MOE_CSV, a 2-GPU run), and prints one markdown table per layout:

  decode, DP attention + EP8 / EP16: per-step time of one rank at B sequences per rank, split
    into attention + DeltaNet (+ shared expert, router, norms, sampling) / routed experts /
    lm_head / MoE dispatch + combine, and tokens/s per GPU (= per rank: B / step);
  prefill, TP4 / EP4, one 6,000-token prompt: time, tokens/s per instance and per GPU.

bf16 and block-FP8 (`--format fp8` checkpoints) rows. Each constant is printed with its
source: measured (this run's CSV, or a dated figure of docs/perf-history.md), computed (from
bytes / FLOPs and this run's measured ceilings) or nominal (a data-sheet rate). The NVL72
columns keep the measured Hopper compute and put only the links at NVL72's nominal rate: a
projection, not a GB200 prediction. python3 standard library only.

Checkpoint labels (the directory names, the first word of each CSV row's shape):
FMT_SLICE_KIND, FMT in {bf16, fp8}; KIND pair (one DeltaNet + one attention layer), attn (the
attention layer), attn2 (two attention layers); SLICE:
  ep8, ep16   decode rank slices: the 397B preset with --experts 64 / 32 (top-10 kept)
  dbase       the same non-expert weights with a tiny MoE (8 experts of 128, top-2)
  head        dbase's attention layer with the real 248,320-row vocab (the lm_head's cost)
  tp4k2, tp4k3  the TP4 rank slice (heads / 4, experts 128) with top-k 2 and 3 (same weights)
  tp4base     the TP4 slice's non-expert weights with the tiny MoE
--check: exit 1 when a number of a table could not be computed (a missing row).
"""

import argparse
import csv
import math
import sys

# ----------------------------------------------------------------------------- the model
LAYERS, ATTN_LAYERS, LINEAR_LAYERS = 60, 15, 45
HIDDEN, EXPERTS, TOP_K, VOCAB = 4096, 512, 10, 248320
DECODE_CONTEXT = 2048
BATCHES = (32, 64, 128, 256)
PREFILL_TOKENS, TP = 6000, 4
TP4_TOPK = (2, 3)  # measured at top-k 2 and 3; TOP_K * 1/TP = 2.5 local experts per token
BASE_EXPERTS = 8  # the tiny MoE of the dbase / tp4base slices
FP8_GROUP = 128  # dispatch fp8 payload: H e4m3 bytes + H / 128 fp32 scales, 16-byte padded

# --------------------------------------------------------------- constants (value, source)
# The 2-GPU dispatch / combine of bench_moe (top-8 of 128 experts, hidden 4096, uniform routing,
# CUDA graph, slowest rank's median): docs/perf-history.md "2026-11-30 MoE dispatch/combine v4",
# 2x H200, commit 86d27c7. Rows T = 1 and T = 512 tokens per rank.
MOE_2GPU = {
    "source": "measured, 2x H200, bench_moe 2026-11-30 (86d27c7, docs/perf-history.md)",
    "world": 2,
    "experts": 128,
    "top_k": 8,
    "rows": {1: (11.6, 8.6, 12.4), 512: (49.9, 79.5, 40.8)},  # dispatch, combine, fp8 dispatch
}
# All-reduce, bf16, 2x H200 (docs/perf.md "All-reduce and MoE dispatch / combine"): 8 KiB
# one-shot (the fixed cost) and 64 MiB.
AR_SMALL_US = 3.99
AR_LARGE_BYTES, AR_LARGE_US = 64 << 20, 238.60
AR_SOURCE = "measured, 2x H200, bench_allreduce 2026-11-30 (fdbe5b9, docs/perf.md)"
NVLINK_H200_GBPS = 450.0  # NVLink 4, per direction per GPU (nominal)
NVLINK_NVL72_GBPS = 900.0  # NVLink 5 (GB200 NVL72), per direction per GPU (nominal)
HBM_FALLBACK_GBPS = 3350.0  # H100 SXM nominal, used only when no decode row gives the ceiling
GEMM_FALLBACK_TFLOPS = 700.0  # nominal-ish, used only when the CSV lacks the gemm row


def comb_ratio(n_out, n_all, k):
    """C(n_out, k) / C(n_all, k) as a float (no huge integers needed for these sizes)."""
    if k > n_out:
        return 0.0
    return math.comb(n_out, k) / math.comb(n_all, k)


def expected_other_ranks(experts, top_k, ranks):
    """Expected number of ranks other than the token's own that hold at least one of its top_k
    experts (drawn without replacement from `experts`, `experts / ranks` per rank): each other
    rank misses all k with probability C(E - g, k) / C(E, k) (hypergeometric), g = E / ranks."""
    g = experts // ranks
    return (ranks - 1) * (1.0 - comb_ratio(experts - g, experts, top_k))


def expected_other_pairs(experts, top_k, ranks):
    """Expected (token, expert) pairs per token computed on another rank: k (E - g) / E."""
    g = experts // ranks
    return top_k * (experts - g) / experts


def dispatch_row_bytes(fp8):
    if not fp8:
        return 2 * HIDDEN
    return (HIDDEN + (HIDDEN // FP8_GROUP) * 4 + 15) // 16 * 16


# -------------------------------------------------------------------- memory of one rank
# The 397B's other shapes (tools/make_random_checkpoint.cpp's preset): gated attention 32 query /
# 2 KV heads of 256; DeltaNet 16 key / 64 value heads of 128, conv kernel 4; experts and the
# shared expert of 1024.
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 2, 256
LIN_K_HEADS, LIN_V_HEADS, LIN_DIM, CONV_K = 16, 64, 128, 4
MOE_INTER = SHARED_INTER = 1024
GPU_GB = {"H100": 80, "H200": 141, "GB200": 186}  # nominal HBM per GPU


def linear_bytes(rows, cols, fp8):
    """A matrix as bf16, or as block FP8: e4m3 codes + fp32 scales per 128 x 128 block."""
    if not fp8:
        return 2 * rows * cols
    return rows * cols + 4 * math.ceil(rows / 128) * math.ceil(cols / 128)


def rank_memory_bytes(tp, local_experts, fp8, seqs, tokens_per_seq):
    """One rank's weights (tp: the heads / shared expert / lm_head split, 1 for a decode rank),
    its KV (bf16) for seqs x tokens_per_seq and DeltaNet states (fp32: the recurrent state and
    the conv window) for seqs; activations and workspaces left out. Quantized (fp8) as
    convert does: attention and DeltaNet projections, experts, shared expert; router,
    embedding, lm_head, norms stay bf16."""
    h = HIDDEN
    qh, hk, hv = Q_HEADS // tp, LIN_K_HEADS // tp, LIN_V_HEADS // tp
    kvh = max(KV_HEADS // tp, 1)
    conv = (2 * hk + hv) * LIN_DIM
    attn = (linear_bytes(2 * qh * HEAD_DIM, h, fp8) + 2 * linear_bytes(kvh * HEAD_DIM, h, fp8) +
            linear_bytes(h, qh * HEAD_DIM, fp8))
    lin = (linear_bytes(conv, h, fp8) + linear_bytes(hv * LIN_DIM, h, fp8) +
           linear_bytes(h, hv * LIN_DIM, fp8) + 2 * 2 * hv * h + 2 * conv * CONV_K)
    si = SHARED_INTER // tp
    moe = (2 * EXPERTS * h + 2 * linear_bytes(si, h, fp8) + linear_bytes(h, si, fp8) + 2 * h +
           local_experts * (2 * linear_bytes(MOE_INTER, h, fp8) + linear_bytes(h, MOE_INTER, fp8)))
    weights = (ATTN_LAYERS * attn + LINEAR_LAYERS * lin + LAYERS * moe +
               2 * VOCAB * h + 2 * math.ceil(VOCAB / tp) * h)
    kv = ATTN_LAYERS * 2 * kvh * HEAD_DIM * 2 * tokens_per_seq
    state = LINEAR_LAYERS * 4 * (hv * LIN_DIM * LIN_DIM + conv * (CONV_K - 1))
    return weights + seqs * (kv + state)


def fits(nbytes):
    """The GPUs of GPU_GB whose memory holds nbytes (GB = 1e9 bytes), e.g. "H200, GB200" or "none"."""
    ok = [g for g, gb in GPU_GB.items() if nbytes <= gb * 1e9]
    return ", ".join(ok) if ok else "none"


# ------------------------------------------------------------------------ reading the CSVs
def read_bench_csv(paths):
    """{(label, op, tokens): us}, and the ceilings: copy B/s (decode rows: bound = bytes / copy)
    and GEMM FLOP/s (the gemm_8192^3 row)."""
    rows, copy_bps, gemm_fps = {}, [], []
    for path in paths:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                try:
                    us, bound = float(r["us"]), float(r["bound_us"])
                    nbytes, flops = float(r["bytes"]), float(r["flops"])
                except (KeyError, ValueError):
                    continue
                if math.isnan(us):
                    continue
                op, tokens = r["op"], int(r["tokens"])
                if op.startswith("gemm_"):
                    gemm_fps.append(flops / (us * 1e-6))
                    continue
                label = r["shape"].split(":")[0].strip()
                rows[(label, op, tokens)] = us
                if op.startswith("decode") and flops == 0 and bound > 0:
                    copy_bps.append(nbytes / (bound * 1e-6))
    med = lambda v: sorted(v)[len(v) // 2] if v else None
    return rows, med(copy_bps), med(gemm_fps)


def moe_rates_from_csv(path):
    """Fixed cost and per-byte rate of dispatch / combine / fp8 dispatch from bench_moe's CSV
    (H 4096 rows, smallest and largest T)."""
    pts = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            try:
                if int(r["H"]) != HIDDEN:
                    continue
                pts.append((int(r["T"]), float(r["dispatch_us"]), float(r["combine_us"]),
                            float(r["dispatch_fp8_us"]), float(r["dispatch_MiB"]) * 1048576,
                            float(r["combine_MiB"]) * 1048576))
            except (KeyError, ValueError):
                continue  # the prefill line
    if len(pts) < 2:
        raise ValueError(path + ": fewer than two H 4096 rows")
    pts.sort()
    lo, hi = pts[0], pts[-1]
    fp8_scale = dispatch_row_bytes(True) / dispatch_row_bytes(False)
    out = {}
    for name, i, bi, scale in (("dispatch", 1, 4, 1.0), ("combine", 2, 5, 1.0),
                               ("dispatch_fp8", 3, 4, fp8_scale)):
        db = (hi[bi] - lo[bi]) * scale
        out[name] = (lo[i], db / ((hi[i] - lo[i]) * 1e-6))
    out["source"] = "measured, bench_moe CSV " + path
    return out


def moe_rates_default():
    """The same from MOE_2GPU: bytes per rank from the exact expectations of its routing."""
    m = MOE_2GPU
    d_tok = expected_other_ranks(m["experts"], m["top_k"], m["world"])
    c_pair = expected_other_pairs(m["experts"], m["top_k"], m["world"])
    (d1, c1, f1), (d2, c2, f2) = m["rows"][1], m["rows"][512]
    dt = 511 * d_tok
    out = {
        "dispatch": (d1, dt * 2 * HIDDEN / ((d2 - d1) * 1e-6)),
        "combine": (c1, 511 * c_pair * 2 * HIDDEN / ((c2 - c1) * 1e-6)),
        "dispatch_fp8": (f1, dt * dispatch_row_bytes(True) / ((f2 - f1) * 1e-6)),
        "source": m["source"],
    }
    return out


# ----------------------------------------------------------------------------- the model
class Missing(Exception):
    pass


NOTES = []  # measurement oddities printed under the tables


def get(rows, label, op, tokens):
    key = (label, op, tokens)
    if key not in rows:
        raise Missing("no row " + "/".join(map(str, key)))
    return rows[key]


def stack(rows, fmt, sl, op, tokens, base):
    """Whole-model time from one slice's pair / attn rows (us): O + 15 A' + 45 D' with
    A' = T_attn - O, D' = T_pair - T_attn, O = 2 T_attn(base) - T_attn2(base) (the per-step or
    per-prompt fixed cost: embedding, final norm, the small head, sampling); and the routed
    experts' share: 60 (M - M_base), M - M_base = ((pair - pair_base) + (attn - attn_base)) / 3."""
    pair = get(rows, f"{fmt}_{sl}_pair", op, tokens)
    attn = get(rows, f"{fmt}_{sl}_attn", op, tokens)
    b_pair = get(rows, f"{fmt}_{base}_pair", op, tokens)
    b_attn = get(rows, f"{fmt}_{base}_attn", op, tokens)
    b_attn2 = get(rows, f"{fmt}_{base}_attn2", op, tokens)
    fixed = 2 * b_attn - b_attn2
    if fixed < 0:  # noise: an attention layer costs more than the fixed part; taken as 0
        NOTES.append(f"{fmt} {base} {op} {tokens}: fixed cost 2 attn - attn2 = {fixed:.1f} us "
                     "< 0, taken as 0")
        fixed = 0.0
    total = fixed + ATTN_LAYERS * (attn - fixed) + LINEAR_LAYERS * (pair - attn)
    routed = LAYERS * ((pair - b_pair) + (attn - b_attn)) / 3
    return total, routed, fixed


def roofline_us(nbytes, flops, copy_bps, gemm_fps):
    return 1e6 * max(nbytes / copy_bps, flops / gemm_fps)


def router_fix_us(local_experts, tokens, copy_bps, gemm_fps):
    """The router's missing columns (the slice routes over its local experts, the real rank
    over all 512, replicated): roofline of the full router minus the slice's, all layers."""
    def one(e):
        return roofline_us(e * HIDDEN * 2 + tokens * e * 4, 2.0 * tokens * HIDDEN * e, copy_bps,
                           gemm_fps)
    return LAYERS * (one(EXPERTS) - one(local_experts))


def decode_comm_us(B, ep, fp8, rates, link_bps=None):
    """One step's dispatch + combine: per MoE layer fixed + bytes / rate for each. Bytes a rank
    sends: dispatch, its B tokens once per other destination rank (expected_other_ranks) x the
    row; combine, the pairs computed on other ranks (B k (E - g) / E) x hidden bf16 (the
    combine sends pair outputs home, weighted-summed there). link_bps replaces the measured
    rates (the nominal-link columns); the measured fixed costs stay."""
    d_name = "dispatch_fp8" if fp8 else "dispatch"
    d_fixed, d_rate = rates[d_name]
    c_fixed, c_rate = rates["combine"]
    d_bytes = B * expected_other_ranks(EXPERTS, TOP_K, ep) * dispatch_row_bytes(fp8)
    c_bytes = B * expected_other_pairs(EXPERTS, TOP_K, ep) * 2 * HIDDEN
    if link_bps:
        d_rate = c_rate = link_bps
    per_layer = d_fixed + 1e6 * d_bytes / d_rate + c_fixed + 1e6 * c_bytes / c_rate
    return LAYERS * per_layer


def allreduce_us(nbytes, ranks, busbw, fixed_us):
    """Ring-equivalent all-reduce: fixed + 2 (N - 1) / N x bytes / bus bandwidth."""
    return fixed_us + 1e6 * 2 * (ranks - 1) / ranks * nbytes / busbw


def ar_busbw():
    """Bus bandwidth of the 2-GPU 64 MiB all-reduce (2 (N - 1) / N = 1), its fixed cost out."""
    return AR_LARGE_BYTES / ((AR_LARGE_US - AR_SMALL_US) * 1e-6)


def predict(rows, copy_bps, gemm_fps, rates, formats=("bf16", "fp8"), batches=BATCHES,
            h200_nominal=False):
    """{'decode': {ep: [row dict]}, 'prefill': [row dict], 'missing': [str]} (times in ms)."""
    out = {"decode": {8: [], 16: []}, "prefill": [], "missing": []}
    h200_link = NVLINK_H200_GBPS * 1e9 if h200_nominal else None
    # The lm_head's measured cost (bf16 in both formats: convert leaves it unquantized).
    head_meas = {}
    for fmt in formats:
        for B in batches:
            try:
                head_meas.setdefault(B, (
                    get(rows, f"{fmt}_head_attn", f"decode_ctx{DECODE_CONTEXT}", B) -
                    get(rows, f"{fmt}_dbase_attn", f"decode_ctx{DECODE_CONTEXT}", B), fmt))
            except Missing:
                pass
    for ep in (8, 16):
        for fmt in formats:
            for B in batches:
                op = f"decode_ctx{DECODE_CONTEXT}"
                try:
                    total, routed, _ = stack(rows, fmt, f"ep{ep}", op, B, "dbase")
                except Missing as e:
                    out["missing"].append(f"decode EP{ep} {fmt} B {B}: {e}")
                    continue
                if B in head_meas:
                    head, head_src = head_meas[B][0], "measured (" + head_meas[B][1] + ")"
                else:
                    head = roofline_us(VOCAB * HIDDEN * 2, 2.0 * B * VOCAB * HIDDEN, copy_bps,
                                       gemm_fps)
                    head_src = "computed"
                rest = total - routed + router_fix_us(EXPERTS // ep, B, copy_bps, gemm_fps)
                compute = rest + routed + head
                dc = decode_comm_us(B, ep, fmt == "fp8", rates, h200_link)
                dc72 = decode_comm_us(B, ep, fmt == "fp8", rates, NVLINK_NVL72_GBPS * 1e9)
                mem = rank_memory_bytes(1, EXPERTS // ep, fmt == "fp8", B, DECODE_CONTEXT)
                out["decode"][ep].append({
                    "fmt": fmt, "B": B, "mem": mem / 1e9, "rest": rest / 1e3, "routed": routed / 1e3,
                    "head": head / 1e3, "head_src": head_src, "dc": dc / 1e3,
                    "step": (compute + dc) / 1e3, "tps": B / ((compute + dc) * 1e-6),
                    "dc72": dc72 / 1e3, "step72": (compute + dc72) / 1e3,
                    "tps72": B / ((compute + dc72) * 1e-6)})
    T = PREFILL_TOKENS
    for fmt in formats:
        try:
            parts = [stack(rows, fmt, f"tp4k{k}", "prefill", T, "tp4base") for k in TP4_TOPK]
        except Missing as e:
            out["missing"].append(f"prefill TP4 {fmt}: {e}")
            continue
        # top-k 2.5 (= 10 / 4 local experts per token on average): the mean of k 2 and 3.
        total = sum(p[0] for p in parts) / len(parts)
        routed = sum(p[1] for p in parts) / len(parts)
        rest = total - routed + router_fix_us(EXPERTS // TP, T, copy_bps, gemm_fps)
        # The vocab-parallel head for the prompt's one logits row (V / 4 rows of the lm_head).
        head = roofline_us(math.ceil(VOCAB / TP) * HIDDEN * 2, 2.0 * math.ceil(VOCAB / TP) * HIDDEN,
                           copy_bps, gemm_fps)
        compute = rest + routed + head
        ar_bytes = T * HIDDEN * 2
        busbw = NVLINK_H200_GBPS * 1e9 if h200_nominal else ar_busbw()
        # Two per layer (after the mixer, after the MoE block), then the logits: each rank's
        # vocab columns in a zeroed full-width fp32 row, all-reduced (docs/architecture.md).
        ar, ar72 = (2 * LAYERS * allreduce_us(ar_bytes, TP, bw, AR_SMALL_US) +
                    allreduce_us(VOCAB * 4, TP, bw, AR_SMALL_US)
                    for bw in (busbw, NVLINK_NVL72_GBPS * 1e9))
        mem = rank_memory_bytes(TP, EXPERTS // TP, fmt == "fp8", 1, T)
        out["prefill"].append({
            "fmt": fmt, "T": T, "mem": mem / 1e9, "rest": rest / 1e3, "routed": routed / 1e3, "head": head / 1e3,
            "ar": ar / 1e3, "time": (compute + ar) / 1e3, "tps": T / ((compute + ar) * 1e-6),
            "ar72": ar72 / 1e3, "time72": (compute + ar72) / 1e3,
            "tps72": T / ((compute + ar72) * 1e-6)})
    return out


# ------------------------------------------------------------------------------- printing
def fmt_rate(bps):
    return f"{bps / 1e9:.1f} GB/s"


def print_tables(res, copy_bps, copy_src, gemm_fps, gemm_src, rates, h200_nominal, file):
    p = lambda *a: print(*a, file=file)
    p("## Qwen3.5-397B-A17B multi-GPU layouts predicted from one GPU (tools/predict_ep.py)")
    p()
    p("| constant | value | source |")
    p("| --- | --- | --- |")
    p(f"| HBM copy rate (decode rows' bound) | {fmt_rate(copy_bps)} | {copy_src} |")
    p(f"| bf16 GEMM rate (8192^3) | {gemm_fps / 1e12:.1f} TFLOP/s | {gemm_src} |")
    for name in ("dispatch", "dispatch_fp8", "combine"):
        fixed, rate = rates[name]
        p(f"| {name} fixed / per-byte rate | {fixed:.1f} us + bytes at {fmt_rate(rate)} | "
          f"{rates['source']} |")
    p(f"| all-reduce fixed / bus bandwidth | {AR_SMALL_US:.2f} us + 2(N-1)/N bytes at "
      f"{fmt_rate(ar_busbw())} | {AR_SOURCE}; 2-GPU bus bandwidth assumed for 4 ranks |")
    p(f"| NVLink, H200 (NVLink 4) | {NVLINK_H200_GBPS:.0f} GB/s per direction | nominal"
      f"{' (used: --h200-nominal)' if h200_nominal else ' (not used: the measured rates are)'} |")
    p(f"| NVLink, GB200 NVL72 (NVLink 5) | {NVLINK_NVL72_GBPS:.0f} GB/s per direction | "
      "nominal (the NVL72 columns: projection) |")
    p()
    p("Rank memory: weights (bf16, or block FP8 where convert quantizes) + bf16 KV + fp32 "
      "DeltaNet states of the rank's sequences, activations left out; fits: which of "
      + ", ".join(f"{g} ({gb} GB)" for g, gb in GPU_GB.items()) + " hold it. A row that fits "
      "none is a compute prediction for a layout that needs more ranks or FP8.")
    for ep in (8, 16):
        p()
        d = expected_other_ranks(EXPERTS, TOP_K, ep)
        c = expected_other_pairs(EXPERTS, TOP_K, ep)
        p(f"### Decode, DP attention + EP{ep} ({EXPERTS // ep} experts per rank), context "
          f"{DECODE_CONTEXT}, B sequences per rank")
        p()
        p(f"Per token and MoE layer a rank sends {d:.3f} dispatch rows (expected other ranks "
          f"among top-{TOP_K} of {EXPERTS}, exact hypergeometric) and {c:.3f} combine rows "
          f"(pairs on other ranks); FP8 rows dispatch e4m3 + scales ({dispatch_row_bytes(True)} "
          f"bytes a row), combine bf16.")
        if ep == 16:
            p("The H200 columns assume 16 GPUs on one NVLink domain; an HGX H200 has 8 (EP16 "
              "across two nodes goes over InfiniBand: not modelled).")
        p()
        p("| format | B | attention + DeltaNet + rest ms | routed experts ms | lm_head ms | "
          "dispatch + combine ms (H200) | step ms (H200) | tok/s per GPU (H200) | "
          "dispatch + combine ms (NVL72, proj.) | step ms (NVL72) | tok/s per GPU (NVL72) | "
          "rank memory GB (fits) |")
        p("| --- |" + " --- |" * 11)
        for r in res["decode"][ep]:
            p(f"| {r['fmt']} | {r['B']} | {r['rest']:.2f} | {r['routed']:.2f} | "
              f"{r['head']:.2f} ({r['head_src']}) | {r['dc']:.2f} | {r['step']:.2f} | "
              f"{r['tps']:.0f} | {r['dc72']:.2f} | {r['step72']:.2f} | {r['tps72']:.0f} | "
              f"{r['mem']:.1f} ({fits(r['mem'] * 1e9)}) |")
    p()
    p(f"### Prefill, TP{TP} / EP{TP}, one {PREFILL_TOKENS}-token prompt (per instance of {TP} "
      "GPUs)")
    p()
    p(f"Routed experts at top-k {TOP_K}/{TP} = {TOP_K / TP} local experts per token: the mean "
      f"of the slice at top-k {TP4_TOPK[0]} and {TP4_TOPK[1]}; 2 all-reduces per layer of "
      f"{PREFILL_TOKENS} x {HIDDEN} bf16, and the fp32 logits row's; lm_head vocab-parallel, one row "
      "(computed).")
    p()
    p("| format | attention + DeltaNet + rest ms | routed experts ms | lm_head ms | "
      "all-reduces ms (H200) | time ms (H200) | tok/s per instance (H200) | tok/s per GPU "
      "(H200) | all-reduces ms (NVL72, proj.) | time ms (NVL72) | tok/s per instance (NVL72) | "
      "rank memory GB (fits) |")
    p("| --- |" + " --- |" * 11)
    for r in res["prefill"]:
        p(f"| {r['fmt']} | {r['rest']:.2f} | {r['routed']:.2f} | {r['head']:.3f} | "
          f"{r['ar']:.2f} | {r['time']:.2f} | {r['tps']:.0f} | {r['tps'] / TP:.0f} | "
          f"{r['ar72']:.2f} | {r['time72']:.2f} | {r['tps72']:.0f} | {r['mem']:.1f} "
          f"({fits(r['mem'] * 1e9)}) |")
    if NOTES:
        p()
        for n in dict.fromkeys(NOTES):
            p("Note: " + n)
    if res["missing"]:
        p()
        p("Not computed (rows missing from the CSVs):")
        for m in res["missing"]:
            p("- " + m)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", action="append", default=[], help="bench_qwen35_cuda CSV (repeat)")
    ap.add_argument("--moe-csv", help="bench_moe CSV of a multi-GPU run (else the 2x H200 figures)")
    ap.add_argument("--formats", default="bf16,fp8")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--h200-nominal", action="store_true",
                    help="H200 columns at the nominal 450 GB/s instead of the measured rates")
    ap.add_argument("--check", action="store_true", help="exit 1 when a table value is missing")
    a = ap.parse_args(argv)
    if not a.csv:
        ap.error("at least one --csv")
    rows, copy_bps, gemm_fps = read_bench_csv(a.csv)
    copy_src = "measured (this run's D2D copy ceiling)"
    gemm_src = "measured (this run's cuBLASLt 8192^3)"
    if copy_bps is None:
        copy_bps, copy_src = HBM_FALLBACK_GBPS * 1e9, "nominal (H100 SXM; no decode row)"
    if gemm_fps is None:
        gemm_fps, gemm_src = GEMM_FALLBACK_TFLOPS * 1e12, "nominal (no gemm row)"
    rates = moe_rates_from_csv(a.moe_csv) if a.moe_csv else moe_rates_default()
    formats = tuple(f for f in a.formats.split(",") if f)
    batches = tuple(int(b) for b in a.batches.split(",") if b)
    res = predict(rows, copy_bps, gemm_fps, rates, formats, batches, a.h200_nominal)
    print_tables(res, copy_bps, copy_src, gemm_fps, gemm_src, rates, a.h200_nominal, sys.stdout)
    return 1 if a.check and res["missing"] else 0


if __name__ == "__main__":
    sys.exit(main())
