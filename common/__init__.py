"""Shared code of the eagle3-train stages: config, manifests, logging, data, models."""
import os

# vLLM starts its engine core and tensor-parallel workers with fork unless torch.cuda.is_initialized().
# A plain torch.cuda.is_available() / device_count() in the parent (our preflight) initialises the
# CUDA driver without setting that flag, and the forked child then dies with "Cannot re-initialize
# CUDA in forked subprocess" (seen on an H200, torch 2.11). With this set before the first such call,
# torch answers from NVML and leaves the driver alone. Every script imports `common` before it asks.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

# vLLM 0.26's Model Runner V2 imports FlashInfer for its sampler unless VLLM_USE_FLASHINFER_SAMPLER=0, and its engine
# dies at start where FlashInfer is not installed (common/vllm_compat.py): decided here, before anything imports vLLM.
# A user's own setting stands. Set inside a stage's process, the variable did not do what exported did: the engine
# hung at start 3 times of 3 on the lent GPUs, exported it started 2 of 2 (docs/gpu.md); so a stage that set it here
# starts again with it in its environment (start_again_with_engine_env, below).
import re
import sys

SET_IN_THIS_PROCESS = []


def flashinfer_sampler_off():
    """VLLM_USE_FLASHINFER_SAMPLER=0 where FlashInfer is missing and the user set nothing; True where this code set it
    (in this process or in the one that started it again)."""
    if "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ:
        import importlib.util
        if importlib.util.find_spec("flashinfer") is None:
            os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
            os.environ["EAGLE3_SET_FLASHINFER_SAMPLER"] = "1"  # so that the engine's start can say so
            SET_IN_THIS_PROCESS.append(True)
    return os.environ.get("EAGLE3_SET_FLASHINFER_SAMPLER") == "1"


def start_again_with_engine_env():
    """A numbered stage script (01_ ... 05_) whose `common` just set a variable above: replaced by the same command
    with it in its environment from the start (os.execv: the same pid, before the stage's own imports)."""
    if SET_IN_THIS_PROCESS and re.fullmatch(r"0[1-5]_\w+\.py", os.path.basename(sys.argv[0] or "")):
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


flashinfer_sampler_off()
start_again_with_engine_env()
