"""The EAGLE-3 draft model in plain PyTorch, with speculators 0.9.0's weight names and math.

  fc:      [aux_1 | aux_2 | aux_3] (3H) -> H
  layer:   one Llama decoder layer whose q/k/v read [input_layernorm(embed) | hidden_norm(h)] (2H)
  norm + lm_head (draft vocab rows of the verifier's lm_head, frozen); embed_tokens frozen.
Training-time test (TTT): step k feeds the layer's own output back with the teacher-forced token
k+1 ahead; its queries attend to step-0 keys causally within the document plus, at their own
position only, to the keys of steps 1..k (the "diagonal" of speculators' extended mask).

A TTT step k >= 1 computes only the positions that still have a loss target (TTTPlan); attention
runs per document on the CPU (fp32, the diagonal as per-row dot products) and as one block-sparse
flex-attention call on CUDA, so its cost grows with the document lengths, not with the packed length
(speculators materialises a T x (k+1)T mask). On the CPU, matmul row counts are rounded up (Linear)
so oneDNN reuses its kernels across steps.
"""
import os
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
    # EAGLE-3.1 (speculators >= 0.7): one RMSNorm over the concatenated aux states before fc (norm_before_fc)
    # or one per aux layer (fc_norm); norm_output: the post-norm state, not the pre-norm one, feeds the next step
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
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


# optimize_bf16 swaps in a compiled version. The tables are made outside it: fused into one kernel,
# cos/sin were recomputed for every head (2.8% of a Kimi-geometry step's GPU time)
apply_rope = _apply_rope


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


