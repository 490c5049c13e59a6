#!/usr/bin/env python3
"""Stage 1: conversations -> chat-templated token ids with an assistant-token loss mask.

Reads --dataset: one source or a weighted mix (packaged ShareGPT, sharegpt-multiturn, verifier-prompts written by the
verifier itself, a local .json/.jsonl in ShareGPT or OpenAI form, an HF id; common/mix.py), drops any prompt that
repeats an MT-bench question; with --regenerate replaces the answers with the verifier's own (vLLM, resumable chunks).
Writes <work-dir>/prepared/tokenized_data.jsonl ({id, source, input_ids, loss_mask} per line) and manifest.json.
"""
import json
import time
from pathlib import Path

from common.errors import UsageError, run_main
from common.io import atomic_path, check_free_disk, sha256_file, sha256_text, write_manifest
from common.models import load_tokenizer, open_verifier, tokenizer_identity
from common.decontam import EvalPrompts
from common.mix import check_mix, check_original_turns, describe_mix, parse_mix, select_conversations
from common.prepare import DATASET_ANSWER, per_source, regenerate, token_stats, tokenize_all
from common.stage import ensure_writable, start
from common.verifier_prompts import SOURCE as VERIFIER, write_prompts

TRUNCATION_POLICY = ("keep the first --max-seq-len tokens; a sample with no assistant token left is dropped "
                     "and counted as no_assistant_after_truncation")


def plan(cfg, log, out, model_dir, mix_stats):
    n = cfg.num_samples or "all"
    log.info("plan: read %s -> select %s conversations (%s; max_turns=%s, dedup=%s, shuffle=%s, seed=%d), none "
             "repeating an MT-bench question", cfg.dataset, n, ", ".join(f"{r['source']} {r['quota'] or 'all'}"
                                                                         for r in mix_stats),
             cfg.max_turns or "all", cfg.dedup, cfg.shuffle, cfg.seed)
    if cfg.regenerate:
        log.info("plan: regenerate answers with vLLM from %s (TP=%d, temperature=%g, max %d new tokens, "
                 "chunks of %d, resumable)", model_dir, cfg.tensor_parallel_size, cfg.temperature,
                 cfg.max_new_tokens, cfg.regenerate_chunk)
        if cfg.keep_original_answers:
            log.info("plan: also keep every conversation with its own answers, as a second sample%s",
                     f" of up to {cfg.original_turns} user turns" if cfg.original_turns else "")
    log.info("plan: write %s/tokenized_data.jsonl (~%.0f MB at most) and manifest.json; truncation: %s",
             out, (cfg.num_samples or 20000) * cfg.max_seq_len * 9 / 1e6, TRUNCATION_POLICY)


def written_prompts(engine, tok, cfg, model_dir, out, evals, log, mix_stats, sources):
    """The prompts of the mix's verifier-prompts entry, written by the verifier (none without that entry)."""
    row = next((r for r in mix_stats if r["source"] == VERIFIER), None)
    if not row:
        return []
    convs, stats = write_prompts(engine.get, tok, row["quota"], cfg, model_dir, out, evals, log)
    row.update(selected=len(convs), written=stats)
    sources.update((ref, VERIFIER) for ref, _ in convs)
    return convs


def main():
    cfg, log = start(1, "01_prepare", __doc__)
    out = Path(cfg.work_dir) / "prepared"
    parts = parse_mix(cfg.dataset)
    check_mix(parts, cfg)
    if cfg.keep_original_answers and not cfg.regenerate:
        raise UsageError("--keep-original-answers keeps the dataset's answers beside regenerated ones: add "
                         "--regenerate, or --no-keep-original-answers (the config may set it)")
    check_original_turns(cfg, log)
    if cfg.chat_template and cfg.chat_template.endswith((".jinja", ".j2", ".txt")) \
            and not Path(cfg.chat_template).is_file():
        raise UsageError(f"--chat-template {cfg.chat_template}: file not found")
    t0 = time.time()
    # Inputs first (seconds), then the verifier's config (seconds), then anything expensive.
    evals = EvalPrompts()
    convs, skips, n_read, sources, mix_stats, twins = select_conversations(cfg, log, parts, evals)
    model_dir, model_config = open_verifier(cfg, log, extra_positions=1)
    if cfg.regenerate:
        from common.engine import check_parallel, cpu_mla_fallback
        check_parallel(cfg, model_config, aux=False)  # regeneration reads no aux hidden states
        cpu_mla_fallback(model_config, log, cfg.dtype, draft=False)
    if cfg.dry_run:
        plan(cfg, log, out, model_dir, mix_stats)
        log.info("dry run: %d conversations would be used; nothing written", len(convs))
        return 0
    ensure_writable(out)
    check_free_disk(out, (cfg.num_samples or 20000) * cfg.max_seq_len * 9, "tokenized data")
    plan(cfg, log, out, model_dir, mix_stats)
    tok = load_tokenizer(model_dir, cfg.chat_template, cfg.trust_remote_code)
    regen_stats = None
    if cfg.regenerate:
        from common.engine import LazyEngine
        engine = LazyEngine(model_dir, cfg)
        convs = convs + written_prompts(engine, tok, cfg, model_dir, out, evals, log, mix_stats, sources)
        originals = [(ref, twins.get(ref, msgs)) for ref, msgs in convs if sources[ref] != VERIFIER]  # with answers
        convs, regen_stats = regenerate(convs, tok, cfg, model_dir, out, log, engine)
        engine.close()
        if cfg.keep_original_answers:  # appended: the regenerated samples keep their indices
            convs = convs + [(f"{ref}{DATASET_ANSWER}", msgs) for ref, msgs in originals]
            if cfg.original_turns:
                log.info("dataset answers: %d of %d twins hold more turns than their regenerated sample (up to %d)",
                         sum(ref in twins for ref, _ in originals), len(originals), cfg.original_turns)
    records, tok_skips, truncated, own_ids = tokenize_all(convs, tok, cfg, log, sources)
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
    params.update(mix=[{k: r[k] for k in ("source", "weight", "quota")} for r in mix_stats], model_dir=model_dir, chat_template_override=sha256_text(cfg.chat_template) if cfg.chat_template
                  else None, truncation_policy=TRUNCATION_POLICY)
    if cfg.regenerate:
        params.update({k: cfg[k] for k in ("temperature", "max_new_tokens", "repetition_penalty",
                                           "drop_capped_answers", "drop_reasoning", "keep_original_answers",
                                           "original_turns")})
    write_manifest(out, "prepare", params, tokenizer=tokenizer_identity(tok), source=describe_mix(parts),
                   counts=stats, sources=per_source(records, mix_stats), regeneration=regen_stats and dict(regen_stats, **own_ids), timings={"total_seconds": round(time.time() - t0, 1)},
                   outputs={"tokenized_data": data_path.name, "tokenized_data_sha256": sha256_file(data_path)})
    log.info("kept %d samples: %d tokens, %d assistant tokens (%.1f%%), %d unique assistant tokens, "
             "%d truncated; dropped %s; %.1fs", stats["samples"], stats["total_tokens"], stats["assistant_tokens"],
             100 * stats["assistant_tokens"] / max(stats["total_tokens"], 1), stats["unique_assistant_tokens"],
             truncated, dict(skips) or "none", time.time() - t0)
    for r in mix_stats:
        log.info("source %s: %d samples, %d tokens, %d assistant tokens", r["source"], r["samples"], r["tokens"],
                 r["assistant_tokens"])
    log.info("wrote %s and manifest.json", data_path)
    return 0


if __name__ == "__main__":
    run_main(main)
