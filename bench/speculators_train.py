#!/usr/bin/env python3
"""speculators 0.9.0's own trainer (`speculators train`: its TrainConfig and main, nothing changed) on data that
bench/speculators_data.py converted from ours: issue 39's reference anchor (bench/speculators_anchor.sh).

  python bench/speculators_train.py --speculator-type dflash --data-path D ...   (the flags of `speculators train`)

Where the `datasets` package cannot be imported (the `device` H200 has no pyarrow, a 55 MB wheel), a stand-in with
the calls speculators' ArrowDataset makes (load_from_disk, select, with_format, rows, a column) reads D/rows.pt,
which the converter writes beside the HF dataset: the same rows either way.
"""
import os
import sys
import types

import torch


class Rows:
    """The part of datasets.Dataset that speculators.train.data.ArrowDataset uses."""

    def __init__(self, cols):
        self.cols = cols

    def __len__(self):
        return len(self.cols["seq_len"])

    def select(self, idx):
        idx = list(idx)
        return Rows({k: [v[i] for i in idx] for k, v in self.cols.items()})

    def with_format(self, _kind):
        return self

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.cols[key]
        return {k: torch.as_tensor(v[key]) for k, v in self.cols.items()}


def stand_in():
    mod = types.ModuleType("datasets")
    mod.load_from_disk = lambda path: Rows(torch.load(os.path.join(path, "rows.pt")))
    mod.Dataset = mod.load_dataset = mod.concatenate_datasets = None  # imported by modules the trainer does not use
    sys.modules["datasets"] = mod


# at import, not under __main__: the loader's spawned workers import this file again and need the same module
try:
    if os.environ.get("SPECULATORS_ROWS"):
        raise ImportError("asked for the stand-in (SPECULATORS_ROWS)")
    import datasets  # noqa: F401
except ImportError as exc:
    print(f"datasets: {exc}; reading rows.pt through a stand-in", file=sys.stderr)
    stand_in()

if __name__ == "__main__":
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig
    main(TrainConfig.resolve(sys.argv[1:]))
