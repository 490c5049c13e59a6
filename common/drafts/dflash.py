"""The DFlash block draft in plain PyTorch, with speculators 0.9.0's weight names and maths.

A DFlash draft reads the same features as EAGLE-3 (aux taps, the final pre-norm state for targets) but drafts
a whole block in one forward: for an anchor position a (a token the verifier has accepted), its block holds
the anchor token and block_size - 1 mask tokens; slot i predicts the token at a + i.

  fc + hidden_norm:  [aux_1 | .. | aux_n] (nH) -> H, the context c_t for every position t
  layers (Qwen3):    queries from the block's stream; keys/values from [c_t for t < a in a's document | the
                     block's own stream] (non-causal within the block); q/k RMS-normed per head, RoPE at the
                     context's positions and a + i for slot i
  norm + lm_head:    the block's logits; the target of slot i is the verifier's distribution at a + i - 1
                     (verifier_lm_head(verifier_norm(h_N))), restricted to the draft vocabulary
Loss at loss-masked slots 1..block_size-1: cross-entropy to the verifier's top token (speculators' DFlash recipe)
or KL to its distribution, weighted per slot (fixed exponential decay, or D-PACE: each slot by the smoothed
chance that the block gets that far), divided by the masked slot count.
Slots whose token lies past the anchor's document are masked (speculators lets a block run into the next
packed document; blocks that stay inside one document compute exactly what speculators computes).
"""
from dataclasses import dataclass

import torch
from torch import nn

from common.drafts import layers
from common.drafts.acceptance import block_metrics
from common.drafts.layers import MLP, Geometry, RMSNorm, compiled_flex, rope_cos_sin
from common.drafts.losses import LOSS_EPS, slot_loss, slot_weights


@dataclass(kw_only=True)
class DFlashGeometry(Geometry):
    num_layers: int
    block_size: int
    num_aux: int
    mask_token_id: int


class BlockAttention(nn.Module):
    """Qwen3 attention whose keys/values are [context | the block's own stream] (speculators' Qwen3DFlashAttention)."""

    def __init__(self, g):
        super().__init__()
        self.g = g
        self.q_proj = nn.Linear(g.hidden_size, g.num_heads * g.head_dim, bias=False)
        self.k_proj = nn.Linear(g.hidden_size, g.num_kv_heads * g.head_dim, bias=False)
        self.v_proj = nn.Linear(g.hidden_size, g.num_kv_heads * g.head_dim, bias=False)
        self.o_proj = nn.Linear(g.num_heads * g.head_dim, g.hidden_size, bias=False)
        self.q_norm = RMSNorm(g.head_dim, g.rms_norm_eps)
        self.k_norm = RMSNorm(g.head_dim, g.rms_norm_eps)

    def forward(self, x, ctx, rope_ctx, rope_block, plan):
        """x [Q, H] the blocks' stream, ctx [T, H] the context, rope_*: (cos, sin) tables, plan: block_plan()."""
        g = self.g
        kv_in = torch.cat([ctx, x])
        q = self.q_norm(self.q_proj(x).view(-1, g.num_heads, g.head_dim))
        k = self.k_norm(self.k_proj(kv_in).view(-1, g.num_kv_heads, g.head_dim))
        v = self.v_proj(kv_in).view(-1, g.num_kv_heads, g.head_dim)
        q = layers.apply_rope(q, rope_block[0][:, None], rope_block[1][:, None])
        k = layers.apply_rope(k, torch.cat([rope_ctx[0], rope_block[0]])[:, None],
                              torch.cat([rope_ctx[1], rope_block[1]])[:, None])
        out = plan.attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.head_dim ** -0.5)
        return self.o_proj(out.transpose(0, 1).reshape(x.shape[0], -1))


def block_plan(doc, anchors, block_size):
    """The attention of the blocks anchored at `anchors` (sorted positions in the packed sequence of documents
    `doc`): one block-sparse flex-attention call on CUDA (layers.attention_backend), else per document."""
    if layers.attention_backend(doc.device) == "flex":
        return FlexBlocks(doc, anchors, block_size)
    return PerDocumentBlocks(doc, anchors, block_size)


