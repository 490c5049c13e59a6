"""Helpers for run_pipeline.sh: is a stage already complete for this config, and the run report.

  python -m common.pipeline done STAGE [options...]   exit 0 if STAGE's manifest is complete and matches
  python -m common.pipeline report [options...]       write WORK_DIR/report.md from the manifests
"""
import json
import sys
from pathlib import Path

from common.config import parse_config

FOLDERS = {"01_prepare_dataset": "prepared", "02_extract_hidden_states": "hidden_states",
           "03_build_vocab_mapping": "vocab", "04_train": "train", "05_evaluate": "eval"}
# options whose value a finished stage's manifest must match for the stage to count as done (a changed one
# re-runs the stage, which resumes what still holds: regeneration chunks and hidden-state files are keyed by
# the settings they depend on)
KEYS = {"01_prepare_dataset": ["dataset", "dataset_split", "num_samples", "seed", "shuffle", "dedup", "max_turns",
                               "max_seq_len", "regenerate", "keep_original_answers", "original_turns", "temperature", "max_new_tokens",
                               "repetition_penalty", "drop_capped_answers", "drop_reasoning"],
        "02_extract_hidden_states": ["hs_dtype", "layer_ids"],
        "03_build_vocab_mapping": ["draft_vocab_size", "draft_vocab_from"],
        "04_train": ["epochs", "max_steps", "ttt_steps", "ttt_decay", "answer_start_weight", "answer_start_tokens",
                     "lr", "warmup_steps", "weight_decay", "grad_clip",
                     "max_tokens_per_step", "seed", "val_fraction", "export_format", "hidden_noise", "train_lm_head",
                     "draft_method", "block_size", "max_anchors", "loss", "block_weights", "optimizer"],
        "05_evaluate": ["eval_dataset", "eval_limit", "num_speculative_tokens", "max_new_tokens", "exact_k_sweep"]}


def manifest(work, stage):
    path = Path(work) / FOLDERS[stage] / "manifest.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if data.get("status") == "complete" else None


def stage_done(stage, cfg):
    man = manifest(cfg.work_dir, stage)
    if man is None:
        return False
    if any(man["params"].get(k) != cfg[k] for k in KEYS[stage] if k in man["params"] and cfg[k] is not None):
        return False
    recorded = man.get("options") or {}  # stage 4: every option that shapes the draft (older manifests: KEYS only)
    if any(recorded[k] != json.loads(json.dumps(cfg[k])) for k in recorded
           if cfg.get(k) is not None and recorded[k] is not None):  # None: derived (layer ids: stage 2's)
        return False
    if "model_dir" in man["params"]:  # another verifier (an HF id and its snapshot folder are the same one)
        from common.models import resolve_verifier
        if man["params"]["model_dir"] != resolve_verifier(cfg.verifier, create=False):
            return False
    if stage == "02_extract_hidden_states":
        prep = manifest(cfg.work_dir, "01_prepare_dataset")
        return bool(prep) and man["params"]["prepared_sha256"] == prep["outputs"]["tokenized_data_sha256"] \
            and man["counts"]["samples"] == man["counts"]["samples_expected"]
    if stage == "04_train":
        return (Path(cfg.work_dir) / "final_draft" / "model.safetensors").is_file()
    return True


def report(cfg):
    work = Path(cfg.work_dir)
    m = {s: manifest(work, s) for s in FOLDERS}
    timings = json.loads((work / "logs" / "timings.json").read_text()) if (work / "logs" / "timings.json").is_file() else {}
    lines = [f"# eagle3-train run report: {work}", "", "## Stages", "", "| stage | wall time | key figures |", "|---|---|---|"]
    p, h, v, t, e = (m[s] for s in FOLDERS)
    figures = {
        "01_prepare_dataset": p and (f"{p['counts']['samples']} samples, {p['counts']['total_tokens']} tokens, "
                                     f"{p['counts']['assistant_tokens']} assistant tokens" +
                                     (f", {p['regeneration']['hit_length_cap']} answers hit the length cap"
                                      if p.get("regeneration") else "")),
        "02_extract_hidden_states": h and (f"{h['counts']['tokens']} tokens, {h['counts']['bytes'] / 1e9:.2f} GB, "
                                           f"self-check agreement {(h.get('self_check') or {}).get('next_token_agreement')}"),
        "03_build_vocab_mapping": v and (f"draft vocab {v['counts']['draft_vocab_size']}, coverage "
                                         f"{100 * v['counts']['coverage']:.2f}%, {v['counts']['unique_assistant_tokens']} "
                                         f"unique assistant tokens"),
        "04_train": t and (f"{t['counts']['steps']} steps, {t['timings']['tokens_per_s']} tokens/s, best simulated "
                           f"acceptance length " + (f"{t['best_validation']['acceptance_length']:.3f}"
                                                    if t.get("best_validation") else "not measured (no validation)")),
        "05_evaluate": e and "; ".join(f"k={r['num_speculative_tokens']}: acceptance length {r['acceptance_length']:.3f}"
                                       + (f", speedup {r['speedup']:.2f}x" if r.get("speedup") is not None
                                          else f" (derived from k={r.get('derived_from_k')})")
                                       for r in e["results"]),
    }
    for s in FOLDERS:
        secs = timings.get(s)
        lines.append(f"| {s} | {f'{secs / 60:.1f} min' if secs is not None else '-'} | {figures[s] or 'not run'} |")
    if timings:
        lines += ["", f"Total wall time: {sum(timings.values()) / 60:.1f} min"]
    if t and t.get("best_validation"):
        bv, k = t["best_validation"], t["params"].get("positions") or t["params"]["ttt_steps"]
        lines += ["", "## Validation accuracy per TTT position", "", "| position | full | conditional |", "|---|---|---|"]
        lines += [f"| {i} | {bv[f'full_acc_{i}']:.3f} | {bv[f'cond_acc_{i}']:.3f} |" for i in range(k)]
    if (work / "train" / "curves.png").is_file():
        lines += ["", "![training curves](train/curves.png)"]
    if (work / "eval" / "acceptance.md").is_file():
        lines += ["", "## Acceptance in vLLM", "", (work / "eval" / "acceptance.md").read_text()]
    (work / "report.md").write_text("\n".join(lines) + "\n")
    return work / "report.md"


def main(argv):
    cmd = argv[0]
    if cmd == "done":
        cfg = parse_config(0, "", argv[2:])
        return 0 if stage_done(argv[1], cfg) else 1
    if cmd == "report":
        print(report(parse_config(0, "", argv[1:])))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
