"""What the training-step benchmarks share: geometries, synthetic packed batches, timing, the bf16 matmul ceiling,
the training step (AdamW as stage 4 runs it) and the gradient comparison of two implementations."""
import statistics
import time

import torch

from common.drafts.ttt_plan import OnHost


GEOMETRIES = {
    "smollm2": dict(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
                    rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=8192, verifier_vocab_size=49152),
    "kimi": dict(hidden_size=7168, num_heads=64, num_kv_heads=64, head_dim=128, intermediate_size=18432,
                 rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=262144, verifier_vocab_size=163840),
    # z-lab/Kimi-K2.5-DFlash's layers (configs/kimi-k2.5-dflash.yaml): 64 query heads over 8 KV heads
    "kimi-dflash": dict(hidden_size=7168, num_heads=64, num_kv_heads=8, head_dim=128, intermediate_size=18432,
                        rms_norm_eps=1e-6, rope_theta=5e4, max_position_embeddings=262144, verifier_vocab_size=163840),
}


def make_batch(T, g, device, seed, max_doc=2048, bf16=None):
    """Documents of 200..max_doc tokens; each a prompt (unmasked) then an answer (masked), ~60% of tokens."""
    gen = torch.Generator().manual_seed(seed)
    docs, a = [], 0
    while a < T:
        n = min(int(torch.randint(200, max_doc + 1, (1,), generator=gen)), T - a)
        docs.append((a, a + n))
        a += n
    mask = torch.zeros(T, dtype=torch.long)
    for a, b in docs:
        mask[a + int((b - a) * float(torch.empty(1).uniform_(0.25, 0.55, generator=gen))):b] = 1
    doc = torch.cat([torch.full((b - a,), j) for j, (a, b) in enumerate(docs)])
    bf16 = device.type == "cuda" if bf16 is None else bf16
    hs = torch.bfloat16 if bf16 else torch.float32  # as the trainer feeds it
    return {"aux": torch.randn(T, 3 * g.hidden_size, generator=gen).to(device, hs),
            "ids": torch.randint(0, g.verifier_vocab_size, (T,), generator=gen).to(device),
            "target_hidden": torch.randn(T, g.hidden_size, generator=gen).to(device, hs),
            "loss_mask": mask.to(device), "doc": doc.to(device),
            "pos": torch.cat([torch.arange(1, b - a + 1) for a, b in docs]).to(device), "docs": docs,
            "cpu": OnHost(loss_mask=mask, doc=doc)}


def timed(step, n_warm, n, device):
    """Median seconds per step, synchronised around each step (host work shows in full)."""
    for _ in range(n_warm):
        step()
    times = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def timed_pipelined(step, n, device):
    """Median seconds per step as a training loop runs it, with no sync between steps: GPU time from one
    step's end to the next's (CUDA events), so host work that overlaps the previous step's kernels is hidden."""
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    events[0].record()
    for e in events[1:]:
        step()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) / 1000 for a, b in zip(events, events[1:]))


def matmul_ceiling(device, n=8192):
    """Measured bf16 matmul FLOP/s (median of 10 n x n x n products)."""
    a, b = torch.randn(n, n, device=device, dtype=torch.bfloat16), torch.randn(n, n, device=device, dtype=torch.bfloat16)
    sec = timed(lambda: a @ b, 3, 10, device)
    return 2 * n ** 3 / sec


def profile(step, name):
    from torch.profiler import ProfilerActivity
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    print(f"--- profile of 2 steps: {name}")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60))


def fp32_batch(batch):
    return {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}


def train_step(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=next(model.parameters()).is_cuda)

    def step():
        loss().backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def bf16_gradient_gap(make, dg, batch, device, args):
    """One implementation's bf16-autocast gradients against its own fp32 gradients, from the same weights."""
    return gradient_gap((make, False), (make, True), dg, batch, device, args)


def gradient_gap(ref, other, dg, batch, device, args):
    """ref, other: (maker, bf16). The second's loss and gradients against the first's, from the same weights:
    -> (loss rel err, {tensor: per-tensor L2 rel err})."""
    torch.manual_seed(0)
    runs, state = [], None
    for make, bf16 in (ref, other):
        model, loss = make(dg, batch, device, args, bf16)
        if state is None:
            state = {k: v.clone() for k, v in model.state_dict().items()}
        else:
            model.load_state_dict(state, strict=False)
        value = loss()
        value.backward()
        runs.append((value.item(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}))
        del model
    (l0, g0), (l1, g1) = runs
    return abs(l1 - l0) / abs(l0), {n: ((g1[n] - g0[n]).norm() / g0[n].norm()).item() for n in g0}
