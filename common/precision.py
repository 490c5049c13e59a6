"""bf16 or fp32: for vLLM on a CPU (--dtype auto) and for training (--amp auto); torch.compile's C++ compiler.

On a CPU the choice is measured, not read from one cpuinfo flag: 2-core machines of this project ran bf16
matrix products at 4x fp32 (Xeon, AMX), 2.5x (AMD EPYC with AVX-512-BF16) and 0.15x (AMD EPYC, AVX2 only).
A probe of about a second times both, once per CPU kind, cached under the eagle3-train cache folder.
"""
import json
import logging
import statistics
import time
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)
PROBE_SHAPE = (256, 1024, 1024)  # rows x in x out: a linear layer of a small model, prefill or a decode batch
BF16_MIN_SPEEDUP = 1.5  # bf16 also pays casts and its slower non-matmul kernels: take it only where clearly faster


def cpu_identity():
    """What decides the ratio: the CPU model, its vector/matrix ISA flags and torch's kernels (not the thread
    count, so that torchrun's one-thread ranks and a full process agree)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = next((l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith("model name")), "unknown")
    flags = next((l.split(":", 1)[1].split() for l in text.splitlines() if l.startswith("flags")), [])
    isa = sorted(f for f in flags if f.startswith(("amx", "avx512", "avx2", "avx_vnni")))
    return f"{model} | {' '.join(isa) or 'no AVX2'} | torch {torch.__version__}"


def _gflops(dtype, seconds):
    rows, k, n = PROBE_SHAPE
    x, w = torch.randn(rows, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    torch.nn.functional.linear(x, w)  # oneDNN builds the kernel on the first call
    done, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        torch.nn.functional.linear(x, w)
        done += 1
    return 2 * rows * k * n * done / elapsed / 1e9


def measure_bf16_speedup(seconds=0.15, rounds=3):
    """Alternating rounds (a neighbour's load hits both dtypes alike); -> {fp32_gflops, bf16_gflops, speedup}."""
    fp32, bf16 = [], []
    for _ in range(rounds):
        fp32.append(_gflops(torch.float32, seconds))
        bf16.append(_gflops(torch.bfloat16, seconds))
    f, b = statistics.median(fp32), statistics.median(bf16)
    return {"fp32_gflops": round(f, 1), "bf16_gflops": round(b, 1), "speedup": round(b / f, 2)}


def probe_path():
    from common.models import cache_root
    return cache_root() / "cpu-precision.json"


@lru_cache(maxsize=1)
def cpu_probe():
    """This CPU kind's bf16/fp32 figures, measured on first use and then read from the cache."""
    from common.io import write_json_atomic
    path, key = probe_path(), cpu_identity()
    known = json.loads(path.read_text()) if path.is_file() else {}
    if key not in known:
        known[key] = dict(measure_bf16_speedup(), measured=time.strftime("%Y-%m-%d %H:%M:%S"))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, known)
    entry = known[key]
    choice = "bf16" if entry["speedup"] >= BF16_MIN_SPEEDUP else "fp32"
    log.info("CPU precision probe: bf16 matmul %.1f GFLOP/s vs fp32 %.1f (%.2fx; bf16 where >= %.1fx) -> %s "
             "[%s; measured %s, cached in %s]", entry["bf16_gflops"], entry["fp32_gflops"], entry["speedup"],
             BF16_MIN_SPEEDUP, choice, key, entry["measured"], path)
    return entry


def cpu_prefers_bf16():
    return cpu_probe()["speedup"] >= BF16_MIN_SPEEDUP


def use_bf16(device, amp):
    """--amp auto: bf16 autocast (fp32 master weights) on GPUs and on CPUs where the probe finds bf16 faster."""
    return amp == "bf16" or (amp == "auto" and (device.type == "cuda" or cpu_prefers_bf16()))


def cpu_compiler_found(log):
    """torch.compile on the CPU builds C++: without a compiler the loss runs eager (a ~1.3x slower step), not fails."""
    from torch._inductor import cpp_builder
    try:
        cpp_builder.get_cpp_compiler()
        return True
    except Exception as e:  # noqa: BLE001 -- any failure to find one means the same: run eager
        log.warning("no C++ compiler for torch.compile (%s): the loss runs eager; install g++ or pass --no-compile "
                    "to silence this", str(e).splitlines()[0][:120])
        return False


def autocast(device, bf16):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
