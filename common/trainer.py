"""Stage 4 logic: build the draft, train it with TTT, checkpoint/resume, validate, plot."""
import json
import math
import os
import random
import resource
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from common.draft import DraftGeometry, Eagle3Draft, acceptance_length, compile_loss, optimize_bf16, take_embedding
from common.engine import cpu_has_amx
from common.errors import UsageError
from common.io import write_json_atomic
from common.log import fmt_duration
from common.models import load_verifier_pieces
from common.train_data import PACKING, make_loader, pack, shifted_len, to_device


# ---------------------------------------------------------------- model construction

def geometry(cfg, text_cfg, draft_vocab, num_aux):
    heads = cfg.draft_num_heads or text_cfg.num_attention_heads
    rope_theta = getattr(text_cfg, "rope_theta", None) or \
        (getattr(text_cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    g = DraftGeometry(
        hidden_size=text_cfg.hidden_size, num_heads=heads,
        num_kv_heads=cfg.draft_num_kv_heads or getattr(text_cfg, "num_key_value_heads", None) or heads,
        head_dim=cfg.draft_head_dim or getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads,
        intermediate_size=cfg.draft_intermediate_size or text_cfg.intermediate_size,
        rms_norm_eps=getattr(text_cfg, "rms_norm_eps", 1e-6), rope_theta=float(rope_theta),
        max_position_embeddings=getattr(text_cfg, "max_position_embeddings", 4096),
        verifier_vocab_size=text_cfg.vocab_size, draft_vocab_size=draft_vocab, num_aux=num_aux,
        norm_before_residual=cfg.norm_before_residual)
    if g.num_heads % g.num_kv_heads:
        raise UsageError(f"draft heads {g.num_heads} must be a multiple of draft KV heads {g.num_kv_heads}")
    return g


def build_model(g, model_dir, target_ids, trained=None, train_head=False):
    """Draft with frozen pieces from the verifier: embeddings, draft lm_head = verifier rows of the draft vocab
    (trained further with train_head). trained: trainable weights from a checkpoint, loaded instead of a
    random init (which takes half a minute for a Kimi-size draft on the one CPU thread torchrun leaves each rank)."""
    if trained is None:
        model = Eagle3Draft(g)
    else:
        with torch.device("meta"):
            model = Eagle3Draft(g)
        model.to_empty(device="cpu")
    model.lm_head.requires_grad_(train_head)
    if trained is not None:
        missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in trained]
        if missing:
            raise RuntimeError(f"checkpoint lacks trainable weights {missing[:3]}")
        model.load_state_dict(trained, strict=False)
    w = load_verifier_pieces(model_dir, g.hidden_size)
    rows = torch.as_tensor(target_ids) if target_ids is not None else torch.arange(g.verifier_vocab_size)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(w["embed_tokens.weight"].float())
        head = w["lm_head.weight"].float()[rows]
        if trained is None or "lm_head.weight" not in trained:
            model.lm_head.weight.copy_(head)
        model.verifier_lm_head.weight.copy_(head)
        model.verifier_norm.weight.copy_(w["norm.weight"].float())
        model.d2t.copy_(rows - torch.arange(len(rows)))
        model.t2d.zero_()
        model.t2d[rows] = True
    return model


# ---------------------------------------------------------------- schedule, checkpoints

def lr_lambda(warmup, total):
    def f(step):
        if step < warmup:
            return (step + 1) / max(warmup, 1)
        progress = (step - warmup) / max(total - warmup, 1)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return f


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
    from safetensors.torch import save_file
    tmp = ckpt_dir.with_name(ckpt_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "trainable.safetensors"))
    torch.save({"optimizer": opt_state, "scheduler": sched.state_dict(), "rng": rng_state(), **state},
               tmp / "state.pt")
    write_json_atomic(tmp / "meta.json", {k: v for k, v in state.items() if k != "history"})
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
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


# ---------------------------------------------------------------- metrics

