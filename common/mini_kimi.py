"""A miniature Kimi-K2.5: the real checkpoint's structure at a size two CPU cores run.

Kimi-K2.5 is `KimiK25ForConditionalGeneration`: a MoonViT vision tower and an `mm_projector` around a
DeepSeek-V3 language model (MLA attention, MoE with a shared expert, a first dense layer). The
miniature keeps all of it: the architecture string, the `kimi_k25` config with a `kimi_k2` text
config, MLA with Kimi's head dims (vLLM's CPU MLA refuses small ones), sigmoid/noaux_tc routing,
the checkpoint's weight names (`language_model.model.layers.*`, per-expert `mlp.experts.N.*`,
`vision_tower.encoder.blocks.*`, `mm_projector.pre_norm`, `mm_projector.proj.0/2`) and Kimi's
role-marker chat template. Only the sizes differ, and the tokenizer is SmolLM2's with Kimi's special
tokens added (Kimi's own tokenizer is remote code with a 163,840-token vocabulary).

Weights are random (seeded), saved in bf16 as the real checkpoint's non-quantised parts are.
transformers' save_pretrained does not write the original names for this model, so the names are
mapped here; a test loads the folder back into transformers and into vLLM, both of which read
the real checkpoint's names.
"""
import json
import os
import re
import shutil
from pathlib import Path

N_LAYERS = 8  # aux ids by the Kimi rule (2, N//2, N-3) = 2, 4, 5 and the final id 8: distinct, ascending
SPECIAL_TOKENS = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                  "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"]
# Kimi-K2.5's role markers; the default system prompt as Kimi's template writes it
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")


# Kimi-K2.5's preprocessor_config.json schema (vLLM's fused Kimi vision processor reads media_proc_cfg)
MEDIA_PROC_CFG = {"in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                  "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512,
                  "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None, "sample_fps": 2.0,
                  "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff"}


# Kimi-K2.5's rotary embedding: YaRN, factor 64 over 4,096 original positions (262,144 served)
YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def text_config(vocab_size, eos_id):
    """DeepSeek-V3 text config as Kimi-K2.5's `text_config` (model_type kimi_k2), miniature sizes."""
    return dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2", vocab_size=vocab_size, hidden_size=256,
        intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=N_LAYERS, num_attention_heads=2,
        num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, moe_layer_freq=1, kv_lora_rank=512, q_lora_rank=64, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, topk_method="noaux_tc", scoring_func="sigmoid", n_group=1,
        topk_group=1, routed_scaling_factor=2.827, norm_topk_prob=True, hidden_act="silu",
        max_position_embeddings=262144, rms_norm_eps=1e-5, rope_theta=50000.0, rope_scaling=dict(YARN),
        tie_word_embeddings=False,
        bos_token_id=eos_id, eos_token_id=eos_id, num_nextn_predict_layers=0)


def build_config(vocab_size, eos_id, token_ids):
    from transformers.models.kimi_k25 import Kimi_K25Config
    vision = dict(patch_size=14, num_attention_heads=2, num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                  merge_kernel_size=[2, 2], pos_emb_height=8, pos_emb_width=8, pos_emb_time=4)
    cfg = Kimi_K25Config(text_config=text_config(vocab_size, eos_id), vision_config=vision,
                         projection_hidden_size=64, tie_word_embeddings=False, **token_ids)
    cfg.architectures = ["KimiK25ForConditionalGeneration"]  # the real checkpoint's string (vLLM's class name)
    return cfg


# transformers' internal names -> the released checkpoint's (what vLLM and transformers' loader read)
RENAMES = [
    (r"^model\.language_model\.", "language_model.model."),
    (r"^lm_head\.", "language_model.lm_head."),
    (r"^model\.mm_projector\.in_proj\.", "mm_projector.proj.0."),
    (r"^model\.mm_projector\.out_proj\.", "mm_projector.proj.2."),
    (r"^model\.mm_projector\.", "mm_projector."),
    (r"^model\.vision_tower\.patch_embed\.pos_emb\.position_embeddings$", "vision_tower.patch_embed.pos_emb.weight"),
    (r"^model\.vision_tower\.patch_embed\.", "vision_tower.patch_embed."),
    (r"^model\.vision_tower\.final_layernorm\.", "vision_tower.encoder.final_layernorm."),
    (r"^model\.vision_tower\.layers\.(\d+)\.norm1\.", r"vision_tower.encoder.blocks.\1.norm0."),
    (r"^model\.vision_tower\.layers\.(\d+)\.norm2\.", r"vision_tower.encoder.blocks.\1.norm1."),
    (r"^model\.vision_tower\.layers\.(\d+)\.mlp\.fc1\.", r"vision_tower.encoder.blocks.\1.mlp.fc0."),
    (r"^model\.vision_tower\.layers\.(\d+)\.mlp\.fc2\.", r"vision_tower.encoder.blocks.\1.mlp.fc1."),
    (r"^model\.vision_tower\.layers\.(\d+)\.attn\.proj\.", r"vision_tower.encoder.blocks.\1.wo."),
    (r"^model\.vision_tower\.layers\.(\d+)\.attn\.wqkv\.", r"vision_tower.encoder.blocks.\1.wqkv."),
]


