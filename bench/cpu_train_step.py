#!/usr/bin/env python3
"""Training-step throughput on a run's real packed batches (CPU): what stage 4 does per step, without
its loader, validation and checkpoints. Every step gets a new batch, as in training, so new matrix
shapes show their cost (synthetic benchmarks that repeat one batch hide it).

  python bench/cpu_train_step.py --work-dir runs/smollm2-135m --steps 60
  python bench/cpu_train_step.py --work-dir W --random-states   # only W/prepared/ needed (stage 1)
  python bench/cpu_train_step.py --work-dir W --draft-method dflash --block-size 8 --draft-layers 2

Prints seconds per step and tokens/s (median over the timed steps) and the mean loss, which must
not change between two versions of the code. To compare two versions, run this file from each
checkout (it uses only the draft/data modules both have).
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))  # the checkout whose code is measured
from common.drafts.eagle3 import DraftGeometry, Eagle3Draft, optimize_bf16  # noqa: E402
from common.drafts.losses import compile_loss, ttt_loss  # noqa: E402
from common.hidden_states import read_sample, sample_path, write_sample  # noqa: E402
from common.train_data import pack, PackedDataset, to_device  # noqa: E402

# train_throughput.GEOMETRIES["smollm2"]; not imported: that module puts its own checkout first on sys.path
SMOLLM2 = dict(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536, rms_norm_eps=1e-5,
               rope_theta=1e5, max_position_embeddings=8192, verifier_vocab_size=49152)


def random_states(prepared, samples, out):
    """Stage 1's records (lengths, loss masks) with random hidden states: the step's cost depends only on the
    shapes, so a machine without stage 2's files (or its disk) measures the same work."""
    gen = torch.Generator().manual_seed(0)
    meta = {"layer_ids": [2, 15, 27, 30], "hidden_size": SMOLLM2["hidden_size"]}
    with open(prepared / "tokenized_data.jsonl") as fh:
        for i, line in zip(range(samples), fh):
            r = json.loads(line)
            h = torch.randn(len(r["input_ids"]), 4, SMOLLM2["hidden_size"], generator=gen)
            write_sample(sample_path(out, i), h, torch.tensor(r["input_ids"]), torch.tensor(r["loss_mask"]), meta)
    return out


def batches(folder, tokens, n, samples, dtype, shift=1):
    lengths = {i: len(read_sample(sample_path(folder, i), torch.bfloat16)["token_ids"]) for i in range(samples)}
    bins = pack(list(lengths), lengths, tokens, 0, 0, shift=shift)
    if len(bins) < n:
        raise SystemExit(f"only {len(bins)} packed sequences from {samples} samples; raise --samples")
    ds = PackedDataset(folder, bins, tokens, shift=shift)
    return [to_device(ds[i], torch.device("cpu"), dtype) for i in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work-dir", required=True, help="a run whose hidden_states/ stage 2 wrote (SmolLM2 geometry)")
    ap.add_argument("--tokens", type=int, default=2048, help="--max-tokens-per-step")
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--samples", type=int, default=600, help="samples to pack the batches from")
    ap.add_argument("--no-compile", action="store_true", help="loss eager (04_train.py --no-compile)")
    ap.add_argument("--compile-layers", action="store_true", help="also compile the norms, SwiGLU and RoPE")
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast (04_train.py --amp off)")
    ap.add_argument("--intermediate-size", type=int, default=SMOLLM2["intermediate_size"],
                    help="the draft's MLP width (04_train.py --draft-intermediate-size)")
    ap.add_argument("--draft-norms", default="fc-norm", choices=("eagle3", "norm-before-fc", "fc-norm"),
                    help="as 04_train.py's (before 2026-12-02 this bench measured eagle3)")
    ap.add_argument("--draft-method", default="eagle3", choices=("eagle3", "dflash"))
    ap.add_argument("--block-size", type=int, default=16, help="DFlash (04_train.py --block-size)")
    ap.add_argument("--draft-layers", type=int, default=5, help="DFlash (04_train.py --draft-layers)")
    ap.add_argument("--max-anchors", type=int, default=512, help="DFlash (04_train.py --max-anchors)")
    ap.add_argument("--random-states", action="store_true",
                    help="random hidden states for W/prepared/'s records instead of W/hidden_states/")
    ap.add_argument("--profile", type=int, default=0, help="print the N costliest ops of the timed steps")
    args = ap.parse_args()
    if args.fp32 and args.compile_layers:
        ap.error("--compile-layers compiles what 04_train.py compiles on GPUs, under bf16 only: drop --fp32")
    work, dtype = Path(args.work_dir), torch.float32 if args.fp32 else torch.bfloat16
    with tempfile.TemporaryDirectory() as tmp:  # the batches are read into memory
        folder = random_states(work / "prepared", args.samples, Path(tmp)) if args.random_states \
            else work / "hidden_states"
        data = batches(folder, args.tokens, args.warmup + args.steps, args.samples, dtype,
                       0 if args.draft_method == "dflash" else 1)
    compile_loss(not args.no_compile)
    torch.manual_seed(0)
    if args.draft_method == "dflash":
        from common.drafts.dflash import DFlashDraft, DFlashGeometry
        model = DFlashDraft(DFlashGeometry(**dict(SMOLLM2, intermediate_size=args.intermediate_size),
                                           draft_vocab_size=args.draft_vocab, num_aux=3, num_layers=args.draft_layers,
                                           block_size=args.block_size, mask_token_id=0))
        step_loss = lambda m, b: m(b, args.max_anchors, generator=torch.Generator().manual_seed(len(times)))  # noqa: E731
        if not args.fp32:
            model.prepare_bf16()
    else:
        norms = dict(norm_before_fc=args.draft_norms == "norm-before-fc", fc_norm=args.draft_norms == "fc-norm",
                     norm_output=args.draft_norms != "eagle3")  # as common/build_draft.py maps them
        model = Eagle3Draft(DraftGeometry(**dict(SMOLLM2, intermediate_size=args.intermediate_size),
                                          draft_vocab_size=args.draft_vocab, **norms))
        step_loss = lambda m, b: ttt_loss(m, b, 3, 0.6)  # noqa: E731
        if not args.fp32:  # --compile-layers: as 04_train.py does on GPUs (bf16 only)
            optimize_bf16(model, args.compile_layers)
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=1e-3, betas=(0.9, 0.95))
    times, losses, tokens = [], [], []
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.profile else None
    for i, b in enumerate(data):
        if prof is not None and i == args.warmup:
            prof.__enter__()
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.fp32):
            loss, _ = step_loss(model, b)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.trainable_parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
            losses.append(loss.item())
            tokens.append(b["ids"].shape[0])
    if prof is not None:
        prof.__exit__(None, None, None)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile))
    sec = statistics.median(times)
    print(f"{args.steps} steps of {args.tokens} tokens: {sec:.3f} s/step median, "
          f"{sum(tokens) / sum(times):.0f} tokens/s, mean loss {sum(losses) / len(losses):.4f}")


if __name__ == "__main__":
    main()
