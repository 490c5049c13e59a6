"""torchrun on CPU (gloo): 2 ranks x 1 micro-batch equal 1 process x 2 accumulated micro-batches,
with DDP and with FSDP; an FSDP run resumed from a mid-run checkpoint ends where it would have."""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, run_script

ARGS = ["--draft-vocab-size", 512, "--max-steps", 3, "--max-tokens-per-step", 256, "--num-workers", 0,
        "--val-fraction", 0.2, "--lr", 1e-3, "--max-seq-len", 192, "--num-threads", 1, "--save-every", 1,
        "--amp", "off", "--log-interval", 0]  # fp32: in bf16, AdamW turns rounding-level gradient differences into lr-sized steps


def make_work(extracted, work):
    for sub in ("prepared", "hidden_states"):
        shutil.copytree(extracted / sub, work / sub)
    run_script("03_build_vocab_mapping.py", "--work-dir", work, "--draft-vocab-size", 512, check=True)
    return work


def torchrun(work, *extra, port=29531):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(ROOT / "04_train.py"), "--work-dir", str(work), *map(str, ARGS), "--grad-accum", "1", *map(str, extra)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout + proc.stderr


def last_step(work):
    return max(int(p.name[5:]) for p in (work / "train" / "checkpoints").glob("step_*"))


def logged_losses(work):
    rows = [json.loads(l) for l in (work / "train" / "metrics.jsonl").read_text().splitlines()]
    return [[r[f"loss_{k}"] for k in range(3)] for r in rows if r["kind"] == "train"]


def weights(work, step):
    return load_file(str(work / "train" / "checkpoints" / f"step_{step}" / "trainable.safetensors"))


@pytest.fixture(scope="module")
def single(extracted, tmp_path_factory):
    work = make_work(extracted, tmp_path_factory.mktemp("single") / "w")
    run_script("04_train.py", "--work-dir", work, *ARGS, "--grad-accum", 2, check=True)
    return work


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_torchrun_two_ranks_matches_accumulation(extracted, single, tmp_path, parallel):
    work = make_work(extracted, tmp_path / parallel)
    torchrun(work, "--parallel", parallel)
    last = last_step(single)
    assert last_step(work) == last >= 2
    a, b = weights(single, last), weights(work, last)
    assert sorted(a) == sorted(b) and len(a) == 12
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    # the log shows the global batch's loss (all ranks), not rank 0's half of it
    torch.testing.assert_close(torch.tensor(logged_losses(work)), torch.tensor(logged_losses(single)), rtol=1e-4, atol=0)
    assert (work / "final_draft" / "model.safetensors").is_file()
    if parallel == "fsdp":  # drop the last checkpoint: the same command resumes from the one before, ends equal
        shutil.rmtree(work / "train" / "checkpoints" / f"step_{last}")
        out = torchrun(work, "--parallel", parallel)
        assert "resumed from" in out and f"step {last - 1}," in out
        after = weights(work, last)
        for k in b:
            torch.testing.assert_close(b[k], after[k], rtol=1e-5, atol=1e-6)
