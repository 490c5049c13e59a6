#!/usr/bin/env python3
"""Stage 1: conversations -> chat-templated token ids with an assistant-token loss mask.

Reads --dataset (packaged ShareGPT, a local .json/.jsonl in ShareGPT or OpenAI form, or an HF id);
with --regenerate replaces the answers with the verifier's own (vLLM, resumable chunks).
Writes <work-dir>/prepared/tokenized_data.jsonl ({id, input_ids, loss_mask} per line) and manifest.json.
"""
import json
import time
from pathlib import Path

from common.errors import UsageError, run_main
from common.io import atomic_path, check_free_disk, sha256_file, sha256_text, write_manifest
from common.models import load_tokenizer, open_verifier, tokenizer_identity
from common.prepare import DATASET_ANSWER, regenerate, select_conversations, token_stats, tokenize_all
from common.sources import check_source, describe_source
from common.stage import ensure_writable, start

TRUNCATION_POLICY = ("keep the first --max-seq-len tokens; a sample with no assistant token left is dropped "
                     "and counted as no_assistant_after_truncation")


def plan(cfg, log, out, model_dir):
    n = cfg.num_samples or "all"
    log.info("plan: read %s -> select %s conversations (max_turns=%s, dedup=%s, shuffle=%s, seed=%d)",
             cfg.dataset, n, cfg.max_turns or "all", cfg.dedup, cfg.shuffle, cfg.seed)
    if cfg.regenerate:
        log.info("plan: regenerate answers with vLLM from %s (TP=%d, temperature=%g, max %d new tokens, "
                 "chunks of %d, resumable)", model_dir, cfg.tensor_parallel_size, cfg.temperature,
                 cfg.max_new_tokens, cfg.regenerate_chunk)
        if cfg.keep_original_answers:
            log.info("plan: also keep every conversation with its own answers, as a second sample")
    log.info("plan: write %s/tokenized_data.jsonl (~%.0f MB at most) and manifest.json; truncation: %s",
             out, (cfg.num_samples or 20000) * cfg.max_seq_len * 9 / 1e6, TRUNCATION_POLICY)


def main():
    cfg, log = start(1, "01_prepare", __doc__)
    out = Path(cfg.work_dir) / "prepared"
    check_source(cfg.dataset)
    if cfg.keep_original_answers and not cfg.regenerate:
        raise UsageError("--keep-original-answers keeps the dataset's answers beside regenerated ones: add "
                         "--regenerate, or --no-keep-original-answers (the config may set it)")
    if cfg.chat_template and cfg.chat_template.endswith((".jinja", ".j2", ".txt")) \
            and not Path(cfg.chat_template).is_file():
        raise UsageError(f"--chat-template {cfg.chat_template}: file not found")
    t0 = time.time()
    # Inputs first (seconds), then the verifier's config (seconds), then anything expensive.
    convs, skips, n_read = select_conversations(cfg, log)
    if not convs:
        raise UsageError(f"--dataset {cfg.dataset}: no usable conversation (skipped: {dict(skips)})")
    model_dir, model_config = open_verifier(cfg, log)
    if cfg.regenerate:
        from common.engine import check_parallel, cpu_mla_fallback
        check_parallel(cfg, model_config)
        cpu_mla_fallback(model_config, log, cfg.dtype, draft=False)
    if cfg.dry_run:
        plan(cfg, log, out, model_dir)
        log.info("dry run: %d conversations would be used; nothing written", len(convs))
        return 0
    ensure_writable(out)
    check_free_disk(out, (cfg.num_samples or 20000) * cfg.max_seq_len * 9, "tokenized data")
    plan(cfg, log, out, model_dir)
    tok = load_tokenizer(model_dir, cfg.chat_template, cfg.trust_remote_code)
    regen_stats = None
    if cfg.regenerate:
        originals = convs
        convs, regen_stats = regenerate(convs, tok, cfg, model_dir, out, log)
        if cfg.keep_original_answers:  # appended: the regenerated samples keep their indices
            convs = convs + [(f"{ref}{DATASET_ANSWER}", msgs) for ref, msgs in originals]
    records, tok_skips, truncated, own_ids = tokenize_all(convs, tok, cfg, log)
    skips.update(tok_skips)
    if not records:
        raise UsageError(f"no sample kept (dropped: {dict(skips)}); check --max-seq-len and the dataset")
    data_path = out / "tokenized_data.jsonl"
    with atomic_path(data_path) as tmp:
        with open(tmp, "w") as fh:
            for r in records:
                fh.write(json.dumps(r, separators=(",", ":")) + "\n")
    stats = token_stats(records)
    stats.update(records_read=n_read, selected=len(convs), truncated=truncated, dropped=dict(skips))
    params = {k: cfg[k] for k in ("verifier", "dataset", "dataset_split", "num_samples", "seed", "shuffle",
                                  "dedup", "max_turns", "max_seq_len", "regenerate")}
    params.update(model_dir=model_dir, chat_template_override=sha256_text(cfg.chat_template) if cfg.chat_template
                  else None, truncation_policy=TRUNCATION_POLICY)
    if cfg.regenerate:
        params.update({k: cfg[k] for k in ("temperature", "max_new_tokens", "repetition_penalty",
                                           "drop_capped_answers", "drop_reasoning", "keep_original_answers")})
    write_manifest(out, "prepare", params, tokenizer=tokenizer_identity(tok), source=describe_source(cfg.dataset),
                   counts=stats, regeneration=regen_stats and dict(regen_stats, **own_ids), timings={"total_seconds": round(time.time() - t0, 1)},
                   outputs={"tokenized_data": data_path.name, "tokenized_data_sha256": sha256_file(data_path)})
    log.info("kept %d samples: %d tokens, %d assistant tokens (%.1f%%), %d unique assistant tokens, "
             "%d truncated; dropped %s; %.1fs", stats["samples"], stats["total_tokens"], stats["assistant_tokens"],
             100 * stats["assistant_tokens"] / max(stats["total_tokens"], 1), stats["unique_assistant_tokens"],
             truncated, dict(skips) or "none", time.time() - t0)
    log.info("wrote %s and manifest.json", data_path)
    return 0


if __name__ == "__main__":
    run_main(main)
