#!/usr/bin/env python3
"""Training-step throughput: our draft step versus speculators 0.9.0's Eagle3DraftModel, same inputs.

Synthetic but realistic packed batches: documents of 200..2048 tokens, ~60% loss mask, random
(never zero) hidden states. Times forward + backward + AdamW step, median of --steps after
--warmup, synchronised on CUDA. Prints one table and writes JSON.

  python bench/train_throughput.py --geometry smollm2 --tokens 2048 --draft-vocab 4096      # CPU
  python bench/train_throughput.py --geometry kimi --tokens 8192 --device cuda               # one H200
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.draft import DraftGeometry, Eagle3Draft, ttt_loss  # noqa: E402

GEOMETRIES = {
    "smollm2": dict(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
                    rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=8192, verifier_vocab_size=49152),
    "kimi": dict(hidden_size=7168, num_heads=64, num_kv_heads=64, head_dim=128, intermediate_size=18432,
                 rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=262144, verifier_vocab_size=163840),
}


def make_batch(T, g, device, seed):
    gen = torch.Generator().manual_seed(seed)
    docs, a = [], 0
    while a < T:
        n = min(int(torch.randint(200, 2049, (1,), generator=gen)), T - a)
        docs.append((a, a + n))
        a += n
    return {"aux": torch.randn(T, 3 * g.hidden_size, generator=gen).to(device),
            "ids": torch.randint(0, g.verifier_vocab_size, (T,), generator=gen).to(device),
            "target_hidden": torch.randn(T, g.hidden_size, generator=gen).to(device),
            "loss_mask": (torch.rand(T, generator=gen) < 0.6).long().to(device),
            "doc": torch.cat([torch.full((b - a,), j) for j, (a, b) in enumerate(docs)]).to(device),
            "pos": torch.cat([torch.arange(1, b - a + 1) for a, b in docs]).to(device), "docs": docs}


def timed(step, n_warm, n, device):
    for _ in range(n_warm):
        step()
    times = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def ours(g, batch, device, args):
    model = Eagle3Draft(g).to(device)
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=1e-4, fused=device.type == "cuda")
    ctx = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)

    def step():
        with ctx:
            loss, _ = ttt_loss(model, batch, args.ttt, 0.8)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def speculators_step(g, batch, device, args):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig
    tl = LlamaConfig(vocab_size=g.verifier_vocab_size, hidden_size=g.hidden_size, intermediate_size=g.intermediate_size,
                     num_hidden_layers=1, num_attention_heads=g.num_heads, num_key_value_heads=g.num_kv_heads,
                     head_dim=g.head_dim, rms_norm_eps=g.rms_norm_eps, rope_theta=g.rope_theta)
    tl._attn_implementation = "simple_flex_attention" if device.type == "cuda" else "sdpa"
    conf = Eagle3SpeculatorConfig(transformer_layer_config=tl, draft_vocab_size=g.draft_vocab_size,
                                  norm_before_residual=True, eagle_aux_hidden_state_layer_ids=[1, 2, 3],
                                  speculators_config=SpeculatorsConfig(
                                      algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig()],
                                      default_proposal_method="greedy",
                                      verifier=VerifierConfig(name_or_path=None, architectures=[])))
    model = Eagle3DraftModel(conf).to(device)
    with torch.no_grad():
        for p in model.parameters():
            if p.isnan().any():
                p.normal_(0, 0.02)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                            fused=device.type == "cuda")
    loss_cfg = resolve_loss_config("kl_div", "eager")  # its fused loss is Triton/GPU only
    ctx = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    kw = dict(hidden_states=batch["aux"][None], input_ids=batch["ids"][None], document_ids=batch["doc"][None],
              loss_mask=batch["loss_mask"][None].bool(), position_ids=batch["pos"][None],
              verifier_last_hidden_states=batch["target_hidden"][None], ttt_steps=args.ttt,
              ttt_step_loss_decay=0.8, loss_config=loss_cfg)

    def step():
        with ctx:
            _, loss, _ = model(**kw)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", choices=GEOMETRIES, default="smollm2")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048])
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--skip-speculators", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    device = torch.device(args.device)
    g = DraftGeometry(**GEOMETRIES[args.geometry], draft_vocab_size=args.draft_vocab)
    rows = []
    for T in args.tokens:
        batch = make_batch(T, g, device, seed=T)
        impls = [("ours", ours)] + ([] if args.skip_speculators else [("speculators 0.9.0", speculators_step)])
        for name, make in impls:
            torch.manual_seed(0)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            step = make(g, batch, device, args)
            sec = timed(step, args.warmup, args.steps, device)
            mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            rows.append({"impl": name, "tokens": T, "step_s": round(sec, 4), "tokens_per_s": round(T / sec, 1),
                         "peak_gib": round(mem, 2)})
            print(f"{name:18s} T={T:6d}  {sec:8.3f} s/step  {T / sec:10.1f} tokens/s  peak {mem:.2f} GiB", flush=True)
            del step
    base = {r["tokens"]: r["tokens_per_s"] for r in rows if r["impl"] != "ours"}
    for r in rows:
        if r["impl"] == "ours" and r["tokens"] in base:
            print(f"T={r['tokens']}: ours / speculators = {r['tokens_per_s'] / base[r['tokens']]:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"geometry": args.geometry, "device": str(device),
                                               "draft_vocab": args.draft_vocab, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
