#!/usr/bin/env python3
"""Stage 4: train the draft (EAGLE-3, or DFlash with --draft-method dflash) on the extracted hidden states and
export it for vLLM.

Reads <work-dir>/hidden_states/, vocab/ and prepared/; writes <work-dir>/train/ (checkpoints,
metrics.jsonl, curves.png, manifest.json) and the servable draft in <work-dir>/final_draft/.
Re-running the same command resumes from the latest checkpoint. Several GPUs:
  torchrun --nproc_per_node 8 04_train.py --config C   (DDP; gloo on CPU)
"""
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from common.config import trained_with
from common.errors import UsageError, run_main
from common.export import compare_with_reference, export_draft, serve_command
from common.prepare import follow_stage1_length, split_by_conversation, validation_groups
from common.hidden_states import check_files
from common.io import write_manifest
from common.models import load_tokenizer, open_verifier
from common.stage import ensure_writable, start
from common.build_draft import build_model, geometry, trainable_parameters, verifier_init_plan
from common.drafts import method_of
from common.drafts.layers import rope_note
from common.train_preflight import checkpoint_disk, micro_batch_memory, read_inputs, refuse_oversized, \
    require_speculators
from common.checkpoints import latest_checkpoint, load_weights
from common.distributed import dist_setup, dist_teardown
from common.metrics import plot_curves
from common.trainer import RESUME_KEYS, Trainer, method_shift, plan_epochs


def set_threads(cfg, device, log):
    """CPU training uses every core. On a GPU this process only feeds the device while the loader's workers do
    the host work: its threads would contend with them (one H200, Kimi geometry: 21.7k tokens/s with all 32
    cores' threads, 32.2k with one)."""
    n = cfg.num_threads or (1 if device.type == "cuda" and "OMP_NUM_THREADS" not in os.environ else 0)
    if n:
        torch.set_num_threads(n)
    log.info("CPU threads for torch in this process: %d", torch.get_num_threads())


