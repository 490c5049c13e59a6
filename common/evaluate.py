"""Stage 5 logic: acceptance of the trained draft in vLLM, read from vLLM's own metrics."""
import json
import time
from pathlib import Path

from common.errors import UsageError
from common.io import sha256_text, write_json_atomic
from common.sources import iter_jsonl, long_context, mtbench_questions


def eval_prompts(spec, limit, work_dir=None, tok=None, cfg=None):
    """-> [(id, messages or prompt token ids)]: MT-bench first turns (packaged; 'mtbench-long': each also after earlier
    conversation in every context bucket --max-seq-len reaches, needs `tok` and `cfg`), 'prepared' (this run's
    own prompts, in-distribution), 'validation' (the prompts of the samples stage 4 held out: its simulated
    acceptance length was measured on them), or a JSONL of prompts/conversations."""
    if spec in ("prepared", "validation"):
        from common.io import read_manifest
        from common.prepare import load_prepared
        _, records = load_prepared(work_dir)
        if spec == "validation":
            held = read_manifest(Path(work_dir) / "train", "train", "04_train.py").get("validation_samples")
            if not held:
                raise UsageError(f"{work_dir}/train/manifest.json lists no validation samples (--val-fraction 0, or "
                                 f"trained by an older eagle3-train); use --eval-dataset prepared")
            records = [records[i] for i in held]
        items = [(r["id"], r["input_ids"][:r["loss_mask"].index(1)]) for r in records]
    elif spec == "mtbench":
        items = [(qid, [{"role": "user", "content": turns[0]}]) for qid, turns, _ in mtbench_questions()]
    elif spec == "mtbench-long":
        items = mtbench_long(tok, cfg.max_seq_len, cfg.max_new_tokens)
    else:
        if not Path(spec).is_file():
            raise UsageError(f"--eval-dataset {spec}: file not found (use 'mtbench' or a .jsonl)")
        items = []
        for ref, rec in iter_jsonl(spec):
            items.append((ref, _messages(rec, ref)))
    return items[:limit] if limit else items


def chat_ids(tok, messages):
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def mtbench_long(tok, max_seq_len, max_new_tokens):
    """Each MT-bench first turn alone (id qid), then after earlier ShareGPT conversation that puts the prompt and its
    answer inside each context bucket from 1K-4K up to --max-seq-len (id qid@1K-4K, qid@4K-8K, ...). One
    conversation, cut at whole turns, comes before every question, so vLLM's prefix cache prefills it once."""
    questions = [(qid, [{"role": "user", "content": turns[0]}]) for qid, turns, _ in mtbench_questions()]
    lens = {qid: len(chat_ids(tok, q)) for qid, q in questions}
    longest, shortest = max(lens.values()), min(lens.values())
    turns = long_context(chars=6 * max_seq_len)  # English runs ~3.6 characters a token: enough for every bucket
    size = lambda pairs: len(chat_ids(tok, turns[:2 * pairs] + [{"role": "user", "content": ""}]))  # noqa: E731
    contexts = []
    for lo, hi in zip(CONTEXT_EDGES[1:], CONTEXT_EDGES[2:]):
        room = min(hi - 1, max_seq_len) - max_new_tokens - longest  # the context with the longest question fits
        if room <= lo - shortest:
            break
        low, high = 0, len(turns) // 2  # the most whole user / assistant pairs whose prompt fits `room`
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if size(mid) <= room else (low, mid - 1)
        if size(low) + shortest >= lo:
            contexts.append((context_bucket(lo), turns[:2 * low]))
    if not contexts:
        raise UsageError(f"--eval-dataset mtbench-long: --max-seq-len {max_seq_len} leaves no room for a question after "
                         f"1,024 tokens of conversation and {max_new_tokens} new tokens; pass --max-seq-len 8192 (or "
                         f"up to the verifier's context)")
    return [item for qid, q in questions
            for item in [(qid, q)] + [(f"{qid}@{label}", context + q) for label, context in contexts]]