class Attention(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.g = g
        self.q_proj = Linear(2 * g.hidden_size, g.num_heads * g.head_dim, bias=False)
        self.k_proj = Linear(2 * g.hidden_size, g.num_kv_heads * g.head_dim, bias=False)
        self.v_proj = Linear(2 * g.hidden_size, g.num_kv_heads * g.head_dim, bias=False)
        self.o_proj = Linear(g.num_heads * g.head_dim, g.hidden_size, bias=False)

    def forward(self, x, xq, pos, qpos, plan, step):
        """x [N, 2H] the step's rows (keys/values); xq [Nq, 2H] its query rows; pos/qpos their positions."""
        g = self.g
        q = self.q_proj(xq).view(-1, g.num_heads, g.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(-1, g.num_kv_heads, g.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(-1, g.num_kv_heads, g.head_dim).transpose(0, 1)
        q, k = rope(q, qpos, g.rope_theta), rope(k, pos, g.rope_theta)
        plan.cache.append((k, v))
        out = plan.attend(q, step)
        return self.o_proj(out.transpose(0, 1).reshape(q.shape[1], -1))


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


_FLEX = _BLOCK_MASK = None


def flex_attend(plan, q, step):
    """GPU: one flex-attention call over [step-0 keys | diagonal keys of steps 1..step], block-sparse."""
    global _FLEX, _BLOCK_MASK
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=True)
        # eager, the mask function runs over the whole Q x KV grid per TTT step; compiled, it is fused
        # (3 graphs, then dynamic shapes; 5-6x faster on a CPU)
        _BLOCK_MASK = torch.compile(create_block_mask)
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

    bm = _BLOCK_MASK(mask_mod, None, None, q.shape[1], ks.shape[1], device=dev)
    return _FLEX(q[None], ks[None], vs[None], block_mask=bm, enable_gqa=q.shape[0] != ks.shape[0])[0]


class MLP(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.gate_proj = Linear(g.hidden_size, g.intermediate_size, bias=False)
        self.up_proj = Linear(g.hidden_size, g.intermediate_size, bias=False)
        self.down_proj = Linear(g.intermediate_size, g.hidden_size, bias=False)

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

    def forward(self, embeds, hidden, pos, plan, step, qsel=None):
        """Rows of one TTT step -> outputs at its query rows (qsel: indices into the rows; None = all)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.g.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        xq, qpos = (x, pos) if qsel is None else (x[qsel], pos[qsel])
        residual = residual if qsel is None else residual[qsel]
        h = residual + self.self_attn(x, xq, pos, qpos, plan, step)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    def __init__(self, g: DraftGeometry):
        super().__init__()
        self.g = g
        self.embed_tokens = nn.Embedding(g.verifier_vocab_size, g.hidden_size)
        self.input_norm = RMSNorm(g.num_aux * g.hidden_size, g.rms_norm_eps) if g.norm_before_fc else None
        self.fc_norm = nn.ModuleList([RMSNorm(g.hidden_size, g.rms_norm_eps) for _ in range(g.num_aux)]) \
            if g.fc_norm else None
        self.fc = Linear(g.num_aux * g.hidden_size, g.hidden_size, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(g)])
        self.norm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.lm_head = Linear(g.hidden_size, g.draft_vocab_size, bias=False)
        # frozen verifier pieces for the training targets (not exported)
        self.verifier_norm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.verifier_lm_head = Linear(g.hidden_size, g.draft_vocab_size, bias=False)
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

    def forward(self, batch, ttt_steps, decay):
        """Training: -> (loss, metrics); see ttt_loss. A forward() so DDP can wrap the model."""
        return ttt_loss(self, batch, ttt_steps, decay)

    def run_steps(self, aux, embeds, pos, plan):
        """Teacher-forced TTT unroll over plan.rows; yields (step, output hidden [len(rows[k]), H]).
        embeds [T, H]: the input embeddings of the tokens (token i+1 at row i)."""
        hidden = self.fc(self.normed_aux(aux))
        layer = self.layers[0]
        h = layer(embeds, hidden, pos, plan, 0, qsel=plan.rows[0])
        yield 0, h
        for k in range(1, len(plan.rows)):
            rows = plan.rows[k]
            # rows[k] is a subset of rows[k-1]: carry each row's hidden state forward
            carried = self.norm(h) if self.g.norm_output else h
            h = layer(embeds[rows + k], carried[plan.lookup[k - 1][rows]], pos[rows] + k, plan, k)
            yield k, h

    def normed_aux(self, aux):
        if self.input_norm is not None:
            return self.input_norm(aux)
        if self.fc_norm is not None:
            return torch.cat([norm(x) for norm, x in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return aux

    def unroll(self, aux, ids, pos, doc, docs, ttt_steps):
        """Logits at every start position per TTT step (step k: positions 0..T-k-1), teacher forced."""
        T = ids.shape[0]
        ix = index_plan(torch.ones(T, dtype=torch.bool), doc.cpu(), docs, ttt_steps, every_row=True)
        plan = make_plan(ix, T, doc, docs, ids.device)
        return [self.lm_head(self.norm(h)) for _, h in self.run_steps(aux, self.embed_tokens(ids), pos, plan)]


def optimize_bf16(model, compile_layers=True):
    """For bf16 autocast: frozen pieces in bf16 (they never update; halves their memory); on CUDA also
    the elementwise chains (RMSNorms, SwiGLU, RoPE) compiled into fused kernels. Module.compile keeps
    the weight names."""
    head_frozen = not model.lm_head.weight.requires_grad  # a trained head keeps its fp32 master weights
    for m in (model.embed_tokens, model.lm_head if head_frozen else None):
        if m is not None:  # None: the embedding was taken to the host (take_embedding)
            m.to(torch.bfloat16)
    if head_frozen and torch.equal(model.verifier_lm_head.weight.to(torch.bfloat16), model.lm_head.weight):
        model.verifier_lm_head.weight = model.lm_head.weight  # the same frozen rows (build_model): store once
    else:
        model.verifier_lm_head.to(torch.bfloat16)
    if compile_layers:
        layer = model.layers[0]
        for m in (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, layer.mlp, model.norm,
                  model.verifier_norm, model.input_norm, *(model.fc_norm or [])):
            if m is not None:
                m.compile(dynamic=True)
    global apply_rope
    apply_rope = torch.compile(_apply_rope, dynamic=True) if compile_layers else _apply_rope
    return model


def take_embedding(model, dtype):
    """Remove the frozen input embedding from the model; -> its weight in `dtype`, a host tensor. On GPUs the
    loader looks up each batch's tokens in it, so only [T, H] rows travel and the table (163840 x 7168 =
    2.3 GB in bf16 at Kimi scale) takes no GPU memory."""
    w = model.embed_tokens.weight.detach().to(dtype)
    model.embed_tokens = None
    return w


def attention_backend(device):
    """flex attention (compiled, block-sparse) on CUDA; per-document SDPA elsewhere or when EAGLE3_ATTN=sdpa."""
    want = os.environ.get("EAGLE3_ATTN", "auto")
    return "flex" if want == "flex" or (want == "auto" and device.type == "cuda") else "sdpa"


def index_plan(mask0, doc, docs, ttt_steps, every_row=False):
    """CPU bookkeeping of one batch (so the GPU never waits on a nonzero()): per TTT step k,
    valid[k][i]: start i has a target at step k (mask at i+k, same document);
    rows[k]: starts step k computes, those with a target at some step j >= k (every_row: all);
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
        rows[k] = torch.arange(T - k) if every_row else need.nonzero().squeeze(1)
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


def _kl_rows(logits, target_logp, idx):
    """-> (KL(target || softmax(logits)) per row, the draft's top token per row); target row r = target_logp[idx[r]]."""
    t = target_logp[idx]
    return (t.exp() * (t - logits.float().log_softmax(-1))).sum(-1), logits.max(-1).indices  # max: 3x argmax in bf16, eager


def _kl_grad(logits, target_logp, idx, grad):
    return ((logits.float().softmax(-1) - target_logp[idx].exp()) * grad[:, None]).to(logits.dtype)


def _targets(t_logits):
    """Verifier logits on the draft vocab -> (top token, fp32 log-probs)."""
    t = t_logits.float()
    return t.max(-1).indices, t.log_softmax(-1)


# compile_loss swaps in compiled versions: each is a chain of passes over [rows, draft vocab] fp32 tensors
# (gather, exp, log-softmax, subtract, multiply), memory-bound; fused, the CPU step ran 1.3-1.45x faster
# (bench/cpu_train_step.py vs --no-compile, 2 alternating pairs)
kl_rows, kl_grad, targets = _kl_rows, _kl_grad, _targets


def compile_loss(enabled=True):
    global kl_rows, kl_grad, targets
    kl_rows, kl_grad, targets = ((torch.compile(f, dynamic=True) for f in (_kl_rows, _kl_grad, _targets)) if enabled
                                 else (_kl_rows, _kl_grad, _targets))


class SoftKL(torch.autograd.Function):
    """Per-row KL(target || softmax(logits)), target row r = target_logp[idx[r]], gradient written
    out: softmax(logits) - p. Autograd's version would keep fp32 log-probs and a gathered copy of
    the targets per TTT step ([rows, draft vocab] each, the largest activations of a big-vocab
    draft); this keeps the logits and re-gathers the targets in backward. Also returns the draft's
    top token per row (for the accuracy counts, from the same pass)."""

    @staticmethod
    def forward(ctx, logits, target_logp, idx):
        ctx.save_for_backward(logits, target_logp, idx)
        kl, top = kl_rows(logits, target_logp, idx)
        ctx.mark_non_differentiable(top)
        return kl, top

    @staticmethod
    def backward(ctx, grad, _):
        logits, target_logp, idx = ctx.saved_tensors
        return kl_grad(logits, target_logp, idx, grad), None, None


def ttt_loss(model, batch, ttt_steps, decay):
    """KL(verifier || draft) on the draft vocab per TTT step, masked; -> (loss, metrics counts).

    batch: aux [T, 3H], ids [T] (token i+1), embeds [T, H] (optional: their embeddings), target_hidden [T, H] (verifier h_N at i+1),
    loss_mask [T], doc [T] document index, pos [T], docs [(start, end)].
    Teacher forcing feeds ground-truth tokens forward, so a start position needs computing at step k
    only if it has a loss target at step k or later: the layer runs on those rows only (step 0 keeps
    keys/values everywhere), the vocab projections only at loss-masked targets.
    """
    aux, ids, pos, doc = batch["aux"], batch["ids"], batch["pos"], batch["doc"]
    embeds = batch["embeds"] if "embeds" in batch else model.embed_tokens(ids)  # looked up by the loader on GPUs
    T, dev = ids.shape[0], ids.device
    cpu = batch.get("cpu") or OnHost(loss_mask=batch["loss_mask"].cpu(), doc=doc.cpu())
    ix = move(index_plan(cpu["loss_mask"].bool(), cpu["doc"], batch["docs"], ttt_steps), dev)
    valid = ix["valid"]
    with torch.no_grad():
        target_ids, target_logp = targets(model.verifier_lm_head(model.verifier_norm(batch["target_hidden"][ix["tpos"]])))
    plan = make_plan(ix, T, doc, batch["docs"], dev)
    chain_ok = torch.ones(T, dtype=torch.bool, device=dev)  # drafts 0..k-1 right from start i
    total, metrics = 0.0, {}
    for k, h in model.run_steps(aux, embeds, pos, plan):
        sel, tr = ix["sel"][k], ix["tr"][k]
        logits = model.lm_head(model.norm(h[ix["local"][k]]))
        kl, top = SoftKL.apply(logits, target_logp, tr)
        step_loss = kl.sum() / max(len(sel), 1)
        total = total + (decay ** k) * step_loss
        with torch.no_grad():
            correct = torch.zeros(T, dtype=torch.bool, device=dev)
            correct[sel] = top == target_ids[tr]
            chain = chain_ok & valid[k]
            metrics[f"loss_{k}"] = step_loss.detach()
            metrics[f"full_correct_{k}"] = (correct & chain).sum()  # drafts 0..k all right
            metrics[f"full_total_{k}"] = valid[k].sum()
            metrics[f"cond_correct_{k}"] = (correct & chain).sum()
            metrics[f"cond_total_{k}"] = chain.sum()
            chain_ok = chain_ok & correct
    return total, metrics


def acceptance_length(full_acc):
    """Expected tokens per verifier step with len(full_acc) drafts: 1 + sum_k P(drafts 0..k all accepted)."""
    return 1.0 + sum(full_acc)
