"""Stage 4's optimizer and learning-rate schedule.

--optimizer adamw (the default): AdamW over every trainable weight. --optimizer muon: torch's Muon over the draft's
hidden weight matrices (attention, MLP, fc) and AdamW over the rest (norms, vectors, a trained lm_head), the split
speculators' trainer makes for its DFlash default (Keller Jordan's: embeddings and heads stay on AdamW); Muon's
update is scaled to AdamW's RMS (match_rms_adamw), so one --lr serves both. Its Newton-Schulz iteration runs in bf16
where training does (GPUs, AMX CPUs), in fp32 elsewhere: torch's Muon always takes bf16, which a CPU without bf16
matrix units runs so slowly that a SmolLM2 EAGLE step took 25 s instead of ~2 (a 2-core AVX2 EPYC).
"""
import math

import torch
import torch.distributed as dist

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


def newton_schulz(g, coefficients, steps, eps, dtype):
    """torch's Muon orthogonalisation (torch.optim._muon._zeropower_via_newtonschulz) in `dtype`."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def owners(costs, world):
    """-> the rank that orthogonalises each matrix: largest first, each to the least-loaded rank."""
    load, owner = [0] * world, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        owner[i] = min(range(world), key=load.__getitem__)
        load[owner[i]] += costs[i]
    return owner


class Muon(torch.optim.Muon):
    """torch's Muon step (Nesterov momentum, orthogonalised update, decoupled weight decay, its lr adjustment) with
    the Newton-Schulz iteration in `ns_dtype`; the same state (momentum_buffer) as torch's. With several ranks (DDP:
    the same gradients on each) every matrix is orthogonalised and updated on one rank and broadcast from there:
    Newton-Schulz is ~0.8 s a step at Kimi DFlash width on one H200, a share of that on each of N."""

    def __init__(self, params, ns_dtype, **kw):
        super().__init__(params, **kw)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        items = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        owner = owners([p.numel() * min(p.shape) for _, p in items], world)  # Newton-Schulz's cost ~ m n min(m, n)
        sent = []
        for (g, p), r in zip(items, owner):
            # every rank keeps every momentum buffer (cheap), so rank 0's checkpoint holds the whole state
            state = self.state[p]
            if "momentum_buffer" not in state:  # not setdefault: that would allocate a zero matrix every step
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - g["momentum"])
            if r == rank:
                update = p.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf
                update = newton_schulz(update, g["ns_coefficients"], g["ns_steps"], g["eps"], self.ns_dtype)
                p.mul_(1 - g["lr"] * g["weight_decay"])
                p.add_(update, alpha=-g["lr"] * 0.2 * math.sqrt(max(p.shape)))  # match_rms_adamw
            if world > 1:
                sent.append(dist.broadcast(p, src=r, async_op=True))
        for w in sent:
            w.wait()


class MuonAdamW(torch.optim.Optimizer):
    """Muon and AdamW stepped as one optimizer: the scheduler sees both groups, a checkpoint holds both states."""

    def __init__(self, matrices, rest, lr, weight_decay, fused, ns_dtype=torch.bfloat16):
        self.parts = {"muon": Muon(matrices, ns_dtype, lr=lr, **MUON)}
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


def build_optimizer(model, cfg, device, bf16=True):
    """bf16: whether training runs bf16 autocast (--amp), which says whether this device's bf16 matmuls are fast."""
    fused = device.type == "cuda"
    params = model.trainable_parameters()
    if cfg.optimizer == "muon":
        matrices, rest = muon_split(model)
        return MuonAdamW(matrices, rest, cfg.lr, cfg.weight_decay, fused, torch.bfloat16 if bf16 else torch.float32)
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