class FlexBlocks:
    """GPU: one flex-attention call; the block mask (made once per forward, shared by the layers) skips the tiles
    no query of a tile can see, so the cost follows each block's visible context, as per document."""

    def __init__(self, doc, anchors, bs):
        flex, block_mask = compiled_flex()
        self.flex, dev, T, Q, pad = flex, doc.device, doc.numel(), anchors.numel() * bs, 256
        # the kernel may read a tile past the end: padded entries are valid indices whose values match nothing
        blk = torch.arange(Q, device=dev) // bs
        kv_doc = torch.cat([doc, torch.full((Q + pad,), -2, device=dev, dtype=doc.dtype)])
        kv_blk = torch.cat([torch.full((T,), -1, device=dev), blk, torch.full((pad,), -3, device=dev)])
        q_blk = torch.cat([blk, torch.full((pad,), -4, device=dev)])
        q_anchor = torch.cat([anchors.repeat_interleave(bs), torch.full((pad,), -1, device=dev)])
        q_doc = torch.cat([doc[anchors].repeat_interleave(bs), torch.full((pad,), -5, device=dev, dtype=doc.dtype)])

        def mask_mod(b, h, qi, ki):  # its document's context before its anchor, and its own block
            context = (kv_blk[ki] == -1) & (kv_doc[ki] == q_doc[qi]) & (ki < q_anchor[qi])
            return context | (kv_blk[ki] == q_blk[qi])
        self.mask = block_mask(mask_mod, None, None, Q, T + Q, device=dev)

    def attend(self, q, k, v, scale):
        """q [h, Q, D]; k/v [kv heads, T + Q, D] (context, then the blocks)."""
        return self.flex(q[None], k[None], v[None], block_mask=self.mask, scale=scale,
                         enable_gqa=q.shape[0] != k.shape[0])[0]


class PerDocumentBlocks:
    """CPU: per document holding anchors, its blocks against its context only (speculators' dense mask would cost
    every block x the packed length). The bookkeeping runs on the host."""

    def __init__(self, doc, anchors, bs):
        self.T, self.bs = doc.numel(), bs
        doc, anchors = doc.cpu(), anchors.cpu()
        starts = torch.cat([torch.tensor([0]), (doc[1:] != doc[:-1]).nonzero().squeeze(-1) + 1])
        of = torch.searchsorted(starts, anchors, right=True) - 1  # each anchor's document
        # per document: (first and last block, its context [start, end), the anchors relative to start)
        self.docs, j = [], 0
        while j < len(anchors):
            d = of[j]
            n = int((of[j:] == d).sum())
            s = int(starts[d])
            self.docs.append((j, j + n, s, int(anchors[j + n - 1]), anchors[j:j + n] - s))
            j += n

    def attend(self, q, k, v, scale):
        rep = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
        return block_attention(q, k, v, self.T, self.docs, self.bs, scale)


def block_attention(q, k, v, T, docs, bs, scale):
    """q [h, Q, D] the blocks' queries; k/v [h, T + Q, D] (context, then the blocks); docs: PerDocumentBlocks.docs.
    A block's queries see the context of its document before its anchor and every query of their own block, in one
    softmax."""
    out = torch.empty_like(q)
    for b0, b1, s, last, rel in docs:
        n, h, D = b1 - b0, q.shape[0], q.shape[-1]
        qd = q[:, b0 * bs:b1 * bs].view(h, n, bs, D)
        kc, vc = k[:, s:last], v[:, s:last]  # the context any of these blocks can see
        ko, vo = (t[:, T + b0 * bs:T + b1 * bs].reshape(h, n, bs, D) for t in (k, v))
        sc = torch.einsum("hnqd,hkd->hnqk", qd, kc) * scale
        seen = torch.arange(last - s, device=q.device)[None, :] < rel.to(q.device)[:, None]  # [n, ctx]
        sc = sc.masked_fill(~seen[None, :, None, :], float("-inf"))
        so = torch.einsum("hnqd,hnkd->hnqk", qd, ko) * scale
        p = torch.softmax(torch.cat([sc, so], -1).float(), -1).to(q.dtype)
        o = torch.einsum("hnqk,hkd->hnqd", p[..., :last - s], vc) + torch.einsum("hnqk,hnkd->hnqd", p[..., last - s:], vo)
        out[:, b0 * bs:b1 * bs] = o.reshape(h, n * bs, D)
    return out


