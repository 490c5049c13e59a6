"""--dtype auto / --amp auto on a CPU follow a measured bf16/fp32 probe, cached per CPU kind."""
import json

import pytest
import torch

from common import precision
from common.engine import compute_dtype


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path))
    precision.cpu_probe.cache_clear()
    yield tmp_path / "cpu-precision.json"
    precision.cpu_probe.cache_clear()


def test_the_probe_measures_once_per_cpu_kind_and_matches_the_kinds_we_know(fresh_cache):
    entry = precision.cpu_probe()
    assert entry["fp32_gflops"] > 1 and entry["bf16_gflops"] > 0
    saved = json.loads(fresh_cache.read_text())
    key = precision.cpu_identity()
    assert saved[key]["measured"] == entry["measured"] and "torch " + torch.__version__ in key
    precision.cpu_probe.cache_clear()
    assert precision.cpu_probe() == entry  # read back, not measured again
    flags = key.split(" | ")[1].split()
    # the kinds measured on this project's machines: AMX ~4x, AVX-512-BF16 ~2.5x, AVX2 only ~0.15x
    if "amx_bf16" in flags:
        assert entry["speedup"] >= precision.BF16_MIN_SPEEDUP
    elif "avx512_bf16" not in flags:
        assert entry["speedup"] < precision.BF16_MIN_SPEEDUP
        assert compute_dtype("auto") == "float32"


@pytest.mark.parametrize("speedup, dtype, bf16", [(3.9, "bfloat16", True), (2.4, "bfloat16", True),
                                                  (1.2, "float32", False), (0.15, "float32", False)])
def test_the_cached_figure_decides_both_vllm_and_training(fresh_cache, speedup, dtype, bf16):
    fresh_cache.write_text(json.dumps({precision.cpu_identity(): {
        "fp32_gflops": 100.0, "bf16_gflops": 100.0 * speedup, "speedup": speedup, "measured": "planted"}}))
    cpu = torch.device("cpu")
    assert compute_dtype("auto") == dtype and precision.use_bf16(cpu, "auto") is bf16
    assert compute_dtype("float32") == "float32" and compute_dtype("bfloat16") == "bfloat16"  # explicit wins
    assert precision.use_bf16(cpu, "off") is False and precision.use_bf16(cpu, "bf16") is True
    assert json.loads(fresh_cache.read_text())[precision.cpu_identity()]["measured"] == "planted"
