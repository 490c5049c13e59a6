"""What vLLM should accept, predicted from our draft: the exported weights run over a sample's stored hidden states,
as in training, give for every place a verify step can start how many leading drafts are right. A vLLM verify step
whose first drafted token is token t of the sequence sees what training sees there (EAGLE-3: row t-2 of the TTT
unroll; DFlash: the block anchored at t-1, the last accepted token): the same context, the same teacher-forced
tokens wherever the drafts are right. So that count is vLLM's accepted count, numerics aside: the stored states are
bf16, vLLM's fp32, and a draft whose top two tokens are nearly tied (a small logit margin) may flip. Stage 5 compares
every served verify step with this prediction (compare_steps); the parity gate (tests/test_parity.py) and
bench/served_vs_simulated.py use it too.
"""
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

# logits between our draft's top two tokens below which a flip may be numerics (bf16 stored states against vLLM's
# fp32): the flips of correct exports measured 0.003 (docs/parity.md); an off-by-one aux id parts at up to 1.6
NEAR_TIE = 0.5


def load_exported_draft(work, device="cpu"):
    """Our draft (EAGLE-3 or DFlash) with the exported (bf16) weights of <work>/final_draft, as vLLM loads them;
    -> (model, d2t)."""
    from common.build_draft import build_model
    from common.drafts import method_of
    man = json.loads((work / "train" / "manifest.json").read_text())
    m = method_of(man["params"])
    d2t = np.load(work / "vocab" / "d2t.npy")
    model_dir = json.loads((work / "prepared" / "manifest.json").read_text())["params"]["model_dir"]
    model = build_model(m.geometry_class().from_dict(man["params"]["geometry"]), model_dir, d2t + np.arange(len(d2t)))
    exported = m.import_weights(load_file(str(work / "final_draft" / "model.safetensors")))
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in exported.items()}, strict=False)
    return model.eval().to(device), torch.as_tensor(d2t)


def _batch(folder, index, n, shift, device):
    from common.train_data import PackedDataset
    b = PackedDataset(folder, [[index]], n, shift=shift)[0]
    return {key: (v.float() if v.is_floating_point() else v).to(device) if torch.is_tensor(v) else v
            for key, v in b.items()}


def _counts(guess, margins, tokens, starts, k):
    """guess/margins [S, k] for the steps whose first draft is token starts[s] -> {t: (right drafts, margins)}."""
    out = {}
    for s, t in enumerate(starts.tolist()):
        n = 0
        while n < k and t + n < len(tokens) and guess[s, n] == tokens[t + n]:
            n += 1
        out[t] = (n, margins[s].tolist())
    return out


def predictions(model, d2t, folder, index, tokens, k):
    """t -> (leading right drafts of a verify step whose first draft is token t, our draft's logit margin between
    its top two tokens at each drafted position), for sample `index` (hidden states in folder)."""
    from common.drafts import method
    dev = next(model.parameters()).device
    tokens = torch.as_tensor(tokens)
    m = method(model.g.method)  # EAGLE-3: TTT rows; DFlash: the block anchored at the last accepted token
    with torch.no_grad():
        logits, starts = m.predict(model, _batch(folder, index, len(tokens), m.shift, dev), k)
        top = logits.topk(2, dim=-1)
    guess = (top.indices[..., 0] + d2t.to(dev)[top.indices[..., 0]]).cpu()
    margins = (top.values[..., 0] - top.values[..., 1]).cpu()
    return _counts(guess, margins, tokens, starts, k)


def served_steps(tokens, prompt, served_ids, accepted_per_step, k):
    """vLLM's verify steps of one request whose k drafts lie inside both its output and the stored sample (the
    stored answer is the verifier's own, so the two agree until either ends) -> [(t, accepted)], t the sequence
    position of the step's first drafted token."""
    same = 0
    while same < len(served_ids) and prompt + same < len(tokens) and served_ids[same] == tokens[prompt + same]:
        same += 1
    out, q = [], 1  # the answer's first token comes from the prefill
    for accepted in accepted_per_step:
        if q + k <= same:
            out.append((prompt + q, accepted))
        q += accepted + 1
    return out


def compare_steps(pairs, k):
    """pairs [(served accepted, (predicted, margins), label)] -> the gate's figures: steps, agreeing steps, per-position
    acceptance served and predicted over the same steps, and every disagreement with its deciding margin (the first
    drafted position where the two differ), smallest first."""
    n = len(pairs)
    agree = sum(a == p for a, (p, _), _ in pairs)
    ties = sorted(({"step": label, "served": a, "predicted": p, "margin": round(m[min(a, p)], 3)}
                   for a, (p, m), label in pairs if a != p), key=lambda d: d["margin"])
    per_pos = lambda f: [round(sum(f(x) > j for x in pairs) / n, 4) if n else None for j in range(k)]  # noqa: E731
    return {"steps": n, "agree": agree, "served_per_position": per_pos(lambda x: x[0]),
            "predicted_per_position": per_pos(lambda x: x[1][0]), "disagreements": ties,
            "beyond_near_ties": sum(d["margin"] >= NEAR_TIE for d in ties)}


