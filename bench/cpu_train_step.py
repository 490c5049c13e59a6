#!/usr/bin/env python3
"""Training-step throughput on a run's real packed batches (CPU): what stage 4 does per step, without
its loader, validation and checkpoints. Every step gets a new batch, as in training, so new matrix
shapes show their cost (synthetic benchmarks that repeat one batch hide it).

  python bench/cpu_train_step.py --work-dir runs/smollm2-135m --steps 60

Prints seconds per step and tokens/s (median over the timed steps) and the mean loss, which must
not change between two versions of the code. To compare two versions, run this file from each
checkout (it uses only the draft/data modules both have).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))  # the checkout whose code is measured
from common import draft  # noqa: E402
from common.draft import DraftGeometry, Eagle3Draft, optimize_bf16, ttt_loss  # noqa: E402
from common.hidden_states import read_sample, sample_path  # noqa: E402
from common.train_data import pack, PackedDataset, to_device  # noqa: E402

# train_throughput.GEOMETRIES["smollm2"]; not imported: that module puts its own checkout first on sys.path
SMOLLM2 = dict(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536, rms_norm_eps=1e-5,
               rope_theta=1e5, max_position_embeddings=8192, verifier_vocab_size=49152)


def batches(folder, tokens, n, samples):
    lengths = {i: len(read_sample(sample_path(folder, i), torch.bfloat16)["token_ids"]) for i in range(samples)}
    bins = pack(list(lengths), lengths, tokens, 0, 0)
    if len(bins) < n:
        raise SystemExit(f"only {len(bins)} packed sequences from {samples} samples; raise --samples")
    ds = PackedDataset(folder, bins, tokens)
    return [to_device(ds[i], torch.device("cpu"), torch.bfloat16) for i in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work-dir", required=True, help="a run whose hidden_states/ stage 2 wrote (SmolLM2 geometry)")
    ap.add_argument("--tokens", type=int, default=2048, help="--max-tokens-per-step")
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--samples", type=int, default=600, help="samples to pack the batches from")
    ap.add_argument("--no-compile", action="store_true", help="loss eager (04_train.py --no-compile)")
    args = ap.parse_args()
    data = batches(Path(args.work_dir) / "hidden_states", args.tokens, args.warmup + args.steps, args.samples)
    if hasattr(draft, "compile_loss"):
        draft.compile_loss(not args.no_compile)
    torch.manual_seed(0)
    model = optimize_bf16(Eagle3Draft(DraftGeometry(**SMOLLM2, draft_vocab_size=args.draft_vocab)), False)
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=1e-3, betas=(0.9, 0.95))
    times, losses, tokens = [], [], []
    for i, b in enumerate(data):
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = ttt_loss(model, b, 3, 0.6)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.trainable_parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
            losses.append(loss.item())
            tokens.append(b["ids"].shape[0])
    sec = statistics.median(times)
    print(f"{args.steps} steps of {args.tokens} tokens: {sec:.3f} s/step median, "
          f"{sum(tokens) / sum(times):.0f} tokens/s, mean loss {sum(losses) / len(losses):.4f}")


if __name__ == "__main__":
    main()
