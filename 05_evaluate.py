#!/usr/bin/env python3
"""Stage 5: serve the verifier with the trained draft in vLLM and measure acceptance.

Reads <work-dir>/final_draft/ (from 04_train.py); writes <work-dir>/eval/acceptance.json and
acceptance.md: acceptance length (1 + accepted/drafts), per-position acceptance, draft acceptance
rate, output tokens/s with and without speculation, and whether greedy outputs equal the
verifier's own (they must at temperature 0); outputs.jsonl: per prompt, the verifier's answer and
where each k's output first differs from it. --num-speculative-tokens 1,2,3 sweeps k: one engine at the
largest k, the smaller k's acceptance derived from its per-position counts (--exact-k-sweep: one
engine per k, each a model load).
"""
import os
import time
from pathlib import Path

from common.errors import UsageError, run_main
from common.evaluate import (acceptance_breakdown, acceptance_row, baseline_key, compare_with_training, derived_rows,
                             eval_prompts, load_baseline, prompt_categories, save_baseline, save_outputs, save_results,
                             serve_context, single_note, tokenize_prompts, vocab_coverage)
from common.generation import run_engine
from common.parity import parity_samples, served_vs_predicted, verdict
from common.drafts import method_of_export
from common.engine import compute_dtype
from common.export import check_exported_draft, serve_command
from common.io import read_manifest, write_manifest
from common.models import load_tokenizer, open_verifier
from common.served import check_served_as_trained
from common.speedup import speedup_model
from common.stage import ensure_writable, start


def longest_trained(work):
    """The longest sample the draft trained on, from stage 1's manifest; 0 where a draft was copied without it (the
    serve command's cap then rests on the contexts measured alone)."""
    if not (work / "prepared" / "manifest.json").exists():
        return 0
    prep = read_manifest(work / "prepared", "prepare", "01_prepare_dataset.py")
    return prep["counts"].get("max_len") or prep["params"]["max_seq_len"]


