#!/usr/bin/env python3
"""Checks of make_random_checkpoint --format fp8 (tests/tools/test_random_checkpoint_fp8.sh).

  check_fp8_checkpoint.py layout GOT WANT   the same tensors (names, dtypes, shapes) and the
                                            same config.json / generation_config.json
  check_fp8_checkpoint.py values FP8 BF16   FP8 (--format fp8) against BF16 (same flags and
                                            seed): finite E4M3 codes (never 0x7f / 0xff),
                                            positive finite scales, dequantized weights within
                                            E4M3's rounding of the bf16 ones, the rest equal
Exit 0 when the check passes, 1 with the differences printed otherwise. Standard library only.
"""
import glob
import json
import math
import os
import struct
import sys


def tensors(d):
    """name -> (dtype, shape, file, begin, end) over every safetensors file of d."""
    out = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h = json.loads(fh.read(n))
        for k, v in h.items():
            if k == "__metadata__":
                continue
            b, e = v["data_offsets"]
            out[k] = (v["dtype"], v["shape"], f, 8 + n + b, 8 + n + e)
    return out


def data(t):
    with open(t[2], "rb") as fh:
        fh.seek(t[3])
        return fh.read(t[4] - t[3])


def load_json(d, f):
    with open(os.path.join(d, f)) as fh:
        return json.load(fh)


def layout(got, want):
    errs = []
    a, b = tensors(got), tensors(want)
    for k in sorted(set(a) | set(b)):
        if k not in a:
            errs.append(f"missing {k} {b[k][:2]}")
        elif k not in b:
            errs.append(f"extra {k} {a[k][:2]}")
        elif a[k][:2] != b[k][:2]:
            errs.append(f"{k}: {a[k][:2]} vs {b[k][:2]}")
    for f in ("config.json", "generation_config.json"):
        if load_json(got, f) != load_json(want, f):
            errs.append(f"{f} differs:\n{json.dumps(load_json(got, f), indent=1)}\nvs\n"
                        f"{json.dumps(load_json(want, f), indent=1)}")
    if not a:
        errs.append("no tensors")
    return errs, f"{len(a)} tensors"


def e4m3(c):
    s = -1.0 if c & 0x80 else 1.0
    e, m = (c >> 3) & 0xF, c & 7
    return s * (m / 8.0 * 2.0 ** -6 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7))


def bf16(raw):
    return [struct.unpack("<f", struct.pack("<I", u << 16))[0]
            for u in struct.unpack(f"<{len(raw) // 2}H", raw)]


def values(fp8, ref):
    errs = []
    a, b = tensors(fp8), tensors(ref)
    table = [e4m3(c) for c in range(256)]
    quantized, sq, n = 0, 0.0, 0
    for k, t in sorted(a.items()):
        if k.endswith("_scale_inv"):
            continue
        if t[0] != "F8_E4M3":
            if t[0] != "BF16" or data(t) != data(b[k]):
                errs.append(f"{k}: {t[0]}, not the bf16 checkpoint's bytes")
            continue
        quantized += 1
        q = data(t)
        if 0x7F in q or 0xFF in q:
            errs.append(f"{k}: NaN codes")
        st = a[k + "_scale_inv"]
        rows, cols = t[1]
        srows, scols = st[1]
        s = struct.unpack(f"<{srows * scols}f", data(st))
        if not all(math.isfinite(x) and x > 0 for x in s):
            errs.append(f"{k}: scales not positive finite")
            continue
        w = bf16(data(b[k]))
        worst = 0.0
        for i in range(rows):
            for j in range(cols):
                sc = s[(i // 128) * scols + j // 128]
                deq, x = table[q[i * cols + j]] * sc, w[i * cols + j]
                # E4M3's rounding of the unrounded value, plus bf16's of the reference
                bound = (max(abs(x) / 16, sc / 1024) + abs(x) / 256) * 1.01 + 1e-12
                worst = max(worst, abs(deq - x) / bound)
                sq += deq * deq
                n += 1
        if worst > 1:
            errs.append(f"{k}: dequantized weights off the bf16 ones ({worst:.2f} x the bound)")
    rms = math.sqrt(sq / max(n, 1))
    if quantized == 0:
        errs.append("no F8_E4M3 tensor")
    elif not 0.017 < rms < 0.023:
        errs.append(f"dequantized RMS {rms:.4f}, not ~0.02 (the bf16 init's)")
    return errs, f"{quantized} quantized tensors, dequantized RMS {rms:.4f}"


if __name__ == "__main__":
    mode, x, y = sys.argv[1:4]
    errs, summary = (layout if mode == "layout" else values)(x, y)
    for e in errs[:20]:
        print(f"  {e}")
    print(f"{mode} {x} vs {y}: {'FAIL' if errs else 'ok'} ({summary})")
    sys.exit(1 if errs else 0)
