"""GPU-only engine rules: the V1 runner's async scheduling (vLLM #56417) and the wait for the previous engine's
GPU memory. The rule is pure logic and runs everywhere; the wait runs where nvidia-smi lists a GPU (the device)."""
import subprocess
import sys
import time

import pytest

from common.engine import gpu_memory_used, v1_runner_reason, wait_gpu_memory
from common.errors import UsageError


def test_v1_runner_is_predicted_where_vllm_would_pick_it(monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    import importlib.util
    has_triton = importlib.util.find_spec("triton") is not None
    base = None if has_triton else "Triton is not installed"
    assert v1_runner_reason() == base
    assert v1_runner_reason({"method": "eagle3", "model": "d", "num_speculative_tokens": 3}) == base
    if has_triton:
        assert v1_runner_reason({"method": "eagle3", "parallel_drafting": True}) == "parallel drafting for EAGLE (P-EAGLE)"
        assert v1_runner_reason({"method": "dflash", "parallel_drafting": True}) is None
        assert v1_runner_reason({"method": "suffix"}) == "speculative method suffix"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert v1_runner_reason() == "VLLM_USE_V2_MODEL_RUNNER=0"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert v1_runner_reason({"method": "suffix"}) is None  # forced V2: vLLM refuses what it cannot run itself


HOLD = """
import sys, time, torch
x = torch.empty(int(sys.argv[1]) << 30, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize(); print("held", flush=True); time.sleep(float(sys.argv[2]))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_memory_used(), reason="needs an NVIDIA GPU (nvidia-smi)")
def test_waits_until_another_process_releases_its_gpu_memory():
    """What close_llm does between stage 5's engines: another process (an engine's worker) holds 8 GiB; the wait
    returns once it exits, and times out with one line naming the GPU when it does not."""
    baseline = gpu_memory_used()
    proc = subprocess.Popen([sys.executable, "-c", HOLD, "8", "4"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    held = gpu_memory_used()
    assert max(held[i] - baseline[i] for i in baseline) > 7 << 30
    t0 = time.time()
    waited = wait_gpu_memory(baseline, timeout=60, poll=0.2)
    assert 1.0 < waited < 30 and proc.wait(timeout=30) == 0, waited
    proc = subprocess.Popen([sys.executable, "-c", HOLD, "8", "30"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    try:
        with pytest.raises(UsageError, match=r"not released within 3 s \(GPU \d+ holds"):
            wait_gpu_memory(baseline, timeout=3, poll=0.2)
    finally:
        proc.kill()
    assert time.time() - t0 < 60
