"""Option names users bring from other EAGLE-3 pipelines (SpecForge, speculators, vLLM, hand-built
scripts), each mapped to ours with the reason. Never accepted silently: one name per option stays the
rule; an unknown option is refused with the exact replacement (unknown_options, called by common/config.py)."""
import difflib
from pathlib import PurePath

from common.errors import UsageError

WORK_DIR = ("--work-dir", "one run folder for all stages: stage 1 writes W/prepared/, stage 2 W/hidden_states/, "
                          "stage 4 W/final_draft/; conversations to read: --dataset")
STAGE_FOLDERS = {"prepared", "hidden_states", "vocab", "train", "final_draft", "eval"}
VERIFIER = ("--verifier", "the verifier: a local HF model folder or an HF id")
TP = ("--tensor-parallel-size", "GPUs per model, as vLLM names it")
BATCH = {2: ("--max-tokens-per-batch", "tokens per engine call, not samples: e.g. 32768"),
         4: ("--max-tokens-per-step", "packed tokens per micro-batch, not samples: e.g. 8192")}

# name -> (our option, why); names of values that mean the same thing keep the user's value
ALIASES = {
    "--model-path": VERIFIER, "--model": VERIFIER, "--target-model-path": VERIFIER, "--target-model": VERIFIER,
    "--verifier-model": VERIFIER, "--base-model": VERIFIER, "--model-name-or-path": VERIFIER,
    "--data-path": WORK_DIR, "--prepared-data": WORK_DIR, "--output-dir": WORK_DIR, "--output": WORK_DIR,
    "--hidden-states-path": WORK_DIR, "--cache-dir": WORK_DIR, "--save-dir": WORK_DIR,
    "--tp-size": TP, "--tp": TP, "--tensor-parallel": TP,
    "--num-epochs": ("--epochs", "training epochs"),
    "--learning-rate": ("--lr", "peak learning rate"),
    "--draft-vocab": ("--draft-vocab-size", "draft vocabulary size"),
    "--vocab-size": ("--draft-vocab-size", "the draft's vocabulary; the verifier's comes from its config"),
    "--max-length": ("--max-seq-len", "longest sample in tokens"),
    "--max-model-len": ("--max-seq-len", "longest sample in tokens"),
    "--seq-len": ("--max-seq-len", "longest sample in tokens"),
    "--ttt-length": ("--ttt-steps", "training-time-test unroll depth"),
    "--num-speculative-steps": ("--num-speculative-tokens", "draft tokens per step in evaluation"),
    "--num-spec-tokens": ("--num-speculative-tokens", "draft tokens per step in evaluation"),
    "--speculative-num-draft-tokens": ("--num-speculative-tokens", "draft tokens per step in evaluation"),
    "--aux-hidden-state-layer-ids": ("--layer-ids", "aux ids plus the final one, vLLM numbering"),
    "--eagle-aux-hidden-state-layer-ids": ("--layer-ids", "aux ids plus the final one, vLLM numbering"),
    "--target-layer-ids": ("--layer-ids", "aux ids plus the final one, vLLM numbering (id k enters layer k)"),
    "--save-interval": ("--save-every", "checkpoint every N optimizer steps"),
    "--total-steps": ("--max-steps", "stop after N optimizer steps"),
    "--num-train-steps": ("--max-steps", "stop after N optimizer steps"),
    "--warmup-ratio": ("--warmup-steps", "a step count, not a fraction of training"),
    "--gradient-accumulation-steps": ("--grad-accum", "micro-batches per optimizer step"),
    "--max-grad-norm": ("--grad-clip", "gradient norm clip"),
    "--num-samples-eval": ("--eval-limit", "prompts to evaluate"),
    "--chat-template-path": ("--chat-template", "a template file or string"),
    "--block-loss": ("--loss", "one loss option for every draft method: kl, ce, tv, nla or lk (DFlash's default stays ce)"),
    "--loss-fn": ("--loss", "kl, ce, tv, nla or lk: speculators' kl_div, ce, tv, nla, lk_hybrid (no weighted mixes)"),
}
KEEP_VALUE = {"--verifier", "--tensor-parallel-size", "--epochs", "--lr", "--draft-vocab-size", "--max-seq-len",
              "--ttt-steps", "--num-speculative-tokens", "--layer-ids", "--save-every", "--max-steps", "--grad-accum",
              "--grad-clip", "--eval-limit", "--chat-template"}


def replacement(name, value, stage):
    """-> (our option with the user's value where it means the same, why) or None for an unknown name."""
    if name == "--batch-size":
        if stage in BATCH:
            return BATCH[stage]
        return (f"{BATCH[2][0]} (stage 2) or {BATCH[4][0]} (stage 4)", "budgets in tokens, not samples")
    if name not in ALIASES:
        return None
    ours, why = ALIASES[name]
    if ours in KEEP_VALUE and value is not None:
        return f"{ours} {value}", why
    if ours == "--work-dir" and value:  # a stage's folder or file inside a run folder: name the run folder
        parts = PurePath(value).parts
        inside = [i for i, p in enumerate(parts) if p in STAGE_FOLDERS]
        if inside:
            return f"--work-dir {PurePath(*parts[:inside[0]]) if inside[0] else '.'}", why
    return ours, why


def _split_unknown(extras):
    """argparse's leftovers -> [(name, value or None)]: '--x=1', '--x 1', '--flag'."""
    out, i = [], 0
    while i < len(extras):
        tok = extras[i]
        if tok.startswith("-") and "=" in tok:
            out.append(tuple(tok.split("=", 1)))
        elif tok.startswith("-"):
            nxt = extras[i + 1] if i + 1 < len(extras) else None
            if nxt is not None and not nxt.startswith("--"):
                out.append((tok, nxt))
                i += 1
            else:
                out.append((tok, None))
        else:
            out.append((tok, None))  # a stray value
        i += 1
    return out


def unknown_options(extras, stage, valid, prog):
    """One error for every unknown option on the command line, each with the exact replacement."""
    lines = []
    for name, value in _split_unknown(extras):
        given = name + (f" {value}" if value is not None else "")
        if not name.startswith("-"):
            lines.append((given, f"a value without an option; see {prog} --help"))
            continue
        found = replacement(name, value, stage)
        if found:
            lines.append((given, f"use {found[0]} ({found[1]})"))
            continue
        close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
        lines.append((given, f"did you mean {close[0]}?" if close else f"see {prog} --help"))
    if len(lines) == 1:
        given, fix = lines[0]
        name = given.split()[0]
        return UsageError(f"unknown option {name}; {fix}" if fix.startswith(("did", "see")) else
                          f"unknown option {given}: {fix}")
    width = max(len(g) for g, _ in lines)
    return UsageError(f"{len(lines)} unknown options, nothing was loaded:\n" +
                      "\n".join(f"  {g:<{width}}  {fix}" for g, fix in lines))
