"""Stage 4's checkpoints: atomic save, resume, pruning; tensors and plain data only (no pickle)."""
import os
import random
import shutil
import time

import numpy as np
import torch

from common.errors import UsageError
from common.io import write_json_atomic


def rng_state():
    """Plain data and tensors only (numpy's key as a list), so that state.pt loads with weights_only=True."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, cached],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s):
    random.setstate(s["python"])
    name, keys, pos, has_gauss, cached = s["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(s["torch"])
    if s.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def is_trainable_key(k, head=False):
    """head: the lm_head is trained (--train-lm-head), so checkpoints carry it."""
    if k.startswith("lm_head"):
        return head
    return not k.startswith(("embed_tokens", "verifier_")) and k not in ("d2t", "t2d")


def head_trained(model):
    return model.lm_head.weight.requires_grad


def trainable_state(model):
    head = head_trained(model)
    return {k: v.detach().cpu() for k, v in model.state_dict().items() if is_trainable_key(k, head)}


def gather_states(model, opt, fsdp):
    """Full trainable weights and optimizer state on the CPU. Under FSDP a collective: every rank calls."""
    if not fsdp:
        return trainable_state(model), opt.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if torch.cuda.is_available():
        # only rank 0 waits for the gathered copies; the others would return with their all-gathers still
        # queued and, after the last checkpoint, exit: rank 0 then hung forever (seen on 2 H200s)
        torch.cuda.synchronize()
    return {k: v for k, v in msd.items() if is_trainable_key(k, head_trained(model))}, osd


def save_checkpoint(ckpt_dir, weights, opt_state, sched, state):
    """Atomic: written to a temporary folder, renamed into place; a kill never leaves half a checkpoint."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    tmp = ckpt_dir.with_name(ckpt_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "trainable.safetensors"))
        if os.environ.get("EAGLE3_TEST_SLOW_CHECKPOINT_S"):  # tests: a slow disk, a kill mid-write
            time.sleep(float(os.environ["EAGLE3_TEST_SLOW_CHECKPOINT_S"]))
        torch.save({"optimizer": opt_state, "scheduler": sched.state_dict(), "rng": rng_state(), **state},
                   tmp / "state.pt")
        write_json_atomic(tmp / "meta.json", {k: v for k, v in state.items() if k != "history"})
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    except (OSError, RuntimeError, SafetensorError) as exc:  # a full disk: torch.save says so in a RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(ckpt_dir.parent).free / 1e9
        raise UsageError(f"writing checkpoint {ckpt_dir} failed ({str(exc).splitlines()[0]}; {free:.1f} GB free "
                         f"there); the checkpoints before it are kept: free space and run the same command to "
                         f"resume") from None
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    os.replace(tmp, ckpt_dir)


def latest_checkpoint(folder):
    done = [p for p in folder.glob("step_*") if (p / "state.pt").is_file() and not p.name.endswith(".tmp")]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def load_weights(path, model):
    from safetensors.torch import load_file
    model.load_state_dict(load_file(str(path / "trainable.safetensors")), strict=False)


def read_state(path):
    """A checkpoint's state.pt, tensors and plain data only. Checkpoint folders travel between nodes and
    people; a full unpickle would run whatever code the file holds, weights_only refuses it unread."""
    import pickle
    try:
        return torch.load(path / "state.pt", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0][:160]
        raise UsageError(f"{path / 'state.pt'} holds more than tensors and plain data and was not loaded (it could "
                         f"run code; or an older eagle3-train wrote it): {first}; delete {path} or use a new --work-dir")


def load_checkpoint(path, model, opt, sched, fsdp=False):
    """Weights, optimizer, scheduler and RNG; -> the saved training state (step, epoch, data position...)."""
    from safetensors.torch import load_file
    state = read_state(path)
    if fsdp:  # every rank loads the full state; torch scatters each rank's shards
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
        set_state_dict(model, opt, model_state_dict=load_file(str(path / "trainable.safetensors")),
                       optim_state_dict=state.pop("optimizer"),
                       options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        load_weights(path, model)
        opt.load_state_dict(state.pop("optimizer"))
    sched.load_state_dict(state.pop("scheduler"))
    set_rng_state(state.pop("rng"))
    return state


def prune_checkpoints(folder, keep_last, best_name):
    ckpts = sorted((p for p in folder.glob("step_*") if not p.name.endswith(".tmp")),
                   key=lambda p: int(p.name.split("_")[1]))
    for p in ckpts[:-keep_last] if keep_last else ckpts:
        if p.name != best_name:
            shutil.rmtree(p, ignore_errors=True)
