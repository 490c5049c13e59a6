"""A disk that fills up mid-stage: stage 2 writing hidden states, stage 4 exporting the draft. Each stops in one line
naming the file, the space there and the space still needed (exit 2, no traceback); every file written before it
stays whole, and the same command resumes once there is room. The full disk is a file-size limit on the stage's
process (RLIMIT_FSIZE): a write past it fails with EFBIG, as one on a full disk fails with ENOSPC."""
import json
import re
import resource
import shutil
import signal
import sys

import torch
from safetensors.torch import load_file

from conftest import copy_work, OVERFIT, ROOT, run_cmd, run_script, usage_error

HF = ["--max-seq-len", 192, "--dtype", "float32", "--backend", "hf", "--self-check-samples", 2]


def run_with_file_limit(limit, script, *args):
    """`script` with files capped at `limit` bytes (SIGXFSZ ignored, so the write fails instead of killing it)."""
    def cap():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return run_cmd([sys.executable, ROOT / script, *args], timeout=600, preexec_fn=cap)


def test_a_disk_full_during_extraction_stops_in_one_line_and_keeps_the_written_samples(extracted, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(extracted / "prepared", work / "prepared")
    hs, done = work / "hidden_states", sorted((extracted / "hidden_states").glob("hs_*.safetensors"))
    n = len(done)
    hs.mkdir()
    for p in done[:2]:  # an interrupted extraction: two samples written (the HF backend's files are the same)
        shutil.copy(p, hs / p.name)
    before = {p.name: p.read_bytes() for p in hs.iterdir()}
    proc = run_with_file_limit(done[0].stat().st_size // 2, "02_extract_hidden_states.py", "--work-dir", work, *HF)
    line = usage_error(proc)
    assert line.startswith(f"error: writing {hs}/hs_") and "the disk is full (" in line, line
    assert re.search(r" free there, ~\d+\.\d MB needed\); every file written before it is kept: free space and run the "
                     r"same command to resume$", line), line
    assert "2 already done" in proc.output
    assert {p.name: p.read_bytes() for p in hs.iterdir()} == before  # no half-written file, the others whole
    again = run_script("02_extract_hidden_states.py", "--work-dir", work, *HF)
    assert again.returncode == 0, again.output[-2000:]
    assert f"2 already done, {n - 2} to extract" in again.output
    assert json.loads((hs / "manifest.json").read_text())["counts"]["samples"] == n


def test_a_disk_full_during_the_export_stops_in_one_line_and_keeps_the_checkpoints(trained, tmp_path):
    work = copy_work(trained, tmp_path / "w")
    shutil.copytree(trained / "train", work / "train")
    shutil.copytree(trained / "final_draft", work / "final_draft")
    before = {p.name: p.read_bytes() for p in (work / "final_draft").iterdir()}
    weights = work / "final_draft" / "model.safetensors"
    # the finished run's command again: nothing to train, the export is rewritten and does not fit
    proc = run_with_file_limit(weights.stat().st_size // 2, "04_train.py", "--work-dir", work, *OVERFIT)
    line = usage_error(proc)
    # what the export still needed: the size of the file it writes, as the whole earlier export shows on disk
    need = float(re.search(r"~(\d+\.\d) MB needed\); every file written before it is kept", line).group(1)) * 1e6
    assert line.startswith(f"error: writing {weights} failed: the disk is full ("), line
    assert abs(need - weights.stat().st_size) < 0.01 * weights.stat().st_size + 0.1e6, (need, weights.stat().st_size)
    assert {p.name: p.read_bytes() for p in (work / "final_draft").iterdir()} == before  # the earlier export, whole
    ckpts = sorted((work / "train" / "checkpoints").glob("step_*"))
    assert ckpts and all((c / "state.pt").is_file() for c in ckpts)
    load_file(str(ckpts[-1] / "trainable.safetensors"))
    again = run_script("04_train.py", "--work-dir", work, *OVERFIT)
    assert again.returncode == 0 and "validation @" not in again.output, again.output[-2000:]
    torch.testing.assert_close(load_file(str(weights)), load_file(str(trained / "final_draft" / "model.safetensors")))


VLLM = ["--max-seq-len", 192, "--dtype", "float32", "--backend", "vllm", "--self-check-samples", 2]


def test_a_disk_full_in_vllms_connector_stops_in_one_line_and_keeps_the_written_samples(extracted, tmp_path):
    """The default backend writes through vLLM's connector in the engine (common/hs_connector.py): a write that fails
    there leaves no half file and stage 2 stops in the same one line, the samples before it whole; the re-run ends
    the job."""
    work = tmp_path / "w"
    shutil.copytree(extracted / "prepared", work / "prepared")
    hs, done = work / "hidden_states", sorted((extracted / "hidden_states").glob("hs_*.safetensors"))
    hs.mkdir()
    for p in done[:2]:
        shutil.copy(p, hs / p.name)
    before = {p.name: p.read_bytes() for p in hs.iterdir()}
    proc = run_with_file_limit(done[0].stat().st_size // 2, "02_extract_hidden_states.py", "--work-dir", work, *VLLM)
    line = usage_error(proc)
    assert line.startswith(f"error: writing {hs}/.staging-") and "the disk is full (" in line, line
    assert "File too large" in line or "code: 27" in line, line  # the writer's own cause, from the engine's side
    assert re.search(r" free there, ~\d+\.\d MB needed\); every file written before it is kept", line), line
    assert {p.name: p.read_bytes() for p in hs.iterdir() if p.name.startswith("hs_")} == before
    again = run_script("02_extract_hidden_states.py", "--work-dir", work, *VLLM)
    assert again.returncode == 0, again.output[-2000:]
    assert json.loads((hs / "manifest.json").read_text())["counts"]["samples"] == len(done)


APPEND = """
import resource, signal, sys
sys.path.insert(0, {root!r})
from common.errors import run_main
from common.io import append_line
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
run_main(lambda: [append_line(sys.argv[1], '{{"step": %d, "loss": 1.2345678}}' % i) for i in range(10)] and 0)
"""


def test_a_disk_full_in_stage_4s_metrics_log_keeps_it_readable(tmp_path):
    """Stage 4 appends a line to metrics.jsonl every step (common/io.append_line): on a full disk the half line is
    cut off again (the resume reads every line back), and the stage stops in one line naming the file."""
    log = tmp_path / "metrics.jsonl"
    proc = run_cmd([sys.executable, "-c", APPEND.format(root=str(ROOT)), log])
    line = usage_error(proc)
    assert line.startswith(f"error: writing {log} failed: the disk is full (") and "~0.0 MB needed" in line, line
    rows = [json.loads(x) for x in log.read_text().splitlines()]  # whole lines only
    assert [r["step"] for r in rows] == list(range(len(rows))) and 2 <= len(rows) < 10
    assert log.stat().st_size <= 100 and log.read_text().endswith("\n")
