"""Loss maths the methods share: the soft-target KL per row with a hand-written backward that keeps no fp32 copies
of [rows, vocab] tensors (SoftKL, EAGLE-3's default TTT loss in eagle3.py), the other --loss kinds per row (row_loss:
autograd, so they keep those copies), and a block draft's slot weights (DFlash)."""
import torch
import torch.nn.functional as F


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


def answer_start_weights(loss_mask, doc, weight, tokens):
    """[T] loss weights: `weight` where a target is among the first `tokens` of its answer (a run of loss-masked
    positions within one document), 1 elsewhere."""
    masked, idx = loss_mask.bool(), torch.arange(loss_mask.shape[0])
    last_unmasked = torch.where(masked, -1, idx).cummax(0).values
    doc_start = torch.where(torch.cat([torch.ones(1, dtype=torch.bool), doc[1:] != doc[:-1]]), idx, 0).cummax(0).values
    in_answer = idx - torch.maximum(last_unmasked + 1, doc_start)
    return torch.where(masked & (in_answer < tokens), float(weight), 1.0)


LOSS_EPS = 1e-5  # speculators' _LOSS_REDUCTION_EPS


NLA_EPS = 1e-5  # speculators' _NLA_EPS
LK_ETA = 3.0  # lk's blend: lambda = exp(-eta * acceptance), the LK paper's best hybrid (speculators' lk_hybrid default)


def row_loss(kind, logits, targets):
    """[rows] loss in fp32 against the verifier's logits (log-probs do as well). kl: KL(verifier || draft); ce: to
    the verifier's top token; with acceptance a = sum(min(p, q)) (speculative sampling's): tv 1 - a, nla -log a, lk
    lambda * kl + (1 - lambda) * tv, lambda = exp(-eta * a) not differentiated (the LK losses paper)."""
    if kind == "ce":
        return F.cross_entropy(logits.float(), targets.argmax(-1), reduction="none")
    logq = F.log_softmax(logits.float(), -1)
    p = F.softmax(targets.float(), -1)
    if kind == "kl":
        return F.kl_div(logq, p, reduction="none").sum(-1)
    accept = torch.minimum(logq.exp(), p).sum(-1)
    if kind == "tv":
        return 1 - accept
    if kind == "nla":
        return -accept.clamp_min(NLA_EPS).log()
    lam = torch.exp(-LK_ETA * accept.detach())
    return lam * F.kl_div(logq, p, reduction="none").sum(-1) + (1 - lam) * (1 - accept)



def slot_weights(kind, slot, mask, elementwise, block_size, gamma, dpace_alpha):
    """Per-slot loss weights [Q]. fixed: exp(-(i - 1) / gamma) for slot i >= 1 (speculators' dflash_loss_decay);
    dpace: sum over the slots m >= i of the smoothed chance that slots 1..m are all accepted (D-PACE)."""
    if kind == "fixed":
        return torch.exp(-(slot - 1).clamp(min=0).float() / gamma) * (slot != 0)
    with torch.no_grad():
        q = torch.exp(-elementwise).float().view(-1, block_size)
        m = mask.view(-1, block_size).float()
        smooth = torch.where(m > 0, (1 - dpace_alpha) * q + dpace_alpha, torch.ones_like(q))
        prefix = torch.cumprod(smooth, dim=-1)
        return (torch.flip(torch.cumsum(torch.flip(prefix * m, [-1]), -1), [-1]) * m).view(-1)
