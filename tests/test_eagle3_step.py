"""The optimised TTT step (row subsets, per-document attention) equals a dense reference.

The reference is written out independently here, as speculators computes it: every position at
every step, one T x (k+1)T mask (causal within the document over step-0 keys, plus the diagonal).
"""
import pytest
import torch
import torch.nn.functional as F

from common.drafts import ttt_plan
from common.drafts.eagle3 import DraftGeometry, Eagle3Draft
from common.drafts.eagle3 import ttt_loss


def tiny_batch(T=300, seed=0, vocab=500, H=64):
    gen = torch.Generator().manual_seed(seed)
    lens = [90, 130, 80]
    doc = torch.cat([torch.full((n,), j) for j, n in enumerate(lens)])
    docs, a = [], 0
    for n in lens:
        docs.append((a, a + n))
        a += n
    mask = torch.zeros(T, dtype=torch.long)
    for a, b in docs:  # a prompt, then an answer: the loss mask is a span per document
        mask[a + (b - a) // 3:b] = 1
    mask[docs[1][0] + 70:docs[1][0] + 75] = 0  # a hole inside an answer
    return {"aux": torch.randn(T, 3 * H, generator=gen), "ids": torch.randint(0, vocab, (T,), generator=gen),
            "target_hidden": torch.randn(T, H, generator=gen), "loss_mask": mask, "doc": doc,
            "pos": torch.cat([torch.arange(1, n + 1) for n in lens]), "docs": docs}


def speculators_loss(kind):
    """speculators 0.9.0's eager loss of our --loss kind: per row, against the verifier's logits."""
    from speculators.losses import eager
    fn = {"kl": eager.kl_div_loss, "ce": eager.ce_loss, "tv": eager.tv_loss, "nla": eager.neg_log_acceptance_loss,
          "lk": eager.lk_hybrid_loss}[kind]
    return lambda logits, targets: fn(logits[None], targets[None])[0]


def start_weights_by_hand(mask, doc, weight, tokens):
    """Each position's weight, counting its place in its answer (a run of masked positions in one document)."""
    w, run = [], 0
    for i in range(len(mask)):
        run = run + 1 if mask[i] and i and mask[i - 1] and doc[i] == doc[i - 1] else int(bool(mask[i]))
        w.append(weight if mask[i] and run <= tokens else 1.0)
    return torch.tensor(w, dtype=torch.float64)


def plain_rope(x, pos, theta):
    """Llama's rotary embedding written out (rotate-half, plain RoPE at `theta`): not the draft's own Rotary."""
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
    return x * cos + torch.cat([-x[..., dim // 2:], x[..., :dim // 2]], -1) * sin


def dense_reference(m, b, ttt, decay, loss="kl", start=None):
    g, T = m.g, b["ids"].shape[0]
    weight = torch.ones(T, dtype=torch.float64) if start is None else start_weights_by_hand(b["loss_mask"], b["doc"], *start)
    doc, pos, mask0 = b["doc"], b["pos"], b["loss_mask"].bool()
    layer = m.layers[0]
    at = layer.self_attn
    assert at.rotary.params["rope_type"] == "default"  # the reference writes plain RoPE out
    target_logp = m.verifier_lm_head(m.verifier_norm(b["target_hidden"])).log_softmax(-1)
    causal = (doc[:, None] == doc[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    hidden, ks, vs, total = m.fc(b["aux"]), [], [], 0.0
    for k in range(ttt):
        ids = torch.cat([b["ids"][k:], b["ids"].new_zeros(k)])
        normed = layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(m.embed_tokens(ids)), normed], -1)
        q = plain_rope(at.q_proj(x).view(T, g.num_heads, -1).transpose(0, 1), pos + k, g.rope_theta)
        ks.append(plain_rope(at.k_proj(x).view(T, g.num_kv_heads, -1).transpose(0, 1), pos + k, g.rope_theta))
        vs.append(at.v_proj(x).view(T, g.num_kv_heads, -1).transpose(0, 1))
        full_mask = torch.cat([causal] + [torch.eye(T, dtype=torch.bool)] * k, 1)
        rep = g.num_heads // g.num_kv_heads
        o = F.scaled_dot_product_attention(q, torch.cat(ks, 1).repeat_interleave(rep, 0),
                                           torch.cat(vs, 1).repeat_interleave(rep, 0), attn_mask=full_mask)
        h = normed + at.o_proj(o.transpose(0, 1).reshape(T, -1))
        hidden = h + layer.mlp(layer.post_attention_layernorm(h))
        logp = m.lm_head(m.norm(hidden)).log_softmax(-1)
        valid = torch.zeros(T, dtype=torch.bool)
        valid[:T - k] = mask0[k:] & (doc[:T - k] == doc[k:])
        tgt = torch.cat([target_logp[k:], target_logp[:k]])  # row i -> verifier at i + k
        if loss == "kl":
            per_row = (tgt.exp() * (tgt - logp)).sum(-1)
        else:  # speculators' definition (fp32 softmaxes)
            per_row = speculators_loss(loss)(logp.float(), tgt.float()).to(logp.dtype)
        w = torch.cat([weight[k:], weight[:k]])[valid]  # the weight of row i's target, i + k
        total = total + decay ** k * (per_row[valid] * w).sum() / w.sum()
    return total


@pytest.mark.parametrize("bucket,loss,start", [(1, "kl", None), (64, "kl", None), (1, "ce", None), (1, "lk", None),
                                               (1, "nla", None), (1, "tv", None), (1, "kl", (3.0, 10)),
                                               (1, "ce", (2.0, 40))])
def test_row_subsets_equal_dense_reference(bucket, loss, start, monkeypatch):
    """bucket 64: the attention products' sizes rounded up as in bf16 (extra keys and queries), here in fp64.
    Every --loss kind: the reference takes speculators' own loss functions. start: --answer-start-weight / -tokens
    (the tiny batch's answers are 53-87 targets, one split in two by a hole)."""
    monkeypatch.setattr(ttt_plan, "attn_bucket", lambda dtype: bucket)
    g = DraftGeometry(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                      rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=512, verifier_vocab_size=500,
                      draft_vocab_size=500)
    torch.manual_seed(0)
    m = Eagle3Draft(g).double()
    for p in (m.embed_tokens.weight, m.lm_head.weight, m.verifier_lm_head.weight):
        p.data.normal_()
    b = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in tiny_batch().items()}
    value, metrics = ttt_loss(m, b, 3, 0.8, loss, start)
    value.backward()
    ours = [p.grad.clone() for p in m.trainable_parameters()]
    m.zero_grad()
    ref = dense_reference(m, b, 3, 0.8, loss, start)
    if start:  # the weights move the loss: the same batch unweighted reads otherwise
        assert abs(float(ref.detach()) - float(dense_reference(m, b, 3, 0.8, loss).detach())) > 1e-3
    ref.backward()
    torch.testing.assert_close(value.double(), ref, rtol=1e-5, atol=1e-6)  # ours takes log-softmax in fp32
    for a, r in zip(ours, (p.grad for p in m.trainable_parameters())):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-6)
    assert int(metrics["full_total_0"]) == int(b["loss_mask"].sum())


@pytest.mark.parametrize("layers", [1, 2])
def test_flex_attention_equals_the_per_document_products(layers, monkeypatch):
    """CUDA's path (one block-sparse flex-attention call per TTT step; with 2 layers each with its own keys, step 0
    at every position) against the CPU's per-document products on training's row subsets: the same hidden states
    at every step, loss and accuracy counts. Forward only: flex attention has no CPU backward. Eager flex attention
    here: the same mask and key layout, while torch 2.13's CPU inductor fails to compile this kernel (undeclared
    cur_kvSplitSize8), a CPU-only fault."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    monkeypatch.setattr(ttt_plan, "compiled_flex", lambda: (flex_attention, create_block_mask))
    g = DraftGeometry(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                      rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=512, verifier_vocab_size=500,
                      draft_vocab_size=500, num_layers=layers)
    torch.manual_seed(0)
    m = Eagle3Draft(g).float().eval()
    for p in (m.embed_tokens.weight, m.lm_head.weight, m.verifier_lm_head.weight):
        p.data.normal_()
    b = tiny_batch()
    ix = ttt_plan.index_plan(b["loss_mask"].bool(), b["doc"], b["docs"], 3, full_first=layers > 1)
    runs = {}
    for backend in ("sdpa", "flex"):
        monkeypatch.setenv("EAGLE3_ATTN", backend)
        plan = ttt_plan.make_plan(ix, len(b["ids"]), b["doc"], b["docs"], torch.device("cpu"))
        assert plan.backend == backend
        with torch.no_grad():
            runs[backend] = [h for _, h in m.run_steps(b["aux"], m.embed_tokens(b["ids"]), b["pos"], plan)], \
                ttt_loss(m, b, 3, 0.8)
    for a, r in zip(runs["flex"][0], runs["sdpa"][0]):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runs["flex"][1][0], runs["sdpa"][1][0], rtol=1e-5, atol=1e-6)
    assert {k: int(v) for k, v in runs["flex"][1][1].items()} == {k: int(v) for k, v in runs["sdpa"][1][1].items()}


def test_bf16_attention_close_to_fp32():
    """In bf16 the per-document products run on sizes rounded up to 64 (extra keys past the document, extra
    query rows): every TTT step's output stays within bf16 rounding of the fp32 path, which rounds nothing."""
    b = tiny_batch()
    T, heads, kv, dim = 300, 4, 2, 16
    ix = ttt_plan.index_plan(b["loss_mask"].bool(), b["doc"], b["docs"], 3)
    gen = torch.Generator().manual_seed(1)
    qs = [3 * torch.randn(heads, len(ix["rows"][k]), dim, generator=gen) for k in range(3)]  # peaked attention
    cache = [(torch.randn(kv, n, dim, generator=gen), torch.randn(kv, n, dim, generator=gen))
             for n in [T] + [len(ix["rows"][k]) for k in (1, 2)]]
    bf = lambda t: t.to(torch.bfloat16)  # noqa: E731
    for dtype in (torch.float32, torch.bfloat16):  # the same bf16-rounded inputs to both
        plan = ttt_plan.make_plan(ix, T, b["doc"], b["docs"], torch.device("cpu"))
        plan.cache = [(bf(k).to(dtype), bf(v).to(dtype)) for k, v in cache]
        out = [plan.attend(bf(q).to(dtype), k).float() for k, q in enumerate(qs)]
        if dtype == torch.float32:
            ref = out
    assert ttt_plan.attn_bucket(torch.bfloat16) == 64
    for o, r in zip(out, ref):
        assert (o - r).abs().max().item() < 0.05


def test_cpu_linear_rounds_rows_without_changing_results():
    """Rows padded to a multiple of 64 for oneDNN's kernel reuse: same outputs and gradients as nn.Linear."""
    from common.drafts.layers import Linear
    torch.manual_seed(0)
    lin = Linear(24, 40, bias=False).double()
    x = torch.randn(37, 24, dtype=torch.double, requires_grad=True)
    y = lin(x)
    ref_x = x.detach().clone().requires_grad_()
    ref = F.linear(ref_x, lin.weight)
    assert y.shape == (37, 40)
    torch.testing.assert_close(y, ref)
    g = torch.randn(37, 40, dtype=torch.double)
    y.backward(g)
    w_grad = lin.weight.grad.clone()
    lin.weight.grad = None
    ref.backward(g)
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(w_grad, lin.weight.grad)


def test_compiled_loss_equals_eager():
    """--compile on the CPU: the fused KL passes give the eager values, gradients and top tokens."""
    import common.drafts.losses as D
    torch.manual_seed(0)
    logits = (torch.randn(45, 300) * 3).bfloat16()
    target_logp = torch.randn(60, 300).mul(2).log_softmax(-1)
    idx = torch.randperm(60)[:45]
    out = {}
    for compiled in (False, True):
        D.compile_loss(compiled)
        assert (D.kl_rows is not D._kl_rows) == compiled
        try:
            x = logits.clone().requires_grad_()
            kl, top = D.SoftKL.apply(x, target_logp, idx)
            kl.sum().backward()
            ids, logp = D.targets(logits)
            out[compiled] = kl.detach(), top, x.grad, ids, logp
        finally:
            D.compile_loss(False)
    for eager, fused in zip(out[False], out[True]):
        torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-5)
    ref = (target_logp[idx].exp() * (target_logp[idx] - logits.float().log_softmax(-1))).sum(-1)
    torch.testing.assert_close(out[True][0], ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(out[True][1], logits.float().argmax(-1))


@pytest.mark.parametrize("rope_type", ["default", "yarn"])
def test_training_at_a_position_offset_changes_only_rounding(rope_type):
    """Why stage 4 has no position-offset option (docs/long-context.md): rotary attention sees only the distance
    between query and key, so the same samples trained 250,000 positions further on give the same loss and
    gradients, up to the fp32 rounding of the angles (~0.015 rad there). Plain RoPE and Kimi-K2.5's YaRN."""
    from common.mini_kimi import YARN
    params = {"rope_type": "default", "rope_theta": 1e4} if rope_type == "default" else \
        {"rope_theta": 5e4, **{k: v for k, v in YARN.items() if k != "type"}, "rope_type": "yarn"}
    g = DraftGeometry(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                      rms_norm_eps=1e-5, rope_theta=params["rope_theta"], max_position_embeddings=262144,
                      verifier_vocab_size=500, draft_vocab_size=500, rope_parameters=params)
    torch.manual_seed(0)
    m = Eagle3Draft(g).double()
    for p in (m.embed_tokens.weight, m.lm_head.weight, m.verifier_lm_head.weight):
        p.data.normal_()
    b = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in tiny_batch().items()}
    runs = []
    for pos in (b["pos"], b["pos"] + 250_000, b["pos"] * 3):  # the last: other distances, for scale
        m.zero_grad()
        loss, _ = ttt_loss(m, {**b, "pos": pos}, 3, 0.8)
        loss.backward()
        runs.append((float(loss.detach()), torch.cat([p.grad.flatten() for p in m.trainable_parameters()])))
    (l0, g0), (l1, g1), (l3, g3) = runs
    far, other = (g1 - g0).norm() / g0.norm(), (g3 - g0).norm() / g0.norm()
    print(f"{rope_type}: loss {l0:.9f} at 0, {l1:.9f} at +250,000, {l3:.9f} at 3x the distances; gradients differ "
          f"by {far:.1e} and {other:.1e} of their norm")
    assert far < 1e-2 * other  # 250,000 positions on: a hundredth of what other distances change, or less
