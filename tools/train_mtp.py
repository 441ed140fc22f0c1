#!/usr/bin/env python3
"""Train the MTP (multi-token prediction) draft layer of a Qwen3-MoE checkpoint, e.g. the demo.

    python3 tools/train_mtp.py --model models/demo --corpus build-demo/corpus/corpus.txt \
        --out models/demo [--minutes 3] [--device cuda]
    python3 tools/train_mtp.py --model DIR --synthetic-tokens 20000 --steps 5 --out /tmp/mtp \
        --device cpu                                                  # pipeline smoke test

The layer is Qwen3.5's published MTP layout, as Tandem loads it (src/model/qwen3_moe.h):
  x = mtp.fc([RMSNorm_e(embed(t+1)); RMSNorm_h(h_t)])   (mtp.pre_fc_norm_embedding / _hidden)
  y = mtp.layers.0(x)                                   (a Qwen3-MoE decoder layer)
  q = lm_head(mtp.norm(y))                              (embedding and lm_head: the target's)
where h_t is the target's final hidden state (after model.norm) at position t; q predicts the
token at t + 2. The target is frozen; the layer is trained by distillation (KL from the target's
own distribution at t + 1, the one the verify step compares against) plus the corpus token's
cross entropy, starting from the target's last decoder layer, fc = [0 | I]-ish.

The target forward is implemented here in plain torch (fp32 on the CPU, bf16 autocast on cuda);
with --check-golden (default on when golden.json exists) it must reproduce the checkpoint's
golden.json greedy tokens first, so the hidden states are the ones Tandem computes.

Output: when --out is the model directory and it has model.safetensors.index.json, the tensors
go to OUT/model-mtp.safetensors and the index's weight_map lists them (the checkpoint then has its
own mtp.* tensors: --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'); else
OUT/model.safetensors (+ config.json) is a separate MTP directory ("model": OUT). bf16 unless
--dtype f32. Also OUT/mtp_train.json: steps, tokens, losses and the measured top-1 agreement
(the greedy acceptance rate of the first draft) on held-out windows.

Needs torch (>= 1.13) and, for --corpus, the `tokenizers` package (the model's tokenizer.json).
No network access.
"""
import argparse
import json
import math
import os
import random
import struct
import sys
import time

import torch
import torch.nn.functional as F

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def log(msg):
    print(f"[train_mtp] {msg}", flush=True)


# ---- safetensors (the format is small enough to read and write here) -----------------------

def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        dt = DTYPES.get(info["dtype"])
        if dt is None:
            raise SystemExit(f"{path}: tensor {name}: dtype {info['dtype']} not supported here")
        t = torch.frombuffer(bytearray(data[b:e]), dtype=dt) if e > b else torch.empty(0, dtype=dt)
        out[name] = t.reshape(info["shape"]).float()
    return out


