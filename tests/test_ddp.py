"""torchrun DDP on CPU (gloo): 2 ranks x 1 micro-batch equal 1 process x 2 accumulated micro-batches."""
import shutil
import subprocess
import sys

import torch
from safetensors.torch import load_file

from conftest import ROOT, run_script

ARGS = ["--draft-vocab-size", 512, "--max-steps", 3, "--max-tokens-per-step", 256, "--num-workers", 0,
        "--val-fraction", 0.2, "--lr", 1e-3, "--max-seq-len", 192, "--num-threads", 1]


def test_torchrun_two_ranks_matches_accumulation(extracted, tmp_path):
    works = {}
    for name in ("single", "ddp"):
        work = tmp_path / name
        for sub in ("prepared", "hidden_states"):
            shutil.copytree(extracted / sub, work / sub)
        run_script("03_build_vocab_mapping.py", "--work-dir", work, "--draft-vocab-size", 512, check=True)
        works[name] = work
    run_script("04_train.py", "--work-dir", works["single"], *ARGS, "--grad-accum", 2, check=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29531",
           str(ROOT / "04_train.py"), "--work-dir", str(works["ddp"]), *map(str, ARGS), "--grad-accum", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    last = [max((w / "train" / "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:])) for w in works.values()]
    assert last[0].name == last[1].name and int(last[0].name[5:]) >= 2
    a, b = (load_file(str(c / "trainable.safetensors")) for c in last)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    assert (works["ddp"] / "final_draft" / "model.safetensors").is_file()
