"""One process or many (torchrun): device and process group, DDP/FSDP wrapping, sums over ranks."""
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from common.errors import UsageError


def dist_setup(cfg):
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; NCCL on GPUs, gloo on CPU. -> (rank, world, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    want = cfg.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no GPU is visible")
    if want == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=cfg.dist_timeout))
    return rank, world, device


# the slowest checkpoint disk we plan for (network storage); a Kimi DFlash checkpoint, 41.75 GB, took 80 s on an
# H200 node's local disk and would take ~70 min at this rate
SLOW_DISK_BYTES_PER_S = 10e6


def checkpoint_wait(nbytes):
    """Seconds the other ranks wait for rank 0 to write a checkpoint of `nbytes`: 30 min, or its size at a slow disk's
    rate where that is longer."""
    return max(1800.0, nbytes / SLOW_DISK_BYTES_PER_S)


def after_rank0_writes(rank, world, name, seconds):
    """Every rank returns once rank 0 has written checkpoint `name`. The others wait on the rendezvous store, not in
    a collective, so the write (minutes for a Kimi checkpoint, more on a slow disk) never runs into the process
    group's timeout (--dist-timeout); they wait `seconds`, then stop in one line."""
    if world == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    key = f"eagle3/checkpoint/{name}"
    if rank == 0:
        store.set(key, "written")
        return
    try:
        store.wait([key], timedelta(seconds=seconds))
    except RuntimeError as exc:  # torch's store timeout (DistStoreError is a RuntimeError)
        raise UsageError(f"rank {rank}: rank 0 did not finish writing checkpoint {name} within {seconds:.0f} s "
                         f"({str(exc).splitlines()[0][:120]}); the checkpoints before it are kept: run the same "
                         f"command to resume") from None


def dist_teardown(world):
    """After training, before rank 0 exports: every rank waits for the others (the last checkpoint is whole), then
    leaves the process group. A rank that exited with gloo's group alive aborted at exit now and then ("terminate
    called without an active exception"), and torchrun then killed rank 0 mid-checkpoint."""
    if world > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def wrap_parallel(model, device, world, how):
    """One process: the model itself. DDP: replicas, gradients all-reduced. FSDP (torch's fully_shard):
    trainable weights, gradients and AdamW state sharded across ranks; the frozen verifier pieces stay
    replicated (no gradients, nothing to shard but memory). The layer stays gathered for the whole
    step because every TTT step reuses it."""
    if world == 1:
        return model
    if how == "ddp":
        # device_ids=None: the batch is already on the device; DDP would copy even the host-side tensors
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=None)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    frozen = {p for p in model.parameters() if not p.requires_grad}
    # GPUs: weights gathered in bf16 (the matmuls run in bf16 under autocast anyway), gradients reduced in fp32
    # into fp32 shards. Measured on 2 H200s at Kimi geometry: peak 26.1 -> 19.5 GiB per GPU, 50.0k -> 52.9k
    # tokens/s. CPU (gloo, the tests): fp32, so the tests compare exactly with one process.
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda"
          else MixedPrecisionPolicy())
    for layer in model.layers:  # EAGLE-3: one; DFlash: a stack
        fully_shard(layer, reshard_after_forward=False, mp_policy=mp)
    fully_shard(model, reshard_after_forward=False, ignored_params=frozen, mp_policy=mp)
    return model


def all_reduce_sums(sums, device, ttt_steps):
    if not (dist.is_available() and dist.is_initialized()):
        return sums
    # the same keys on every rank, also on a rank that saw no validation sequence
    keys = ["batches"] + [f"{m}_{k}" for m in ("loss", "full_correct", "full_total", "cond_correct", "cond_total")
                          for k in range(ttt_steps)]
    t = torch.tensor([float(sums.get(k, 0)) for k in keys], device=device, dtype=torch.float64)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def global_sums(sums, device, world):
    """One optimizer step's metric sums over all ranks (so the log shows the global batch's loss, not rank 0's
    share); an all-reduce every step, queued on the device, read only when a line is logged."""
    if world == 1:
        return sums
    keys = sorted(k for k in sums if k != "batches")
    t = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64, device=device) for k in keys])
    dist.all_reduce(t)
    return dict(zip(keys, t.unbind()), batches=sums["batches"] * world)


def agreed(flag, device, world):
    """One answer for every rank (the one all give, else False): each rank may probe its CPU on its own."""
    if world == 1:
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())
