"""An engine that dies while it starts ends the stage in seconds, with one line naming the cause.

vLLM starts its engine core (and, at TP > 1, its workers) as processes of their own. When one of them dies during
start-up, the `LLM(...)` call in the stage can wait on it forever without a line (seen with vLLM 0.26 on an H100:
7.5 min, until the call was killed). While an engine starts, a thread here watches this process's vLLM processes;
one that has died unreaped (a zombie) means a dead engine: the stage logs the last error line those processes
wrote (their output passes through a small tee kept here), stops what is left of the engine, and exits with status 1.
Finished work is on disk already (every stage writes atomically and resumes), so a re-run picks up where it was.
"""
import collections
import contextlib
import os
import re
import signal
import sys
import threading
import time

TAIL = collections.deque(maxlen=400)  # the last lines this process and its engine wrote while an engine started
# the line a traceback ends with (its exception), or a logger's ERROR line
ERROR_LINE = re.compile(r"^\s*(?:\S*(?:Error|Exception|Exit)\w*:|RuntimeError|CUDA error|.*\bERROR\b)")


class Tee:
    """While an engine starts, fd `fd` (1 or 2) of this process passes through a pipe read by a daemon thread that
    writes every byte on to the real file and keeps the last lines in TAIL. The engine's processes, started meanwhile,
    inherit the pipe, so their tracebacks land in TAIL too; the thread goes on forwarding their output for the
    process's life. restore() gives this process its real fd back once the start is over (its own later lines, the
    one-line errors at exit included, then go straight out), after the pipe has drained."""

    def __init__(self, fd):
        (sys.stdout if fd == 1 else sys.stderr).flush()
        self.fd, self.real = fd, os.dup(fd)
        self.r, w = os.pipe()
        os.dup2(w, fd)
        os.close(w)
        threading.Thread(target=self._pump, daemon=True, name=f"tee-{fd}").start()

    def _pump(self):
        buf = b""
        while True:
            try:
                chunk = os.read(self.r, 65536)
            except OSError:
                return
            if not chunk:
                return
            with contextlib.suppress(OSError):
                os.write(self.real, chunk)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            TAIL.extend(line.decode("utf-8", "replace") for line in lines)

    def drain(self, timeout=2.0):
        import fcntl
        import struct
        import termios
        (sys.stdout if self.fd == 1 else sys.stderr).flush()
        deadline = time.time() + timeout
        while time.time() < deadline:
            left = struct.unpack("i", fcntl.ioctl(self.r, termios.FIONREAD, b"\0\0\0\0"))[0]
            if not left:
                return
            time.sleep(0.01)

    def restore(self):
        self.drain()
        os.dup2(self.real, self.fd)


def _children():
    """{pid: (parent pid, state, command line)} of every process, from /proc."""
    out = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{d}/stat").read()
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            out[int(d)] = (int(ppid), state, cmd or name)
        except (OSError, ValueError):
            continue
    return out


def descendants(pid=None, table=None):
    """{pid: (state, command line)} of every process below `pid` (default: this one)."""
    table = table if table is not None else _children()
    below, todo = {}, [pid or os.getpid()]
    while todo:
        p = todo.pop()
        for c, (pp, state, cmd) in table.items():
            if pp == p and c not in below:
                below[c] = (state, cmd)
                todo.append(c)
    return below


def is_engine(cmd, mine):
    """An engine process by its command line: vLLM's title (VLLM::EngineCore, VLLM::Worker_TP0), a fork of this
    process (the same command line) or a child multiprocessing spawned (not its resource tracker)."""
    return cmd.startswith("VLLM") or cmd == mine or ("multiprocessing" in cmd and "resource_tracker" not in cmd)


def cause():
    """The last error-looking line written to stderr (an engine's traceback ends with the exception's line)."""
    lines = [line for line in TAIL if line.strip()]
    for line in reversed(lines):
        if ERROR_LINE.match(line) and not line.strip().startswith("Traceback"):
            return line.strip()[:300]
    return lines[-1].strip()[:300] if lines else "no error line was written"


class StartWatch:
    """Context for one engine start: a thread polls this process's descendants every `poll` s. An engine process (a
    fork of this one, a multiprocessing child or one titled VLLM::...) that has died and is left unreaped (a zombie:
    nothing waited on it) for `grace` s while the start is still under way means a dead engine that vLLM did not notice
    (it raises on its own where it does, the better outcome). Then `on_dead(line)` runs: by default log the line, stop
    every descendant and exit 1. Helpers that exit and are waited for (vLLM's registry probe, compilers) are not
    engines: they are never zombies for long."""

    def __init__(self, log, poll=1.0, grace=10.0, on_dead=None):
        self.log, self.poll, self.grace = log, poll, grace
        self.on_dead = on_dead or self._exit
        self.done = threading.Event()

    def __enter__(self):
        self.tees = [Tee(1), Tee(2)]
        self.thread = threading.Thread(target=self._watch, daemon=True, name="engine-start-watch")
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        for tee in self.tees:
            tee.restore()
        return False

    def _watch(self):
        me = os.getpid()
        mine = _children().get(me, (0, "", ""))[2]
        seen, dead = {}, {}
        while not self.done.wait(self.poll):
            for pid, (state, cmd) in descendants(me).items():
                if state != "Z":
                    if is_engine(cmd, mine):
                        seen[pid] = cmd
                elif pid in seen:
                    dead.setdefault(pid, time.time())
            for pid, since in dead.items():
                if time.time() - since >= self.grace and not self.done.is_set():
                    self.on_dead(f"vLLM's engine died while starting (process {pid}, {seen[pid].split(' ')[0]}, "
                                 f"exited): {cause()}")
                    return

    def _exit(self, line):
        self.log.error("%s; the full traceback is above in this log. Fix that and re-run the same command: finished "
                       "work is kept", line)
        for pid in descendants():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for tee in self.tees:
            tee.drain()
        os._exit(1)
