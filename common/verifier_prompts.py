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
    kept, seen, drops, asked, rounds = [], set(), Counter(), 0, 0
    prog = Progress(n, SOURCE, unit="prompts", interval=cfg.log_interval)
    while len(kept) < n and rounds < 6:  # ~1.5x asked per round; six rounds cover a keep rate above ~15%
        m = math.ceil((n - len(kept)) * 1.5) + 8
        jobs = [(starts[(asked + j) % len(starts)], cfg.seed * 1_000_003 + asked + j) for j in range(m)]
        params = [SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, max_tokens=PROMPT_MAX_TOKENS, seed=seed,
                                 stop_token_ids=[tok.eos_token_id] if tok.eos_token_id is not None else None)
                  for _, seed in jobs]
        prompts = [{"prompt_token_ids": tok(prefix, add_special_tokens=False)["input_ids"]} for (_, prefix), _ in jobs]
        outs = get_llm().generate(prompts, params, use_tqdm=False)
        asked, rounds = asked + m, rounds + 1
        for ((hint, _), _), out in zip(jobs, outs):
            text = out.outputs[0].text.strip()
            why = degenerate(text, out.outputs[0].finish_reason)
            key = " ".join(re.findall(r"\w+", text.lower()))
            why = why or ("duplicate" if key in seen else None) or ("eval_prompt_overlap" if evals.overlaps(text)
                                                                    else None)
            if why:
                drops[why] += 1
                continue
            seen.add(key)
            if len(kept) < n:
                kept.append({"prompt": text, "hint": hint})
                prog.update()
    prog.close()
    stats = {"asked": asked, "kept": len(kept), "dropped": dict(drops), "hints": Counter(r["hint"] for r in kept)}
    log.info("%s: kept %d of %d written (%.0f%%); dropped %s", SOURCE, len(kept), asked, 100 * len(kept) / asked,
             dict(drops) or "none")
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps({"stats": stats, "prompts": kept}, indent=0) + "\n")
    return _convs(kept), stats


def _convs(rows):
    """The written prompts as conversations whose one answer regeneration writes."""
    return [(f"{SOURCE}[{i}]", [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": ""}])
            for i, r in enumerate(rows)]
