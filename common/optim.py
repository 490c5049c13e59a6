"""Stage 4's optimizer and learning-rate schedule.

--optimizer adamw (the default): AdamW over every trainable weight. --optimizer muon: torch's Muon over the draft's
hidden weight matrices (attention, MLP, fc) and AdamW over the rest (norms, vectors, a trained lm_head), the split
speculators' trainer makes for its DFlash default (Keller Jordan's: embeddings and heads stay on AdamW); Muon's
update is scaled to AdamW's RMS (match_rms_adamw), so one --lr serves both.
"""
import math

import torch

# speculators 0.9.0's Muon defaults (momentum, weight decay of the Muon group, Newton-Schulz steps)
MUON = dict(momentum=0.95, weight_decay=0.1, ns_steps=5, adjust_lr_fn="match_rms_adamw")
BETAS = (0.9, 0.95)


def muon_split(model):
    """-> (Muon's parameters: trainable 2-D matrices, not a vocabulary head or embedding; AdamW's: the rest)."""
    matrices, rest = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        vocab = any(h in name for h in ("lm_head", "embed_tokens"))
        (matrices if p.ndim == 2 and min(p.shape) > 1 and not vocab else rest).append(p)
    return matrices, rest


class MuonAdamW(torch.optim.Optimizer):
    """Muon and AdamW stepped as one optimizer: the scheduler sees both groups, a checkpoint holds both states."""

    def __init__(self, matrices, rest, lr, weight_decay, fused):
        self.parts = {"muon": torch.optim.Muon(matrices, lr=lr, **MUON)}
        if rest:
            self.parts["adamw"] = torch.optim.AdamW(rest, lr=lr, betas=BETAS, weight_decay=weight_decay, fused=fused)
        self.defaults, self.state = {"lr": lr}, {}

    @property
    def param_groups(self):
        """The parts' own groups, live: loading a state dict replaces them, and the scheduler must set those."""
        return [g for opt in self.parts.values() for g in opt.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        for opt in self.parts.values():
            opt.step()

    def zero_grad(self, set_to_none=True):
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {name: opt.state_dict() for name, opt in self.parts.items()}

    def load_state_dict(self, state):
        for name, opt in self.parts.items():
            opt.load_state_dict(state[name])


def build_optimizer(model, cfg, device):
    fused = device.type == "cuda"
    params = model.trainable_parameters()
    if cfg.optimizer == "muon":
        matrices, rest = muon_split(model)
        return MuonAdamW(matrices, rest, cfg.lr, cfg.weight_decay, fused)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=BETAS, weight_decay=cfg.weight_decay, fused=fused)


def lr_lambda(warmup, total, shape="cosine"):
    """Linear warm-up over `warmup` steps, then a decay to 0 at `total`: half a cosine, or a straight line
    (speculators' default)."""
    def f(step):
        if step < warmup:
            return (step + 1) / max(warmup, 1)
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return 1 - progress if shape == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return f
