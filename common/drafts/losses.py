"""The training losses: EAGLE-3's KL per TTT step (ttt_loss, with a hand-written backward that keeps no fp32
copies of [rows, vocab] tensors), and DFlash's per-slot loss and slot weights."""
import torch
import torch.nn.functional as F

from common.drafts.ttt_plan import OnHost, index_plan, make_plan, move


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


LOSS_EPS = 1e-5  # speculators' _LOSS_REDUCTION_EPS


def slot_loss(kind, logits, targets):
    """[Q] per-slot loss in fp32: ce (to the verifier's argmax, D-PACE's confidence is exp(-ce)) or kl."""
    if kind == "ce":
        return F.cross_entropy(logits.float(), targets.argmax(-1), reduction="none")
    return F.kl_div(F.log_softmax(logits.float(), -1), F.softmax(targets.float(), -1), reduction="none").sum(-1)


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