def summarize(sums, ttt_steps):
    """Counts summed over batches -> per-position loss, full/cond accuracy, simulated acceptance length."""
    out = {}
    for k in range(ttt_steps):
        out[f"loss_{k}"] = float(sums.get(f"loss_{k}", 0.0)) / max(sums.get("batches", 1), 1)
        out[f"full_acc_{k}"] = float(sums.get(f"full_correct_{k}", 0)) / max(float(sums.get(f"full_total_{k}", 0)), 1)
        out[f"cond_acc_{k}"] = float(sums.get(f"cond_correct_{k}", 0)) / max(float(sums.get(f"cond_total_{k}", 0)), 1)
    out["acceptance_length"] = acceptance_length([out[f"full_acc_{k}"] for k in range(ttt_steps)])
    return out


def accumulate(sums, metrics):
    """Sums stay on the device (no sync per micro-batch); summarize() reads them at log time."""
    for k, v in metrics.items():
        sums[k] = sums.get(k, 0) + (v.detach().double() if torch.is_tensor(v) else v)
    sums["batches"] = sums.get("batches", 0) + 1


def global_sums(sums, device, world):
    """One optimizer step's metric sums over all ranks (so the log shows the global batch's loss, not rank 0's
    share); an all-reduce every step, queued on the device, read only when a line is logged."""
    if world == 1:
        return sums
    keys = sorted(k for k in sums if k != "batches")
    t = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64, device=device) for k in keys])
    dist.all_reduce(t)
    return dict(zip(keys, t.unbind()), batches=sums["batches"] * world)


def merge_sums(total, part):
    for k, v in part.items():
        total[k] = total.get(k, 0) + v


def use_bf16(device, amp):
    """bf16 autocast where matmuls are fast in bf16: GPUs, and CPUs with AMX (4x fp32 per core here)."""
    return amp == "bf16" or (amp == "auto" and (device.type == "cuda" or cpu_has_amx()))


def cpu_compiler_found(log):
    """torch.compile on the CPU builds C++: without a compiler the loss runs eager (a ~1.3x slower step), not fails."""
    from torch._inductor import cpp_builder
    try:
        cpp_builder.get_cpp_compiler()
        return True
    except Exception as e:  # noqa: BLE001 -- any failure to find one means the same: run eager
        log.warning("no C++ compiler for torch.compile (%s): the loss runs eager; install g++ or pass --no-compile "
                    "to silence this", str(e).splitlines()[0][:120])
        return False


def autocast(device, bf16):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


def peak_memory_gb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def plot_curves(metrics_path, out_png, ttt_steps):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(l) for l in Path(metrics_path).read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    val = [r for r in rows if r["kind"] == "val"]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for k in range(ttt_steps):
        ax[0].plot([r["step"] for r in train], [r[f"loss_{k}"] for r in train], label=f"train loss pos {k}")
        ax[1].plot([r["step"] for r in val], [r[f"full_acc_{k}"] for r in val], marker="o", label=f"val full acc {k}")
    ax[2].plot([r["step"] for r in val], [r["acceptance_length"] for r in val], marker="o")
    ax[0].set_title("train loss (KL) per TTT position"), ax[0].legend(), ax[0].set_xlabel("step")
    ax[1].set_title("validation accuracy per position"), ax[1].legend(), ax[1].set_xlabel("step")
    ax[2].set_title("simulated acceptance length"), ax[2].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out_png, dpi=80)
    plt.close(fig)


def add_noise(aux, scale, num_aux):
    """aux [T, num_aux * H] + Gaussian noise, std = scale x the RMS of each token's state in each layer."""
    x = aux.view(aux.shape[0], num_aux, -1)
    rms = x.float().pow(2).mean(-1, keepdim=True).sqrt()
    return (x + torch.randn_like(x, dtype=torch.float32) * (scale * rms)).to(aux.dtype).view_as(aux)


# ---------------------------------------------------------------- distributed

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
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


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
    fully_shard(model.layers[0], reshard_after_forward=False, mp_policy=mp)
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


# ---------------------------------------------------------------- the loop

RESUME_KEYS = ("epochs", "max_steps", "lr", "warmup_steps", "weight_decay", "grad_clip", "grad_accum",
               "max_tokens_per_step", "ttt_steps", "ttt_decay", "seed", "val_fraction", "hidden_noise",
               "train_lm_head")