def tokenize_prompts(spec, items, tok, cfg):
    """-> (prompts for vLLM, their ids, how many of this run's own samples were too long to serve). A prompt of
    MT-bench or a file that cannot fit --max-seq-len with its answer is an error: its context was not measured."""
    room = cfg.max_seq_len - cfg.max_new_tokens
    prompts, refs, skipped = [], [], 0
    for ref, msgs in items:
        ids = msgs if isinstance(msgs[0], int) else chat_ids(tok, msgs)
        if len(ids) > room and spec in ("prepared", "validation"):  # cut to --max-seq-len for training: no answer room
            skipped += 1
            continue
        if len(ids) > room:
            raise UsageError(f"--eval-dataset {spec}: prompt {ref} is {len(ids)} tokens, more than --max-seq-len "
                             f"{cfg.max_seq_len} - --max-new-tokens {cfg.max_new_tokens} = {room}, the longest the "
                             f"engine serves with its answer; raise --max-seq-len (up to the verifier's context) or "
                             f"drop the prompt")
        prompts.append({"prompt_token_ids": list(ids)})
        refs.append(ref)
    if not prompts:
        raise UsageError(f"--eval-dataset {spec}: every prompt is longer than --max-seq-len - --max-new-tokens = "
                         f"{room} tokens; raise --max-seq-len")
    return prompts, refs, skipped


def prompt_categories(spec, work_dir=None, refs=()):
    """-> (table key, {prompt id: group}): MT-bench's eight categories, mtbench-long's short / context bucket, a
    JSONL's "category" field; for this run's own prompts ('prepared', 'validation') the --dataset source each came
    from."""
    if spec in ("prepared", "validation"):
        from common.prepare import load_prepared
        return "by_source", {r["id"]: r.get("source", "") for r in load_prepared(work_dir)[1]}
    if spec == "mtbench-long":
        return "by_category", {r: r.partition("@")[2] or "short" for r in refs}
    return "by_category", _categories(spec)


def _categories(spec):
    if spec == "mtbench":
        return {qid: cat for qid, _, cat in mtbench_questions()}
    if spec not in ("prepared", "validation") and Path(spec).is_file():
        return {ref: rec["category"] for ref, rec in iter_jsonl(spec) if isinstance(rec, dict) and "category" in rec}
    return {}


def _messages(rec, ref):
    from common.chat import BadRecord, Skip, normalize
    if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
        return [{"role": "user", "content": rec["prompt"]}]
    try:
        msgs = normalize(rec, max_turns=1)
    except (Skip, BadRecord) as exc:
        raise UsageError(f"{ref}: not a prompt ({{'prompt': ...}}) or a conversation: {exc}")
    return msgs[:-1]  # up to the first assistant answer, which the verifier regenerates


def baseline_key(model_dir, cfg, prompts):
    """What the verifier's own outputs and timings depend on: its files (names, sizes, times), the prompts, the
    decoding and engine settings, the vLLM version."""
    import vllm

    from common.engine import compute_dtype
    files = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in Path(model_dir).iterdir() if p.is_file())
    settings = {k: cfg[k] for k in ("max_new_tokens", "temperature", "seed", "max_seq_len", "latency_prompts",
                                    "tensor_parallel_size", "pipeline_parallel_size", "cpu_kv_cache_gb")}
    settings["dtype"] = compute_dtype(cfg.eval_dtype or cfg.dtype)
    return sha256_text(json.dumps([str(Path(model_dir).resolve()), files, settings, vllm.__version__,
                                   [p["prompt_token_ids"] for p in prompts]]))


def load_baseline(out, key):
    """The baseline an earlier run of this stage decoded with the same key -> (run_engine's tokens, seconds, single;
    when it was decoded), else None: a re-run after a failed draft engine, or a second draft, skips a model load."""
    path = Path(out) / "baseline.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if saved.get("key") != key:
        return None
    return (saved["tokens"], saved["seconds"], saved["single"] and tuple(saved["single"])), saved["decoded"]


def save_baseline(out, key, tokens, seconds, single):
    write_json_atomic(Path(out) / "baseline.json", {"key": key, "decoded": time.strftime("%Y-%m-%d %H:%M:%S"),
                                                    "seconds": seconds, "single": single, "tokens": tokens})


BUCKET = 64  # answer positions per bucket of the by-position breakdown


def _summary(accepted, k):
    n = max(len(accepted), 1)
    return {"drafts": len(accepted), "acceptance_length": round(1 + sum(accepted) / n, 4),
            "per_position_acceptance": [round(sum(a > i for a in accepted) / n, 4) for i in range(k)]}


