"""Stage 4 when something goes wrong: killed and resumed (the same curve and weights), a planted pickle payload,
damaged or foreign hidden-state files, a file failing mid-training, a loss that is not finite, a damaged export, a
disk too small for its checkpoints. Each stops in one line (exit 2, no traceback) and keeps what was written."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import copy_work, OVERFIT, ROOT, run_script, script_env, usage_error, VOCAB


# fp32 (--amp off, as test_ddp runs): the resume is compared exactly, on every machine kind (bf16 autocast once parted
# two identical processes at step 1 on an AMX Xeon, which no resume causes). EAGLE-3 with --hidden-noise: the noise
# each sequence draws must be drawn again after the resume (from the sequence's own seed, common/trainer.py)
@pytest.mark.parametrize("extra", [("--hidden-noise", 0.2), ("--optimizer", "muon", "--draft-method", "dflash",
                                                             "--block-size", 4, "--draft-layers", 2, "--max-anchors", 16)],
                         ids=["eagle3_noise", "dflash_muon"])
def test_sigkill_resume_matches_uninterrupted(extracted, tmp_path, extra):
    args = [*VOCAB, "--epochs", 4, "--max-tokens-per-step", 256, "--num-workers", 0, "--val-fraction", 0.5,
            "--save-every", 2, "--keep-last", 3, "--log-interval", 0, "--lr", 1e-3, "--max-seq-len", 192,
            "--amp", "off", *extra]
    runs = {}
    for name in ("straight", "killed"):
        work = copy_work(runs.get("straight") or extracted, tmp_path / name)
        if name == "straight":  # the killed run copies its vocab
            run_script("03_build_vocab_mapping.py", "--work-dir", work, *VOCAB, check=True)
        else:
            cmd = [sys.executable, str(ROOT / "04_train.py"), "--work-dir", str(work), *map(str, args)]
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                    env=script_env(), start_new_session=True)
            ck = work / "train" / "checkpoints"
            deadline = time.time() + 300
            while time.time() < deadline and not (ck / "step_4" / "state.pt").exists():
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            assert not (work / "train" / "manifest.json").exists()
        proc = run_script("04_train.py", "--work-dir", work, *args)
        assert proc.returncode == 0, proc.output[-3000:]
        if name == "killed":
            resumed_at = int(re.search(r"resumed from \S*step_(\d+)", proc.output).group(1))
            assert 4 <= resumed_at, proc.output[-2000:]
        runs[name] = work
    a_ck, b_ck = (sorted((w / "train" / "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:]))[-1]
                  for w in runs.values())
    assert a_ck.name == b_ck.name
    rows = [list(map(json.loads, (w / "train" / "metrics.jsonl").read_text().splitlines())) for w in runs.values()]
    # every step and validation row, its loss and accuracies included: the resumed run is the same run
    assert [r for r in rows[0] if r["kind"] == "val"] == [r for r in rows[1] if r["kind"] == "val"], resumed_at
    timing = {"tokens_per_s", "step_time_s", "data_wait", "peak_mem_gb", "train_seconds"}
    train = [[{k: v for k, v in r.items() if k not in timing} for r in run if r["kind"] == "train"] for run in rows]
    assert train[0] == train[1], f"resumed at step {resumed_at}"
    for a_dir, b_dir in ((a_ck, b_ck), *[(runs["straight"] / "final_draft", runs["killed"] / "final_draft")]):
        for f in ("trainable.safetensors",) if "step_" in a_dir.name else ("model.safetensors",):
            a, b = load_file(str(a_dir / f)), load_file(str(b_dir / f))
            assert sorted(a) == sorted(b)
            for k in a:
                torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{f} {k}: {m}")
    mans = [json.loads((w / "train" / "manifest.json").read_text()) for w in runs.values()]
    assert mans[0]["best_validation"] == mans[1]["best_validation"] and mans[0]["best_validation"]
    # the same command once more on a finished run: nothing retrained, re-validated or lost
    metrics = (runs["killed"] / "train" / "metrics.jsonl").read_text()
    proc = run_script("04_train.py", "--work-dir", runs["killed"], *args)
    assert proc.returncode == 0 and "resumed from" in proc.output and "validation @" not in proc.output
    assert (runs["killed"] / "train" / "metrics.jsonl").read_text() == metrics
    # other settings on the same checkpoints: a one-line usage error naming them, nothing touched
    proc = run_script("04_train.py", "--work-dir", runs["killed"], *args, "--lr", 2e-3)
    assert proc.returncode == 2 and "other settings (lr)" in proc.output and "Traceback" not in proc.output
    assert (runs["killed"] / "train" / "metrics.jsonl").read_text() == metrics


class _Payload:
    """What a tampered state.pt could hold: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_payload_planted_in_a_checkpoint_is_refused_unrun(trained, tmp_path):
    from common.checkpoints import latest_checkpoint
    work = tmp_path / "w"
    shutil.copytree(trained, work)
    ckpt = latest_checkpoint(work / "train" / "checkpoints")
    state = torch.load(ckpt / "state.pt", weights_only=True)  # our own checkpoints load as plain data
    marker = tmp_path / "payload-ran"
    torch.save({**state, "extra": _Payload(marker)}, ckpt / "state.pt")
    proc = run_script("04_train.py", "--work-dir", work, *OVERFIT)  # the same command resumes from it
    last = usage_error(proc)
    assert last.startswith("error: ") and "state.pt holds more than tensors and plain data" in last, last
    assert not marker.exists()


