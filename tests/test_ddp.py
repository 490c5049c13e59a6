"""torchrun on CPU (gloo): 2 ranks x 1 micro-batch equal 1 process x 2 accumulated micro-batches, with DDP (EAGLE-3
and DFlash, Muon) and with FSDP; a run killed mid-checkpoint, or resumed from a mid-run checkpoint on 2 ranks or on 1,
ends where it would have; a checkpoint write longer than --dist-timeout aborts no rank."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import kill_tree, ROOT, run_cmd, run_script

ARGS = ["--draft-vocab-size", 512, "--max-steps", 3, "--max-tokens-per-step", 256, "--num-workers", 0,
        "--val-fraction", 0.2, "--lr", 1e-3, "--max-seq-len", 192, "--num-threads", 1, "--save-every", 1,
        "--amp", "off", "--log-interval", 0]  # fp32: in bf16, AdamW turns rounding-level gradient differences into lr-sized steps


def make_work(extracted, work):
    for sub in ("prepared", "hidden_states"):
        shutil.copytree(extracted / sub, work / sub)
    run_script("03_build_vocab_mapping.py", "--work-dir", work, "--draft-vocab-size", 512, check=True)
    return work


def torchrun_cmd(work, *extra, port=29531):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
            str(ROOT / "04_train.py"), "--work-dir", str(work), *map(str, ARGS), "--grad-accum", "1", *map(str, extra)]


def torchrun(work, *extra, port=29531, env=None):
    proc = run_cmd(torchrun_cmd(work, *extra, port=port), timeout=600, env=dict(os.environ, **(env or {})))
    assert proc.returncode == 0, proc.output[-3000:]
    return proc.output


def killed_mid_checkpoint(work, *extra):
    """torchrun stage 4 SIGKILLed (every rank and torchrun itself) while rank 0 writes its step-2 checkpoint: the
    weights file is in step_2.tmp, the rest not yet (the write is slowed to make the moment wide)."""
    env = dict(os.environ, EAGLE3_TEST_SLOW_CHECKPOINT_S="6")
    proc = subprocess.Popen(torchrun_cmd(work, *extra), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    tmp = work / "train" / "checkpoints" / "step_2.tmp"
    deadline = time.time() + 300
    while time.time() < deadline and not (tmp / "trainable.safetensors").exists() and proc.poll() is None:
        time.sleep(0.05)
    kill_tree(proc.pid)  # torchrun and its ranks (each in a session of its own)
    proc.wait()
    assert (tmp / "trainable.safetensors").exists() and not (tmp / "state.pt").exists()
    assert sorted(p.name for p in tmp.parent.iterdir()) == ["step_1", "step_2.tmp"]


def verifier_head_rows(work):
    import numpy as np
    from common.models import load_verifier_pieces, resolve_verifier
    d2t = np.load(work / "vocab" / "d2t.npy")
    head = load_verifier_pieces(resolve_verifier("embedded:smollm2-135m-instruct"))["lm_head.weight"].float()
    return head[torch.as_tensor(d2t + np.arange(len(d2t)))]


def last_step(work):
    return max(int(p.name[5:]) for p in (work / "train" / "checkpoints").glob("step_*"))


def logged(work, key):
    return [r[key] for r in map(json.loads, (work / "train" / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"]


def logged_losses(work):
    return [list(x) for x in zip(*(logged(work, f"loss_{k}") for k in range(3)))]


def weights(work, step):
    return load_file(str(work / "train" / "checkpoints" / f"step_{step}" / "trainable.safetensors"))


@pytest.fixture(scope="module")
def single(extracted, tmp_path_factory):
    """1 process x 2 accumulated micro-batches, per option set (built once)."""
    runs = {}

    def get(*extra):
        if extra not in runs:
            work = make_work(extracted, tmp_path_factory.mktemp("single") / "w")
            run_script("04_train.py", "--work-dir", work, *ARGS, "--grad-accum", 2, *extra, check=True)
            runs[extra] = work
        return runs[extra]
    return get


DFLASH = ("--draft-method", "dflash", "--block-size", 4, "--draft-layers", 2, "--max-anchors", 16)


# FSDP also trains the lm_head (--train-lm-head) and EAGLE-3.1's per-layer fc norms: their gradients, sharded
# state, checkpoints and resume
# DDP with Muon: each rank orthogonalises its share of the matrices and broadcasts them (common/optim.py); AdamW's
# update runs on every rank in the FSDP case. The DDP runs are killed mid-checkpoint first and resumed.
# DFlash draws its anchors at random: from each packed sequence's own seed, so 2 ranks draw what 1 process draws
# --hidden-noise draws from each sequence's seed too: the killed and resumed 2-rank run equals one process's
@pytest.mark.parametrize("parallel,extra", [("ddp", ("--optimizer", "muon", "--hidden-noise", 0.2)),
                                            ("ddp", ("--optimizer", "muon", *DFLASH)),
                                            ("fsdp", ("--train-lm-head", "--draft-norms", "fc-norm"))],
                         ids=["ddp_muon", "ddp_dflash_muon", "fsdp_head_norms"])
def test_torchrun_two_ranks_matches_accumulation(extracted, single, tmp_path, parallel, extra):
    ref = single(*extra)
    work = make_work(extracted, tmp_path / parallel)
    fsdp, dflash = parallel == "fsdp", "dflash" in extra
    if fsdp:
        torchrun(work, "--parallel", parallel, *extra)
    else:
        killed_mid_checkpoint(work, "--parallel", parallel, *extra)
        # resumed from the last whole checkpoint; the DFlash run's rank 0 takes 12 s a checkpoint, past an 8-s
        # --dist-timeout: rank 1 waits for each write apart from the collectives and nothing aborts
        slow = {"EAGLE3_TEST_SLOW_CHECKPOINT_S": "12"} if dflash else {}
        out = torchrun(work, "--parallel", parallel, *extra, *(("--dist-timeout", 8) if dflash else ()), env=slow)
        assert f"resumed from {work / 'train' / 'checkpoints' / 'step_1'}: step 1," in out, out[-3000:]
    last = last_step(ref)
    assert last_step(work) == last >= 2
    a, b = weights(ref, last), weights(work, last)
    assert sorted(a) == sorted(b) and ("lm_head.weight" in a) == fsdp
    if not dflash:
        assert len(a) == 12 + 4 * fsdp and ("fc_norm.2.weight" in a) == fsdp
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    # the log shows the global batch's loss (all ranks), not rank 0's half of it
    torch.testing.assert_close(torch.tensor(logged_losses(work)), torch.tensor(logged_losses(ref)), rtol=1e-4, atol=0)
    # cumulative tokens count every rank's sequences exactly: the same as one process reading them all
    tokens = logged(ref, "tokens")
    assert logged(work, "tokens") == tokens and 0 < tokens[0] and tokens == sorted(set(tokens)), tokens
    exported = load_file(str(work / "final_draft" / "model.safetensors"))
    if fsdp:  # the trained head is what gets exported, and it moved away from the verifier's rows
        torch.testing.assert_close(exported["lm_head.weight"], b["lm_head.weight"].bfloat16())
        verifier_rows = verifier_head_rows(work)
        moved = (b["lm_head.weight"] - verifier_rows).abs().max()
        assert 1e-4 < moved < 0.05 * verifier_rows.abs().max(), moved  # trained from the rows, a few lr-sized steps
    if parallel == "fsdp":  # drop the last checkpoint: the same command resumes from the one before, ends equal
        shutil.rmtree(work / "train" / "checkpoints" / f"step_{last}")
        out = torchrun(work, "--parallel", parallel, *extra)
        assert "resumed from" in out and f"step {last - 1}," in out
        after = weights(work, last)
        for k in b:
            torch.testing.assert_close(b[k], after[k], rtol=1e-5, atol=1e-6)
    if parallel == "ddp":
        resume_on_one_rank(work, b, last, extra)


def sequences(work):
    return [(r["step"], r["epoch"], r["sequences"]) for r in map(json.loads, (work / "train" / "metrics.jsonl")
                                                               .read_text().splitlines()) if r["kind"] == "train"]


def resume_on_one_rank(work, uninterrupted, last, extra):
    """A 2-rank run (1 micro-batch each) resumed by one process: it keeps the global batch of 2 sequences with 2
    accumulated micro-batches, so each resumed step reads the very sequences it read on 2 ranks and the
    weights end where they would have."""
    seen = sequences(work)
    assert len(seen) == last and all(b - a == 2 for _, _, (a, b) in seen), seen  # 2 sequences per step, both ranks
    shutil.rmtree(work / "train" / "checkpoints" / f"step_{last}")
    proc = run_script("04_train.py", "--work-dir", work, *ARGS, "--grad-accum", 1, *extra)  # as a user would, on 1 process
    assert proc.returncode == 0, proc.output[-3000:]
    assert "resuming a run of 2 ranks on 1 rank: 2 micro-batches per rank per step (--grad-accum 1 asked)" in proc.output
    assert "resumed from" in proc.output and f"step {last - 1}," in proc.output
    assert sequences(work) == seen
    after = weights(work, last)
    for k in uninterrupted:
        torch.testing.assert_close(uninterrupted[k], after[k], rtol=1e-4, atol=1e-5)


def test_a_global_batch_the_new_ranks_cannot_split_is_refused_in_one_line(extracted, tmp_path):
    work = make_work(extracted, tmp_path / "w")
    run_script("04_train.py", "--work-dir", work, *ARGS, "--grad-accum", 1, "--max-steps", 1, check=True)
    state = torch.load(work / "train" / "checkpoints" / "step_1" / "state.pt", weights_only=True)
    assert state["world_size"] == 1 and state["settings"]["global_batch"] == 1
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
           str(ROOT / "04_train.py"), "--work-dir", str(work), *map(str, ARGS), "--grad-accum", "1", "--max-steps", "1"]
    proc = run_cmd(cmd, timeout=600)
    assert proc.returncode != 0
    assert ("error: checkpoints in " f"{work / 'train' / 'checkpoints'} were made by 1 rank with 1 sequences per optimizer "
            "step; 2 ranks cannot split them evenly") in proc.stderr, (proc.stdout + proc.stderr)[-3000:]