def verdict(c):
    """'' when vLLM accepted what the draft predicts (near-ties aside), else one line naming the likely causes."""
    if not c["steps"]:  # no proof either way: say so, rather than pass
        return (f"the served-vs-trained check compared no verify step ({c.get('prompts', 0)} held-out samples, none with "
                f"a verify step inside its stored answer): served acceptance is unchecked against training; hold out "
                f"more samples (stage 4's --val-fraction) or raise --max-new-tokens")
    gap = max(abs(a - b) for a, b in zip(c["served_per_position"], c["predicted_per_position"]))
    if c["agree"] >= 0.95 * c["steps"] and gap <= 0.02 and c["beyond_near_ties"] <= 0.01 * c["steps"]:
        return ""
    return (f"vLLM accepted otherwise than the draft predicts at {c['steps'] - c['agree']} of {c['steps']} verify steps "
            f"({c['beyond_near_ties']} beyond near-ties; per position served {c['served_per_position']} vs predicted "
            f"{c['predicted_per_position']}): likely causes: a draft config vLLM reads otherwise than training used "
            f"(aux layer ids, EAGLE-3.1 norms, DFlash causality), hidden states from another verifier, dtype or engine "
            f"version than the one serving, or a chat template other than stage 1's")


def verify_walk(predicted, prompt, answer_len, k):
    """The verify steps vLLM would take if its drafts were these predictions: [(answer position q, accepted)],
    from q = 1 (the prefill writes answer token 0), each step moving 1 + accepted; steps whose k drafts lie
    inside the answer only."""
    steps, q = [], 1
    while q + k <= answer_len:
        accepted = predicted[prompt + q][0]
        steps.append((q, accepted))
        q += accepted + 1
    return steps


def parity_samples(work, limit, room):
    """The first `limit` held-out samples that hold the verifier's own answer (what vLLM writes at temperature 0) and
    whose prompt fits `room` tokens -> ([(index, record)], why none)."""
    from common.hidden_states import sample_path
    from common.io import read_manifest
    from common.prepare import DATASET_ANSWER, load_prepared
    if not limit:
        return [], "--parity-prompts 0"
    prep, records = load_prepared(work)
    if not prep["params"].get("regenerate"):
        return [], "stage 1 kept the dataset's answers (no --regenerate): vLLM writes other ones"
    held = read_manifest(Path(work) / "train", "train", "04_train.py").get("validation_samples") or []
    chosen = [(i, records[i]) for i in held if not records[i]["id"].endswith(DATASET_ANSWER)
              and records[i]["loss_mask"].index(1) <= room and sample_path(Path(work) / "hidden_states", i).is_file()]
    return chosen[:limit], "" if chosen else "no held-out sample with the verifier's own answer and its hidden states"


def served_vs_predicted(work, samples, checked, k):
    """vLLM's verify steps on `samples` (checked: their served tokens and steps) against what our exported draft,
    run as in training over the same tokens' stored hidden states, predicts at each step (common/parity.py)."""
    # on the CPU everywhere: the path the tests run (at Kimi width its cost is unmeasured; --parity-prompts 0 skips it)
    model, d2t = load_exported_draft(Path(work))
    pairs = []
    for (i, rec), ids, steps in zip(samples, *checked):
        prompt = rec["loss_mask"].index(1)
        at = served_steps(rec["input_ids"], prompt, ids, steps or [], k)
        if at:
            predicted = predictions(model, d2t, Path(work) / "hidden_states", i, rec["input_ids"], k)
            pairs += [(a, predicted[t], f"{rec['id']}@{t - prompt}") for t, a in at]
    return dict(compare_steps(pairs, k), prompts=len(samples))


def parity_table(r, c):
    """acceptance.md's section: per position, vLLM beside the draft's prediction at the same verify steps and stage 4's
    validation figure (every held-out position), then the disagreements with their margins."""
    trained = c.get("stage4_validation") or [None] * len(c["served_per_position"])
    lines = ["", f"k={r['num_speculative_tokens']}: served against trained on {c['prompts']} held-out samples holding "
                 f"the verifier's own answers: at {c['agree']} of {c['steps']} verify steps vLLM accepted what the draft, "
                 f"run as in training over the same tokens, predicts", "",
             "| drafted position | vLLM | predicted at vLLM's steps | stage 4 validation (every position) |",
             "|---|---|---|---|"]
    shown = lambda x: "not measured" if x is None else f"{x:.3f}"  # noqa: E731 (no verify step compared: no figure)
    lines += [f"| {j + 1} | {shown(s)} | {shown(p)} | {'-' if t is None else f'{t:.3f}'} |"
              for j, (s, p, t) in enumerate(zip(c["served_per_position"], c["predicted_per_position"], trained))]
    if c["disagreements"]:
        shown = ", ".join(f"{d['step']} vLLM {d['served']} / predicted {d['predicted']} (margin {d['margin']:.2f})"
                          for d in c["disagreements"][:12])
        lines += ["", f"Disagreements, smallest logit margin first ({c['beyond_near_ties']} at a margin >= {NEAR_TIE}): "
                      f"{shown}"]
    return lines
