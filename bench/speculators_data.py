#!/usr/bin/env python3
"""Our stage 2-3 outputs as speculators' offline training data, for issue 39's reference anchor (speculators' own
trainer on exactly our hidden states and vocabulary; bench/speculators_anchor.sh runs it):

  python bench/speculators_data.py WORK OUT [--val-fraction 0.05] [--seed 0]

OUT/ becomes an HF datasets folder (speculators' --data-path) (input_ids, loss_mask, seq_len; our training split first, then our validation
split, so that `speculators train --train-data-ratio R` holds out exactly the samples stage 4 holds out),
OUT/rows.pt holds the same columns (for bench/speculators_train.py where `datasets` is missing),
OUT/hidden_states/hs_{row}.safetensors links to WORK/hidden_states/hs_{idx} (the same file layout: aux layers, then
the final state), OUT/d2t.npy and OUT/t2d.npy copy WORK/vocab/. Prints R and the verifier folder as shell lines.
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.prepare import split_by_conversation  # noqa: E402


def read_tokens(path):
    with safe_open(str(path), "pt") as f:
        if "hidden_states_scale" in f.keys():
            sys.exit(f"{path}: fp8 hidden states; speculators' file backend reads bf16 (re-run stage 2 in bf16)")
        return f.get_tensor("token_ids").tolist(), f.get_tensor("loss_mask").bool().tolist()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    hs_man = json.loads((a.work / "hidden_states" / "manifest.json").read_text())
    records = [json.loads(line) for line in (a.work / "prepared" / "tokenized_data.jsonl").open()]
    bad = {int(i) for i in hs_man["counts"].get("bad_samples") or {}}
    present = [i for i in range(len(records)) if i not in bad and (a.work / "hidden_states" / f"hs_{i}.safetensors").exists()]
    if len(present) + len(bad) < len(records):
        print(f"# only {len(present)} of {len(records)} samples have hidden states here", file=sys.stderr)
    # the split 04_train.py makes (same fraction, seed and conversation grouping)
    train, val = split_by_conversation(records, present, a.val_fraction, a.seed)
    order = train + val
    hs = a.out / "hidden_states"
    hs.mkdir(parents=True, exist_ok=True)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for row, idx in enumerate(order):
        src = (a.work / "hidden_states" / f"hs_{idx}.safetensors").resolve()
        ids, mask = read_tokens(src)
        rows["input_ids"].append(ids)
        rows["loss_mask"].append(mask)
        rows["seq_len"].append(len(ids))
        link = hs / f"hs_{row}.safetensors"
        link.unlink(missing_ok=True)
        link.symlink_to(src)
    torch.save(rows, a.out / "rows.pt")  # for bench/speculators_train.py's stand-in where `datasets` is missing
    try:
        from datasets import Dataset
        ds = Dataset.from_dict(rows)
        ds.set_format(type="torch")
        ds.save_to_disk(str(a.out))  # speculators: load_from_disk(--data-path), its hidden_states/ inside
    except ImportError:
        print("# no `datasets` here: rows.pt only", file=sys.stderr)
    for name in ("d2t.npy", "t2d.npy"):
        shutil.copy(a.work / "vocab" / name, a.out / name)
    # int(n * R) == len(train): speculators' split boundary
    ratio = (len(train) + 0.5) / len(order)
    assert int(len(order) * ratio) == len(train)
    (a.out / "split.json").write_text(json.dumps({"train": train, "val": val}))
    print(f"TRAIN_RATIO={ratio:.6f}")
    print(f"VERIFIER={hs_man['params']['model_dir']}")
    print(f"LAYERS='{' '.join(map(str, hs_man['params']['layer_ids'][:-1]))}'")
    print(f"# {len(train)} train / {len(val)} validation samples, {sum(rows['seq_len'])} tokens", file=sys.stderr)


if __name__ == "__main__":
    main()
