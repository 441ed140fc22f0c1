#!/usr/bin/env python3
"""tools/predict_ep.py on hand-made CSVs: every table value against the formulas worked out by
hand here (docs/perf.md "Multi-GPU layouts predicted from one GPU"), the exact expected number
of destination ranks against a brute-force enumeration, and --check's exit status.

    python3 tests/tools/test_predict_ep.py SOURCE_DIR
"""

import contextlib
import importlib.util
import io
import itertools
import math
import os
import sys
import tempfile
import unittest

SRC = sys.argv.pop(1) if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
spec = importlib.util.spec_from_file_location("predict_ep", os.path.join(SRC, "tools", "predict_ep.py"))
pe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pe)

# Ceilings: copy 4e12 B/s (decode rows: 4e9 bytes, bound 1000 us), GEMM 5e14 FLOP/s (1e12 FLOP in
# 2000 us).
COPY, GEMM = 4e12, 5e14
DECODE = {  # label -> us at B = 32, context 2048
    "bf16_dbase_attn": 300, "bf16_dbase_attn2": 500, "bf16_dbase_pair": 700,
    "bf16_ep8_attn": 800, "bf16_ep8_pair": 1700, "bf16_head_attn": 900,
    "bf16_ep16_attn": 600, "bf16_ep16_pair": 1300,
}
PREFILL = {  # label -> us, one 6000-token prompt
    "bf16_tp4base_attn": 1000, "bf16_tp4base_attn2": 1900, "bf16_tp4base_pair": 2500,
    "bf16_tp4k2_attn": 2000, "bf16_tp4k2_pair": 4500,
    "bf16_tp4k3_attn": 2400, "bf16_tp4k3_pair": 5300,
}
RATES = {"dispatch": (10.0, 1e11), "combine": (5.0, 2e11), "dispatch_fp8": (12.0, 5e10),
         "source": "test"}


def write_csv(path, rows):
    """bench_qwen35_cuda's CSV header, its GEMM-ceiling row, then `rows`."""
    with open(path, "w") as f:
        f.write("op,tokens,shape,us,bound_us,bytes,flops\n")
        f.write('gemm_8192^3,8192,"8192x8192x8192 (the GEMM ceiling)",2000,2000,4e8,1e12\n')
        f.writelines(rows)
    return path


def write_csvs(d, decode=True, prefill=True):
    paths = []
    if decode:
        rows = [f'decode_ctx2048,32,"{label}: 32 seqs x 2048 ctx, graph, switches default",'
                f"{us},1000,4e9,0\n" for label, us in DECODE.items()]
        rows.append('decode FAILED,0,"some error",nan,nan,0,0\n')
        paths.append(write_csv(os.path.join(d, "decode.csv"), rows))
    if prefill:
        rows = [f'prefill,6000,"{label}: one prompt, eager (MFU = bound / us)",{us},'
                f"10,1e9,1e12\n" for label, us in PREFILL.items()]
        paths.append(write_csv(os.path.join(d, "prefill.csv"), rows))
    return paths


def hyper_miss(E, g, k):
    """C(E - g, k) / C(E, k) as the product of k ratios (a different route from math.comb)."""
    r = 1.0
    for i in range(k):
        r *= (E - g - i) / (E - i)
    return r