def plan_epochs(train_idx, lengths, cfg, world):
    """Packed sequences per epoch, cut to a multiple of ranks x accumulation: every optimizer step sees
    the same global batch and no gradient is carried into the next epoch (DDP also needs every rank to
    run the same number of backwards). The few dropped sequences differ per epoch (new shuffle)."""
    per = world * cfg.grad_accum
    epochs = [pack(train_idx, lengths, cfg.max_tokens_per_step, cfg.seed, e) for e in range(cfg.epochs)]
    if len(epochs[0]) < per:
        raise UsageError(f"{len(epochs[0])} packed sequences of {cfg.max_tokens_per_step} tokens per epoch, fewer than "
                         f"{world} ranks x --grad-accum {cfg.grad_accum}; lower --grad-accum or --max-tokens-per-step")
    return [b[:len(b) - len(b) % per] for b in epochs]


class Trainer:
    def __init__(self, cfg, model, device, folder, train_idx, val_idx, lengths, out_dir, log, rank=0, world=1):
        self.cfg, self.device, self.folder, self.out, self.log = cfg, device, folder, Path(out_dir), log
        self.rank, self.world = rank, world
        self.train_idx, self.val_idx, self.lengths = train_idx, val_idx, lengths
        self.bf16 = use_bf16(device, cfg.amp)
        self.dtype = torch.bfloat16 if self.bf16 else torch.float32
        # on GPUs the loader looks the input tokens up in host memory (2.3 GB less GPU memory at Kimi scale)
        self.host_embed = take_embedding(model, self.dtype) if device.type == "cuda" else None
        self.model = model.to(device)
        if self.bf16:
            optimize_bf16(model, cfg.compile and device.type == "cuda")
        log.info("precision: %s (--amp %s)", "bf16 autocast, fp32 master weights" if self.bf16 else "fp32", cfg.amp)
        if cfg.compile and device.type == "cpu":
            compile_loss(cpu_compiler_found(log))
        self.fsdp = world > 1 and cfg.parallel == "fsdp"
        self.ddp = wrap_parallel(model, device, world, cfg.parallel)
        self.opt = torch.optim.AdamW(model.trainable_parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                     weight_decay=cfg.weight_decay, fused=device.type == "cuda")
        self.epoch_bins = plan_epochs(train_idx, lengths, cfg, world)
        self.total_steps = sum(len(b) // (world * cfg.grad_accum) for b in self.epoch_bins)
        if cfg.max_steps:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg.warmup_steps, self.total_steps))
        self.val_bins = pack(val_idx, lengths, cfg.max_tokens_per_step, cfg.seed, 0) if val_idx else []
        self.settings = {k: cfg[k] for k in RESUME_KEYS}
        self.settings["geometry"] = model.g.to_dict()
        self.settings["optimizer_layout"] = "fsdp" if self.fsdp else "plain"  # their saved states differ
        self.settings["packing"] = PACKING  # a checkpoint's data position indexes this packing's sequences
        self.state = {"step": 0, "epoch": 0, "bin": 0, "best": None, "best_step": None, "tokens": 0,
                      "train_seconds": 0.0, "settings": self.settings}
        self.ckpt_dir = self.out / "checkpoints"
        self.metrics_path = self.out / "metrics.jsonl"
        self.data_wait = 0.0  # seconds the loop waited for the loader (logged as a share of each window)

    def resume(self):
        ckpt = latest_checkpoint(self.ckpt_dir)
        if ckpt is None:
            if self.rank == 0 and self.metrics_path.exists():
                self.metrics_path.unlink()  # a fresh run starts a fresh curve
            return False
        saved = read_state(ckpt).get("settings")
        if saved != self.settings:
            saved = saved or {}
            diff = sorted(k for k in self.settings if saved.get(k) != self.settings[k])
            older = " by an older eagle3-train" if any(k not in saved for k in diff) else ""
            raise UsageError(f"checkpoints in {self.ckpt_dir} were made{older} with other settings ({', '.join(diff)}); "
                             f"use a new --work-dir, or delete {self.out} to start over")
        self.state = load_checkpoint(ckpt, self.model, self.opt, self.sched, self.fsdp)
        if self.rank == 0:
            self._truncate_metrics(self.state["step"])
        self.log.info("resumed from %s: step %d, epoch %d, sequence %d of the epoch", ckpt, self.state["step"],
                      self.state["epoch"], self.state["bin"])
        return True

    def _truncate_metrics(self, step):
        if self.metrics_path.exists():
            rows = [l for l in self.metrics_path.read_text().splitlines() if json.loads(l)["step"] <= step]
            self.metrics_path.write_text("".join(r + "\n" for r in rows))

    def _write_metrics(self, row):
        if self.rank == 0:
            with open(self.metrics_path, "a") as fh:
                fh.write(json.dumps(row) + "\n")

    def _checkpoint(self, val=None):
        t0 = time.time()
        weights, opt_state = gather_states(self.model, self.opt, self.fsdp)  # collective under FSDP
        if val is not None:
            self.state["validated_step"] = self.state["step"]  # a re-run of a finished run skips it
        if self.rank != 0:
            return time.time() - t0
        name = f"step_{self.state['step']}"
        if val is not None and (self.state["best"] is None or val["acceptance_length"] > self.state["best"]):
            self.state["best"], self.state["best_step"] = val["acceptance_length"], self.state["step"]
        save_checkpoint(self.ckpt_dir / name, weights, opt_state, self.sched, dict(self.state))
        best = f"step_{self.state['best_step']}" if self.state["best_step"] is not None else None
        prune_checkpoints(self.ckpt_dir, self.cfg.keep_last, best)
        size, seconds = sum(f.stat().st_size for f in (self.ckpt_dir / name).iterdir()), time.time() - t0
        self.log.info("checkpoint %s: %.2f GB in %.1f s", name, size / 1e9, seconds)
        return seconds

    def run_validation(self):
        if not self.val_bins:
            return None
        bins = self.val_bins[self.rank::self.world]
        # every rank runs the same number of forwards (FSDP gathers weights in each; DDP syncs
        # buffers): a rank short of sequences repeats the first one and does not count it
        n = math.ceil(len(self.val_bins) / self.world)
        loader = make_loader(self.folder, bins + self.val_bins[:1] * (n - len(bins)), self.cfg.max_tokens_per_step, 0,
                             embed=self.host_embed)
        self.model.eval()
        sums = {}
        with torch.no_grad():
            for i, batch in enumerate(loader):
                batch = to_device(batch, self.device, self.dtype)
                with autocast(self.device, self.bf16):
                    _, m = self.ddp(batch, self.cfg.ttt_steps, self.cfg.ttt_decay)
                if i < len(bins):
                    accumulate(sums, m)
        self.model.train()
        val = summarize(all_reduce_sums(sums, self.device, self.cfg.ttt_steps), self.cfg.ttt_steps)
        row = {"kind": "val", "step": self.state["step"], "epoch": self.state["epoch"], **val}
        self._write_metrics(row)
        k = self.cfg.ttt_steps
        self.log.info("validation @ step %d: full acc %s, cond acc %s, simulated acceptance length %.3f (k=%d)",
                      self.state["step"], " / ".join(f"{val[f'full_acc_{i}']:.3f}" for i in range(k)),
                      " / ".join(f"{val[f'cond_acc_{i}']:.3f}" for i in range(k)), val["acceptance_length"], k)
        return val

    def train(self):
        cfg, st = self.cfg, self.state
        self.model.train()
        last_log, window = time.time(), self._window()
        while st["epoch"] < cfg.epochs and st["step"] < self.total_steps:
            bins = self.epoch_bins[st["epoch"]]
            mine = bins[self.rank::self.world]
            loader = make_loader(self.folder, mine[st["bin"]:], cfg.max_tokens_per_step, cfg.num_workers,
                                 pin=self.device.type == "cuda", embed=self.host_embed)
            micro = 0
            step_sums = {}
            t_step = time.time()
            for batch in self._waited(loader):
                batch = to_device(batch, self.device, self.dtype)
                if cfg.hidden_noise:
                    batch["aux"] = add_noise(batch["aux"], cfg.hidden_noise, self.model.g.num_aux)
                with autocast(self.device, self.bf16):
                    loss, metrics = self.ddp(batch, cfg.ttt_steps, cfg.ttt_decay)
                (loss / cfg.grad_accum).backward()
                accumulate(step_sums, metrics)
                st["bin"] += 1
                micro += 1
                if micro % cfg.grad_accum:
                    continue
                # the global step's tokens (every rank's sequences), from the plan: no communication
                step_tokens = sum(self._bin_tokens(b) for b in bins[(st["bin"] - cfg.grad_accum) * self.world:
                                                                     st["bin"] * self.world])
                window["tokens"] += step_tokens
                self._optimizer_step()
                merge_sums(window["sums"], global_sums(step_sums, self.device, self.world))
                step_sums = {}
                st["step"] += 1
                st["tokens"] += step_tokens
                step_time = time.time() - t_step
                st["train_seconds"] += step_time
                t_step = time.time()
                if time.time() - last_log >= min(cfg.log_interval, 10) or st["step"] in (1, self.total_steps):
                    self._log_train(window, step_time)
                    last_log, window = time.time(), self._window()
                last = st["step"] >= self.total_steps or st["bin"] >= len(mine)  # validated and saved below anyway
                if cfg.save_every and st["step"] % cfg.save_every == 0 and not last:
                    paused = self._checkpoint()
                    t_step += paused  # step times and tokens/s leave the save out (it is logged on its own)
                    window["t"] += paused
                if st["step"] >= self.total_steps:
                    break
            if st["step"] >= self.total_steps and st["bin"] < len(mine):
                break
            st["epoch"] += 1
            st["bin"] = 0
            t0 = time.time()
            self._checkpoint(self.run_validation())
            window["t"] += time.time() - t0
        if st["bin"] and st.get("validated_step") != st["step"]:  # stopped mid-epoch by --max-steps
            self._checkpoint(self.run_validation())
        return st

    def _bin_tokens(self, b):
        return sum(shifted_len(self.lengths[i], self.cfg.max_tokens_per_step) for i in b)

    def _window(self):
        return {"tokens": 0, "t": time.time(), "sums": {}, "wait": self.data_wait}

    def _waited(self, loader):
        """The loader's batches; the seconds spent blocked on each add to self.data_wait."""
        it = iter(loader)
        while True:
            t = time.time()
            batch = next(it, None)
            self.data_wait += time.time() - t
            if batch is None:
                return
            yield batch

    def _optimizer_step(self):
        torch.nn.utils.clip_grad_norm_(self.model.trainable_parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    def _log_train(self, window, step_time):
        st, cfg = self.state, self.cfg
        elapsed = time.time() - window["t"]
        s = summarize(window["sums"], cfg.ttt_steps)
        tps = window["tokens"] / max(elapsed, 1e-9)
        wait = min((self.data_wait - window["wait"]) / max(elapsed, 1e-9), 1.0)
        row = {"kind": "train", "step": st["step"], "epoch": st["epoch"], "lr": self.sched.get_last_lr()[0],
               "tokens_per_s": round(tps, 1), "step_time_s": round(step_time, 3), "data_wait": round(wait, 3),
               "peak_mem_gb": round(peak_memory_gb(self.device), 2), "tokens": st["tokens"],
               "train_seconds": round(st["train_seconds"], 3), **s}
        self._write_metrics(row)
        remaining = (self.total_steps - st["step"]) * (st["train_seconds"] / max(st["step"], 1))
        self.log.info("step %d/%d epoch %d | loss %s | acc %s | lr %.2e | %.0f tok/s | %.2fs/step | data wait %.0f%% | "
                      "peak %.2f GB | ETA %s", st["step"], self.total_steps, st["epoch"] + 1,
                      " / ".join(f"{s[f'loss_{k}']:.3f}" for k in range(cfg.ttt_steps)),
                      " / ".join(f"{s[f'full_acc_{k}']:.3f}" for k in range(cfg.ttt_steps)),
                      row["lr"], tps, step_time, 100 * wait, row["peak_mem_gb"], fmt_duration(remaining))
