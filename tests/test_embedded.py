"""The embedded verifier: the GGUF -> safetensors conversion is faithful and deterministic."""
import json
from pathlib import Path

import torch

from common.models import convert_gguf, embedded_dir, resolve_verifier

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def test_converted_model_matches_gguf_and_answers_sensibly(verifier_dir, tokenizer):
    from transformers import AutoModelForCausalLM
    _, gguf = embedded_dir("smollm2-135m-instruct")
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    ours = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = ours(ids).logits, ref(ids).logits
    assert torch.equal(a, b)  # same dequantised weights, same fp32 math
    with torch.no_grad():
        out = ours.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
    cfg = json.loads((Path(verifier_dir) / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template


def test_conversion_is_deterministic(tmp_path, verifier_dir):
    from safetensors.torch import load_file
    _, gguf = embedded_dir("smollm2-135m-instruct")
    convert_gguf(gguf, tmp_path / "again")
    a = load_file(str(Path(verifier_dir) / "model.safetensors"))
    b = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    weights = Path(verifier_dir) / "model.safetensors"
    before = (weights.stat().st_ino, weights.stat().st_mtime_ns)
    resolve_verifier("embedded:smollm2-135m-instruct")  # cached: not converted again (a conversion replaces the folder)
    assert (weights.stat().st_ino, weights.stat().st_mtime_ns) == before


def test_dry_runs_read_an_unconverted_models_geometry_from_its_source(verifier_dir):
    """Stage 2's dry run before the first conversion plans with these (it hard-coded SmolLM2's before)."""
    from common.models import embedded_text_config, load_verifier_config, mini_kimi_dir
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
    converted = load_verifier_config(verifier_dir)
    planned = embedded_text_config("embedded:smollm2-135m-instruct")
    assert [getattr(planned, k) for k in keys] == [getattr(converted, k) for k in keys] == [30, 576, 9, 3, 49152]
    mini = embedded_text_config("embedded:kimi-k2.5-mini")
    built = load_verifier_config(str(mini_kimi_dir()))
    assert [getattr(mini, k) for k in keys[:4]] == [getattr(built, k) for k in keys[:4]] == [8, 256, 2, 2]
    assert mini.model_type == built.model_type == "kimi_k2"
