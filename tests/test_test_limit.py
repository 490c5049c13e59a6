"""The per-test time limit (EAGLE3_TEST_LIMIT_S, tests/conftest.py) ends a hung stage with everything it started: a
stage that hangs with a child of its own (as vLLM's engine core is) is stopped, and the child does not outlive it."""
import os
import signal
import subprocess
import sys
import time

from conftest import proc_stat, ROOT

HANGS = """
import subprocess, sys, time
# a process of the stage in a session of its own, as torchrun's ranks are: the stage's process group does not hold it,
# so only conftest.kill_tree (which follows parent links) ends it
child = subprocess.Popen(["sleep", "300"], start_new_session=True)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(300)
"""

TEST = """
from conftest import run_script

def test_a_stage_that_hangs():
    run_script({script!r}, {pid_file!r}, timeout=600)
"""


def alive(pid):
    try:
        return proc_stat(pid)[1] != "Z"  # a zombie holds nothing
    except OSError:
        return False


def test_the_limit_ends_a_hung_stage_and_the_processes_it_started(tmp_path):
    script, pid_file = tmp_path / "hangs.py", tmp_path / "child.pid"
    script.write_text(HANGS)
    (tmp_path / "test_inner.py").write_text(TEST.format(script=str(script), pid_file=str(pid_file)))
    env = dict(os.environ, EAGLE3_TEST_LIMIT_S="5", PYTHONPATH=str(ROOT / "tests"))
    t0 = time.time()
    # not run_cmd: its own clean-up would end the child this test is about
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")], timeout=120, env=env,
                          cwd=tmp_path, capture_output=True, text=True)
    proc.output = proc.stdout + proc.stderr
    took = time.time() - t0
    assert proc.returncode == 1 and "1 failed" in proc.output, proc.output[-3000:]
    assert "test_inner.py::test_a_stage_that_hangs ran past 5 s (EAGLE3_TEST_LIMIT_S)" in proc.output, proc.output[-3000:]
    assert took < 60, took  # the limit, not the stage's 300 s nor run_script's timeout
    pid = int(pid_file.read_text())
    deadline = time.time() + 10
    while alive(pid) and time.time() < deadline:
        time.sleep(0.2)
    left = alive(pid)
    if left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"the hung stage's child {pid} outlived the limit"