def _rope_interleaved(w, heads):
    """transformers splits the vision q/k rows into rotary halves per head; the checkpoint interleaves them."""
    rows = w.shape[0]
    return w.view(heads, 2, rows // heads // 2, -1).transpose(1, 2).reshape(rows, -1)


def original_names(state, vision_heads):
    """transformers' state dict -> the checkpoint layout: per-expert MoE weights, fused vision qkv."""
    import torch
    out = {}
    for key, value in state.items():
        m = re.match(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", key)
        if m:  # fused [E, 2I, H] / [E, H, I] -> experts.N.{gate,up,down}_proj.weight
            for j in range(value.shape[0]):
                if m.group(2) == "gate_up_proj":
                    gate, up = value[j].chunk(2, dim=0)
                    out[f"{m.group(1)}.{j}.gate_proj.weight"], out[f"{m.group(1)}.{j}.up_proj.weight"] = gate, up
                else:
                    out[f"{m.group(1)}.{j}.down_proj.weight"] = value[j]
            continue
        m = re.match(r"(.*\.attn)\.q_proj\.(weight|bias)$", key)
        if m:  # q, k, v -> one wqkv
            parts = [state[f"{m.group(1)}.{p}_proj.{m.group(2)}"] for p in "qkv"]
            if m.group(2) == "weight":
                parts = [_rope_interleaved(parts[0], vision_heads), _rope_interleaved(parts[1], vision_heads), parts[2]]
            key, value = f"{m.group(1)}.wqkv.{m.group(2)}", torch.cat(parts, dim=0)
        elif re.match(r".*\.attn\.[kv]_proj\.", key):
            continue
        out[key] = value
    renamed = {}
    for key, value in out.items():
        for pattern, repl in RENAMES:
            key, n = re.subn(pattern, repl, key)
            if n:
                break
        renamed[key] = value.contiguous()
    return renamed


def save_shards(weights, folder):
    """Two shards and an index, as a released checkpoint has; the vision tower and projector in the first,
    so that a reader that takes the first `*norm.weight` it meets gets mm_projector.pre_norm.weight."""
    from safetensors.torch import save_file
    lm = {k: v for k, v in weights.items() if k.startswith("language_model.")}
    shards = {"model-00001-of-00002.safetensors": {k: v for k, v in weights.items() if k not in lm},
              "model-00002-of-00002.safetensors": lm}
    for name, part in shards.items():
        save_file(part, str(folder / name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in weights.values())},
             "weight_map": {k: name for name, part in shards.items() for k in sorted(part)}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_mini_kimi(out_dir, tokenizer_dir, seed=0):
    """Write the miniature into `out_dir` (atomically): config.json, model.safetensors, tokenizer."""
    import torch
    from transformers import AutoTokenizer
    from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration

    out_dir = Path(out_dir)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    tok.eos_token = "<|im_end|>"
    vocab = (len(tok) + 255) // 256 * 256  # padded like Kimi's 163,840
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in [("image_token_id", "<|media_pad|>"),
                                                         ("vision_start_token_id", "<|media_begin|>"),
                                                         ("vision_end_token_id", "<|media_end|>")]}
    ids["video_token_id"] = vocab - 1
    cfg = build_config(vocab, tok.eos_token_id, ids)
    torch.manual_seed(seed)
    model = Kimi_K25ForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):  # zero in transformers' init
                p.normal_(0, 0.5)
            elif name.endswith("mlp.gate.weight"):
                p.mul_(5.0)
            elif name.startswith("model.language_model.layers.") and \
                    name.endswith(("o_proj.weight", "down_proj", "down_proj.weight")):  # fused experts: no .weight
                p.mul_(0.25)
        # Decisive choices: a random model's near-uniform next-token and expert scores are all near-ties,
        # which two implementations (or batched verification and one-token decoding) break differently at
        # fp32 rounding, and its context drifts its answer across such ties every few tokens. Logits of std
        # ~8 (not ~0.3), router scores spread over the sigmoid (not all ~0.5) and layers that add a quarter
        # of the usual to the residual stream keep greedy outputs apart from ties.
        model.lm_head.weight.mul_(25.0)
    weights = {k: v.to(torch.bfloat16) for k, v in original_names(model.state_dict(), cfg.vision_config.num_attention_heads).items()}
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_shards(weights, tmp)
    conf = cfg.to_dict()
    # media_placeholder_token_id: the released config's (remote-code schema) name for the image token, which
    # vLLM's EAGLE-3 proposer reads from a Kimi-K2.5 verifier (without it the draft engine dies at start)
    conf.update(architectures=["KimiK25ForConditionalGeneration"], dtype="bfloat16",
                media_placeholder_token_id=ids["image_token_id"])
    conf["text_config"]["model_type"] = "kimi_k2"
    (tmp / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    tok.save_pretrained(tmp)
    (tmp / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out_dir)
    return out_dir
