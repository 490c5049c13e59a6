"""The EAGLE-3 draft model in plain PyTorch, with speculators 0.9.0's weight names and math.

  fc:      [aux_1 | aux_2 | aux_3] (3H) -> H
  layer:   one Llama decoder layer whose q/k/v read [input_layernorm(embed) | hidden_norm(h)] (2H)
  norm + lm_head (draft vocab rows of the verifier's lm_head, frozen); embed_tokens frozen.
Training-time test (TTT): step k feeds the layer's own output back with the teacher-forced token
k+1 ahead; its queries attend to step-0 keys causally within the document plus, at their own
position only, to the keys of steps 1..k (the "diagonal" of speculators' extended mask).

Attention runs per document of a packed sequence with torch SDPA, so its cost grows with the
document lengths, not with the packed length (speculators materialises a T x (k+1)T mask).
"""
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DraftGeometry:
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
    num_aux: int = 3
    norm_before_residual: bool = True
    hidden_act: str = "silu"
    rope_scaling: dict = None

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
        return self.weight * x.to(dtype)


def rope(x, pos, theta):
    """Rotate-half RoPE as in transformers' Llama. x [.., T, D], pos [T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos.float()[:, None] * inv[None]
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.g = g
        self.q_proj = nn.Linear(2 * g.hidden_size, g.num_heads * g.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * g.hidden_size, g.num_kv_heads * g.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * g.hidden_size, g.num_kv_heads * g.head_dim, bias=False)
        self.o_proj = nn.Linear(g.num_heads * g.head_dim, g.hidden_size, bias=False)

    def forward(self, x, pos, docs, cache):
        """x [T, 2H]; pos [T]; docs: list of (start, end); cache: list of (k, v) of earlier TTT steps."""
        g, T = self.g, x.shape[0]
        q = self.q_proj(x).view(T, g.num_heads, g.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(T, g.num_kv_heads, g.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(T, g.num_kv_heads, g.head_dim).transpose(0, 1)
        q, k = rope(q, pos, g.rope_theta), rope(k, pos, g.rope_theta)
        cache.append((k, v))
        rep = g.num_heads // g.num_kv_heads
        out = torch.empty_like(q)
        for a, b in docs:
            ks = torch.cat([ck[:, a:b] for ck, _ in cache], dim=1)
            vs = torch.cat([cv[:, a:b] for _, cv in cache], dim=1)
            if rep > 1:
                ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
            if len(cache) == 1:
                out[:, a:b] = F.scaled_dot_product_attention(q[:, a:b], ks, vs, is_causal=True)
            else:
                out[:, a:b] = F.scaled_dot_product_attention(q[:, a:b], ks, vs, attn_mask=ttt_mask(b - a, len(cache),
                                                                                                      q.device))
        return self.o_proj(out.transpose(0, 1).reshape(T, -1))


_MASKS = {}


def ttt_mask(n, steps, device):
    """[n, steps*n] bool: causal over step-0 keys, then the diagonal for each later step."""
    key = (n, steps, str(device))
    if key not in _MASKS:
        if len(_MASKS) > 64:
            _MASKS.clear()
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        eye = torch.eye(n, dtype=torch.bool, device=device)
        _MASKS[key] = torch.cat([causal] + [eye] * (steps - 1), dim=1)
    return _MASKS[key]


class MLP(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.gate_proj = nn.Linear(g.hidden_size, g.intermediate_size, bias=False)
        self.up_proj = nn.Linear(g.hidden_size, g.intermediate_size, bias=False)
        self.down_proj = nn.Linear(g.intermediate_size, g.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.g = g
        self.self_attn = Attention(g)
        self.mlp = MLP(g)
        self.input_layernorm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.hidden_norm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(g.hidden_size, g.rms_norm_eps)

    def forward(self, embeds, hidden, pos, docs, cache):
        normed = self.hidden_norm(hidden)
        residual = normed if self.g.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h = residual + self.self_attn(x, pos, docs, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    def __init__(self, g: DraftGeometry):
        super().__init__()
        self.g = g
        self.embed_tokens = nn.Embedding(g.verifier_vocab_size, g.hidden_size)
        self.fc = nn.Linear(g.num_aux * g.hidden_size, g.hidden_size, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(g)])
        self.norm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.lm_head = nn.Linear(g.hidden_size, g.draft_vocab_size, bias=False)
        # frozen verifier pieces for the training targets (not exported)
        self.verifier_norm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.verifier_lm_head = nn.Linear(g.hidden_size, g.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(g.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(g.verifier_vocab_size, dtype=torch.bool))
        for m in (self.embed_tokens, self.lm_head, self.verifier_norm, self.verifier_lm_head):
            m.requires_grad_(False)
        self._init_trainable()

    def _init_trainable(self):
        for name, p in self.named_parameters():
            if p.requires_grad and p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    def step_logits(self, ids, hidden, pos, docs, cache):
        """One TTT step: -> (next hidden [T, H], draft logits [T, draft_vocab])."""
        h = self.layers[0](self.embed_tokens(ids), hidden, pos, docs, cache)
        return h, self.lm_head(self.norm(h))

    def forward(self, batch, ttt_steps, decay):
        """Training: -> (loss, metrics); see ttt_loss. A forward() so DDP can wrap the model."""
        return ttt_loss(self, batch, ttt_steps, decay)

    def unroll(self, aux, ids, pos, docs, ttt_steps):
        """Inference-style unroll with teacher forcing. aux [T, 3H]; ids/pos [T]. -> list of logits per step."""
        hidden, cache, out = self.fc(aux), [], []
        for k in range(ttt_steps):
            hidden, logits = self.step_logits(shift(ids, k), hidden, pos + k, docs, cache)
            out.append(logits)
        return out


def shift(ids, k):
    """Token k positions ahead (teacher forcing for TTT step k), zero-padded at the end."""
    return ids if k == 0 else torch.cat([ids[k:], ids.new_zeros(k)])


def ttt_loss(model, batch, ttt_steps, decay):
    """KL(verifier || draft) on the draft vocab per TTT step, masked; -> (loss, metrics counts).

    batch: aux [T, 3H], ids [T] (token i+1), target_hidden [T, H] (verifier h_N at i+1),
    loss_mask [T], doc [T] document index, pos [T], docs [(start, end)].
    The vocab projections (the bulk of the FLOPs) run only at loss-masked positions: teacher
    forcing feeds ground-truth tokens forward, so other positions need no logits at all.
    """
    aux, ids, pos, docs = batch["aux"], batch["ids"], batch["pos"], batch["docs"]
    mask0 = batch["loss_mask"].bool()
    tpos = mask0.nonzero().squeeze(1)
    with torch.no_grad():
        t_logits = model.verifier_lm_head(model.verifier_norm(batch["target_hidden"][tpos])).float()
        target_ids = t_logits.argmax(-1)
        target_logp = t_logits.log_softmax(-1)
        target_p = target_logp.exp()
        row_of = torch.full_like(ids, -1)
        row_of[tpos] = torch.arange(len(tpos), device=ids.device)
    hidden, cache = model.fc(aux), []
    T = ids.shape[0]
    chain_ok = torch.ones(T, dtype=torch.bool, device=ids.device)  # drafts 0..k-1 right from start i
    total, metrics = 0.0, {}
    for k in range(ttt_steps):
        hidden = model.layers[0](model.embed_tokens(shift(ids, k)), hidden, pos + k, docs, cache)
        n = T - k
        # logits at start i predict what the verifier says at i + k; both in the same document
        m = mask0[k:] & (batch["doc"][:n] == batch["doc"][k:])
        sel = m.nonzero().squeeze(1)
        rows = row_of[sel + k]
        logp = model.lm_head(model.norm(hidden[sel])).float().log_softmax(-1)
        kl = (target_p[rows] * (target_logp[rows] - logp)).sum(-1)
        step_loss = kl.sum() / max(len(sel), 1)
        total = total + (decay ** k) * step_loss
        with torch.no_grad():
            correct = torch.zeros(T, dtype=torch.bool, device=ids.device)
            correct[sel] = logp.argmax(-1) == target_ids[rows]
            chain = chain_ok[:n] & m
            metrics[f"loss_{k}"] = step_loss.detach()
            metrics[f"full_correct_{k}"] = (correct[:n] & chain).sum()  # drafts 0..k all right
            metrics[f"full_total_{k}"] = m.sum()
            metrics[f"cond_correct_{k}"] = (correct[:n] & chain).sum()
            metrics[f"cond_total_{k}"] = chain.sum()
            chain_ok = chain_ok & correct
    return total, metrics


def acceptance_length(full_acc):
    """Expected tokens per verifier step with len(full_acc) drafts: 1 + sum_k P(drafts 0..k all accepted)."""
    return 1.0 + sum(full_acc)
