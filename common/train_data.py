"""Training data: per-sample hidden-state files -> packed sequences with document boundaries.

Each sample is shifted as EAGLE-3 expects (speculators' shift_batch): the draft sees token i+1
with the aux states of position i, and learns the verifier's distribution at position i+1.
Samples are packed first-fit, in a seeded order per epoch, into sequences of at most
--max-tokens-per-step tokens; attention never crosses a document boundary.
"""
import random

import torch
from torch.utils.data import DataLoader, Dataset

from common.drafts.ttt_plan import OnHost
from common.errors import UsageError, first_line
from common.hidden_states import read_sample, sample_path


def split_samples(indices, val_fraction, seed, conversation=None):
    """Fixed split: -> (train, val). At least one validation sample when asked for any. conversation(i) -> key:
    samples of one conversation (a regenerated answer and the dataset's, --keep-original-answers) stay on one
    side, or validation would score a prompt training saw (and vLLM, serving it, the very answer trained on)."""
    order = list(indices)
    n_val = min(len(order) - 1, max(1, round(len(order) * val_fraction))) if val_fraction > 0 else 0
    if conversation is None:
        random.Random(seed).shuffle(order)
        return sorted(order[n_val:]), sorted(order[:n_val])
    by_key = {}
    for i in order:
        by_key.setdefault(conversation(i), []).append(i)
    keys = sorted(by_key)
    random.Random(seed).shuffle(keys)
    val = []
    for key in keys:
        if len(val) >= n_val:
            break
        val += by_key[key]
    if len(val) == len(order):  # one conversation only: keep training
        val = val[:n_val]
    held = set(val)
    return sorted(i for i in order if i not in held), sorted(val)


def shifted_len(n, budget, shift=1):
    """Tokens a sample of n tokens contributes to a packed sequence (shifted by one for EAGLE-3, not for DFlash;
    cut to the budget)."""
    return min(n - shift, budget)


PACKING = "first-fit, window 32"  # recorded in checkpoints: resuming needs the same sequences
SPLIT = "by conversation"  # likewise: the same train/validation split


def pack(indices, lengths, budget, seed, epoch, window=32, shift=1):
    """First-fit packing of shuffled samples into bins of <= budget tokens. -> list of index lists.
    Each sample goes into the first of the last `window` open bins it fits, so bins come out nearly full;
    in-order packing closed a bin at the first sample that did not fit and left them ~88% full, and
    under DDP every step waits for its longest rank."""
    order = list(indices)
    random.Random(seed * 100003 + epoch).shuffle(order)
    bins, used, first_open = [], [], 0
    for i in order:
        n = shifted_len(lengths[i], budget, shift)
        for b in range(first_open, len(bins)):
            if used[b] + n <= budget:
                bins[b].append(i)
                used[b] += n
                break
        else:
            bins.append([i])
            used.append(n)
            first_open = max(first_open, len(bins) - window)
    return bins


def read_checked(path):
    """A sample file that passed the preflight but fails now (a disk error, a file replaced mid-run) stops the
    stage with one line; the checkpoints already written are kept and the same command resumes from them."""
    try:
        return read_sample(path, torch.bfloat16)
    except Exception as exc:
        raise UsageError(f"{path} cannot be read mid-training ({first_line(exc, 120)}); re-run 02_extract_hidden_states.py with the "
                         f"same options (it redoes that file), then this command: training resumes from its last "
                         f"checkpoint")


class PackedDataset(Dataset):
    """Item i = the i-th packed bin, collated into one sequence. embed: the frozen input embedding as a host
    tensor (GPU training, see draft.take_embedding): each batch then carries its tokens' embeddings."""

    def __init__(self, folder, bins, budget, embed=None, shift=1):
        self.folder, self.bins, self.budget, self.embed, self.shift = folder, bins, budget, embed, shift

    def __len__(self):
        return len(self.bins)

    def __getitem__(self, i):
        samples = [read_checked(sample_path(self.folder, idx)) for idx in self.bins[i]]
        lens = [shifted_len(len(s["token_ids"]), self.budget, self.shift) for s in samples]
        d = self.shift  # EAGLE-3: token t + 1 beside the states of t; DFlash: token t, the states of t
        T, (L, H) = sum(lens), samples[0]["hidden_states"].shape[1:]
        # each sample's states are copied once, straight into the batch (~0.5 GB per 8192 Kimi tokens)
        aux, target = torch.empty(T, L - 1, H, dtype=torch.bfloat16), torch.empty(T, H, dtype=torch.bfloat16)
        docs, a = [], 0
        for s, n in zip(samples, lens):
            aux[a:a + n] = s["hidden_states"][:n, :-1]
            target[a:a + n] = s["hidden_states"][d:n + d, -1]
            docs.append((a, a + n))
            a += n
        out = {"aux": aux.flatten(1), "target_hidden": target,
               "ids": torch.cat([s["token_ids"][d:n + d] for s, n in zip(samples, lens)]),
               "loss_mask": torch.cat([s["loss_mask"][d:n + d] for s, n in zip(samples, lens)]),
               "doc": torch.cat([torch.full((b - a,), j) for j, (a, b) in enumerate(docs)]),
               "pos": torch.cat([torch.arange(d, b - a + d) for a, b in docs]),  # positions start at 1 after the shift
               "docs": docs}
        if self.embed is not None:
            out["embeds"] = self.embed[out["ids"]]
        return out


def make_loader(folder, bins, budget, num_workers, pin=False, embed=None, shift=1):
    """Background workers prefetch the next packed sequences while the current step runs; pin: page-locked
    batches, so the host-to-GPU copies (~0.6 GB per 8192 Kimi tokens) run asynchronously."""
    ds = PackedDataset(folder, bins, budget, embed, shift)
    kwargs = dict(batch_size=None, shuffle=False, num_workers=num_workers, pin_memory=pin)
    if num_workers:
        kwargs.update(prefetch_factor=4, persistent_workers=False)
    return DataLoader(ds, **kwargs)


def to_device(batch, device, dtype):
    """Hidden states in `dtype` (bf16 on GPUs: what the files hold); "cpu" keeps the mask and document
    ids on the host, where the step plans its row indices without waiting on the device."""
    out = {"cpu": OnHost(loss_mask=batch["loss_mask"], doc=batch["doc"])}
    for k, v in batch.items():
        if k == "docs":
            out[k] = v
        elif v.is_floating_point():
            out[k] = v.to(device, dtype, non_blocking=True)
        else:
            out[k] = v.to(device, non_blocking=True)
    return out