class Hypergeometric(unittest.TestCase):
    def test_brute_force(self):
        # 8 experts over 4 ranks (2 each), top-3, token on rank 0: enumerate all C(8, 3) picks.
        for E, k, ranks in ((8, 3, 4), (12, 4, 3), (16, 5, 8)):
            g = E // ranks
            picks = list(itertools.combinations(range(E), k))
            mean = sum(len({e // g for e in p} - {0}) for p in picks) / len(picks)
            self.assertAlmostEqual(pe.expected_other_ranks(E, k, ranks), mean, places=12)
            pairs = sum(sum(1 for e in p if e // g != 0) for p in picks) / len(picks)
            self.assertAlmostEqual(pe.expected_other_pairs(E, k, ranks), pairs, places=12)
        # Not the with-replacement formula (ranks - 1)(1 - (1 - 1/ranks)^k): 1.929 vs 1.734.
        self.assertAlmostEqual(pe.expected_other_ranks(8, 3, 4), 3 * (1 - 20 / 56), places=12)
        self.assertGreater(abs(pe.expected_other_ranks(8, 3, 4) - 3 * (1 - 0.75 ** 3)), 0.1)

    def test_397b(self):
        self.assertAlmostEqual(pe.expected_other_ranks(512, 10, 8),
                               7 * (1 - hyper_miss(512, 64, 10)), places=12)
        self.assertAlmostEqual(pe.expected_other_ranks(512, 10, 8), 5.1818, places=4)
        self.assertAlmostEqual(pe.expected_other_ranks(512, 10, 16), 7.1796, places=4)

    def test_fp8_row(self):
        self.assertEqual(pe.dispatch_row_bytes(False), 8192)
        self.assertEqual(pe.dispatch_row_bytes(True), 4096 + 32 * 4)


class Memory(unittest.TestCase):
    def test_whole_model(self):
        # tp 1, all 512 experts, no sequences: the whole bf16 model. Params per attention layer
        # (16384 + 512 + 512) x 4096 + 4096 x 8192 = 104857600; DeltaNet (12288 + 8192 + 2 x 64)
        # x 4096 + 4096 x 8192 + 12288 x 4 = 118013952; MoE 512 x 4096 (router) + 3 x 1024 x 4096
        # (shared) + 4096 + 512 x 3 x 1024 x 4096 = 6457135104; embedding + head 2 x 248320 x
        # 4096 = 2034237440: 396.3e9 parameters (the name says 397B).
        params = 15 * 104857600 + 45 * 118013952 + 60 * 6457135104 + 2034237440
        self.assertEqual(params, 396345835520)
        self.assertEqual(pe.rank_memory_bytes(1, 512, False, 0, 0), 2 * params)

    def test_sequences(self):
        # One sequence of 1000 tokens: KV 15 x 2 x 2 heads x 256 x 2 bytes x 1000; state 45 x 4 x
        # (64 x 128 x 128 + 12288 x 3).
        one = pe.rank_memory_bytes(1, 64, False, 1, 1000) - pe.rank_memory_bytes(1, 64, False, 0, 0)
        self.assertEqual(one, 30720000 + 195379200)
        # TP4: 1 KV head, 16 value / 4 key heads: KV halves, the state quarters (conv 3072 wide).
        one = pe.rank_memory_bytes(4, 128, False, 1, 1000) - pe.rank_memory_bytes(4, 128, False, 0, 0)
        self.assertEqual(one, 15360000 + 45 * 4 * (16 * 128 * 128 + 3072 * 3))

    def test_fp8_and_fits(self):
        # Block FP8: the expert matrices at 1 byte + a fp32 scale per 128 x 128 block.
        e_bf16 = pe.rank_memory_bytes(1, 1, False, 0, 0) - pe.rank_memory_bytes(1, 0, False, 0, 0)
        e_fp8 = pe.rank_memory_bytes(1, 1, True, 0, 0) - pe.rank_memory_bytes(1, 0, True, 0, 0)
        self.assertEqual(e_bf16, 60 * 3 * 1024 * 4096 * 2)
        self.assertEqual(e_fp8, 60 * 3 * (1024 * 4096 + 4 * 8 * 32))
        self.assertEqual(pe.fits(79e9), "H100, H200, GB200")
        self.assertEqual(pe.fits(141e9), "H200, GB200")
        self.assertEqual(pe.fits(200e9), "none")


class Prediction(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.paths = write_csvs(self.tmp.name)
        self.rows, self.copy, self.gemm = pe.read_bench_csv(self.paths)

    def tearDown(self):
        self.tmp.cleanup()

    def test_ceilings(self):
        self.assertAlmostEqual(self.copy, COPY, delta=1)
        self.assertAlmostEqual(self.gemm, GEMM, delta=1)

    def test_decode_ep8_by_hand(self):
        res = pe.predict(self.rows, COPY, GEMM, RATES, ("bf16",), (32,))
        self.assertEqual(res["missing"], [])
        r = res["decode"][8][0]
        # O = 2 x 300 - 500 = 100; whole model 100 + 15 (800 - 100) + 45 (1700 - 800) = 51100 us;
        # routed 60 ((1700 - 700) + (800 - 300)) / 3 = 30000 us; head 900 - 300 = 600 us.
        # Router fix, 60 x (512-column roofline - 64-column): bytes 512 x 4096 x 2 + 32 x 512 x 4
        # = 4259840 -> 1.06496 us (FLOPs 0.268 us); 64 columns: 532480 bytes -> 0.13312 us.
        router = 60 * (1.06496 - 0.13312)
        rest = 51100 - 30000 + router
        self.assertAlmostEqual(r["rest"] * 1e3, rest, places=6)
        self.assertAlmostEqual(r["routed"] * 1e3, 30000, places=6)
        self.assertAlmostEqual(r["head"] * 1e3, 600, places=6)
        self.assertEqual(r["head_src"], "measured (bf16)")
        # Dispatch: 32 tokens x 7 (1 - C(448,10)/C(512,10)) rows x 8192 bytes at 1e11 B/s + 10 us;
        # combine: 32 x 10 x 448/512 = 280 pairs x 8192 bytes at 2e11 + 5 us = 16.4688 us.
        d = 10 + 32 * 7 * (1 - hyper_miss(512, 64, 10)) * 8192 / 1e11 * 1e6
        c = 5 + 280 * 8192 / 2e11 * 1e6
        self.assertAlmostEqual(c, 16.4688, places=9)
        self.assertAlmostEqual(r["dc"] * 1e3, 60 * (d + c), places=6)
        step = rest + 30000 + 600 + 60 * (d + c)
        self.assertAlmostEqual(r["step"] * 1e3, step, places=6)
        self.assertAlmostEqual(r["tps"], 32 / (step * 1e-6), places=6)
        # NVL72: the same fixed costs, bytes at 900 GB/s.
        d72 = 10 + 32 * 7 * (1 - hyper_miss(512, 64, 10)) * 8192 / 9e11 * 1e6
        c72 = 5 + 280 * 8192 / 9e11 * 1e6
        self.assertAlmostEqual(r["dc72"] * 1e3, 60 * (d72 + c72), places=6)
        self.assertAlmostEqual(r["tps72"], 32 / ((rest + 30600 + 60 * (d72 + c72)) * 1e-6),
                               places=6)

    def test_decode_ep16_by_hand(self):
        res = pe.predict(self.rows, COPY, GEMM, RATES, ("bf16",), (32,))
        r = res["decode"][16][0]
        # 100 + 15 x 500 + 45 x 700 = 39100; routed 60 ((1300 - 700) + (600 - 300)) / 3 = 18000.
        # Router: 32 columns -> (262144 + 4096) bytes -> 0.06656 us.
        rest = 39100 - 18000 + 60 * (1.06496 - 0.06656)
        self.assertAlmostEqual(r["rest"] * 1e3, rest, places=6)
        self.assertAlmostEqual(r["routed"] * 1e3, 18000, places=6)
        d = 10 + 32 * 15 * (1 - hyper_miss(512, 32, 10)) * 8192 / 1e11 * 1e6
        c = 5 + 32 * 10 * (480 / 512) * 8192 / 2e11 * 1e6
        self.assertAlmostEqual(r["step"] * 1e3, rest + 18000 + 600 + 60 * (d + c), places=6)

    def test_negative_fixed_cost(self):
        rows = dict(self.rows)
        rows[("bf16_dbase_attn2", "decode_ctx2048", 32)] = 700  # 2 x 300 - 700 < 0
        pe.NOTES.clear()
        r = pe.predict(rows, COPY, GEMM, RATES, ("bf16",), (32,))["decode"][8][0]
        # O = 0: 15 x 800 + 45 x 900 = 52500.
        self.assertAlmostEqual(r["rest"] * 1e3, 52500 - 30000 + 60 * (1.06496 - 0.13312), places=6)
        self.assertEqual(len(pe.NOTES), 2)  # EP8 and EP16
        self.assertIn("-100.0 us < 0, taken as 0", pe.NOTES[0])
        pe.NOTES.clear()

    def test_head_computed_without_head_rows(self):
        rows = {k: v for k, v in self.rows.items() if not k[0].endswith("_head_attn")}
        r = pe.predict(rows, COPY, GEMM, RATES, ("bf16",), (32,))["decode"][8][0]
        # max(248320 x 4096 x 2 / 4e12, 2 x 32 x 248320 x 4096 / 5e14) = max(508.56, 130.19) us.
        self.assertAlmostEqual(r["head"] * 1e3, 248320 * 4096 * 2 / 4e12 * 1e6, places=6)
        self.assertEqual(r["head_src"], "computed")

    def test_prefill_by_hand(self):
        res = pe.predict(self.rows, COPY, GEMM, RATES, ("bf16",), (32,))
        r = res["prefill"][0]
        # k 2: 100 + 15 x 1900 + 45 x 2500 = 141100, routed 60 (2000 + 1000) / 3 = 60000;
        # k 3: 100 + 15 x 2300 + 45 x 2900 = 165100, routed 60 (2800 + 1400) / 3 = 84000.
        total, routed = (141100 + 165100) / 2, (60000 + 84000) / 2
        # Router fix: 512 columns 2 x 6000 x 4096 x 512 FLOP -> 50.331648 us, 128 -> 12.582912.
        rest = total - routed + 60 * (50.331648 - 12.582912)
        self.assertAlmostEqual(r["rest"] * 1e3, rest, places=6)
        self.assertAlmostEqual(r["routed"] * 1e3, 72000, places=6)
        head = 62080 * 4096 * 2 / 4e12 * 1e6  # vocab / 4 rows, memory-bound: 127.13984 us
        self.assertAlmostEqual(r["head"] * 1e3, head, places=6)
        busbw = 64 * 1048576 / ((238.60 - 3.99) * 1e-6)
        # 120 all-reduces of 6000 x 4096 bf16 + the fp32 logits row (248320 x 4 bytes).
        ar = 120 * (3.99 + 1.5 * 6000 * 4096 * 2 / busbw * 1e6) + (
            3.99 + 1.5 * 248320 * 4 / busbw * 1e6)
        self.assertAlmostEqual(r["ar"] * 1e3, ar, places=6)
        self.assertAlmostEqual(r["time"] * 1e3, rest + 72000 + head + ar, places=6)
        self.assertAlmostEqual(r["tps"], 6000 / ((rest + 72000 + head + ar) * 1e-6), places=6)
        ar72 = 120 * (3.99 + 1.5 * 6000 * 4096 * 2 / 9e11 * 1e6) + (
            3.99 + 1.5 * 248320 * 4 / 9e11 * 1e6)
        self.assertAlmostEqual(r["ar72"] * 1e3, ar72, places=6)

    def test_default_rates(self):
        r = pe.moe_rates_default()
        # 2 GPUs, top-8 of 128: 1 - C(64,8)/C(128,8) rows per token; 511 more tokens took
        # 49.9 - 11.6 us of dispatch.
        rows = 511 * (1 - hyper_miss(128, 64, 8))
        self.assertAlmostEqual(r["dispatch"][0], 11.6)
        self.assertAlmostEqual(r["dispatch"][1], rows * 8192 / (38.3e-6), delta=1)
        self.assertAlmostEqual(r["combine"][1], 511 * 4 * 8192 / (70.9e-6), delta=1)

    def test_moe_csv(self):
        p = os.path.join(self.tmp.name, "moe.csv")
        with open(p, "w") as f:
            f.write("T,H,dispatch_us,dispatch_nccl_us,combine_us,combine_nccl_us,step_us,"
                    "dispatch_fp8_us,dispatch_MiB,combine_MiB\n")
            f.write("1,2048,9,1,9,1,1,9,0.1,0.1\n")
            f.write("1,4096,10,1,8,1,1,11,0.0078125,0.03125\n")
            f.write("512,4096,50,1,72,1,1,31,4,16\n")
            f.write("prefill,4096x4096,dispatch 70,local 1,ours 2\n")
        r = pe.moe_rates_from_csv(p)
        self.assertEqual(r["dispatch"][0], 10)
        self.assertAlmostEqual(r["dispatch"][1], (4 - 0.0078125) * 1048576 / 40e-6, delta=1)
        self.assertAlmostEqual(r["combine"][1], (16 - 0.03125) * 1048576 / 64e-6, delta=1)
        self.assertAlmostEqual(r["dispatch_fp8"][1],
                               (4 - 0.0078125) * 1048576 * 4224 / 8192 / 20e-6, delta=1)


class Cli(unittest.TestCase):
    def run_cli(self, args):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = pe.main(args)
        return rc, buf.getvalue()

    def test_table_and_check(self):
        with tempfile.TemporaryDirectory() as d:
            paths = write_csvs(d)
            args = sum((["--csv", p] for p in paths), []) + ["--formats", "bf16", "--batches",
                                                             "32", "--check"]
            rc, out = self.run_cli(args)
            self.assertEqual(rc, 0, out)
            self.assertIn("### Decode, DP attention + EP8 (64 experts per rank)", out)
            self.assertIn("| bf16 | 32 | 21.16 | 30.00 | 0.60 (measured (bf16)) |", out)
            self.assertIn("| bf16 | 32 | 21.16 | 18.00 | 0.60 (measured (bf16)) |", out)  # EP16
            self.assertIn("| bf16 | 83.36 | 72.00 | 0.127 |", out)
            self.assertIn("measured (this run's D2D copy ceiling)", out)
            self.assertNotIn("Not computed", out)
            # Only the decode CSV: the prefill is missing -> --check fails, the tables print.
            rc, out = self.run_cli(["--csv", paths[0], "--formats", "bf16", "--batches", "32",
                                    "--check"])
            self.assertEqual(rc, 1)
            self.assertIn("prefill TP4 bf16: no row bf16_tp4k2_pair/prefill/6000", out)
            # Without --check a missing row is printed, not an error.
            rc, _ = self.run_cli(["--csv", paths[0], "--formats", "bf16", "--batches", "32"])
            self.assertEqual(rc, 0)
            # FP8 asked for, none measured: missing rows.
            rc, out = self.run_cli(["--csv", paths[0], "--csv", paths[1], "--batches", "32",
                                    "--check"])
            self.assertEqual(rc, 1)
            self.assertIn("decode EP8 fp8 B 32", out)


if __name__ == "__main__":
    unittest.main(verbosity=2)
