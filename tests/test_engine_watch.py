"""An engine process that dies while the stage waits on it ends the stage in seconds with one line
(common/engine_watch.py). vLLM 0.26 on an H100 left a stage waiting 7.5 min on its dead engine; the same shape is
built here with a real child process that dies with a traceback while its parent blocks, as `LLM(...)` did. The GPU
case itself (vLLM 0.26 without FlashInfer) is tests/test_gpu.py's, run with `pytest -m gpu` on the device."""
import time

from conftest import ROOT, run_cmd, session_processes

SCRIPT = f"""
import logging, multiprocessing as mp, subprocess, sys, time
sys.path.insert(0, {str(ROOT)!r})
from common.engine_watch import StartWatch

def engine(die):
    time.sleep(3)  # up for a while, as an engine core loading its model
    if die:
        raise ModuleNotFoundError("No module named 'flashinfer'")
    time.sleep(600)

if __name__ == "__main__":
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
    die = sys.argv[1] == "die"
    with StartWatch(logging.getLogger("stage"), poll=0.5, grace=2):
        subprocess.run(["sleep", "0.1"])  # short helpers of the start, waited for: not engines
        subprocess.run([sys.executable, "-c", "import time; time.sleep(3)"])
        p = mp.get_context("fork").Process(target=engine, args=(die,), daemon=True)
        p.start()
        time.sleep(8)  # the start: for a dead engine, LLM(...) waited here forever
    print("engine started", flush=True)
    print("error: a one-line error at exit", file=sys.stderr)  # after the start: straight out, never lost in the tee
    sys.exit(2)
"""


def test_a_dead_engine_ends_the_stage_with_its_cause(tmp_path):
    script = tmp_path / "stage.py"
    script.write_text(SCRIPT.replace("time.sleep(8)", "time.sleep(600)"))
    t0 = time.time()
    proc = run_cmd(["python3", script, "die"], timeout=120)
    took = time.time() - t0
    assert proc.returncode == 1 and took < 30, (took, proc.output[-2000:])
    errors = [line for line in proc.output.splitlines() if line.startswith("vLLM's engine died while starting")]
    assert len(errors) == 1, proc.output[-2000:]
    assert "exit status 1): its traceback, just above in this log, says why" in errors[0], errors
    assert "engine started" not in proc.output
    # the engine's own traceback reaches the same log, with the cause
    assert "ModuleNotFoundError: No module named 'flashinfer'" in proc.output


def test_a_healthy_start_and_short_helpers_are_left_alone(tmp_path):
    script = tmp_path / "stage.py"
    script.write_text(SCRIPT)
    proc = run_cmd(["python3", script, "live"], timeout=120)
    assert proc.returncode == 2 and "engine started" in proc.output, proc.output[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == "error: a one-line error at exit"  # the stage's own output intact
    assert "died" not in proc.output


def test_nothing_of_a_dead_engine_outlives_the_stage(tmp_path):
    """The watch stops every process below the stage before it exits (an engine's workers hold GPU memory)."""
    script = tmp_path / "stage.py"
    script.write_text(SCRIPT.replace("time.sleep(8)", "time.sleep(600)").replace(
        "raise ModuleNotFoundError", "mp.get_context('fork').Process(target=time.sleep, args=(600,)).start(); "
                                     "raise ModuleNotFoundError"))
    import subprocess
    proc = subprocess.Popen(["python3", script, "die"], start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out[-2000:]
    assert session_processes(proc.pid, wait=10) == [], "processes of the dead engine outlived the stage"
