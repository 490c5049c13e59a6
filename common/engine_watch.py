"""An engine that dies while it starts ends the stage in seconds, in one line.

vLLM starts its engine core (and, at TP > 1, its workers) as processes of their own. When one of them dies during
start-up, the `LLM(...)` call in the stage can wait on it forever without a line (seen with vLLM 0.26 on an H100:
7.5 min, until the call was killed). While an engine starts, a thread here watches this process's engine processes;
one that dies (a zombie nothing waited on, or gone) while the start is still under way means a dead engine: the stage
logs one line (the process, its exit status; its traceback is just above in the same log), stops what is left of the
engine and exits with status 1. Finished work is on disk already (every stage writes atomically and resumes), so a
re-run picks up where it was. The engine's output is left as it is: it reaches the stage's log directly.
"""
import contextlib
import os
import signal
import sys
import threading
import time


_CMDLINES = {}  # pid -> (its name in /proc/PID/stat, its command line) when the command line was read


def _table():
    """{pid: (parent pid, state, command line, exit code)} of every process, from /proc (exit code: zombies only).
    /proc/PID/stat every poll; a process's cmdline only when its name is new or changed (VLLM::): reading it takes
    the process's memory-map lock, so a starting engine is not made to wait on this thread every second."""
    out = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as fh:
                stat = fh.read()
            rest = stat.rsplit(")", 1)[1].split()
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            pid = int(d)
            seen_name, known = _CMDLINES.get(pid, (None, None))
            if seen_name != name:
                with open(f"/proc/{d}/cmdline", "rb") as fh:
                    known = fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip() or name
                _CMDLINES[pid] = (name, known)
            code = int(rest[49]) if rest[0] == "Z" and len(rest) > 49 else None  # field 52: the wait status
            out[pid] = (int(rest[1]), rest[0], known, code)
        except (OSError, ValueError, IndexError):
            continue
    return out


def descendants(pid=None, table=None):
    """{pid: (state, command line, exit code)} of every process below `pid` (default: this one)."""
    table = table if table is not None else _table()
    below, todo = {}, [pid or os.getpid()]
    while todo:
        p = todo.pop()
        for c, (pp, state, cmd, code) in table.items():
            if pp == p and c not in below:
                below[c] = (state, cmd, code)
                todo.append(c)
    return below


def is_engine(cmd, mine):
    """An engine process by its command line: vLLM's title (VLLM::EngineCore, VLLM::Worker_TP0), a fork of this
    process (the same command line) or a child multiprocessing spawned (not its resource tracker)."""
    return cmd.startswith("VLLM") or cmd == mine or ("multiprocessing" in cmd and "resource_tracker" not in cmd)


def status_text(code):
    if code is None:
        return "exited"
    return f"killed by signal {code & 0x7F}" if code & 0x7F else f"exit status {code >> 8}"


class StartWatch:
    """Context for one engine start: a thread polls this process's descendants every `poll` s. An engine process (see
    is_engine) seen alive that is then a zombie (or, titled VLLM::, gone), while the start is still under way, for
    `grace` s (vLLM
    raises on its own where it notices, the better outcome), means a dead engine: `on_dead(line)` runs, by default
    log the line, stop every descendant and exit 1. Helpers of the start (vLLM's registry probe, compilers) have
    command lines of their own and are not engines."""

    def __init__(self, log, poll=1.0, grace=10.0, on_dead=None):
        self.log, self.poll, self.grace = log, poll, grace
        self.on_dead = on_dead or self._exit
        self.done = threading.Event()

    def __enter__(self):
        threading.Thread(target=self._watch, daemon=True, name="engine-start-watch").start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        return False

    def _watch(self):
        me = os.getpid()
        mine = _table().get(me, (0, "", "", None))[2]
        seen, dead = {}, {}
        while not self.done.wait(self.poll):
            below = descendants(me)
            for pid, (state, cmd, code) in below.items():
                if state != "Z" and is_engine(cmd, mine):
                    seen[pid] = cmd
            for pid, cmd in seen.items():  # gone: reaped by vLLM without a word (only a titled engine counts)
                if below.get(pid, ("Z",))[0] == "Z" and (pid in below or cmd.startswith("VLLM")):
                    dead.setdefault(pid, (time.time(), below.get(pid, (None, None, None))[2]))
            for pid, (since, code) in dead.items():
                if time.time() - since >= self.grace and not self.done.is_set():
                    self.on_dead(f"vLLM's engine died while starting (process {pid}, {seen[pid].split(' ')[0]}, "
                                 f"{status_text(code)}): its traceback, just above in this log, says why")
                    return

    def _exit(self, line):
        self.log.error("%s. Fix that and re-run the same command: finished work is kept", line)
        for pid in descendants():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