def test_damaged_missing_or_foreign_hidden_state_files_are_refused_before_training(extracted, tmp_path):
    """Stage 4 reads every file's header first: a deleted, cut-short, overwritten or foreign file stops it in one
    line naming that file, before the draft is built (it once trained on without them, or died in a traceback)."""
    from common.hidden_states import read_meta
    work = copy_work(extracted, tmp_path / "w")
    run_script("03_build_vocab_mapping.py", "--work-dir", work, *VOCAB, check=True)
    hs = work / "hidden_states"
    good = (hs / "hs_1.safetensors").read_bytes()
    other = (hs / "hs_2.safetensors").read_bytes()
    damage = [("deleted", lambda p: p.unlink(), "is missing"),
              ("cut short", lambda p: p.write_bytes(good[:len(good) // 2]), "cannot be read"),
              ("garbage", lambda p: p.write_bytes(os.urandom(4096)), "cannot be read"),
              ("another sample's file", lambda p: p.write_bytes(other), "holds")]  # its shape, or its tokens
    assert read_meta(hs / "hs_1.safetensors")["params_hash"]
    for what, harm, needle in damage:
        harm(hs / "hs_1.safetensors")
        proc = run_script("04_train.py", "--work-dir", work, *OVERFIT, "--max-steps", 1)
        line = usage_error(proc)
        assert line.startswith(f"error: {hs / 'hs_1.safetensors'} {needle}"), (what, line)
        assert "re-run 02_extract_hidden_states.py with the same options: it redoes just those files" in line
        assert "precision:" not in proc.output and not (work / "train" / "checkpoints").exists()  # no draft built
        (hs / "hs_1.safetensors").write_bytes(good)
    proc = run_script("04_train.py", "--work-dir", work, *OVERFIT, "--max-steps", 1, "--max-tokens-per-step", 64)
    assert proc.returncode == 2 and "more than --max-tokens-per-step 64" in proc.stderr, proc.output[-2000:]


def test_a_file_that_fails_mid_training_stops_the_stage_in_one_line(extracted, tmp_path):
    """Read through a loader worker process (as training reads), a file that went bad after the preflight ends
    in one line naming it, not in the worker's traceback."""
    from common.trainer import Trainer
    from common.train_data import make_loader
    hs = shutil.copytree(extracted / "hidden_states", tmp_path / "hidden_states")
    (hs / "hs_3.safetensors").write_bytes(b"\0" * 100)
    waiting = SimpleNamespace(data_wait=0.0)
    from common.errors import UsageError
    with pytest.raises(UsageError) as err:
        for _ in Trainer._waited(waiting, make_loader(hs, [[0], [3]], 512, num_workers=1)):
            pass
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{hs / 'hs_3.safetensors'} cannot be read mid-training"), msg
    assert "training resumes from its last checkpoint" in msg


def test_a_loss_that_is_not_finite_stops_training_in_one_line_keeping_the_checkpoints(trained, tmp_path):
    """A learning rate that blows the weights up (z-lab/dflash #115: NaN norms at step ~240 at lr 6e-4): the first step
    whose loss or gradient is not finite stops before its update, in one line naming the step, the tensor and the
    samples; the checkpoints written before it stay."""
    work = copy_work(trained, tmp_path / "w")
    proc = run_script("04_train.py", "--work-dir", work, *OVERFIT, "--lr", 1e30, "--warmup-steps", 0, "--save-every", 1,
                      "--keep-last", 3, "--epochs", 3)
    last = proc.stderr.strip().splitlines()[-1]
    usage_error(proc)
    m = re.match(r"error: step (\d+): (the loss|the gradient of \S+) is not finite \(samples \[[\d, ]+\]\); stopped "
                 r"before the update, checkpoint step_(\d+) kept; lower --lr \(now 1e\+30\)", last)
    assert m and int(m.group(3)) == int(m.group(1)) - 1, last
    assert (work / "train" / "checkpoints" / f"step_{m.group(3)}" / "state.pt").is_file()
    assert not (work / "final_draft").exists()


def test_a_damaged_exported_draft_is_refused_before_an_engine_starts(trained, tmp_path):
    """Stage 5 checks final_draft/ first: a damaged config.json or model.safetensors, or one that is not what
    stage 4 exported, costs one line and no model load (it used to start the verifier's engine, then die)."""
    work = tmp_path / "w"
    (work / "train").mkdir(parents=True)
    shutil.copy(trained / "train" / "manifest.json", work / "train" / "manifest.json")
    shutil.copytree(trained / "final_draft", work / "final_draft")
    conf, weights = work / "final_draft" / "config.json", work / "final_draft" / "model.safetensors"
    good_conf, good_weights = conf.read_text(), weights.read_bytes()
    other = json.loads(good_conf)
    other.pop("eagle_aux_hidden_state_layer_ids")
    for harm, needle in [(lambda: conf.write_text(good_conf[:50]), "config.json is not valid JSON"),
                         (lambda: conf.write_text(json.dumps(other)), "has no top-level eagle_aux_hidden_state_layer_ids"),
                         (lambda: weights.write_bytes(good_weights[:1000]), "model.safetensors cannot be read"),
                         (lambda: weights.unlink(), "model.safetensors is missing")]:
        harm()
        proc = run_script("05_evaluate.py", "--work-dir", work, "--eval-limit", 1)
        line = usage_error(proc)
        assert needle in line and "re-run 04_train.py" in line, line
        assert "vLLM engine ready" not in proc.output and "baseline" not in proc.output
        conf.write_text(good_conf)
        weights.write_bytes(good_weights)


def test_a_checkpoint_the_disk_cannot_hold_stops_in_one_line_and_keeps_the_last(tmp_path):
    """A full disk mid-run (a 42 GB Kimi DFlash checkpoint filled an H200 node's disk: a torch.save traceback and a
    half-written folder) ends in one line; the half-written checkpoint is removed, the one before it kept. The full
    disk is a file-size limit on a child process: writes past 1 MiB fail there as on a full disk."""
    code = f"""
import resource, signal, sys, torch
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
from common.checkpoints import latest_checkpoint, save_checkpoint
from common.errors import UsageError
opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))])
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
weights, folder = {{"w": torch.ones(1 << 19)}}, Path({str(tmp_path)!r})
save_checkpoint(folder / "step_1", weights, opt.state_dict(), sched, {{"step": 1}})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    save_checkpoint(folder / "step_2", {{"w": torch.ones(1 << 20)}}, opt.state_dict(), sched, {{"step": 2}})
except UsageError as exc:
    print("refused:", exc)
print("latest:", latest_checkpoint(folder).name)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 2, proc.stdout + proc.stderr
    assert lines[0].startswith(f"refused: writing checkpoint {tmp_path / 'step_2'} failed (") and "File too large" in \
        lines[0] and lines[0].endswith("the checkpoints before it are kept: free space and run the same command to "
                                       "resume"), lines[0]
    assert lines[1] == "latest: step_1" and sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
    assert load_file(str(tmp_path / "step_1" / "trainable.safetensors"))["w"].numel() == 1 << 19


def test_checkpoints_that_cannot_fit_on_disk_are_refused_before_training(tmp_path):
    """The disk preflight counts the checkpoints a run holds at once (--keep-last, the best, the one being written),
    each 12 bytes a trainable parameter, minus those already there, plus the export."""
    from common.errors import UsageError
    from common.train_preflight import checkpoint_disk
    cfg = SimpleNamespace(epochs=10, save_every=0, keep_last=2)
    assert checkpoint_disk(cfg, 1000, 40, 10, tmp_path) == 12000
    free = shutil.disk_usage(tmp_path).free
    n = free // 12 // 3  # 3 slots of this size fit; 4 (--keep-last 2: two, the best, the one being written) do not
    with pytest.raises(UsageError) as err:
        checkpoint_disk(cfg, n, 40, 10, tmp_path)
    msg = str(err.value)
    assert msg.startswith(f"4 checkpoints of ~{12 * n / 1e9:.1f} GB each (--keep-last 2, the best, the one being "
                          f"written) and the export need ~") and "lower --keep-last" in msg, msg
    checkpoint_disk(SimpleNamespace(epochs=10, save_every=0, keep_last=0), n, 40, 10, tmp_path)  # 2 slots fit
    with pytest.raises(UsageError, match="^3 checkpoints"):  # --save-every 10 over 20 steps of 2 epochs: 4 saves
        checkpoint_disk(SimpleNamespace(epochs=2, save_every=10, keep_last=1), 2 * n, 20, 2, tmp_path)
    checkpoint_disk(SimpleNamespace(epochs=1, save_every=0, keep_last=2), n, 4, 1, tmp_path)  # one save
