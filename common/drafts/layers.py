"""Layers both draft methods share: RMSNorm, rotate-half RoPE, the SwiGLU MLP, a Linear whose CPU matmuls see
rounded row counts, and the choice of attention backend (compiled flex attention on CUDA)."""
import os
from dataclasses import asdict, dataclass, fields

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
    # the verifier's rotary embedding (rope_type, rope_theta and its scaling: YaRN for Kimi-K2.5), as vLLM builds the
    # draft's from the exported config; None: plain RoPE at rope_theta (manifests written before it existed)
    rope_parameters: dict = None

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, d):
        """From a manifest's geometry, ignoring fields a later version dropped."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


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


# rope_parameters' keys that decide the rotary angles (transformers' and vLLM's names); others are dropped
ROPE_KEYS = ("rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "attention_factor", "truncate", "low_freq_factor", "high_freq_factor")
# scalings whose angles depend on the position alone: a draft can train with them and vLLM computes the same
STATIC_ROPE = ("default", "linear", "yarn", "llama3")


def rope_parameters(config):
    """The rotary embedding of a (verifier's or draft's) config as one dict: transformers 5's `rope_parameters`, or
    transformers 4's `rope_theta` + `rope_scaling`, with `type` read as `rope_type`."""
    p = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    p["rope_type"] = p.get("rope_type") or p.get("type") or "default"
    p.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    return normal_rope(p)


def normal_rope(p):
    """Only the keys that decide the angles, numbers as floats (JSON and vLLM may turn 32 into 32.0)."""
    return {k: (float(p[k]) if isinstance(p[k], (int, float)) and not isinstance(p[k], bool) else p[k])
            for k in ROPE_KEYS if p.get(k) is not None}


def trained_rope(rope_parameters, rope_theta):
    """A geometry's rotary embedding: its rope_parameters, or plain RoPE at rope_theta (manifests before them)."""
    return normal_rope(rope_parameters or {"rope_type": "default", "rope_theta": rope_theta})


def rope_note(g):
    """'yarn, theta 50000, factor 64 over 4096 positions' / 'plain RoPE, theta 100000': for the logs."""
    p = Rotary(g).params
    if p["rope_type"] == "default":
        return f"plain RoPE, theta {p['rope_theta']:g}"
    over = f" over {p['original_max_position_embeddings']:g} positions" if "original_max_position_embeddings" in p else ""
    return f"{p['rope_type']}, theta {p['rope_theta']:g}, factor {p.get('factor', 1):g}{over}"


class Rotary:
    """The draft's rotary embedding, the one vLLM builds from the exported config: plain, or the verifier's scaling
    from transformers' own initialisation (YaRN, llama3, linear), not a second copy of it. The frequencies are made
    on first use (a model built on the meta device must not make them there), then kept per device."""

    def __init__(self, g):
        self.params = trained_rope(g.rope_parameters, g.rope_theta)
        self.g, self.scale, self._inv = g, 1.0, {}

    def _frequencies(self):
        p, g = self.params, self.g
        if p["rope_type"] == "default":
            d = g.head_dim
            return 1.0 / (p["rope_theta"] ** (torch.arange(0, d, 2, device="cpu", dtype=torch.float32) / d)), 1.0
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        conf = LlamaConfig(hidden_size=g.num_heads * g.head_dim, num_attention_heads=g.num_heads, head_dim=g.head_dim,
                           max_position_embeddings=g.max_position_embeddings, rope_parameters=dict(p))
        with torch.device("cpu"):
            inv, scale = ROPE_INIT_FUNCTIONS[p["rope_type"]](conf, "cpu")
        return inv.float(), float(scale)

    def cos_sin(self, pos, dtype):
        """cos/sin tables [T, D] of rotate-half RoPE at positions pos [T] (transformers' Llama; scaled as YaRN asks)."""
        inv = self._inv.get(pos.device)
        if inv is None:
            cpu, self.scale = self._frequencies()
            inv = self._inv[pos.device] = cpu.to(pos.device)
        ang = pos.float()[:, None] * inv[None]
        emb = torch.cat([ang, ang], dim=-1)
        if self.scale == 1.0:
            return emb.cos().to(dtype), emb.sin().to(dtype)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


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


def rope(x, pos, rotary):
    """x [.., T, D], pos [T], rotary: a Rotary."""
    return apply_rope(x, *rotary.cos_sin(pos, x.dtype))


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
