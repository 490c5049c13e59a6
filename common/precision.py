"""bf16 or fp32 for training, and torch.compile's C++ compiler on the CPU."""
import torch

from common.engine import cpu_has_amx


def use_bf16(device, amp):
    """bf16 autocast where matmuls are fast in bf16: GPUs, and CPUs with AMX (4x fp32 per core here)."""
    return amp == "bf16" or (amp == "auto" and (device.type == "cuda" or cpu_has_amx()))


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
