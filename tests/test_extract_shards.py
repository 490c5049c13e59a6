"""fp8 storage and sharded extraction (HF backend: no engine start, so this stays fast)."""
import json
import shutil

import torch

from common.hidden_states import quantize_fp8, read_sample, write_sample
from conftest import run_script

ARGS = ["--max-seq-len", 192, "--dtype", "float32", "--backend", "hf", "--self-check-samples", 2]


def test_fp8_roundtrip_halves_size(tmp_path):
    torch.manual_seed(0)
    hidden = torch.randn(50, 4, 576) * torch.logspace(-2, 2, 50)[:, None, None]  # very different token scales
    ids, mask = torch.arange(50), torch.ones(50)
    write_sample(tmp_path / "bf16.safetensors", hidden, ids, mask, {"layer_ids": [1, 2, 3, 4]})
    write_sample(tmp_path / "fp8.safetensors", hidden, ids, mask, {"layer_ids": [1, 2, 3, 4]}, "float8_e4m3fn")
    a = read_sample(tmp_path / "fp8.safetensors", torch.float32)["hidden_states"]
    rel = ((a - hidden).norm(dim=-1) / hidden.norm(dim=-1)).max().item()
    assert rel < 0.05  # per-token-and-layer scales keep small and large tokens alike
    size = lambda n: (tmp_path / n).stat().st_size  # noqa: E731
    assert size("fp8.safetensors") < 0.55 * size("bf16.safetensors")
    q, scale = quantize_fp8(hidden)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (50, 4)


def test_two_shards_fill_one_folder_and_fp8_files_train_ready(extracted, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(extracted / "prepared", work / "prepared")
    first = run_script("02_extract_hidden_states.py", "--work-dir", work, *ARGS, "--num-shards", 2, "--shard-index", 0,
                       "--hs-dtype", "float8_e4m3fn", check=True)
    assert "left to other shards" in first.output and not (work / "hidden_states" / "manifest.json").exists()
    run_script("02_extract_hidden_states.py", "--work-dir", work, *ARGS, "--num-shards", 2, "--shard-index", 1,
               "--hs-dtype", "float8_e4m3fn", check=True)
    man = json.loads((work / "hidden_states" / "manifest.json").read_text())
    n = len((work / "prepared" / "tokenized_data.jsonl").read_text().splitlines())
    assert man["counts"]["samples"] == n and man["params"]["hs_dtype"] == "float8_e4m3fn"
    for i in range(n):  # same states as the bf16 vLLM extraction, within fp8 precision
        a = read_sample(work / "hidden_states" / f"hs_{i}.safetensors", torch.float32)["hidden_states"]
        b = read_sample(extracted / "hidden_states" / f"hs_{i}.safetensors", torch.float32)["hidden_states"]
        rel = ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp(min=1e-6)).mean().item()
        assert rel < 0.08, (i, rel)