class BlockLayer(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.input_layernorm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.self_attn = BlockAttention(g)
        self.post_attention_layernorm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.mlp = MLP(g)

    def forward(self, x, ctx, rope_ctx, rope_block, plan):
        h = x + self.self_attn(self.input_layernorm(x), ctx, rope_ctx, rope_block, plan)
        return h + self.mlp(self.post_attention_layernorm(h))


def select_anchors(loss_mask, max_anchors, block_size, generator=None):
    """Up to max_anchors loss-masked positions, at random, sorted; the last block_size positions of the packed
    sequence are never anchors (as speculators). -> LongTensor [n]."""
    valid = loss_mask.bool().clone()
    valid[-block_size:] = False
    idx = valid.nonzero().squeeze(-1)
    perm = torch.randperm(idx.numel(), generator=generator, device=idx.device)[:max_anchors]
    return idx[perm].sort().values


class DFlashDraft(nn.Module):
    """Trainable: fc, hidden_norm, layers, norm (and lm_head with --train-lm-head); frozen: embed_tokens, the draft
    lm_head (the verifier's rows of the draft vocab), verifier_norm, verifier_lm_head."""
    shift = 0  # its batches are not shifted: position t holds token t and the states computed at t

    def __init__(self, g):
        super().__init__()
        self.g = g
        self.embed_tokens = nn.Embedding(g.verifier_vocab_size, g.hidden_size)
        self.fc = nn.Linear(g.num_aux * g.hidden_size, g.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(g) for _ in range(g.num_layers))
        self.norm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.lm_head = nn.Linear(g.hidden_size, g.draft_vocab_size, bias=False)
        self.verifier_lm_head = nn.Linear(g.hidden_size, g.draft_vocab_size, bias=False)
        self.verifier_norm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.register_buffer("d2t", torch.zeros(g.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(g.verifier_vocab_size, dtype=torch.bool))
        for m in (self.embed_tokens, self.lm_head, self.verifier_lm_head, self.verifier_norm):
            m.requires_grad_(False)
        for p in self.parameters():
            if p.requires_grad and p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    @property
    def positions(self):
        """Drafted tokens per block: the per-position metrics' length."""
        return self.g.block_size - 1

    def prepare_bf16(self, compile_layers=False):
        """bf16 autocast: the frozen pieces in bf16 (the head's rows stored once when the draft head is frozen); on
        CUDA also the elementwise chains (RMSNorms, SwiGLU, RoPE) compiled into fused kernels, as EAGLE-3's."""
        self.embed_tokens.to(torch.bfloat16)
        if not self.lm_head.weight.requires_grad:
            self.lm_head.to(torch.bfloat16)
        if not self.lm_head.weight.requires_grad and torch.equal(self.verifier_lm_head.weight.to(torch.bfloat16),
                                                                 self.lm_head.weight):
            self.verifier_lm_head.weight = self.lm_head.weight
        else:
            self.verifier_lm_head.to(torch.bfloat16)
        if compile_layers:
            for m in (self.hidden_norm, self.norm, self.verifier_norm, *(m for layer in self.layers for m in (
                    layer.input_layernorm, layer.post_attention_layernorm, layer.mlp, layer.self_attn.q_norm,
                    layer.self_attn.k_norm))):
                m.compile(dynamic=True)
        layers.use_compiled_rope(compile_layers)

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    def block_logits(self, aux, ids, pos, doc, anchors):
        """-> logits [n * block_size, draft vocab] of the blocks anchored at `anchors` (positions in the packed
        sequence); aux [T, n_aux * H], ids/pos/doc [T] (pos: position in its document)."""
        g, bs = self.g, self.g.block_size
        stream = torch.full((anchors.numel() * bs,), g.mask_token_id, dtype=torch.long, device=ids.device)
        stream[::bs] = ids[anchors]
        x = self.embed_tokens(stream)
        ctx = self.hidden_norm(self.fc(aux))
        offsets = torch.arange(bs, device=ids.device)
        block_pos = (pos[anchors][:, None] + offsets[None]).reshape(-1)
        rope_ctx = rope_cos_sin(pos, g.head_dim, g.rope_theta, x.dtype)
        rope_block = rope_cos_sin(block_pos, g.head_dim, g.rope_theta, x.dtype)
        plan = block_plan(doc, anchors, bs)
        for layer in self.layers:
            x = layer(x, ctx, rope_ctx, rope_block, plan)
        return self.lm_head(self.norm(x))

    def targets_and_mask(self, target_hidden, loss_mask, doc, anchors):
        """The verifier's logits for each slot (at a + i - 1) and the slots that count: loss-masked, inside the
        anchor's document, not slot 0."""
        bs, T = self.g.block_size, target_hidden.shape[0]
        idx = (anchors[:, None] + torch.arange(bs, device=anchors.device)[None]).reshape(-1)
        with torch.no_grad():
            targets = self.verifier_lm_head(self.verifier_norm(target_hidden[(idx - 1) % T]))
        inside = idx < T
        idx = idx.clamp(max=T - 1)
        mask = loss_mask[idx].bool() & inside & (doc[idx] == doc[anchors].repeat_interleave(bs))
        mask = mask.view(-1, bs)
        mask[:, 0] = False
        return targets, mask.view(-1)

    def forward(self, batch, max_anchors=512, weighting="dpace", loss="ce", gamma=4.0, dpace_alpha=0.5, anchors=None,
                generator=None):
        """-> (loss, metrics) on one packed sequence. batch: aux [T, n_aux * H], target_hidden [T, H], ids,
        loss_mask, doc, pos [T], unshifted (position t holds token t and the states computed at t)."""
        bs = self.g.block_size
        if isinstance(anchors, str):  # "all": every loss-masked anchor, max_anchors at a time (validation)
            return self._every_anchor(batch, max_anchors, weighting, loss, gamma, dpace_alpha)
        if anchors is None:
            anchors = select_anchors(batch["loss_mask"], max_anchors, bs, generator)
        logits = self.block_logits(batch["aux"], batch["ids"], batch["pos"], batch["doc"], anchors)
        targets, mask = self.targets_and_mask(batch["target_hidden"], batch["loss_mask"], batch["doc"], anchors)
        per_slot = slot_loss(loss, logits, targets) * mask
        slot = torch.arange(logits.shape[0], device=logits.device) % bs
        w = slot_weights(weighting, slot, mask, per_slot, bs, gamma, dpace_alpha)
        total = (per_slot * w).sum() / (mask.sum() + LOSS_EPS)
        return total, block_metrics(logits, targets, mask, per_slot, bs)


    def _every_anchor(self, batch, chunk, *loss_args):
        """Validation: every position that can anchor a block does, so the simulated acceptance length is not a
        sample; the loss is the mean over the chunks."""
        every = select_anchors(batch["loss_mask"], batch["loss_mask"].numel(), self.g.block_size)
        losses, sums = [], {}
        for i in range(0, max(every.numel(), 1), chunk):
            loss, m = self(batch, chunk, *loss_args, anchors=every[i:i + chunk])
            losses.append(loss)
            for k, v in m.items():
                sums[k] = sums.get(k, 0) + v
        n = len(losses)
        for k in sums:
            if k.startswith("loss_"):
                sums[k] = sums[k] / n
        return torch.stack(losses).mean(), sums


def trainable_count(g):
    """Parameters a DFlash draft trains (its layers and fc; norms aside)."""
    return g.num_layers * (2 * g.hidden_size * g.num_heads * g.head_dim + 2 * g.hidden_size * g.num_kv_heads
                           * g.head_dim + 3 * g.hidden_size * g.intermediate_size) + g.num_aux * g.hidden_size ** 2


def geometry_note(g):
    """One line for logs and dry runs."""
    params = trainable_count(g)
    return (f"DFlash: {g.num_layers} layers, block {g.block_size}, heads {g.num_heads}/{g.num_kv_heads} x "
            f"{g.head_dim}, MLP {g.intermediate_size}, {params / 1e6:.1f}M trainable, mask token {g.mask_token_id}")


