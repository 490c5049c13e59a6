"""Training metrics: per-position sums over batches, their summary (accuracy, simulated acceptance length), curves."""
import json
import resource
from pathlib import Path

import torch

from common.drafts.acceptance import acceptance_length


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


def merge_sums(total, part):
    for k, v in part.items():
        total[k] = total.get(k, 0) + v


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
