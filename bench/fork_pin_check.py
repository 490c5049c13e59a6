"""Does pinned host memory in a forked child finish, given what the parent did before the fork?

vLLM starts its engine core by forking the stage's process; twice on the lent GPUs (vLLM 0.26, 2026-12-07) that
engine stopped for minutes inside its first pinned-memory allocation (`torch.zeros(..., pin_memory=True)` in the V2
runner's buffers), GPU idle. This forks a child as vLLM does, after each thing the stage's process had done by then,
and times the child's pinned allocations. Each case runs in a fresh process; a child still busy after --limit s is
reported as hung and killed.

    python bench/fork_pin_check.py [--limit 45] [CASE ...]     # cases: see CASES; default all
"""
import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = {
    "bare": "import torch, fork",
    "vllm": "+ import vLLM and let it detect the platform (its own NVML init and shutdown)",
    "nvml": "+ nvidia-ml-py's NVML init / memory query / shutdown in this process (the stages' old GPU baseline)",
    "proc-reads": "+ a thread reading every process's /proc cmdline and stat each second (the old start watch)",
    "start-watch": "+ common.engine_watch.StartWatch as the stages run it now",
    "old-stage": "vllm + nvml + proc-reads: what the stage's process did before the hang",
    "new-stage": "vllm + start-watch + common.engine.gpu_memory_used (nvidia-smi): what it does now",
}


def child(q):
    import torch
    t0 = time.time()
    torch.cuda.set_device(0)
    bufs = [torch.zeros(1 << (10 + i % 12), dtype=torch.int32, pin_memory=True) for i in range(40)]
    x = torch.ones(1 << 20, device="cuda")
    x.copy_(torch.zeros(1 << 20, pin_memory=True), non_blocking=True)
    torch.cuda.synchronize()
    q.put((time.time() - t0, len(bufs)))


def proc_reads(stop):
    while not stop.wait(1.0):
        for d in filter(str.isdigit, os.listdir("/proc")):
            for f in ("stat", "cmdline"):
                try:
                    with open(f"/proc/{d}/{f}", "rb") as fh:
                        fh.read()
                except OSError:
                    pass


def one(case, limit):
    import torch  # noqa: F401  (the stages import torch before their engine)
    parts = {"old-stage": ["vllm", "nvml", "proc-reads"], "new-stage": ["vllm", "start-watch", "smi"]}.get(case, [case])
    stop = threading.Event()
    watch = None
    if "vllm" in parts:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform
        current_platform.get_device_name()
    if "nvml" in parts:
        import pynvml
        pynvml.nvmlInit()
        pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
        pynvml.nvmlShutdown()
    if "smi" in parts:
        from common.engine import gpu_memory_used
        gpu_memory_used()
    if "proc-reads" in parts:
        threading.Thread(target=proc_reads, args=(stop,), daemon=True).start()
    if "start-watch" in parts:
        import logging

        from common.engine_watch import StartWatch
        watch = StartWatch(logging.getLogger("w"), on_dead=lambda line: print("watch:", line)).__enter__()
    mapped = "libcuda" in Path("/proc/self/maps").read_text()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    t0 = time.time()
    p.start()
    p.join(limit)
    if p.is_alive():
        p.kill()
        result = f"HUNG: the child's pinned allocations still running after {limit} s (killed)"
    else:
        result = f"ok: 40 pinned buffers + a copy in {q.get()[0]:.2f} s" if p.exitcode == 0 else \
            f"child failed, exit {p.exitcode}"
    stop.set()
    if watch:
        watch.__exit__(None, None, None)
    print(f"{case:12s} {result}; libcuda in the parent before the fork: {mapped}; {time.time() - t0:.1f} s", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", help=", ".join(CASES))
    ap.add_argument("--limit", type=float, default=45)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(args.one, args.limit)
    unknown = set(args.cases) - set(CASES)
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    for case in args.cases or CASES:
        print(f"-- {case}: {CASES[case]}", flush=True)
        subprocess.run([sys.executable, __file__, "--one", case, "--limit", str(args.limit)], timeout=args.limit + 120)


if __name__ == "__main__":
    main()