def main():
    cfg, log = start(4, "04_train", __doc__)
    rank, world, device = dist_setup(cfg)
    if rank:
        logging.getLogger().setLevel(logging.WARNING)  # one log per run: rank 0 speaks
    set_threads(cfg, device, log)
    torch.manual_seed(cfg.seed)
    prep_man, records, hs_man, voc_man, layer_ids = read_inputs(cfg)
    follow_stage1_length(cfg, prep_man, log)
    model_dir, text_cfg = open_verifier(cfg, log)
    cfg["draft_vocab_from"] = voc_man["params"].get("draft_vocab_from", "all")  # recorded as what stage 3 built
    full = voc_man["counts"]["full_vocabulary"]
    draft_vocab = text_cfg.vocab_size if full else voc_man["counts"]["draft_vocab_size"]
    require_speculators(cfg)
    method = method_of(cfg)  # the draft method: its geometry, model, loss, export (common/drafts/)
    g = geometry(cfg, text_cfg, draft_vocab, len(layer_ids) - 1, log=log,
                 tokenizer=lambda: load_tokenizer(model_dir, trust_remote_code=cfg.trust_remote_code))
    hs_dir = Path(cfg.work_dir) / "hidden_states"
    # every file stage 2 wrote (it lists the samples it excluded as bad), checked from its header: seconds
    excluded = {int(i) for i in hs_man["counts"].get("bad_samples") or {}}
    lengths = {i: len(r["input_ids"]) for i, r in enumerate(records) if i not in excluded}
    t0 = time.time()
    check_files(hs_dir, {i: records[i]["input_ids"] for i in lengths}, len(layer_ids), text_cfg.hidden_size,
                hs_man["params_hash"])
    log.info("checked %d hidden-state files in %.1f s", len(lengths), time.time() - t0)
    if len(lengths) < 2:
        raise UsageError(f"only {len(lengths)} hidden-state files in {hs_dir}; need at least 2 (train + validation)")
    longest, shift = max(lengths.values()), method_shift(cfg)
    if longest - shift > cfg.max_tokens_per_step:
        raise UsageError(f"the longest sample has {longest} tokens, more than --max-tokens-per-step "
                         f"{cfg.max_tokens_per_step} holds; raise it to at least {longest - shift}")
    present = sorted(lengths)
    train_idx, val_idx = split_by_conversation(records, present, cfg.val_fraction, cfg.seed)
    bins = plan_epochs(train_idx, lengths, cfg, world)  # enough packed sequences for ranks x accumulation?
    need, have = micro_batch_memory(cfg, g, min(longest, cfg.max_tokens_per_step), device)
    log.info("plan: %d train / %d validation samples (%d tokens), draft hidden %d, heads %d/%d x %d, MLP %d, "
             "draft vocab %d of %d, aux layers %s, %s, %d tokens per micro-batch x %d accumulation x %d ranks on "
             "%s; ~%.1f GB per micro-batch (%.1f GB available)", len(train_idx), len(val_idx), sum(lengths.values()),
             g.hidden_size, g.num_heads, g.num_kv_heads, g.head_dim, g.intermediate_size, g.draft_vocab_size,
             g.verifier_vocab_size, layer_ids[:-1], method.note(g, cfg), cfg.max_tokens_per_step, cfg.grad_accum, world,
             device, need / 1e9, (have or 0) / 1e9)
    refuse_oversized(cfg, need, have, device)
    out = Path(cfg.work_dir) / "train"
    per_epoch = len(bins[0]) // (world * cfg.grad_accum)
    steps = sum(len(b) // (world * cfg.grad_accum) for b in bins)  # as the trainer counts them
    steps = min(steps, cfg.max_steps or steps)
    ckpt = checkpoint_disk(cfg, trainable_parameters(g, cfg.train_lm_head), steps, -(-steps // per_epoch), out)
    log.info("disk: %d steps, checkpoints of ~%.2f GB (--keep-last %d)", steps, ckpt / 1e9, cfg.keep_last)
    init_plan = verifier_init_plan(g, model_dir, text_cfg) if cfg.draft_init == "verifier" else None
    if init_plan:
        log.info("draft init: %d weights copied from the verifier's last layers (%s ... %s)", len(init_plan),
                 init_plan[0][2], init_plan[-1][2])
    if cfg.dry_run:
        log.info("dry run: preflight passed; nothing written")
        return 0
    ensure_writable(out)
    target_ids = None if full else np.load(Path(cfg.work_dir) / "vocab" / "d2t.npy") + np.arange(draft_vocab)
    model = build_model(g, model_dir, target_ids, train_head=cfg.train_lm_head, init_plan=init_plan)
    groups = validation_groups(records, val_idx, prep_man["params"].get("regenerate", False))
    trainer = Trainer(cfg, model, device, hs_dir, train_idx, val_idx, lengths, out, log, rank, world, groups)
    trainer.resume()
    t0 = time.time()
    state = trainer.train()
    dist_teardown(world)
    if rank != 0:
        return 0
    best = out / "checkpoints" / f"step_{state['best_step']}" if state.get("best_step") is not None else None
    final_val = [json.loads(l) for l in trainer.metrics_path.read_text().splitlines() if '"val"' in l]
    src = best if best and best.exists() else None
    if src:
        log.info("exporting the best checkpoint %s (simulated acceptance length %.3f)", src.name, state["best"])
    if trainer.fsdp:  # the trained model is sharded across ranks: export a plain copy built from a checkpoint
        torch.set_num_threads(os.cpu_count() or 1)  # the other ranks are done; torchrun left one thread each
        src = src or latest_checkpoint(out / "checkpoints")
        t1 = time.time()
        model = build_model(g, model_dir, target_ids, load_file(str(src / "trainable.safetensors")),
                            train_head=cfg.train_lm_head)
        log.info("plain copy for export built from %s in %.1f s", src.name, time.time() - t1)
    elif src:
        load_weights(src, model)
    plot_curves(trainer.metrics_path, out / "curves.png", trainer.positions)
    return finish(cfg, log, model, g, layer_ids, model_dir, text_cfg, state, final_val, out, time.time() - t0,
                  len(train_idx), val_idx, trainer.positions)


def finish(cfg, log, model, g, layer_ids, model_dir, text_cfg, state, val_rows, out, seconds, n_train, val_idx, k):
    final = Path(cfg.work_dir) / "final_draft"
    best_val = max(val_rows, key=lambda r: r["acceptance_length"]) if val_rows else None
    meta = {"layer_ids": layer_ids, "layer_convention": "vllm (id k enters decoder layer k; final id N pre-norm)",
            "verifier": cfg.verifier, "best_validation": best_val}
    shapes = export_draft(model, final, cfg, layer_ids[:-1], cfg.verifier if not
                          cfg.verifier.startswith("embedded:") else model_dir, text_cfg, meta)
    log.info("exported a %s draft to %s (%d tensors)", cfg.draft_method, final, len(shapes))
    if cfg.reference_config:
        diffs = compare_with_reference(shapes, cfg.reference_config)
        log.info("reference %s: %s", cfg.reference_config, "names and shapes identical" if not diffs else
                 f"{len(diffs)} differences:\n  " + "\n  ".join(diffs))
    params = {o: cfg[o] for o in (*RESUME_KEYS, "grad_accum", "export_format", "draft_method",
                                  *method_of(cfg).options)}
    params["positions"] = k  # per-position metrics: TTT steps, or a DFlash block's drafted tokens
    params["draft_vocab_from"] = cfg.draft_vocab_from  # stage 3's, which built the vocab (main)
    write_manifest(out, "train", dict(params, layer_ids=layer_ids, geometry=g.to_dict()),
                   counts={"train_samples": n_train, "val_samples": len(val_idx), "steps": state["step"],
                           "tokens": state["tokens"]},
                   timings={"train_seconds_this_run": round(seconds, 1),
                            "tokens_per_s": round(state["tokens"] / max(state["train_seconds"], 1e-9), 1)},
                   best_validation=best_val, validation_samples=list(val_idx),  # for 05 --eval-dataset validation
                   final_draft=str(final), exported_shapes=shapes, options=trained_with(cfg))
    if best_val:
        log.info("best validation: full acc %s, cond acc %s, simulated acceptance length %.3f",
                 " / ".join(f"{best_val[f'full_acc_{i}']:.3f}" for i in range(k)),
                 " / ".join(f"{best_val[f'cond_acc_{i}']:.3f}" for i in range(k)), best_val["acceptance_length"])
    log.info("context: the draft trained on samples of up to %d tokens (--max-seq-len) with the verifier's rotary "
             "embedding (%s, exported with it for %d positions); the serve command below caps --max-model-len at the "
             "trained length (05_evaluate.py --eval-dataset mtbench-long --max-seq-len N measures acceptance by context "
             "length and prints the command for what it measured)", cfg.max_seq_len, rope_note(g), g.max_position_embeddings)
    log.info("serve it (OpenAI-compatible server on port 8000): %s", serve_command(model_dir, final, cfg))
    return 0


if __name__ == "__main__":
    run_main(main)
