#!/usr/bin/env python3
"""Stage 4's validation for any exported draft of a geometry stage 4 builds: the held-out split that stage 4's
options make, every position scored, per-position acceptance and the simulated acceptance length, as stage 4 logs
them for its own drafts. For issue 39's reference anchor, which trains a draft with speculators' own trainer and
needs it scored by the same simulator as ours (bench/speculators_anchor.sh).

  python bench/simulate_validation.py DRAFT_DIR [04_train.py options: --config C --work-dir W --draft-method ...]

Prints stage 4's validation line and writes DRAFT_DIR/simulated_validation.json.
"""
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.build_draft import build_model, geometry  # noqa: E402
from common.drafts import method_of  # noqa: E402
from common.models import load_tokenizer, open_verifier  # noqa: E402
from common.prepare import split_by_conversation, validation_groups  # noqa: E402
from common.stage import start  # noqa: E402
from common.train_preflight import read_inputs  # noqa: E402
from common.trainer import Trainer  # noqa: E402


def main():
    draft = Path(sys.argv[1])
    cfg, log = start(4, "simulate_validation", __doc__, sys.argv[2:])
    device = torch.device("cuda" if torch.cuda.is_available() and cfg.device != "cpu" else "cpu")
    prep_man, records, hs_man, voc_man, layer_ids = read_inputs(cfg)
    model_dir, text_cfg = open_verifier(cfg, log)
    work = Path(cfg.work_dir)
    d2t = np.load(work / "vocab" / "d2t.npy")
    g = geometry(cfg, text_cfg, len(d2t), len(layer_ids) - 1, log=log, tokenizer=lambda: load_tokenizer(model_dir))
    conf = json.loads((draft / "config.json").read_text())
    if "mask_token_id" in conf:  # as trained (a tokenizer of another transformers may resolve another)
        g = dataclasses.replace(g, mask_token_id=conf["mask_token_id"])
    bad = {int(i) for i in hs_man["counts"].get("bad_samples") or {}}
    hs = work / "hidden_states"
    lengths = {i: len(r["input_ids"]) for i, r in enumerate(records)
               if i not in bad and (hs / f"hs_{i}.safetensors").exists()}  # all of them, after stage 2
    train_idx, val_idx = split_by_conversation(records, sorted(lengths), cfg.val_fraction, cfg.seed)
    model = build_model(g, model_dir, d2t + np.arange(len(d2t)))
    weights = method_of(cfg).import_weights(load_file(str(draft / "model.safetensors")))
    missing, unexpected = model.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                 for k, v in weights.items()}, strict=False)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    if trained & set(missing):
        sys.exit(f"{draft}: no weights for {sorted(trained & set(missing))[:4]}: another geometry than the options'")
    log.info("%s: %d tensors loaded (ignored: %s)", draft, len(weights) - len(unexpected), unexpected or "none")
    groups = validation_groups(records, val_idx, prep_man["params"].get("regenerate", False))
    with tempfile.TemporaryDirectory() as out:
        val = Trainer(cfg, model, device, hs, train_idx, val_idx, lengths, out, log,
                      val_groups=groups).run_validation()
    (draft / "simulated_validation.json").write_text(json.dumps(val, indent=1))


if __name__ == "__main__":
    main()
