"""Stage 4's training loop: epochs of packed sequences, TTT steps, validation, checkpoints, logging."""
import json
import math
import time
from pathlib import Path

import torch

from common.checkpoints import gather_states, latest_checkpoint, load_checkpoint, prune_checkpoints, read_state, \
    save_checkpoint
from common.distributed import after_rank0_writes, agreed, all_reduce_sums, checkpoint_wait, global_sums, \
    wrap_parallel
from common.drafts import method_of
from common.drafts.layers import take_embedding, use_flex_on_cuda
from common.drafts.losses import compile_loss
from common.errors import UsageError
from common.io import append_line
from common.log import fmt_duration
from common.optim import build_optimizer, lr_lambda
from common.metrics import accumulate, merge_sums, peak_memory_gb, summarize
from common.precision import autocast, cpu_compiler_found, use_bf16
from common.train_data import PACKING, SPLIT, make_loader, pack, shifted_len, to_device


def with_later_defaults(saved, now, geometry):
    """A checkpoint's settings as this version records them: those added since it was written (absent there) at the
    value they had then, each option's default, so a run started before an option existed resumes (where it is not
    set otherwise); those no longer recorded (another method's options) left out."""
    from dataclasses import MISSING, fields

    from common.config import BY_NAME
    if "block_loss" in saved and "loss" not in saved:  # DFlash's --block-loss, now --loss ('' = ce for DFlash)
        saved["loss"] = "" if saved["block_loss"] == "ce" else saved["block_loss"]
    saved = {k: saved[k] for k in now if k in saved}
    for k, v in now.items():
        if k not in saved and k in BY_NAME and BY_NAME[k].default == v:
            saved[k] = v
    if isinstance(saved.get("geometry"), dict):
        saved["geometry"] = dict(saved["geometry"])
        for f in fields(geometry):
            if f.name not in saved["geometry"] and f.default is not MISSING:
                saved["geometry"][f.name] = f.default
    return saved


def add_noise(aux, scale, num_aux, seed):
    """aux [T, num_aux * H] + Gaussian noise, std = scale x the RMS of each token's state in each layer, drawn from the
    packed sequence's own seed (on the host, as DFlash's anchors): any rank count, accumulation or resume draws the
    same noise for the same sequence."""
    x = aux.view(aux.shape[0], num_aux, -1)
    rms = x.float().pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(2 * seed + 1)).to(x.device)  # not the anchors'
    return (x + noise * (scale * rms)).to(aux.dtype).view_as(aux)


# grad_accum is not among them: a resume on another number of ranks keeps the global batch (ranks x accumulation)
RESUME_KEYS = ("epochs", "max_steps", "lr", "warmup_steps", "weight_decay", "grad_clip", "max_tokens_per_step", "seed",
               "val_fraction", "optimizer", "lr_schedule", "hidden_noise", "train_lm_head", "loss",
               "draft_init")  # + the method's options


def sequence_seed(seed, epoch, index):
    """One packed sequence's seed for its random draws (DFlash's anchors): the same on any rank or world size."""
    return (seed * 1_000_003 + epoch) * 10_000_019 + index


def method_shift(cfg):
    """Tokens a sample is shifted by in its batches (its method's: EAGLE-3 reads token t + 1 beside the states of t)."""
    return method_of(cfg).shift


def plan_epochs(train_idx, lengths, cfg, world, grad_accum=None):
    """Packed sequences per epoch, cut to a multiple of ranks x accumulation: every optimizer step sees
    the same global batch and no gradient is carried into the next epoch (DDP also needs every rank to
    run the same number of backwards). The few dropped sequences differ per epoch (new shuffle)."""
    per = world * (grad_accum or cfg.grad_accum)
    epochs = [pack(train_idx, lengths, cfg.max_tokens_per_step, cfg.seed, e, shift=method_shift(cfg))
              for e in range(cfg.epochs)]
    if len(epochs[0]) < per:
        raise UsageError(f"{len(epochs[0])} packed sequences of {cfg.max_tokens_per_step} tokens per epoch, fewer than "
                         f"{world} ranks x {per // world} accumulated micro-batches; lower --grad-accum or "
                         f"--max-tokens-per-step")
    return [b[:len(b) - len(b) % per] for b in epochs]


def ranks(n):
    return f"{n} rank" + ("s" if n != 1 else "")


