#!/usr/bin/env python3
"""Why a served acceptance length differs from training's simulated one, on a run's held-out samples that
hold the verifier's own answers (what vLLM serves at temperature 0). Our exported draft runs over each
sample's stored hidden states (common/parity.py) and gives:
  every position: 1 + the mean run of right drafts over every answer position (training's way);
  verify walk:    the same predictions sampled where vLLM's verify steps start (each step jumps 1 + accepted,
                  so easy stretches get fewer steps: the served figure is a token-weighted harmonic mean);
  vLLM:           the served figure on the same prompts, and how many of its verify steps the walk predicts,
                  from <work>/eval/outputs.jsonl of `05_evaluate.py --eval-dataset validation` (if there).

  python bench/served_vs_simulated.py --work-dir W [--hidden-states DIR] [-k 3]
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.parity import load_exported_draft, predictions, served_steps, verify_walk  # noqa: E402
from common.prepare import DATASET_ANSWER, load_prepared  # noqa: E402


def acceptance_length(steps):
    return 1 + sum(a for _, a in steps) / max(len(steps), 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work-dir", required=True, type=Path)
    ap.add_argument("--hidden-states", type=Path, help="another extraction of the same prepared data (default: W's)")
    ap.add_argument("-k", type=int, default=3)
    a = ap.parse_args()
    work, k = a.work_dir, a.k
    folder = a.hidden_states or work / "hidden_states"
    _, records = load_prepared(work)
    held = json.loads((work / "train" / "manifest.json").read_text())["validation_samples"]
    outputs = work / "eval" / "outputs.jsonl"
    served = {r["id"]: r for r in map(json.loads, outputs.read_text().splitlines())} if outputs.is_file() else {}
    model, d2t = load_exported_draft(work)
    every, walk, walk_served, vllm, agree, compared, samples, n_served = [], [], [], [], 0, 0, 0, 0
    for i in held:
        rec = records[i]
        if rec["id"].endswith(DATASET_ANSWER):
            continue  # vLLM would not write the dataset's answer: nothing to compare step by step
        samples += 1
        prompt = rec["loss_mask"].index(1)
        n = len(rec["input_ids"]) - prompt
        predicted = predictions(model, d2t, folder, i, rec["input_ids"], k)
        every += [(q, predicted[prompt + q][0]) for q in range(1, n - k + 1)]
        walk += verify_walk(predicted, prompt, n, k)
        out = served.get(rec["id"])
        if out and out[f"k{k}_ids"] == rec["input_ids"][prompt:prompt + len(out[f"k{k}_ids"])]:
            n_served += 1
            walk_served += verify_walk(predicted, prompt, len(out[f"k{k}_ids"]), k)
            ids, steps = out[f"k{k}_ids"], out[f"k{k}_accepted_per_step"]
            for t, accepted in served_steps(rec["input_ids"], prompt, ids, steps, k):
                vllm.append((t - prompt, accepted))
                agree += accepted == predicted[t][0]
                compared += 1
    print(f"{samples} held-out samples with the verifier's own answers, k={k}, hidden states from {folder}")
    print(f"every position (training's way): acceptance length {acceptance_length(every):.3f} over {len(every)} positions")
    print(f"verify walk (where vLLM's steps start): {acceptance_length(walk):.3f} over {len(walk)} steps")
    if vllm:
        print(f"vLLM, on the {n_served} of them it served: {acceptance_length(vllm):.3f} over {len(vllm)} steps; the walk "
              f"on the same answers {acceptance_length(walk_served):.3f}; at vLLM's steps the predictions agree at "
              f"{agree}/{compared} ({100 * agree / compared:.1f}%)")


if __name__ == "__main__":
    main()
