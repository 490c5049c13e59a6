"""Layers both draft methods share: RMSNorm, rotate-half RoPE, the SwiGLU MLP, a Linear whose CPU matmuls see
rounded row counts, and the choice of attention backend (compiled flex attention on CUDA)."""
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Geometry:
    """What both draft methods' layers need (each method adds its own fields, keyword-only)."""
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    verifier_vocab_size: int
    draft_vocab_size: int
    hidden_act: str = "silu"

    def to_dict(self):
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        # bf16 in, bf16 out under autocast: the residual stream and the q/k/v inputs stay bf16, so
        # autocast stores no fp32 copies for backward (HF's version promotes to the fp32 weight dtype)
        return (self.weight * x.to(dtype)).to(dtype)


def rope_cos_sin(pos, d, theta, dtype):
    """cos/sin tables [T, D] of rotate-half RoPE, as in transformers' Llama."""
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=pos.device, dtype=torch.float32) / d))
    ang = pos.float()[:, None] * inv[None]
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _apply_rope(x, cos, sin):
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# compiled by use_compiled_rope (bf16 on GPUs). The tables are made outside it: fused into one kernel,
# cos/sin were recomputed for every head (2.8% of a Kimi-geometry step's GPU time)
apply_rope = _apply_rope


def use_compiled_rope(enabled):
    global apply_rope
    apply_rope = torch.compile(_apply_rope, dynamic=True) if enabled else _apply_rope


def rope(x, pos, theta):
    """x [.., T, D], pos [T]."""
    return apply_rope(x, *rope_cos_sin(pos, x.shape[-1], theta, x.dtype))


ROW_BUCKET = 64


def attn_bucket(dtype):
    """The per-document attention products' sizes are rounded up to this (TTTPlan._attend_sdpa), for the
    reason Linear rounds its rows. Only in bf16/fp16: fp32 and fp64 products go to MKL, which builds no kernels."""
    return ROW_BUCKET if dtype in (torch.bfloat16, torch.float16) else 1


class Linear(nn.Linear):
    """nn.Linear whose CPU matmuls see row counts rounded up to a multiple of ROW_BUCKET. oneDNN builds a
    kernel per new shape (a [1400, 576] x [576, 4096] bf16 product: ~18 ms the first time, 6 ms after),
    and packed batches bring new row counts every step; rounded, a few dozen shapes recur."""

    def forward(self, x):
        n = x.shape[0]
        pad = -n % ROW_BUCKET
        if not pad or x.device.type != "cpu" or x.dim() != 2:
            return super().forward(x)
        return super().forward(F.pad(x, (0, 0, 0, pad)))[:n]


class MLP(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.gate_proj = Linear(g.hidden_size, g.intermediate_size, bias=False)
        self.up_proj = Linear(g.hidden_size, g.intermediate_size, bias=False)
        self.down_proj = Linear(g.intermediate_size, g.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


_FLEX_ON_CUDA = True  # off with --no-compile: flex attention is only fast compiled (eager it builds the whole grid)


def use_flex_on_cuda(enabled):
    global _FLEX_ON_CUDA
    _FLEX_ON_CUDA = enabled


def attention_backend(device):
    """flex attention (compiled, block-sparse) on CUDA; per-document products elsewhere, with --no-compile or when
    EAGLE3_ATTN=sdpa."""
    want = os.environ.get("EAGLE3_ATTN", "auto")
    return "flex" if want == "flex" or (want == "auto" and device.type == "cuda" and _FLEX_ON_CUDA) else "sdpa"


_FLEX = None


def compiled_flex():
    """-> (flex_attention, create_block_mask), both compiled once per process. Eager, the mask function would run
    over the whole Q x KV grid; compiled, it is fused (3 graphs, then dynamic shapes)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        _FLEX = torch.compile(flex_attention, dynamic=True), torch.compile(create_block_mask)
    return _FLEX


def take_embedding(model, dtype):
    """Remove the frozen input embedding from the model; -> its weight in `dtype`, a host tensor. On GPUs the
    loader looks up each batch's tokens in it, so only [T, H] rows travel and the table (163840 x 7168 =
    2.3 GB in bf16 at Kimi scale) takes no GPU memory."""
    w = model.embed_tokens.weight.detach().to(dtype)
    model.embed_tokens = None
    return w
