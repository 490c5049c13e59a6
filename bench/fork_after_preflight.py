#!/usr/bin/env python3
"""On a GPU: run the preflights of the vLLM stages (1 with --regenerate, 2, 5) in this process, as the
scripts do before they build an engine, then fork a child that uses CUDA, as vLLM's engine core and
tensor-parallel workers start. The child must work. With --without-fix the process first drops
PYTORCH_NVML_BASED_CUDA_CHECK and asks torch.cuda.is_available() the plain way, to show what the fix
prevents ("Cannot re-initialize CUDA in forked subprocess").

  python bench/fork_after_preflight.py [--without-fix] -- STAGE OPTIONS (--config C --work-dir W ...)
Prints one JSON line per step.
"""
import argparse
import json
import multiprocessing as mp
import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(queue):
    try:
        import torch
        x = torch.ones(1024, 1024, device="cuda")
        queue.put({"child_cuda": "ok", "sum": float((x @ x).sum().item())})
    except Exception as exc:  # the failure this script exists to show
        queue.put({"child_cuda": "failed", "error": f"{type(exc).__name__}: {exc}"[:300]})


def preflight(script, args):
    sys.argv = [script, *args, "--dry-run"]
    try:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    except SystemExit as exc:
        return exc.code or 0
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--without-fix", action="store_true")
    ap.add_argument("stage_args", nargs=argparse.REMAINDER, help="options every stage gets, after --")
    a = ap.parse_args()
    args = [x for x in a.stage_args if x != "--"]
    sys.path.insert(0, str(ROOT))
    if a.without_fix:
        os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
        import torch
        print(json.dumps({"step": "plain torch.cuda.is_available()", "value": torch.cuda.is_available(),
                          "initialized": torch.cuda.is_initialized()}), flush=True)
    else:
        for script, extra in [("01_prepare_dataset.py", ["--regenerate"]), ("02_extract_hidden_states.py", []),
                              ("05_evaluate.py", [])]:
            code = preflight(script, args + extra)
            import torch
            print(json.dumps({"step": f"{script} --dry-run", "exit": code,
                              "PYTORCH_NVML_BASED_CUDA_CHECK": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"),
                              "cuda_initialized": torch.cuda.is_initialized()}), flush=True)
    ctx = mp.get_context("fork")  # what vLLM uses while torch.cuda.is_initialized() is False
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(queue,))
    proc.start()
    proc.join(120)
    print(json.dumps({"step": "forked child uses CUDA", "exitcode": proc.exitcode,
                      **(queue.get(timeout=5) if not queue.empty() else {})}), flush=True)


if __name__ == "__main__":
    main()
