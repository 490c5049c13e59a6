#!/usr/bin/env python3
"""Carry exported drafts off a machine that returns few, small files (the `device` GPU: 8 files of 16 MiB):
`pack` writes each run's trained weights without the frozen lm_head (the verifier's rows of the draft vocab, a
third of a SmolLM2 draft's bytes) plus its config, manifest and log; `unpack` rebuilds final_draft/ from the
verifier's own embedding here and checks the head's SHA-256 against the one packed.

  python bench/draft_transport.py pack OUT W-a W-b ...        # on the GPU machine, after bench/gpu_ab.sh
  python bench/draft_transport.py unpack OUT/W-a.tar DEST     # here: DEST/final_draft, DEST/train, DEST/logs
  python bench/draft_transport.py states OUT W-a [N]           # there: the hidden states of stage 5's first N parity
                                                               # samples (tar xf OUT/parity_states.tar -C DEST here)
"""
import hashlib
import io
import sys
import tarfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.models import load_verifier_pieces, resolve_verifier  # noqa: E402

KEEP = ("final_draft/config.json", "train/manifest.json", "train/metrics.jsonl", "logs/04_train.log")


def digest(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def pack(out, runs):
    for run in map(Path, runs):
        sd = load_file(run / "final_draft" / "model.safetensors")
        head = sd.pop("lm_head.weight")
        data = save(sd, metadata={"format": "pt"})
        with tarfile.open(Path(out) / f"{run.name}.tar", "w") as tar:
            add(tar, "model.safetensors", data)
            add(tar, "lm_head.sha256", digest(head).encode())
            for rel in KEEP:
                if (run / rel).is_file():
                    tar.add(run / rel, arcname=rel)
        print(f"{run.name}: {len(data) / 2**20:.1f} MiB of weights without the {tuple(head.shape)} head")


def add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def unpack(tar_path, dest, verifier="embedded:smollm2-135m-instruct"):
    import numpy as np
    dest = Path(dest)
    with tarfile.open(tar_path) as tar:
        tar.extractall(dest, filter="data")
    sd = load_file(dest / "model.safetensors")
    embed = load_verifier_pieces(resolve_verifier(verifier))["lm_head.weight"].float()  # as build_model copies it
    d2t = sd["d2t"].numpy() if "d2t" in sd else np.zeros(embed.shape[0], dtype=np.int64)
    head = embed[torch.from_numpy(d2t + np.arange(len(d2t)))].to(torch.bfloat16).contiguous()
    want = (dest / "lm_head.sha256").read_text()
    if digest(head) != want:
        raise SystemExit(f"{tar_path}: the rebuilt lm_head differs from the trained one (another verifier?)")
    save_file({**sd, "lm_head.weight": head}, str(dest / "final_draft" / "model.safetensors"),
              metadata={"format": "pt"})
    (dest / "model.safetensors").unlink()
    print(f"{dest}/final_draft: lm_head {tuple(head.shape)} rebuilt, SHA-256 as trained")


def states(out, run, limit=8, cap=15.5 * 2**20):
    """The stored states of the held-out samples stage 5's served-vs-trained check reads (common/parity.py's choice,
    the same split for every variant), as many as fit one returned file, with stage 2's manifest."""
    from common.hidden_states import sample_path
    from common.parity import parity_samples
    run = Path(run)
    chosen, why = parity_samples(run, limit, 10**9)
    files = [run / "hidden_states" / "manifest.json"]
    size = files[0].stat().st_size
    for i, _ in chosen:
        path = sample_path(run / "hidden_states", i)
        if size + path.stat().st_size > cap:
            break
        files.append(path)
        size += path.stat().st_size
    with tarfile.open(Path(out) / "parity_states.tar", "w") as tar:
        for f in files:
            tar.add(f.resolve(), arcname=str(f.relative_to(run)))
    print(f"parity_states.tar: {len(files) - 1} of {len(chosen)} samples' states, {size / 2**20:.1f} MiB {why}")


if __name__ == "__main__":
    if sys.argv[1] == "pack":
        pack(sys.argv[2], sys.argv[3:])
    elif sys.argv[1] == "states":
        states(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:5]))
    else:
        unpack(sys.argv[2], sys.argv[3])
