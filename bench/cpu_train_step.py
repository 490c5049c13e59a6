#!/usr/bin/env python3
"""Training-step throughput on a run's real packed batches (CPU): what stage 4 does per step, without
its loader, validation and checkpoints. Every step gets a new batch, as in training, so new matrix
shapes show their cost (synthetic benchmarks that repeat one batch hide it).

  python bench/cpu_train_step.py --work-dir runs/smollm2-135m --steps 60
  python bench/cpu_train_step.py --work-dir W --random-states   # only W/prepared/ needed (stage 1)
  python bench/cpu_train_step.py --work-dir W --draft-method dflash --block-size 8 --draft-layers 2
  python bench/cpu_train_step.py --work-dir W --random-states --optimizer adamw --lr 0.001   # against the default's Muon

Every option besides the bench's own is 04_train.py's (the draft method and its options, --max-tokens-per-step,
--draft-vocab-size, --optimizer and --lr, --amp off for fp32, --no-compile for the eager loss), read over configs/smollm2-135m.yaml
unless --config names another; the draft is built through the method registry, as stage 4 builds it.

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
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path.cwd()))  # the checkout whose code is measured
from common.config import parse_config  # noqa: E402
from common.build_draft import geometry  # noqa: E402
from common.drafts import method_of  # noqa: E402
from common.drafts.losses import compile_loss  # noqa: E402
from common.optim import build_optimizer  # noqa: E402
from common.precision import use_bf16  # noqa: E402
from common.hidden_states import read_sample, sample_path, write_sample  # noqa: E402
from common.train_data import pack, PackedDataset, to_device  # noqa: E402

# SmolLM2-135M's text config, the fields a draft's geometry takes from it (no model load for a bench)
SMOLLM2_TEXT = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                               intermediate_size=1536, rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=8192,
                               vocab_size=49152)


def random_states(prepared, samples, out):
    """Stage 1's records (lengths, loss masks) with random hidden states: the step's cost depends only on the
    shapes, so a machine without stage 2's files (or its disk) measures the same work."""
    gen = torch.Generator().manual_seed(0)
    meta = {"layer_ids": [2, 15, 27, 30], "hidden_size": SMOLLM2_TEXT.hidden_size}
    with open(prepared / "tokenized_data.jsonl") as fh:
        for i, line in zip(range(samples), fh):
            r = json.loads(line)
            h = torch.randn(len(r["input_ids"]), 4, SMOLLM2_TEXT.hidden_size, generator=gen)
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
    ap = argparse.ArgumentParser(usage="%(prog)s --work-dir W [bench options] [04_train.py options]")
    ap.add_argument("--work-dir", required=True, help="a run whose hidden_states/ stage 2 wrote (SmolLM2 geometry)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--samples", type=int, default=600, help="samples to pack the batches from")
    ap.add_argument("--random-states", action="store_true",
                    help="random hidden states for W/prepared/'s records instead of W/hidden_states/")
    ap.add_argument("--profile", type=int, default=0, help="print the N costliest ops of the timed steps")
    args, stage4 = ap.parse_known_args()
    if "--config" not in stage4:  # the embedded default's recipe unless told otherwise
        stage4 = ["--config", "configs/smollm2-135m.yaml", *stage4]
    cfg = parse_config(4, "bench", [*stage4, "--work-dir", args.work_dir])
    m = method_of(cfg)  # the draft method, its geometry, model and loss arguments, as stage 4 looks them up
    work, fp32 = Path(args.work_dir), not use_bf16(torch.device("cpu"), cfg.amp)  # --amp auto: this CPU's probe
    dtype = torch.float32 if fp32 else torch.bfloat16
    with tempfile.TemporaryDirectory() as tmp:  # the batches are read into memory
        folder = random_states(work / "prepared", args.samples, Path(tmp)) if args.random_states \
            else work / "hidden_states"
        data = batches(folder, cfg.max_tokens_per_step, args.warmup + args.steps, args.samples, dtype, m.shift)
    compile_loss(cfg.compile)
    torch.manual_seed(0)
    no_mask = SimpleNamespace(mask_token_id=0, mask_token="<mask>")  # DFlash: any id serves the bench
    g = geometry(cfg, SMOLLM2_TEXT, cfg.draft_vocab_size, 3, lambda: no_mask)
    model = m.model(g)
    if not fp32:
        m.prepare_bf16(model, cfg, torch.device("cpu"))
    loss_args = m.loss_args(cfg)
    opt = build_optimizer(model, cfg, torch.device("cpu"), bf16=not fp32)  # --optimizer, --lr: as stage 4 builds it
    times, losses, tokens = [], [], []
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.profile else None
    for i, b in enumerate(data):
        if prof is not None and i == args.warmup:
            prof.__enter__()
        torch.manual_seed(i)  # the same random draws (DFlash's anchors) in every version of the code
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not fp32):
            loss, _ = model(b, *loss_args)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.trainable_parameters(), cfg.grad_clip)
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
    print(f"{m.note(g, cfg)}, {cfg.optimizer}: {args.steps} steps of {cfg.max_tokens_per_step} tokens: {sec:.3f} s/step median, "
          f"{sum(tokens) / sum(times):.0f} tokens/s, mean loss {sum(losses) / len(losses):.4f}")


if __name__ == "__main__":
    main()
