"""Per-sample hidden-state files: `hidden_states/hs_{idx}.safetensors`.

Layout (the same as vLLM's hidden-states connector and speculators' offline data):
  hidden_states [T, L, H]  bf16, or float8_e4m3fn with hidden_states_scale [T, L] fp32 (per token+layer)
  token_ids     [T]        int64
  loss_mask     [T]        uint8 (ours; other tools ignore it)
Metadata (strings): layer_ids (JSON), layer_convention, hidden_size, storage dtype, params hash.
Readers get bf16 back whatever the storage dtype.
"""
import json
import math

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from common.io import atomic_path

LAYER_CONVENTION = ("vllm: id k is the residual stream entering decoder layer k (= transformers "
                    "output_hidden_states[k]); id N (num_hidden_layers) is the final state before the final norm")
FP8_MAX = 448.0


def sample_path(folder, idx):
    return folder / f"hs_{idx}.safetensors"


def bytes_per_token(num_layers, hidden_size, hs_dtype):
    if hs_dtype == "float8_e4m3fn":
        return num_layers * (hidden_size + 4) + 9
    return num_layers * hidden_size * 2 + 9


def quantize_fp8(hidden):
    """[T, L, H] -> (fp8 tensor, fp32 scale [T, L]); scale = amax / 448 per token and layer."""
    hidden = hidden.float()
    scale = hidden.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    return (hidden / scale[..., None]).to(torch.float8_e4m3fn), scale


def write_sample(path, hidden, token_ids, loss_mask, meta, hs_dtype="bfloat16", need=None):
    """need: bytes the stage has still to write, this file included (named if the disk fills up)."""
    tensors = {"token_ids": token_ids.to(torch.int64).contiguous(),
               "loss_mask": loss_mask.to(torch.uint8).contiguous()}
    if hs_dtype == "float8_e4m3fn":
        q, scale = quantize_fp8(hidden)
        tensors.update(hidden_states=q.contiguous(), hidden_states_scale=scale.contiguous())
    else:
        tensors["hidden_states"] = hidden.to(torch.bfloat16).contiguous()
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}
    with atomic_path(path, need) as tmp:
        save_file(tensors, str(tmp), metadata=dict(meta, storage_dtype=hs_dtype))


def read_sample(path, dtype=torch.bfloat16):
    """-> dict(hidden_states [T, L, H] in `dtype`, token_ids, loss_mask); dequantises fp8."""
    data = load_file(str(path))
    hs = data["hidden_states"]
    if "hidden_states_scale" in data:
        hs = hs.float() * data.pop("hidden_states_scale")[..., None]
    data["hidden_states"] = hs.to(dtype)
    return data


def read_meta(path):
    with safe_open(str(path), "pt") as fh:
        return fh.metadata() or {}


def is_valid(path, expected_ids, params_hash):
    """A finished file is kept on re-runs only if it opens, matches the run and carries the right ids."""
    try:
        with safe_open(str(path), "pt") as fh:
            if (fh.metadata() or {}).get("params_hash") != params_hash:
                return False
            ids = fh.get_tensor("token_ids")
            shape = fh.get_slice("hidden_states").get_shape()
        return ids.tolist() == list(expected_ids) and shape[0] == len(expected_ids)
    except Exception:  # truncated or corrupt: redo it
        return False


def check_hidden(hidden, token_ids, expected_ids, num_layers, hidden_size):
    """Reason a freshly extracted sample is bad, or None."""
    if token_ids.tolist() != list(expected_ids):
        return "token ids differ from the prepared sample"
    if tuple(hidden.shape) != (len(expected_ids), num_layers, hidden_size):
        return f"shape {tuple(hidden.shape)} != {(len(expected_ids), num_layers, hidden_size)}"
    if not torch.isfinite(hidden).all():
        return "NaN/Inf in hidden states"
    return None


def disk_estimate(num_tokens, num_layers, hidden_size, hs_dtype):
    return math.ceil(num_tokens * bytes_per_token(num_layers, hidden_size, hs_dtype) * 1.02)


def file_problem(path, token_ids, num_layers, hidden_size, params_hash):
    """Why a hidden-state file cannot be trained on, from its header and token ids (a millisecond), or None."""
    num_tokens = len(token_ids)
    if not path.is_file():
        return "is missing"
    try:
        with safe_open(str(path), "pt") as fh:
            meta, keys = fh.metadata() or {}, set(fh.keys())
            if not {"hidden_states", "token_ids", "loss_mask"} <= keys:
                return f"lacks {sorted({'hidden_states', 'token_ids', 'loss_mask'} - keys)}"
            shape = tuple(fh.get_slice("hidden_states").get_shape())
            ids = fh.get_tensor("token_ids")
    except Exception as exc:  # truncated, overwritten, not safetensors
        return f"cannot be read ({str(exc).splitlines()[0][:80]})"
    if meta.get("params_hash") != params_hash:
        return "was written by another extraction (other verifier, layers, dtype or prepared data)"
    if shape != (num_tokens, num_layers, hidden_size):
        return f"holds hidden states of shape {list(shape)}, not [{num_tokens}, {num_layers}, {hidden_size}]"
    if not torch.equal(ids, torch.as_tensor(token_ids, dtype=ids.dtype)):
        return "holds another sample's tokens (a file copied or renamed from elsewhere)"
    return None


def check_files(folder, expected, num_layers, hidden_size, params_hash):
    """Every expected file (expected: sample index -> its token ids) checked from its header and ids; UsageError
    naming the first bad one and how many there are. Stage 2 redoes exactly the missing and damaged files."""
    from common.errors import UsageError
    bad = [(i, why) for i, ids in expected.items()
           if (why := file_problem(sample_path(folder, i), ids, num_layers, hidden_size, params_hash))]
    if bad:
        i, why = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UsageError(f"{sample_path(folder, i)} {why}{more}; re-run 02_extract_hidden_states.py with the same "
                         f"options: it redoes just those files")