class Trainer:
    def __init__(self, cfg, model, device, folder, train_idx, val_idx, lengths, out_dir, log, rank=0, world=1,
                 val_groups=None):
        self.cfg, self.device, self.folder, self.out, self.log = cfg, device, folder, Path(out_dir), log
        self.rank, self.world = rank, world
        self.ckpt_dir = self.out / "checkpoints"
        self.train_idx, self.val_idx, self.lengths = train_idx, val_idx, lengths
        self.bf16 = agreed(use_bf16(device, cfg.amp), device, world)
        self.dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.method = method_of(cfg)
        self.shift = self.method.shift
        # what the model's forward takes besides the batch, and how many draft positions its metrics have
        self.loss_args = self.method.loss_args(cfg)
        self.positions = self.method.positions(cfg)
        # on GPUs an EAGLE-style loader looks the input tokens up in host memory (2.3 GB less GPU memory at Kimi
        # scale); a block draft embeds only its anchor and mask tokens, on the device
        self.host_embed = take_embedding(model, self.dtype) if device.type == "cuda" and self.method.host_embedding \
            else None
        self.model = model.to(device)
        use_flex_on_cuda(cfg.compile)
        if self.bf16:
            self.method.prepare_bf16(model, cfg, device)
        log.info("precision: %s (--amp %s)", "bf16 autocast, fp32 master weights" if self.bf16 else "fp32", cfg.amp)
        if cfg.compile and device.type == "cpu":
            compile_loss(cpu_compiler_found(log))
        self.fsdp = world > 1 and cfg.parallel == "fsdp"
        # the model as the ranks run it: itself (one process, or FSDP, which shards it in place) or its DDP wrapper
        self.parallel_model = wrap_parallel(model, device, world, cfg.parallel)
        self.grad_accum = self._accumulation(cfg.grad_accum)
        self.opt = build_optimizer(model, cfg, device, self.bf16)  # AdamW, or Muon + AdamW (common/optim.py)
        self.epoch_bins = plan_epochs(train_idx, lengths, cfg, world, self.grad_accum)
        self.total_steps = sum(len(b) // (world * self.grad_accum) for b in self.epoch_bins)
        if cfg.max_steps:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg.warmup_steps, self.total_steps,
                                                                         cfg.lr_schedule))
        # validation packed per group (val_groups: name -> sample indices), reported overall and per group
        self.val_sets = {name: pack(idx, lengths, cfg.max_tokens_per_step, cfg.seed, 0, shift=self.shift)
                         for name, idx in (val_groups or {"all": val_idx}).items() if idx}
        self.settings = {k: cfg[k] for k in RESUME_KEYS + self.method.options}
        self.settings["geometry"] = model.g.to_dict()
        self.settings["draft_method"] = cfg.draft_method  # a checkpoint of one method is not resumed as another
        self.settings["optimizer_layout"] = "fsdp" if self.fsdp else "plain"  # their saved states differ
        self.settings["packing"] = PACKING  # a checkpoint's data position indexes this packing's sequences
        self.settings["split"] = SPLIT
        self.settings["global_batch"] = world * self.grad_accum  # sequences per optimizer step, all ranks together
        self.settings["data_position"] = "global"  # "seq": sequences of the epoch consumed by all ranks together
        # an older per-rank position ("bin") is refused by the settings check
        self.state = {"step": 0, "epoch": 0, "seq": 0, "best": None, "best_step": None, "tokens": 0,
                      "train_seconds": 0.0, "world_size": world, "settings": self.settings}
        self.metrics_path = self.out / "metrics.jsonl"
        # fp32 weights and two optimizer moments: what rank 0 writes while the other ranks wait for it
        ckpt_bytes = 12 * sum(p.numel() for p in model.trainable_parameters())
        self.checkpoint_wait = checkpoint_wait(ckpt_bytes)
        if world > 1:
            log.info("checkpoints of ~%.2f GB: the other ranks wait up to %s for rank 0 to write each (collectives "
                     "time out after --dist-timeout %d s)", ckpt_bytes / 1e9, fmt_duration(self.checkpoint_wait),
                     cfg.dist_timeout)
        self.data_wait = 0.0  # seconds the loop waited for the loader (logged as a share of each window)

    def _accumulation(self, asked):
        """Micro-batches per rank per optimizer step: --grad-accum, except when resuming on another number of ranks,
        where the saved global batch (ranks x accumulation) is kept, so the schedule in optimizer steps and the
        sequences each step sees stay those of the interrupted run; refused where the new ranks cannot split it."""
        ckpt = latest_checkpoint(self.ckpt_dir)
        # meta.json, not state.pt: the optimizer state there is gigabytes at Kimi scale, and every rank reads it
        saved = json.loads((ckpt / "meta.json").read_text()) if ckpt and (ckpt / "meta.json").is_file() else {}
        was, batch = saved.get("world_size"), (saved.get("settings") or {}).get("global_batch")
        if not was or was == self.world or not batch:
            return asked
        if batch % self.world:
            raise UsageError(f"checkpoints in {self.ckpt_dir} were made by {ranks(was)} with {batch} sequences per "
                             f"optimizer step; {ranks(self.world)} cannot split them evenly: resume on a number of ranks "
                             f"that divides {batch} (e.g. {was}), or use a new --work-dir")
        accum = batch // self.world
        self.log.info("resuming a run of %s on %s: %d micro-batches per rank per step (--grad-accum %d asked) keep "
                      "its %d sequences per optimizer step, its schedule and its data order", ranks(was),
                      ranks(self.world), accum, asked, batch)
        return accum

    def resume(self):
        ckpt = latest_checkpoint(self.ckpt_dir)
        if ckpt is None:
            if self.rank == 0 and self.metrics_path.exists():
                self.metrics_path.unlink()  # a fresh run starts a fresh curve
            return False
        saved = with_later_defaults(read_state(ckpt).get("settings") or {}, self.settings, self.model.g)
        if saved != self.settings:
            saved = saved or {}
            diff = sorted(k for k in self.settings if saved.get(k) != self.settings[k])
            older = " by an older eagle3-train" if any(k not in saved for k in diff) else ""
            raise UsageError(f"checkpoints in {self.ckpt_dir} were made{older} with other settings ({', '.join(diff)}); "
                             f"use a new --work-dir, or delete {self.out} to start over")
        self.state = load_checkpoint(ckpt, self.model, self.opt, self.sched, self.fsdp)
        self.state["world_size"] = self.world
        if self.rank == 0:
            self._truncate_metrics(self.state["step"])
        self.log.info("resumed from %s: step %d, epoch %d, sequence %d of the epoch", ckpt, self.state["step"],
                      self.state["epoch"], self.state["seq"])
        return True

    def _truncate_metrics(self, step):
        if self.metrics_path.exists():
            rows = [l for l in self.metrics_path.read_text().splitlines() if json.loads(l)["step"] <= step]
            self.metrics_path.write_text("".join(r + "\n" for r in rows))

    def _write_metrics(self, row):
        if self.rank == 0:
            append_line(self.metrics_path, json.dumps(row))

    def _checkpoint(self, val=None):
        t0 = time.time()
        weights, opt_state = gather_states(self.model, self.opt, self.fsdp)  # collective under FSDP
        if val is not None:
            self.state["validated_step"] = self.state["step"]  # a re-run of a finished run skips it
        name = f"step_{self.state['step']}"
        if self.rank != 0:
            after_rank0_writes(self.rank, self.world, name, self.checkpoint_wait)
            return time.time() - t0
        if val is not None and (self.state["best"] is None or val["acceptance_length"] > self.state["best"]):
            self.state["best"], self.state["best_step"] = val["acceptance_length"], self.state["step"]
        save_checkpoint(self.ckpt_dir / name, weights, opt_state, self.sched, dict(self.state))
        best = f"step_{self.state['best_step']}" if self.state["best_step"] is not None else None
        prune_checkpoints(self.ckpt_dir, self.cfg.keep_last, best)
        after_rank0_writes(self.rank, self.world, name, self.checkpoint_wait)
        size, seconds = sum(f.stat().st_size for f in (self.ckpt_dir / name).iterdir()), time.time() - t0
        self.log.info("checkpoint %s: %.2f GB in %.1f s", name, size / 1e9, seconds)
        return seconds

    def _validation_sums(self, val_bins):
        bins = val_bins[self.rank::self.world]
        # every rank runs the same number of forwards (FSDP gathers weights in each; DDP syncs
        # buffers): a rank short of sequences repeats the first one and does not count it
        n = math.ceil(len(val_bins) / self.world)
        loader = make_loader(self.folder, bins + val_bins[:1] * (n - len(bins)), self.cfg.max_tokens_per_step, 0,
                             embed=self.host_embed, shift=self.shift)
        every = self.method.validation_args  # a block draft: every block a loss-masked position can anchor
        sums = {}
        with torch.no_grad():
            for i, batch in enumerate(loader):
                batch = to_device(batch, self.device, self.dtype)
                with autocast(self.device, self.bf16):
                    _, m = self.parallel_model(batch, *self.loss_args, *every)
                if i < len(bins):
                    accumulate(sums, m)
        return all_reduce_sums(sums, self.device, self.positions)

    def run_validation(self):
        if not self.val_sets:
            return None
        k = self.positions
        self.model.eval()
        total, groups = {}, {}
        for name, bins in self.val_sets.items():
            sums = self._validation_sums(bins)
            merge_sums(total, sums)
            groups[name] = summarize(sums, k)
        self.model.train()
        val = summarize(total, k)
        row = {"kind": "val", "step": self.state["step"], "epoch": self.state["epoch"], **val}
        if len(groups) > 1:
            row["groups"] = val["groups"] = groups
        self._write_metrics(row)
        self.log.info("validation @ step %d: full acc %s, cond acc %s, simulated acceptance length %.3f (k=%d)",
                      self.state["step"], " / ".join(f"{val[f'full_acc_{i}']:.3f}" for i in range(k)),
                      " / ".join(f"{val[f'cond_acc_{i}']:.3f}" for i in range(k)), val["acceptance_length"], k)
        if len(groups) > 1:
            self.log.info("  by answer: %s", "; ".join(
                f"{name} ({sum(map(len, self.val_sets[name]))} samples) simulated acceptance length "
                f"{g['acceptance_length']:.3f}, full acc " + " / ".join(f"{g[f'full_acc_{i}']:.3f}" for i in range(k))
                for name, g in groups.items()))
        return val

    def train(self):
        cfg, st = self.cfg, self.state
        self.model.train()
        if cfg.compile and self.device.type == "cuda" and st["step"] == 0:  # else a silent log for minutes
            self.log.info("step 1 compiles the GPU kernels (torch.compile: ~2 min at Kimi width, seconds for small "
                          "drafts); its line follows")
        last_log, window = time.time(), self._window()
        while st["epoch"] < cfg.epochs and st["step"] < self.total_steps:
            bins = self.epoch_bins[st["epoch"]]
            # this rank's share of the rest of the epoch: every world-th sequence from the global position on
            loader = make_loader(self.folder, bins[st["seq"] + self.rank::self.world], cfg.max_tokens_per_step, cfg.num_workers,
                                 pin=self.device.type == "cuda", embed=self.host_embed, shift=self.shift)
            micro = 0
            step_sums, losses = {}, []
            t_step = time.time()
            for batch in self._waited(loader):
                batch = to_device(batch, self.device, self.dtype)
                seed = sequence_seed(cfg.seed, st["epoch"], st["seq"] + self.rank)  # this batch's global index
                if cfg.hidden_noise:
                    batch["aux"] = add_noise(batch["aux"], cfg.hidden_noise, self.model.g.num_aux, seed)
                with autocast(self.device, self.bf16):
                    loss, metrics = self.parallel_model(batch, *self.loss_args, **self.method.step_kwargs(seed))
                (loss / self.grad_accum).backward()
                losses.append(loss.detach())
                accumulate(step_sums, metrics)
                st["seq"] += self.world  # the ranks move through the epoch together
                micro += 1
                if micro % self.grad_accum:
                    continue
                # the global step's tokens (every rank's sequences), from the plan: no communication
                step_tokens = sum(self._bin_tokens(b) for b in bins[st["seq"] - self.grad_accum * self.world:st["seq"]])
                window["tokens"] += step_tokens
                norm = self._optimizer_step(losses, bins[st["seq"] - self.grad_accum * self.world:st["seq"]])
                window["grad_norm"] = max(window["grad_norm"], norm)
                merge_sums(window["sums"], global_sums(step_sums, self.device, self.world))
                step_sums, losses = {}, []
                st["step"] += 1
                st["tokens"] += step_tokens
                step_time = time.time() - t_step
                st["train_seconds"] += step_time
                t_step = time.time()
                if time.time() - last_log >= min(cfg.log_interval, 10) or st["step"] in (1, self.total_steps):
                    self._log_train(window, step_time)
                    last_log, window = time.time(), self._window()
                last = st["step"] >= self.total_steps or st["seq"] >= len(bins)  # validated and saved below anyway
                if cfg.save_every and st["step"] % cfg.save_every == 0 and not last:
                    paused = self._checkpoint()
                    t_step += paused  # step times and tokens/s leave the save out (it is logged on its own)
                    window["t"] += paused
                if st["step"] >= self.total_steps:
                    break
            if st["step"] >= self.total_steps and st["seq"] < len(bins):
                break
            st["epoch"] += 1
            st["seq"] = 0
            t0 = time.time()
            self._checkpoint(self.run_validation())
            window["t"] += time.time() - t0
        if st["seq"] and st.get("validated_step") != st["step"]:  # stopped mid-epoch by --max-steps
            self._checkpoint(self.run_validation())
        return st

    def _bin_tokens(self, b):
        return sum(shifted_len(self.lengths[i], self.cfg.max_tokens_per_step, self.shift) for i in b)

    def _window(self):
        return {"tokens": 0, "t": time.time(), "sums": {}, "wait": self.data_wait, "epoch": self.state["epoch"],
                "seq": self.state["seq"], "grad_norm": 0.0}

    def _waited(self, loader):
        """The loader's batches; the seconds spent blocked on each add to self.data_wait."""
        it = iter(loader)
        while True:
            t = time.time()
            try:
                batch = next(it, None)
            except UsageError as exc:  # from a loader worker, it carries the worker's traceback: keep its last line
                raise UsageError(str(exc).strip().splitlines()[-1].split("UsageError: ", 1)[-1]) from None
            self.data_wait += time.time() - t
            if batch is None:
                return
            yield batch

    def _optimizer_step(self, losses, sequences):
        norm = torch.nn.utils.clip_grad_norm_(self.model.trainable_parameters(), self.cfg.grad_clip)
        if not torch.isfinite(norm):  # one sync a step; an update with it would leave every weight NaN
            self._not_finite(losses, sequences)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return norm.item()  # the sync isfinite already made

    def _not_finite(self, losses, sequences):
        """Stop before the optimizer step, in one line naming the step and the first tensor that is not finite; the
        checkpoints already written (the last one finite) are kept."""
        step = self.state["step"] + 1
        samples = sorted({i for b in sequences for i in b})
        if not torch.isfinite(torch.stack(losses)).all():
            what = "the loss"
        else:
            what = next((f"the gradient of {name}" for name, p in self.model.named_parameters()
                         if p.grad is not None and not torch.isfinite(p.grad).all()), "a gradient (another rank's shard)")
        kept = latest_checkpoint(self.ckpt_dir)
        raise UsageError(f"step {step}: {what} is not finite (samples {samples[:8]}{' ...' if len(samples) > 8 else ''}"
                         f"); stopped before the update, {f'checkpoint {kept.name} kept' if kept else 'no checkpoint yet'}"
                         f"; lower --lr (now {self.cfg.lr:g}) or raise --warmup-steps, or check those samples' hidden "
                         f"states (stage 2's self-check)")

    def _log_train(self, window, step_time):
        st = self.state
        elapsed = time.time() - window["t"]
        s = summarize(window["sums"], self.positions)
        tps = window["tokens"] / max(elapsed, 1e-9)
        wait = min((self.data_wait - window["wait"]) / max(elapsed, 1e-9), 1.0)
        row = {"kind": "train", "step": st["step"], "epoch": st["epoch"], "lr": self.sched.get_last_lr()[0],
               "tokens_per_s": round(tps, 1), "step_time_s": round(step_time, 3), "data_wait": round(wait, 3),
               "peak_mem_gb": round(peak_memory_gb(self.device), 2), "tokens": st["tokens"],
               "train_seconds": round(st["train_seconds"], 3), "grad_norm_max": round(window["grad_norm"], 4),
               # the epoch's packed sequences these steps consumed (all ranks): the data position, for a resume's audit
               "sequences": [window["seq"] if window["epoch"] == st["epoch"] else 0, st["seq"]], **s}
        self._write_metrics(row)
        remaining = (self.total_steps - st["step"]) * (st["train_seconds"] / max(st["step"], 1))
        # grad norm: the largest of the window's steps, before clipping (a spike shows before a loss does)
        self.log.info("step %d/%d epoch %d | loss %s | acc %s | grad norm %.3g | lr %.2e | %.0f tok/s | %.2fs/step | "
                      "data wait %.0f%% | peak %.2f GB | ETA %s", st["step"], self.total_steps, st["epoch"] + 1,
                      " / ".join(f"{s[f'loss_{k}']:.3f}" for k in range(self.positions)),
                      " / ".join(f"{s[f'full_acc_{k}']:.3f}" for k in range(self.positions)),
                      window["grad_norm"], row["lr"], tps, step_time, 100 * wait, row["peak_mem_gb"], fmt_duration(remaining))
