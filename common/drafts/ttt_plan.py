"""EAGLE-3's training-time-test plan: which rows each TTT step computes and which keys each query sees, on the
host (so the GPU never waits on a nonzero()), and the attention over it: per document on CPUs, one block-sparse
flex-attention call on CUDA."""
import copy

import torch
import torch.nn.functional as F

from common.drafts.layers import attention_backend, attn_bucket, compiled_flex


class TTTPlan:
    """Which rows each TTT step computes, and which keys each query sees.

    Step 0 computes keys/values at every position (all later queries attend to them causally within
    their document) but queries, MLP and logits only at rows[0]. Step k >= 1 computes only rows[k]:
    positions with a loss target at some step j >= k, so rows[k+1] is a subset of rows[k]. A query of
    step k at position i sees the step-0 keys i' <= i of its document plus its own keys of steps 1..k
    (the "diagonal" of speculators' extended mask). Identical maths to computing every row.
    """

    def __init__(self, T, doc, docs, rows, lookup, ranges, backend="sdpa"):
        self.T, self.doc, self.docs, self.rows, self.backend = T, doc, docs, rows, backend
        self.lookup = lookup  # lookup[j]: original position -> row index within rows[j] (-1 if absent)
        self.doc_ranges = ranges  # ranges[k][d]: first row of rows[k] in document d (Python ints)
        self.cache = []

    def for_layer(self):
        """The same plan for another draft layer: its own keys and values."""
        other = copy.copy(self)
        other.cache = []
        return other

    def attend(self, q, step):
        if self.backend == "flex":
            return flex_attend(self, q, step)
        return self.attend_sdpa(q, step)

    def attend_sdpa(self, q, step):
        with torch.autocast(q.device.type, enabled=False):  # the products run in q's dtype, by hand
            return self._attend_sdpa(q, step)

    def _attend_sdpa(self, q, step):
        """Per document: its step-0 keys, causal, plus each query's own keys of steps 1..step as per-row dot
        products: scores [m, n + step], not SDPA's [m, n + step*m] with a diagonal mask. Cost grows with the
        document lengths. The two products run in q's dtype (bf16 under autocast), the softmax and the
        diagonal in fp32. In bf16, oneDNN builds a kernel per new matrix shape (~2.7 ms, against 0.2 ms for a
        cached one), so both sizes are rounded up (attn_bucket): the extra keys lie past the document's end
        (masked by the causal test), the extra queries' outputs are dropped."""
        q_orig, ranges, out = self.rows[step], self.doc_ranges[step], torch.empty_like(q)
        k0, v0 = self.cache[0]  # [heads, T, dim] views of [T, heads, dim]
        bucket = attn_bucket(q.dtype)
        kv, dim = k0.shape[0], q.shape[-1]
        grp = q.shape[0] // kv  # query heads per KV head (GQA): they share one product
        # contiguous copies with room to round up; rows past the last query get position T: they see every key,
        # so no row is all -inf
        k0, v0, qp = (F.pad(t, (0, 0, 0, bucket - 1)) for t in (k0, v0, q * dim ** -0.5))
        q_pos = F.pad(q_orig, (0, bucket - 1), value=self.T)
        for d, (a, b) in enumerate(self.docs):
            lo, hi = ranges[d], ranges[d + 1]
            if lo == hi:
                continue
            m, n = hi - lo, b - a
            mp, n_ = -(-m // bucket) * bucket, -(-n // bucket) * bucket
            s = torch.bmm(qp[:, lo:lo + mp].reshape(kv, grp * mp, dim), k0[:, a:a + n_].transpose(1, 2))
            s = s.view(kv, grp, mp, n_).masked_fill(torch.arange(a, a + n_, device=q.device) > q_pos[lo:lo + mp, None],
                                                   float("-inf"))
            if step:
                qi = q_orig[lo:hi]
                sel = [self.lookup[j][qi] for j in range(1, step + 1)]
                kd = torch.stack([self.cache[j][0][:, r] for j, r in enumerate(sel, 1)], 1).float()  # [kv, step, m, dim]
                vd = torch.stack([self.cache[j][1][:, r] for j, r in enumerate(sel, 1)], 1).float()
                qf = qp[:, lo:hi].reshape(kv, grp, 1, m, dim).float()
                # elementwise, not einsum: as a bmm it would be m tiny products per KV head, slow on the CPU
                diag = (qf * kd[:, None]).sum(-1).transpose(-1, -2)  # [kv, grp, m, step]
                s = torch.cat([s.float(), F.pad(diag, (0, 0, 0, mp - m), value=0.0)], -1)
            p = s.softmax(-1, dtype=torch.float32)
            o = torch.bmm(p[..., :n_].to(q.dtype).reshape(kv, grp * mp, n_), v0[:, a:a + n_]).view(kv, grp, mp, dim)
            o = o[:, :, :m]
            if step:
                o = o.float() + (p[:, :, :m, n_:].transpose(-1, -2)[..., None] * vd[:, None]).sum(2)
            out[:, lo:hi] = o.reshape(-1, m, dim).to(out.dtype)
        return out


def flex_attend(plan, q, step):
    """GPU: one flex-attention call over [step-0 keys | diagonal keys of steps 1..step], block-sparse."""
    flex, block_mask = compiled_flex()
    dev, T = q.device, plan.T
    ks = torch.cat([plan.cache[j][0] for j in range(step + 1)], 1)
    vs = torch.cat([plan.cache[j][1] for j in range(step + 1)], 1)
    pad = 256  # the kernel may read a block past the end: padded entries are valid indices, masked out
    kv_orig = torch.cat([torch.arange(T, device=dev)] + list(plan.rows[1:step + 1]) + [torch.zeros(pad, dtype=torch.long, device=dev)])
    kv_step = torch.cat([torch.zeros(T, dtype=torch.long, device=dev)] +
                        [torch.full((len(plan.rows[j]),), j, device=dev) for j in range(1, step + 1)] +
                        [torch.full((pad,), -1, device=dev)])
    q_orig = torch.cat([plan.rows[step], torch.zeros(pad, dtype=torch.long, device=dev)])
    doc = plan.doc

    def mask_mod(b, h, qi, ki):
        qo, ko, ks_ = q_orig[qi], kv_orig[ki], kv_step[ki]
        return ((ks_ == 0) & (doc[ko] == doc[qo]) & (ko <= qo)) | ((ks_ > 0) & (ko == qo))

    bm = block_mask(mask_mod, None, None, q.shape[1], ks.shape[1], device=dev)
    return flex(q[None], ks[None], vs[None], block_mask=bm, enable_gqa=q.shape[0] != ks.shape[0])[0]


def index_plan(mask0, doc, docs, ttt_steps, every_row=False, full_first=False):
    """CPU bookkeeping of one batch (so the GPU never waits on a nonzero()): per TTT step k,
    valid[k][i]: start i has a target at step k (mask at i+k, same document);
    rows[k]: starts step k computes, those with a target at some step j >= k (every_row: all; full_first: all at
    step 0, where a draft of several layers needs every position's keys in each layer);
    local[k]: which of rows[k] have a target now; tr[k]: their row in the verifier targets (tpos);
    lookup[k]: position -> index in rows[k]; ranges[k]: per document, its first row in rows[k]."""
    T = mask0.shape[0]
    valid, need = [], torch.zeros(T, dtype=torch.bool)
    for k in range(ttt_steps):
        v = torch.zeros(T, dtype=torch.bool)
        v[:T - k] = mask0[k:] & (doc[:T - k] == doc[k:])
        valid.append(v)
    rows = [None] * ttt_steps
    for k in reversed(range(ttt_steps)):
        need = need | valid[k]
        rows[k] = torch.arange(T - k) if every_row or (full_first and k == 0) else need.nonzero().squeeze(1)
    tpos = mask0.nonzero().squeeze(1)
    row_of = torch.full((T,), -1, dtype=torch.long)
    row_of[tpos] = torch.arange(len(tpos))
    ix = {"valid": torch.stack(valid), "tpos": tpos, "rows": rows, "local": [], "sel": [], "tr": [], "lookup": []}
    bounds = torch.tensor([a for a, _ in docs] + [docs[-1][1]])
    ix["ranges"] = [torch.searchsorted(r, bounds).tolist() for r in rows]
    for k in range(ttt_steps):
        local = valid[k][rows[k]].nonzero().squeeze(1)
        sel = rows[k][local]
        lk = torch.full((T,), -1, dtype=torch.long)
        lk[rows[k]] = torch.arange(len(rows[k]))
        ix["local"].append(local), ix["sel"].append(sel), ix["tr"].append(row_of[sel + k]), ix["lookup"].append(lk)
    return ix


class OnHost:
    """Host copies of the mask and document ids, read like a dict. DDP and FSDP move every tensor they
    find in a forward's arguments (inside lists, dicts, dataclasses) to the GPU, but not an object's."""

    def __init__(self, **tensors):
        self._t = tensors

    def __getitem__(self, key):
        return self._t[key]


def move(ix, device):
    """Index tensors to the device without a host sync (pinned, non-blocking copies)."""
    if device.type == "cpu":
        return ix
    def mv(v):
        if torch.is_tensor(v):
            return v.pin_memory().to(device, non_blocking=True) if v.device.type == "cpu" else v.to(device)
        return [mv(x) for x in v] if isinstance(v, list) and v and torch.is_tensor(v[0]) else v
    return {k: mv(v) for k, v in ix.items()}


def make_plan(ix, T, doc, docs, device):
    return TTTPlan(T, doc, docs, ix["rows"], ix["lookup"], ix["ranges"], attention_backend(device))