def read_checkpoint(d):
    index = os.path.join(d, "model.safetensors.index.json")
    files = []
    if os.path.exists(os.path.join(d, "model.safetensors")):
        files = ["model.safetensors"]
    elif os.path.exists(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    w = {}
    for f in files:
        w.update(read_safetensors(os.path.join(d, f)))
    return w


def write_safetensors(path, tensors, dtype):
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        if dtype == "bf16":
            raw = t.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
            dt = "BF16"
        else:
            raw = t.to(torch.float32).numpy().tobytes()
            dt = "F32"
        header[name] = {"dtype": dt, "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    return off


# ---- the model (Qwen3-MoE, as src/model/qwen3_moe.cpp computes it) ------------------------

class Cfg:
    def __init__(self, c):
        c = c.get("text_config", c)
        self.h = c["hidden_size"]
        self.layers = c["num_hidden_layers"]
        self.qh = c["num_attention_heads"]
        self.kvh = c["num_key_value_heads"]
        self.d = c.get("head_dim") or self.h // self.qh
        self.eps = c.get("rms_norm_eps", 1e-6)
        rp = c.get("rope_parameters") or {}
        self.theta = c.get("rope_theta") or rp.get("rope_theta", 1e6)
        self.vocab = c["vocab_size"]
        self.experts = c.get("num_experts") or 0
        self.topk = c.get("num_experts_per_tok") or 0
        self.moe_inter = c.get("moe_intermediate_size") or 0
        self.inter = c.get("intermediate_size") or 0
        self.norm_topk = c.get("norm_topk_prob", True)
        self.mlp_only = set(c.get("mlp_only_layers") or [])
        self.sparse_step = c.get("decoder_sparse_step") or 1
        self.tie = c.get("tie_word_embeddings", False)
        if c.get("model_type") not in (None, "qwen3_moe"):
            raise SystemExit(f"model_type {c.get('model_type')}: this tool trains Qwen3-MoE MTP layers")

    def is_moe(self, l):
        return self.experts > 0 and l not in self.mlp_only and (l + 1) % self.sparse_step == 0


def rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def rope(x, pos, theta):  # x [B, T, H, d], rotate-half
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    f = pos.float()[:, None] * inv[None, :]  # [T, d/2]
    cos = torch.cat([f.cos(), f.cos()], -1)[None, :, None, :]
    sin = torch.cat([f.sin(), f.sin()], -1)[None, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rot = torch.cat([-x2, x1], -1)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


def causal_attention(q, k, v):  # q [B, H, T, d], k / v [B, H, S, d] (S >= T: the last T are q's)
    T, S = q.shape[-2], k.shape[-2]
    if hasattr(F, "scaled_dot_product_attention") and T == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if hasattr(F, "scaled_dot_product_attention") and T == 1:
        return F.scaled_dot_product_attention(q, k, v)  # one query sees every cached key
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])  # torch < 2.0
    mask = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(S - T + 1)
    s = s.masked_fill(mask, float("-inf"))
    return (torch.softmax(s, -1) @ v.float()).to(q.dtype)


def decoder_layer(p, pre, x, cfg, moe, cache=None, pos0=0):
    """One Qwen3-MoE decoder layer; p maps names (without `pre`) to tensors. With `cache` (a
    dict kept per layer), x holds the tokens at positions pos0.. and the keys / values of the
    earlier positions come from (and the new ones go to) the cache."""
    B, T, H = x.shape
    g = lambda n: p[pre + n]
    xn = rms_norm(x, g("input_layernorm.weight"), cfg.eps)
    q = (xn @ g("self_attn.q_proj.weight").t()).view(B, T, cfg.qh, cfg.d)
    k = (xn @ g("self_attn.k_proj.weight").t()).view(B, T, cfg.kvh, cfg.d)
    v = (xn @ g("self_attn.v_proj.weight").t()).view(B, T, cfg.kvh, cfg.d)
    q = rms_norm(q, g("self_attn.q_norm.weight"), cfg.eps)
    k = rms_norm(k, g("self_attn.k_norm.weight"), cfg.eps)
    pos = torch.arange(T, device=x.device) + pos0
    q, k = rope(q, pos, cfg.theta), rope(k, pos, cfg.theta)
    if cache is not None:
        if "k" in cache:
            k = torch.cat([cache["k"], k], 1)
            v = torch.cat([cache["v"], v], 1)
        cache["k"], cache["v"] = k, v
    rep = cfg.qh // cfg.kvh
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    a = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    a = a.transpose(1, 2).reshape(B, T, cfg.qh * cfg.d)
    x = x + a @ g("self_attn.o_proj.weight").t()
    xn = rms_norm(x, g("post_attention_layernorm.weight"), cfg.eps)
    if moe:
        flat = xn.reshape(-1, H)
        probs = torch.softmax((flat @ g("mlp.gate.weight").t()).float(), -1)
        w, idx = probs.topk(cfg.topk, -1)
        if cfg.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        y = torch.zeros_like(flat)
        for e in range(cfg.experts):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            ep = f"mlp.experts.{e}."
            xe = flat[rows]
            he = F.silu(xe @ g(ep + "gate_proj.weight").t()) * (xe @ g(ep + "up_proj.weight").t())
            y.index_add_(0, rows, (he @ g(ep + "down_proj.weight").t()) * w[rows, slot, None].to(y.dtype))
        y = y.view(B, T, H)
    else:
        y = (F.silu(xn @ g("mlp.gate_proj.weight").t()) * (xn @ g("mlp.up_proj.weight").t())) @ \
            g("mlp.down_proj.weight").t()
    return x + y


def lm_head(p, cfg):
    return p["model.embed_tokens.weight"] if cfg.tie else p["lm_head.weight"]


def target_hidden(p, ids, cfg):
    """The final hidden states after model.norm, [B, T, H]."""
    x = p["model.embed_tokens.weight"][ids]
    for l in range(cfg.layers):
        x = decoder_layer(p, f"model.layers.{l}.", x, cfg, cfg.is_moe(l))
    return rms_norm(x, p["model.norm.weight"], cfg.eps)


def target_step(p, tok, cfg, cache, pos):
    """The final hidden state (after model.norm) of one new token per sequence, tok [B] at
    position pos, with the keys / values of the earlier positions in `cache` ({layer: dict})."""
    x = p["model.embed_tokens.weight"][tok][:, None]
    for l in range(cfg.layers):
        x = decoder_layer(p, f"model.layers.{l}.", x, cfg, cfg.is_moe(l), cache.setdefault(l, {}), pos)
    return rms_norm(x, p["model.norm.weight"], cfg.eps)[:, -1]


def mtp_forward(p, m, ids_next, hidden, cfg):
    """MTP hidden after mtp.norm for inputs (t + 1, h_t), [B, T, H]."""
    e = rms_norm(p["model.embed_tokens.weight"][ids_next], m["mtp.pre_fc_norm_embedding.weight"], cfg.eps)
    hn = rms_norm(hidden, m["mtp.pre_fc_norm_hidden.weight"], cfg.eps)
    x = torch.cat([e, hn], -1) @ m["mtp.fc.weight"].t()
    x = decoder_layer(m, "mtp.layers.0.", x, cfg, "mtp.layers.0.mlp.gate.weight" in m)
    return rms_norm(x, m["mtp.norm.weight"], cfg.eps)


def init_mtp(p, cfg, seed):
    """The target's last decoder layer, fc = [eps noise | I], norms from the target."""
    gen = torch.Generator().manual_seed(seed)
    last = f"model.layers.{cfg.layers - 1}."
    m = {}
    for name, t in p.items():
        if name.startswith(last):
            m["mtp.layers.0." + name[len(last):]] = t.clone()
    fc = torch.randn(cfg.h, 2 * cfg.h, generator=gen) * 0.02
    fc[:, cfg.h:] += torch.eye(cfg.h)
    m["mtp.fc.weight"] = fc
    m["mtp.pre_fc_norm_embedding.weight"] = torch.ones(cfg.h)
    m["mtp.pre_fc_norm_hidden.weight"] = torch.ones(cfg.h)
    m["mtp.norm.weight"] = p["model.norm.weight"].clone()
    return m


# ---- data ---------------------------------------------------------------------------------

def corpus_tokens(model_dir, corpus, max_chars):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise SystemExit("--corpus needs the `tokenizers` package (or use --synthetic-tokens)")
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    text = open(corpus, encoding="utf-8").read()
    if max_chars > 0:
        text = text[:max_chars]
    ids = []
    for doc in text.split("\n\n\n"):
        ids.extend(tok.encode(doc).ids)
        eot = tok.token_to_id("<|endoftext|>")
        if eot is not None:
            ids.append(eot)
    return ids


def self_generate(p, cfg, n_tokens, T, temperatures, dev, seed, batch, max_seconds=0.0):
    """Text sampled from the target itself (windows of T tokens from random first tokens): the
    distribution the drafts are verified against, no corpus or tokenizer needed. The batches
    cycle through `temperatures` (0: greedy, the continuations a greedy request verifies)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dgen = torch.Generator(device=dev).manual_seed(seed)  # sampling where the logits are
    out, B, i = [], max(1, min(batch, -(-n_tokens // T))), 0
    auto = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else None
    t0 = time.time()
    while sum(len(x) for x in out) < n_tokens:
        if max_seconds > 0 and out and time.time() - t0 > max_seconds:
            break  # the time cap: what was generated so far
        temperature = temperatures[i % len(temperatures)]
        i += 1
        seq = torch.randint(0, cfg.vocab, (B, 1), generator=gen).to(dev)
        cache = {}  # one token per step against the cached keys / values
        with torch.no_grad():
            for t in range(T - 1):
                if auto:
                    with auto:
                        h = target_step(p, seq[:, -1], cfg, cache, t).float()
                else:
                    h = target_step(p, seq[:, -1], cfg, cache, t).float()
                logits = h @ lm_head(p, cfg).t().float()
                if temperature <= 0:
                    nxt = logits.argmax(-1, keepdim=True)
                else:
                    probs = torch.softmax(logits / temperature, -1)
                    nxt = torch.multinomial(probs, 1, generator=dgen)
                seq = torch.cat([seq, nxt], 1)
        out.extend(seq.tolist())
    return [t for row in out for t in row][:n_tokens]


def agreement_on(p, m, cfg, ids, start):
    """Top-1 agreement of the MTP draft (from h_t, token t+1) with the target's argmax at t+1,
    over t >= start - 1: what a greedy K = 1 verify accepts."""
    x = torch.tensor([ids], device=next(iter(p.values())).device)
    with torch.no_grad():
        h = target_hidden(p, x, cfg).float()
        t = (h[:, 1:-1] @ lm_head(p, cfg).t().float()).argmax(-1)
        o = mtp_forward(p, m, x[:, 1:-1], h[:, :-2], cfg).float()
        q = (o @ lm_head(p, cfg).t().float()).argmax(-1)
    a = max(0, start - 1)
    return (q[0, a:] == t[0, a:]).float().mean().item()


def check_golden(p, cfg, model_dir, dev):
    path = os.path.join(model_dir, "golden.json")
    if not os.path.exists(path):
        return
    g = json.load(open(path))
    for case in g["cases"][:2]:
        ids = list(case["prompt_ids"])
        want = case["output_ids"][: min(8, len(case["output_ids"]))]
        got = []
        for _ in want:
            with torch.no_grad():
                h = target_hidden(p, torch.tensor([ids], device=dev), cfg)
                nxt = int((h[0, -1] @ lm_head(p, cfg).t()).argmax())
            got.append(nxt)
            ids.append(nxt)
        if got != want:
            raise SystemExit(f"{path}: this tool's target forward gives {got}, golden.json {want}")
    log("target forward reproduces golden.json")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="target checkpoint (Qwen3-MoE)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--corpus", help="training text (tokenized with the model's tokenizer.json)")
    ap.add_argument("--synthetic-tokens", type=int, default=0, help="random tokens instead (tests)")
    ap.add_argument("--self-generate", type=int, default=0,
                    help="train on this many tokens sampled from the target itself (no corpus)")
    ap.add_argument("--gen-temperature", default="1.0",
                    help="sampling temperature(s) of --self-generate, comma-separated, cycled per "
                         "batch (0: greedy)")
    ap.add_argument("--gen-batch", type=int, default=512, help="sequences generated at once")
    ap.add_argument("--gen-minutes", type=float, default=0.0,
                    help="stop generating after this long (0: when --self-generate tokens are made)")
    ap.add_argument("--eval-every", type=int, default=100,
                    help="held-out agreement every this many steps; the best state is kept")
    ap.add_argument("--eval-ids", default="",
                    help="comma-separated ids (prompt then a greedy continuation): print the "
                         "greedy K = 1 agreement on them after training (bf16-rounded weights)")
    ap.add_argument("--eval-prompt-len", type=int, default=1)
    ap.add_argument("--max-corpus-chars", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: --minutes)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--distill", type=float, default=0.8, help="weight of the KL term (rest: CE)")
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-check-golden", action="store_true")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    dev = torch.device(args.device)
    cfg = Cfg(json.load(open(os.path.join(args.model, "config.json"))))
    p = {k: v.to(dev) for k, v in read_checkpoint(args.model).items() if not k.startswith("mtp.")}
    log(f"target {args.model}: hidden {cfg.h}, {cfg.layers} layers, vocab {cfg.vocab}, device {dev}")
    if not args.no_check_golden:
        check_golden(p, cfg, args.model, dev)

    if args.synthetic_tokens > 0:
        ids = torch.randint(0, cfg.vocab, (args.synthetic_tokens,)).tolist()
    elif args.self_generate > 0:
        t0 = time.time()
        temps = [float(x) for x in str(args.gen_temperature).split(",") if x]
        ids = self_generate(p, cfg, args.self_generate, args.seq_len, temps, dev, args.seed,
                            args.gen_batch, 60.0 * args.gen_minutes)
        log(f"generated {len(ids)} tokens from the target in {time.time() - t0:.1f} s")
    elif args.corpus:
        ids = corpus_tokens(args.model, args.corpus, args.max_corpus_chars)
    else:
        raise SystemExit("give --corpus FILE, --self-generate N or --synthetic-tokens N")
    T = min(args.seq_len, len(ids) // 4)
    data = torch.tensor(ids, dtype=torch.long, device=dev)
    held = data[-max(T * 8, len(ids) // 20):]  # held-out tail for the agreement figure
    train = data[: len(data) - len(held)]
    log(f"{len(ids)} tokens ({len(train)} train, {len(held)} held out), windows of {T}")

    m = {k: v.to(dev).requires_grad_(True) for k, v in init_mtp(p, cfg, args.seed).items()}
    opt = torch.optim.AdamW(list(m.values()), lr=args.lr, weight_decay=0.0)
    auto = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else None

    def losses(win):
        with torch.no_grad():
            if auto:
                with auto:
                    h = target_hidden(p, win, cfg)
            else:
                h = target_hidden(p, win, cfg)
            h = h.float()
            tlogits = (h[:, 1:-1] @ lm_head(p, cfg).t()).float()  # target at t+1: predicts t+2
        if auto:
            with auto:
                o = mtp_forward(p, m, win[:, 1:-1], h[:, :-2], cfg)
        else:
            o = mtp_forward(p, m, win[:, 1:-1], h[:, :-2], cfg)
        q = (o.float() @ lm_head(p, cfg).t().float())
        ce = F.cross_entropy(q.reshape(-1, cfg.vocab), win[:, 2:].reshape(-1))
        kl = F.kl_div(F.log_softmax(q, -1).reshape(-1, cfg.vocab),
                      F.log_softmax(tlogits, -1).reshape(-1, cfg.vocab), log_target=True,
                      reduction="batchmean")
        agree = (q.argmax(-1) == tlogits.argmax(-1)).float().mean()
        return ce, kl, agree

    def batch(src, n):
        starts = torch.randint(0, len(src) - T - 1, (n,), device=dev)
        return src[starts[:, None] + torch.arange(T, device=dev)[None, :]]

    def held_agreement():
        g = torch.Generator(device="cpu").manual_seed(args.seed + 1)  # the same windows each time
        starts = torch.randint(0, len(held) - T - 1, (64,), generator=g).to(dev)
        wins = held[starts[:, None] + torch.arange(T, device=dev)[None, :]]
        with torch.no_grad():
            return sum(losses(wins[i:i + 16])[2].item() for i in range(0, 64, 16)) / 4

    t0 = time.time()
    budget = args.minutes * 60
    step, seen, hist = 0, 0, []
    best = (-1.0, 0, None)  # held-out agreement, step, state
    while True:
        if args.steps and step >= args.steps:
            break
        if not args.steps and time.time() - t0 >= budget:
            break
        frac = (time.time() - t0) / budget if not args.steps else step / args.steps
        for g in opt.param_groups:
            g["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
        ce, kl, agree = losses(batch(train, args.batch))
        loss = args.distill * kl + (1 - args.distill) * ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(m.values()), 1.0)
        opt.step()
        step += 1
        seen += args.batch * T
        if step % 50 == 1 or args.steps:
            log(f"step {step}: ce {ce.item():.3f} kl {kl.item():.3f} agree {agree.item():.3f}")
            hist.append({"step": step, "ce": ce.item(), "kl": kl.item(), "agree": agree.item()})
        if args.eval_every > 0 and step % args.eval_every == 0:
            a = held_agreement()
            hist.append({"step": step, "held_out_agree": a})
            if a > best[0]:
                best = (a, step, {k: v.detach().clone() for k, v in m.items()})

    # The best state by held-out agreement (training longer than the data supports memorises
    # the training windows: the training agreement keeps rising while the held-out one falls).
    final = held_agreement()
    if best[2] is not None and best[0] > final:
        log(f"keeping step {best[1]}'s state (held-out {best[0]:.3f} > final {final:.3f})")
        with torch.no_grad():
            for k in m:
                m[k].copy_(best[2][k])
    agreement = max(final, best[0])
    log(f"held-out top-1 agreement with the target (first-draft greedy acceptance): {agreement:.3f}")

    if args.eval_ids:
        ids_e = [int(x) for x in args.eval_ids.split(",") if x]
        rounded = {k: v.detach().to(torch.bfloat16).float() if args.dtype == "bf16" else v.detach()
                   for k, v in m.items()}
        log(f"agreement on --eval-ids: {agreement_on(p, rounded, cfg, ids_e, args.eval_prompt_len):.3f}")

    os.makedirs(args.out, exist_ok=True)
    same = os.path.abspath(args.out) == os.path.abspath(args.model)
    index = os.path.join(args.out, "model.safetensors.index.json")
    tensors = {k: v.detach() for k, v in m.items()}
    if same and os.path.exists(index):
        fname = "model-mtp.safetensors"
        size = write_safetensors(os.path.join(args.out, fname), tensors, args.dtype)
        idx = json.load(open(index))
        wm = {k: v for k, v in idx["weight_map"].items() if not k.startswith("mtp.")}
        wm.update({k: fname for k in tensors})
        idx["weight_map"] = dict(sorted(wm.items()))
        json.dump(idx, open(index, "w"), indent=2)
        log(f"wrote {args.out}/{fname} ({size} bytes) and added mtp.* to {index}")
    elif same:
        raise SystemExit(f"{args.out}: a single-file checkpoint; write the MTP layer to its own "
                         "directory (--out DIR, then \"model\": DIR in --speculative-config)")
    else:
        size = write_safetensors(os.path.join(args.out, "model.safetensors"), tensors, args.dtype)
        with open(os.path.join(args.model, "config.json")) as f, \
                open(os.path.join(args.out, "config.json"), "w") as g:
            g.write(f.read())
        log(f"wrote {args.out}/model.safetensors ({size} bytes): \"model\": \"{args.out}\"")
    json.dump({"steps": step, "tokens": seen, "seconds": round(time.time() - t0, 1),
               "seq_len": T, "batch": args.batch, "held_out_agreement": agreement,
               "history": hist}, open(os.path.join(args.out, "mtp_train.json"), "w"), indent=2)


if __name__ == "__main__":
    sys.exit(main())
