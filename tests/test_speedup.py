"""What an acceptance length buys (common/speedup.py): the weight-bytes model against hand-computed values, the
verifier's bytes per token against its files' own sizes and its config's shapes, and the measured step costs."""
import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.speedup import measured, predict, step_bytes, verifier_bytes


def test_a_dense_verifier_pays_k_draft_passes_per_round():
    v = {"dense": 1e9, "routed": 0, "experts": 0, "topk": 0}
    p = predict(2.5, 3, 3, v, 1e8)  # c = 0.1, r = 1: 2.5 / (1 + 3 x 0.1)
    assert p["c"] == 0.1 and p["r_verify"] == 1.0 and p["predicted_speedup"] == 1.923
    assert predict(2.5, 3, 1, v, 1e8)["predicted_speedup"] == 2.273  # a block draft: one pass, 2.5 / 1.1


def test_a_moe_verifier_reads_the_union_of_the_experts_its_tokens_route_to():
    # Kimi-K2.5's routing: 384 experts, 8 a token; 1 GB an expert, 2 GB outside the experts (round numbers)
    v = {"dense": 2e9, "routed": 384e9, "experts": 384, "topk": 8}
    assert step_bytes(v, 1) == pytest.approx(10e9)
    # 4 tokens (k = 3): 384 x (1 - (376/384)^4) = 31.014 experts expected, by hand
    assert step_bytes(v, 4) == pytest.approx(2e9 + 31.014e9, rel=1e-4)
    p = predict(2.5, 3, 3, v, 1e9)
    assert p["r_verify"] == pytest.approx(3.301, abs=1e-3) and p["c"] == 0.1
    assert p["predicted_speedup"] == pytest.approx(2.5 / (3.3014 + 0.3), abs=2e-3)


def test_measured_step_costs_split_a_round_into_the_verifier_and_the_draft():
    # baseline: 256 tokens in 2.56 s (10 ms a step); speculative: 300 tokens in 3.0 s over 120 rounds (25 ms each)
    m = measured((300, 3.0, 120), (256, 2.56, 256), k=3, passes=3)
    assert m["verifier_ms_per_step"] == 10.0 and m["round_ms"] == 25.0 and m["draft_ms_per_pass"] == 5.0
    assert m["c"] == 0.5 and m["acceptance_length_concurrency_1"] == 2.5
    assert m["formula_speedup"] == 1.0 and m["measured_speedup"] == 1.0
    assert measured(None, (256, 2.56, 256), 3, 3) is None
    assert measured((300, 3.0), (256, 2.56), 3, 3) is None  # a baseline.json decoded before rounds were counted


def test_a_dense_verifiers_bytes_are_its_files_less_nothing(verifier_dir):
    """SmolLM2 ties its output projection to the embedding: every tensor is read each step, once."""
    v = verifier_bytes(verifier_dir, SimpleNamespace())
    on_disk = 0
    for f in Path(verifier_dir).glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = struct.unpack("<Q", fh.read(8))[0]
        on_disk += f.stat().st_size - 8 - header
    assert v == {"dense": on_disk, "routed": 0, "experts": 0, "topk": 0}


def test_a_moe_verifiers_experts_are_counted_from_its_config():
    from common.models import resolve_verifier
    folder = resolve_verifier("embedded:kimi-k2.5-mini")
    text = json.loads((Path(folder) / "config.json").read_text())["text_config"]
    cfg = SimpleNamespace(**text)
    v = verifier_bytes(folder, cfg)
    moe_layers = text["num_hidden_layers"] - text["first_k_dense_replace"]
    per_expert = 3 * text["hidden_size"] * text["moe_intermediate_size"] * 2 * moe_layers  # gate, up, down in bf16
    assert v["experts"] == text["n_routed_experts"] == 4 and v["topk"] == text["num_experts_per_tok"] == 2
    assert v["routed"] == per_expert * v["experts"], v
    assert v["dense"] > 0 and step_bytes(v, 1) < step_bytes(v, 4) <= v["dense"] + v["routed"]