# context lengths (prompt + answer so far, tokens) of the by-context breakdown: each bucket is [edge, next edge)
CONTEXT_EDGES = (0, 1024, 4096, 8192, 16384, 32768, 65536, 131072, 262144)


def context_bucket(n):
    """-> the label of the context bucket holding n tokens ("0-1K", "1K-4K", ..., "256K+")."""
    label = lambda e: f"{e // 1024}K" if e else "0"  # noqa: E731
    for lo, hi in zip(CONTEXT_EDGES, CONTEXT_EDGES[1:]):
        if n < hi:
            return f"{label(lo)}-{label(hi)}"
    return f"{label(CONTEXT_EDGES[-1])}+"


def acceptance_breakdown(steps, groups, k, bucket=BUCKET, group_key="by_category", prompt_lens=None):
    """vLLM's verify steps per prompt -> acceptance per prompt category, per answer-position bucket (where
    the step's first drafted token falls: the answer's first token comes from the prefill, each step then
    adds its accepted drafts + 1) and, given each prompt's length in tokens, per context-length bucket (the prompt
    plus the answer before the step: how far back the draft attends). None when the engine gave no per-request
    steps."""
    if not steps or any(s is None for s in steps):
        return None
    by_group, by_pos, by_ctx = {}, {}, {}
    for i, (accepted, group) in enumerate(zip(steps, groups)):
        pos = 1
        for a in accepted:
            by_group.setdefault(group, []).append(a)
            by_pos.setdefault(pos // bucket, []).append(a)
            if prompt_lens is not None:
                by_ctx.setdefault(context_bucket(prompt_lens[i] + pos), []).append(a)
            pos += a + 1
    out = {"by_position": {f"{b * bucket}-{b * bucket + bucket - 1}": _summary(by_pos[b], k) for b in sorted(by_pos)}}
    if by_ctx:
        order = [context_bucket(e) for e in CONTEXT_EDGES]
        out["by_context"] = {c: _summary(by_ctx[c], k) for c in order if c in by_ctx}
    if any(groups):
        out[group_key] = {g or "(none)": _summary(a, k) for g, a in sorted(by_group.items())}
    return out


def serve_context(by_context, longest, trained, verifier):
    """-> (--max-model-len for the serve command, a line saying why). The verifier's own context where acceptance in
    the farthest context bucket measured, past the trained length, is within 10% of the 0-1K bucket's; otherwise the
    longest context measured (prompt + answer), or the trained length where that is longer."""
    buckets = list(by_context or {})
    if "0-1K" not in buckets or len(buckets) < 2:
        cap = max(longest, trained)
        return cap, (f"acceptance measured up to {longest:,} tokens of context (prompt + answer), no longer context "
                     f"measured: the serve command caps --max-model-len at {cap:,} (05_evaluate.py --eval-dataset "
                     f"mtbench-long --max-seq-len N measures acceptance by context length)")
    short, far = by_context["0-1K"]["acceptance_length"], by_context[buckets[-1]]["acceptance_length"]
    change = far / short - 1
    measured = f"acceptance measured up to {longest:,} tokens of context: {far:.3f} at {buckets[-1]} against " \
        f"{short:.3f} at 0-1K ({100 * change:+.0f}%)"
    if longest > trained and change >= -0.10:
        return verifier, f"{measured}, within 10%: the serve command allows the verifier's own {verifier:,} positions"
    cap = max(longest, trained)
    return cap, f"{measured}: the serve command caps --max-model-len at {cap:,} (raise it knowingly)"


def single_note(single):
    return "" if not single else f"; one prompt at a time: {single[0]} tokens in {single[1]:.1f}s = " \
        f"{single[0] / single[1]:.1f} tokens/s"


def concurrency_one(single, base_single):
    """tokens/s with and without the draft when prompts are decoded one at a time; {} when not measured."""
    if not single or not base_single:
        return {}
    rate, base = single[0] / single[1], base_single[0] / base_single[1]
    return {"tokens_per_s_concurrency_1": round(rate, 2), "baseline_tokens_per_s_concurrency_1": round(base, 2),
            "speedup_concurrency_1": round(rate / base, 3)}


def acceptance_row(k, tokens, seconds, counters, base_tokens, base_seconds, single=None, base_single=None):
    n_out = sum(len(t) for t in tokens)
    drafts = max(counters["drafts"], 1)
    return {"num_speculative_tokens": k, "acceptance_length": round(1 + counters["accepted"] / drafts, 4),
            "per_position_acceptance": [round(x / drafts, 4) for x in counters["per_pos"]],
            "draft_acceptance_rate": round(counters["accepted"] / max(counters["draft_tokens"], 1), 4),
            "drafts": counters["drafts"], "accepted_tokens": counters["accepted"], "output_tokens": n_out,
            "tokens_per_s": round(n_out / seconds, 2),
            "baseline_tokens_per_s": round(sum(len(t) for t in base_tokens) / base_seconds, 2),
            "speedup": round((n_out / seconds) / (sum(len(t) for t in base_tokens) / base_seconds), 3),
            "outputs_equal_baseline": sum(a == b for a, b in zip(tokens, base_tokens)), "prompts": len(tokens),
            **concurrency_one(single, base_single)}


def compare_with_training(rows, best, log):
    """On the held-out samples: vLLM's acceptance beside stage 4's simulated one (the exported checkpoint's),
    overall and on the samples that hold the verifier's own answers (with --keep-original-answers the others
    hold the dataset's, which vLLM never serves: the verifier answers those prompts its own way)."""
    def full_acc(v):
        return [v[f"full_acc_{i}"] for i in range(sum(key.startswith("full_acc_") for key in v))]
    full, own = full_acc(best), (best.get("groups") or {}).get("verifier answers")
    for row in rows:
        k = row["num_speculative_tokens"]
        if k > len(full):
            continue
        simulated = 1 + sum(full[:k])
        row["trainer_simulated_acceptance_length"] = round(simulated, 4)
        row["trainer_full_accuracy"] = [round(x, 4) for x in full[:k]]
        line = (f"k={k} on the validation samples: vLLM acceptance length {row['acceptance_length']:.3f} vs training's "
                f"simulated {simulated:.3f} ({100 * (row['acceptance_length'] / simulated - 1):+.1f}%)")
        if own:
            own_sim = 1 + sum(full_acc(own)[:k])
            row["trainer_simulated_on_verifier_answers"] = round(own_sim, 4)
            row["trainer_full_accuracy_on_verifier_answers"] = [round(x, 4) for x in full_acc(own)[:k]]
            line += (f", {own_sim:.3f} on the samples holding the verifier's own answers "
                     f"({100 * (row['acceptance_length'] / own_sim - 1):+.1f}%)")
        log.info("%s; per position %s vs %s", line, row["per_position_acceptance"], row["trainer_full_accuracy"])


def derived_rows(row, ks):
    """Acceptance at each smaller k from one run at the largest k: a round at k drafts the same first k
    tokens as at K, so P(first i drafts accepted) is read off K's per-position counts. Approximate: the
    rounds start at other positions when fewer tokens are drafted (measured gap: README, stage 5)."""
    out = []
    for k in sorted(set(ks) - {row["num_speculative_tokens"]}):
        per_pos = row["per_position_acceptance"][:k]
        out.append({"num_speculative_tokens": k, "acceptance_length": round(1 + sum(per_pos), 4),
                    "per_position_acceptance": per_pos,
                    "draft_acceptance_rate": round(sum(per_pos) / k, 4),
                    "derived_from_k": row["num_speculative_tokens"], "tokens_per_s": None, "speedup": None,
                    "baseline_tokens_per_s": row["baseline_tokens_per_s"], "outputs_equal_baseline": None,
                    "prompts": row["prompts"]})
    return out


def _num(x, fmt, suffix=""):
    return "-" if x is None else f"{x:{fmt}}{suffix}"


def markdown_table(rows, label):
    lines = [f"Acceptance on {label} (vLLM metrics)", "",
             "| k | acceptance length | per-position acceptance | draft acceptance rate | tokens/s | baseline tokens/s "
             "| speedup | outputs equal baseline |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        k = f"{r['num_speculative_tokens']}" + (f" (from k={r['derived_from_k']})" if r.get("derived_from_k") else "")
        equal = "-" if r["outputs_equal_baseline"] is None else f"{r['outputs_equal_baseline']}/{r['prompts']}"
        lines.append(f"| {k} | {r['acceptance_length']:.3f} | "
                     f"{' / '.join(f'{x:.3f}' for x in r['per_position_acceptance'])} | "
                     f"{r['draft_acceptance_rate']:.3f} | {_num(r['tokens_per_s'], '.1f')} | "
                     f"{r['baseline_tokens_per_s']:.1f} | {_num(r['speedup'], '.2f', 'x')} | {equal} |")
    single = [r for r in rows if r.get("tokens_per_s_concurrency_1")]
    if single:
        lines += ["", "Tokens/s at concurrency 1 (the first prompts decoded one at a time: what one user waiting for "
                      "an answer sees)", "", "| k | tokens/s | baseline tokens/s | speedup |", "|---|---|---|---|"]
        lines += [f"| {r['num_speculative_tokens']} | {r['tokens_per_s_concurrency_1']:.1f} | "
                  f"{r['baseline_tokens_per_s_concurrency_1']:.1f} | {r['speedup_concurrency_1']:.2f}x |" for r in single]
    for r in rows:
        if r.get("speedup_model"):
            from common.speedup import speedup_lines
            lines += speedup_lines(r["speedup_model"])
        if r.get("served_vs_predicted"):
            from common.parity import parity_table
            lines += parity_table(r, r["served_vs_predicted"])
        if not r.get("derived_from_k") and r.get("steps_source") and not r.get("breakdown"):
            lines += ["", f"k={r['num_speculative_tokens']} by prompt, answer position and context: not measured (no "
                          f"request's verify steps came back from the engine)"]
    if any(r.get("derived_from_k") for r in rows):
        lines += ["", "Rows marked 'from k=K' are derived from the k=K run's per-position counts (no engine of "
                      "their own; --exact-k-sweep runs one per k)."]
    for r in rows:
        for key, title in (("by_category", "prompt category"), ("by_source", "prompt source (--dataset entry)"),
                           ("by_position", "answer positions (where a verify step starts)"),
                           ("by_context", "context length (prompt + answer before the verify step, tokens)")):
            table = (r.get("breakdown") or {}).get(key)
            if table:
                lines += ["", f"k={r['num_speculative_tokens']} by {title}", "",
                          "| | verify steps | acceptance length | per-position acceptance |", "|---|---|---|---|"]
                lines += [f"| {name} | {v['drafts']} | {v['acceptance_length']:.3f} | "
                          f"{' / '.join(f'{x:.3f}' for x in v['per_position_acceptance'])} |" for name, v in table.items()]
    return "\n".join(lines) + "\n"


def vocab_coverage(work_dir, token_lists):
    """Share of the verifier's output tokens inside the draft vocab (a ceiling on acceptance); None: full vocab."""
    import numpy as np
    path = Path(work_dir) / "vocab" / "d2t.npy"
    if not path.is_file():
        return None
    d2t = np.load(path)
    held = set((d2t + np.arange(len(d2t))).tolist())
    tokens = [t for ts in token_lists for t in ts]
    return round(sum(t in held for t in tokens) / max(len(tokens), 1), 4)


def first_difference(a, b):
    """Index of the first differing token of two outputs; None when equal."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if a == b else n


def save_outputs(path, refs, base_tokens, outputs, tok, steps=None):
    """One line per prompt: its id, the verifier's answer (text and ids), and per k the speculative output's ids,
    where it first differs from the verifier's and vLLM's accepted drafts per verify step (in order)."""
    import json
    steps = steps or {}
    with open(path, "w") as fh:
        for i, (ref, base) in enumerate(zip(refs, base_tokens)):
            diff = {f"k{k}_first_difference": first_difference(toks[i], base) for k, toks in outputs.items()}
            ids = {f"k{k}_ids": toks[i] for k, toks in outputs.items()}
            per_step = {f"k{k}_accepted_per_step": st[i] for k, st in steps.items() if st and st[i] is not None}
            fh.write(json.dumps({"id": ref, "baseline": tok.decode(base), "baseline_tokens": len(base), **diff,
                                 "baseline_ids": base, **ids, **per_step}) + "\n")


def save_results(out_dir, rows, meta):
    from common.io import write_json_atomic
    write_json_atomic(Path(out_dir) / "acceptance.json", {**meta, "results": rows})
    serve = f"\nContext: {meta['serve']['why']}.\n" if meta.get("serve") else ""
    (Path(out_dir) / "acceptance.md").write_text(markdown_table(rows, meta["eval_dataset"]) + serve)

