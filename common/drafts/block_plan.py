"""DFlash's block attention: every block (its anchor and mask slots) sees its document's context before its anchor
and its own block: all of it (bidirectional, DFlash's design), or with causal=True each slot the slots up to itself
(speculators' DFlash default). One block-sparse flex-attention call on CUDA; per document on CPUs, where a dense
mask over the packed sequence would cost every block x the packed length (speculators' layout)."""
import torch

from common.drafts import layers
from common.drafts.layers import compiled_flex


def block_plan(doc, anchors, block_size, causal=False):
    """The attention of the blocks anchored at `anchors` (sorted positions in the packed sequence of documents
    `doc`): one block-sparse flex-attention call on CUDA (layers.attention_backend), else per document."""
    if layers.attention_backend(doc.device) == "flex":
        return FlexBlocks(doc, anchors, block_size, causal)
    return PerDocumentBlocks(doc, anchors, block_size, causal)


class FlexBlocks:
    """GPU: one flex-attention call; the block mask (made once per forward, shared by the layers) skips the tiles
    no query of a tile can see, so the cost follows each block's visible context, as per document."""

    def __init__(self, doc, anchors, bs, causal=False):
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
            own = kv_blk[ki] == q_blk[qi]
            return context | ((own & (ki <= T + qi)) if causal else own)
        self.mask = block_mask(mask_mod, None, None, Q, T + Q, device=dev)

    def attend(self, q, k, v, scale):
        """q [h, Q, D]; k/v [kv heads, T + Q, D] (context, then the blocks)."""
        return self.flex(q[None], k[None], v[None], block_mask=self.mask, scale=scale,
                         enable_gqa=q.shape[0] != k.shape[0])[0]


class PerDocumentBlocks:
    """CPU: per document holding anchors, its blocks against its context only (speculators' dense mask would cost
    every block x the packed length). The bookkeeping runs on the host."""

    def __init__(self, doc, anchors, bs, causal=False):
        self.T, self.bs, self.causal = doc.numel(), bs, causal
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
        return block_attention(q, k, v, self.T, self.docs, self.bs, scale, self.causal)


def block_attention(q, k, v, T, docs, bs, scale, causal=False):
    """q [h, Q, D] the blocks' queries; k/v [h, T + Q, D] (context, then the blocks); docs: PerDocumentBlocks.docs.
    A block's queries see the context of its document before its anchor and every query of their own block, in one
    softmax."""
    out = torch.empty_like(q)
    later = torch.ones(bs, bs, dtype=torch.bool, device=q.device).triu(1) if causal else None  # slot i sees 0..i
    for b0, b1, s, last, rel in docs:
        n, h, D = b1 - b0, q.shape[0], q.shape[-1]
        qd = q[:, b0 * bs:b1 * bs].view(h, n, bs, D)
        kc, vc = k[:, s:last], v[:, s:last]  # the context any of these blocks can see
        ko, vo = (t[:, T + b0 * bs:T + b1 * bs].reshape(h, n, bs, D) for t in (k, v))
        sc = torch.einsum("hnqd,hkd->hnqk", qd, kc) * scale
        seen = torch.arange(last - s, device=q.device)[None, :] < rel.to(q.device)[:, None]  # [n, ctx]
        sc = sc.masked_fill(~seen[None, :, None, :], float("-inf"))
        so = torch.einsum("hnqd,hnkd->hnqk", qd, ko) * scale
        if causal:
            so = so.masked_fill(later, float("-inf"))
        p = torch.softmax(torch.cat([sc, so], -1).float(), -1).to(q.dtype)
        o = torch.einsum("hnqk,hkd->hnqd", p[..., :last - s], vc) + torch.einsum("hnqk,hnkd->hnqd", p[..., last - s:], vo)
        out[:, b0 * bs:b1 * bs] = o.reshape(h, n * bs, D)
    return out
