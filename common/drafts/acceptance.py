"""Acceptance maths: the expected tokens per verify step, and a block draft's per-slot counts in the keys EAGLE-3's
training reports (so validation, checkpoint choice and the parity gate read one format)."""
import torch


def acceptance_length(full_acc):
    """Expected tokens per verifier step with len(full_acc) drafts: 1 + sum_k P(drafts 0..k all accepted)."""
    return 1.0 + sum(full_acc)


def block_metrics(logits, targets, mask, kl, bs):
    """The keys EAGLE-3's training reports, per draft slot k = 0..bs-2 (slot k + 1 of the block): KL, and accuracy
    of the first k + 1 drafts all right (full) and of draft k given the earlier ones right (cond), so that the
    simulated acceptance length 1 + sum_k full_acc_k is the mean accepted run of a block plus the bonus token.
    `loss_k` is the mean per-slot loss (ce or kl) of slot k + 1."""
    with torch.no_grad():
        right = (logits.argmax(-1) == targets.argmax(-1)).view(-1, bs)[:, 1:]
        valid = mask.view(-1, bs)[:, 1:]
        chain = torch.ones_like(right[:, 0])
        out = {}
        for k in range(bs - 1):
            ok = right[:, k] & valid[:, k]
            before = chain & valid[:, k]
            out[f"loss_{k}"] = (kl.view(-1, bs)[:, k + 1].sum() / valid[:, k].sum().clamp(min=1)).detach()
            out[f"full_correct_{k}"] = (ok & chain).sum()
            out[f"full_total_{k}"] = valid[:, k].sum()
            out[f"cond_correct_{k}"] = (ok & chain).sum()
            out[f"cond_total_{k}"] = before.sum()
            chain = chain & ok
        return out