def main():
    cfg, log = start(5, "05_evaluate", __doc__)
    work = Path(cfg.work_dir)
    train_man = read_manifest(work / "train", "train", "04_train.py")
    draft = work / "final_draft"
    conf = check_exported_draft(draft, train_man.get("exported_shapes"))
    trained_len = longest_trained(work)
    method = method_of_export(conf)
    if method.name != cfg.draft_method:  # vLLM would load it with the wrong proposer, after the verifier's model load
        raise UsageError(f"{draft} holds a {method.name} draft but --draft-method is "
                         f"{cfg.draft_method}; pass --draft-method {method.name} (the config may set it)")
    if os.environ.get("EAGLE3_SERVE_AS_EXPORTED") != "1":  # the parity gate's own test serves a broken export on purpose
        check_served_as_trained(draft, train_man["params"])  # vLLM's readers against stage 4's geometry, in seconds
    model_dir, text_cfg = open_verifier(cfg, log)
    tok = load_tokenizer(model_dir, trust_remote_code=cfg.trust_remote_code)
    items = eval_prompts(cfg.eval_dataset, cfg.eval_limit, work, tok, cfg)
    prompts, ids_kept, skipped = tokenize_prompts(cfg.eval_dataset, items, tok, cfg)  # too long: refused before loads
    from common.engine import check_parallel, cpu_mla_fallback
    check_parallel(cfg, text_cfg)
    cpu_mla_fallback(text_cfg, log, cfg.eval_dtype or cfg.dtype)
    ks = method.served_k(conf, cfg, log)  # a block draft: the block it was trained on
    log.info("plan: %d prompts from %s, %d new tokens each, temperature %g; engines: baseline + %s with %s%s",
             len(prompts), cfg.eval_dataset, cfg.max_new_tokens, cfg.temperature,
             ", ".join(f"k={k}" for k in (ks if cfg.exact_k_sweep else ks[-1:])), draft,
             "" if cfg.exact_k_sweep or len(ks) == 1 else f" (k={', '.join(map(str, ks[:-1]))} derived from k={ks[-1]})")
    if cfg.latency_prompts:
        log.info("plan: then, in each engine, the first %d prompts one at a time (tokens/s at concurrency 1)",
                 min(cfg.latency_prompts, len(items)))
    checks, why_not = parity_samples(work, cfg.parity_prompts, cfg.max_seq_len - cfg.max_new_tokens)
    log.info("plan: %s", f"then {len(checks)} held-out samples with the verifier's own answers, greedy, in the draft's "
             f"engine: every verify step against what the draft predicts there" if checks else
             f"no served-vs-trained check ({why_not})")
    if cfg.dry_run:
        log.info("dry run: nothing written")
        return 0
    if skipped:
        log.info("plan: skipped %d of this run's samples longer than %d tokens (--max-seq-len %d - --max-new-tokens "
                 "%d: no room for an answer)", skipped, cfg.max_seq_len - cfg.max_new_tokens, cfg.max_seq_len,
                 cfg.max_new_tokens)
    longest = max(len(p["prompt_token_ids"]) for p in prompts)
    log.info("plan: prompts of %d to %d tokens (median %d), contexts up to %d tokens with the answer (--max-seq-len %d)",
             min(len(p["prompt_token_ids"]) for p in prompts), longest,
             sorted(len(p["prompt_token_ids"]) for p in prompts)[len(prompts) // 2], longest + cfg.max_new_tokens,
             cfg.max_seq_len)
    out = ensure_writable(work / "eval")
    t0 = time.time()
    key = baseline_key(model_dir, cfg, prompts)
    reused = load_baseline(out, key)
    if reused:
        (base_tokens, base_s, base_single), when = reused
        log.info("baseline: reused %s/baseline.json, decoded %s with the same verifier files, prompts and settings "
                 "(no engine started; its tokens/s are from then: delete the file to decode again)", out, when)
    else:
        base_tokens, base_s, _, _, base_single, _ = run_engine(model_dir, cfg, prompts)
        save_baseline(out, key, base_tokens, base_s, base_single)  # a draft engine that fails next keeps it
    log.info("baseline (no speculation): %d tokens in %.1fs = %.1f tokens/s%s", sum(map(len, base_tokens)), base_s,
             sum(map(len, base_tokens)) / base_s, single_note(base_single))
    coverage = vocab_coverage(work, base_tokens)
    if coverage is not None:
        log.info("the draft vocab holds %.2f%% of the verifier's output tokens here (a ceiling on acceptance)",
                 100 * coverage)
    rows, outputs, steps_by_k = [], {}, {}
    group_key, categories = prompt_categories(cfg.eval_dataset, work, ids_kept)
    engines = ks if cfg.exact_k_sweep else ks[-1:]  # each engine is a model load (22 min for Kimi-K2.5)
    for k in engines:
        spec = {"method": method.name, "model": str(draft.resolve()), "num_speculative_tokens": k}
        check = [{"prompt_token_ids": r["input_ids"][:r["loss_mask"].index(1)]} for _, r in checks] \
            if checks and k == engines[-1] else None
        tokens, secs, counters, steps, single, checked = run_engine(model_dir, cfg, prompts, spec, check)
        row = acceptance_row(k, tokens, secs, counters, base_tokens, base_s, single, base_single)
        row["steps_source"] = counters["steps_source"]
        row["speedup_model"] = speedup_model(cfg, text_cfg, model_dir, draft, k, method.draft_passes(k),
                                             row["acceptance_length"], single, base_single,
                                             compute_dtype(cfg.eval_dtype or cfg.dtype))
        row["breakdown"] = acceptance_breakdown(steps, [categories.get(r, "") for r in ids_kept], k,
                                                group_key=group_key,
                                                prompt_lens=[len(p["prompt_token_ids"]) for p in prompts])
        rows.append(row)
        outputs[k], steps_by_k[k] = tokens, steps
        log.info("k=%d: acceptance length %.3f, per position %s, draft acceptance rate %.3f, %.1f tokens/s "
                 "(%.2fx baseline), outputs equal baseline %d/%d", k, row["acceptance_length"],
                 row["per_position_acceptance"], row["draft_acceptance_rate"], row["tokens_per_s"], row["speedup"],
                 row["outputs_equal_baseline"], row["prompts"])
        if "speedup_concurrency_1" in row:
            log.info("k=%d at concurrency 1 (%d prompts one at a time): %.1f tokens/s vs %.1f baseline (%.2fx)", k,
                     min(cfg.latency_prompts, len(prompts)), row["tokens_per_s_concurrency_1"],
                     row["baseline_tokens_per_s_concurrency_1"], row["speedup_concurrency_1"])
        log_speedup(k, row["speedup_model"], log)
        for key, table in (row["breakdown"] or {}).items():
            log.info("k=%d %s: %s", k, key.replace("_", " "), ", ".join(
                f"{name} {v['acceptance_length']:.3f}" for name, v in table.items()))
        if checked:
            parity_check(work, checks, checked, k, train_man, row, log)
        if cfg.temperature == 0 and row["outputs_equal_baseline"] != row["prompts"]:
            log.warning("k=%d: %d greedy outputs differ from the verifier's own (numerical near-ties or an engine "
                        "issue)", k, row["prompts"] - row["outputs_equal_baseline"])
    if not cfg.exact_k_sweep and len(ks) > 1:
        for row in derived_rows(rows[-1], ks):
            log.info("k=%d (derived from k=%d's per-position counts): acceptance length %.3f, per position %s",
                     row["num_speculative_tokens"], row["derived_from_k"], row["acceptance_length"],
                     row["per_position_acceptance"])
            rows.append(row)
        rows.sort(key=lambda r: r["num_speculative_tokens"])
    if cfg.eval_dataset == "validation" and train_man.get("best_validation"):
        compare_with_training(rows, train_man["best_validation"], log)
    longest = max(len(p["prompt_token_ids"]) + len(t) for p, t in zip(prompts, base_tokens))
    cap, why = serve_context((rows[-1]["breakdown"] or {}).get("by_context"), longest, trained_len,
                             getattr(text_cfg, "max_position_embeddings", None) or cfg.max_seq_len)
    log.info("context: %s", why)
    log.info("serve it (OpenAI-compatible server on port 8000): %s",
             serve_command(model_dir, draft, cfg, k=ks[-1], max_model_len=cap))
    meta = {"eval_dataset": cfg.eval_dataset, "prompts": len(prompts), "skipped_long_prompts": skipped,
            "serve": {"max_model_len": cap, "longest_measured_context": longest, "why": why},
            "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "draft": str(draft),
            "draft_vocab_coverage": coverage}
    save_results(out, rows, meta)
    save_outputs(out / "outputs.jsonl", ids_kept, base_tokens, outputs, tok, steps_by_k)
    write_manifest(out, "evaluate", {k: cfg[k] for k in ("eval_dataset", "eval_limit", "num_speculative_tokens",
                                                         "max_new_tokens", "temperature", "exact_k_sweep",
                                                         "latency_prompts")},
                   results=rows, timings={"total_seconds": round(time.time() - t0, 1)})
    log.info("wrote %s/acceptance.json, acceptance.md and outputs.jsonl", out)
    return 0


def log_speedup(k, s, log):
    m, p = s["measured"], s["predicted"]
    if m:
        log.info("k=%d measured on %s: verifier step %.2f ms, speculative round %.2f ms, draft pass %.2f ms (c = %.3f)",
                 k, s["machine"], m["verifier_ms_per_step"], m["round_ms"], m["draft_ms_per_pass"], m["c"])
    log.info("k=%d predicted for %s at concurrency 1 by weight bytes: %.2fx (acceptance length %.3f, c = %.4f, "
             "r_verify %.2f, %d draft passes per round; formula in report.md)", k, s["target"], p["predicted_speedup"],
             p["acceptance_length"], p["c"], p["r_verify"], p["draft_passes"])


def parity_check(work, checks, checked, k, train_man, row, log):
    """Served against trained on held-out samples: vLLM's accepted count at every verify step against the draft's
    prediction there; one warning line when they differ beyond near-ties."""
    t0 = time.time()
    try:
        c = served_vs_predicted(work, checks, checked, k)
    except Exception as exc:  # after the model loads: a failing check must not cost the acceptance figures
        log.warning("k=%d: the served-vs-trained check failed (%s: %s); the acceptance figures stand", k,
                    type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
        return
    best = train_man.get("best_validation") or {}
    c["stage4_validation"] = [best.get(f"full_acc_{j}") for j in range(k)] if best else None
    c["steps_source"] = row.get("steps_source")
    row["served_vs_predicted"] = c
    if c["steps"]:
        log.info("k=%d served vs trained on %d held-out samples: vLLM accepted what the draft predicts at %d of %d verify "
                 "steps (from %s); per position vLLM %s, predicted %s (%.1f s)", k, c["prompts"], c["agree"], c["steps"],
                 c["steps_source"], c["served_per_position"], c["predicted_per_position"], time.time() - t0)
    why = verdict(c)
    if why:
        log.warning("k=%d: %s", k, why)


if __name__ == "__main__":
    run_main(main)
