"""What vLLM should accept, predicted from our draft: the exported weights run over a sample's stored
hidden states give, at every row, how many leading TTT predictions are right; a vLLM verify step whose
first drafted token is answer token q sees what row P+q-2 sees (P: the prompt's length), so that count
is its accepted count, numerics aside. Used by the parity gate (tests/test_parity.py) and by
bench/served_vs_simulated.py (where a served acceptance length differs from training's, and why).
"""
import json

import numpy as np
import torch
from safetensors.torch import load_file


def load_exported_draft(work):
    """Our draft (EAGLE-3 or DFlash) with the exported (bf16) weights of <work>/final_draft, as vLLM loads them;
    -> (model, d2t)."""
    from common.build_draft import build_model
    from common.drafts.dflash import DFlashGeometry
    from common.drafts.eagle3 import DraftGeometry
    man = json.loads((work / "train" / "manifest.json").read_text())
    d2t = np.load(work / "vocab" / "d2t.npy")
    model_dir = json.loads((work / "prepared" / "manifest.json").read_text())["params"]["model_dir"]
    geometry = DFlashGeometry if man["params"].get("draft_method") == "dflash" else DraftGeometry
    model = build_model(geometry(**man["params"]["geometry"]), model_dir, d2t + np.arange(len(d2t)))
    exported = load_file(str(work / "final_draft" / "model.safetensors"))
    if "midlayer.self_attn.q_proj.weight" in exported:
        exported = {k.replace("midlayer.", "layers.0."): v for k, v in exported.items()}
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in exported.items()}, strict=False)
    return model.eval(), torch.as_tensor(d2t)


def predicted_accepts(model, d2t, folder, index, tokens, k):
    """row -> leading right TTT predictions (0..k) of the draft at that row of sample `index` (hidden states in folder)."""
    from common.train_data import PackedDataset
    b = PackedDataset(folder, [[index]], len(tokens))[0]
    b = {key: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for key, v in b.items()}
    with torch.no_grad():
        logits = model.unroll(b["aux"], b["ids"], b["pos"], b["doc"], b["docs"], k)
    tokens = torch.as_tensor(tokens)
    right = []
    for j in range(k):
        top = logits[j].argmax(-1)
        guess = top + d2t[top]  # draft vocab -> verifier ids
        n = len(tokens) - 2 - j  # row i at step j predicts token i + 2 + j
        right.append(guess[:n] == tokens[2 + j:2 + j + n])
    return {row: next((j for j in range(k) if not right[j][row]), k) for row in range(len(right[-1]))}


def verify_walk(predicted, prompt, answer_len, k):
    """The verify steps vLLM would take if its drafts were these predictions: [(answer position q, accepted)],
    from q = 1 (the prefill writes answer token 0), each step moving 1 + accepted; steps whose k drafts lie
    inside the answer only."""
    steps, q = [], 1
    while q + k <= answer_len:
        accepted = predicted[prompt + q - 2]
        steps.append((q, accepted))
        q += accepted + 1
    return steps


def predicted_block_accepts(model, d2t, folder, index, tokens):
    """DFlash: anchor position a -> how many leading drafts of the block anchored at a are right (slot i predicts
    token a + i). A vLLM verify step whose first drafted token is answer token q anchors at P+q-1 (its last
    accepted token), with the verifier's states before it as context: the same inputs, so the same count."""
    from common.train_data import PackedDataset
    b = PackedDataset(folder, [[index]], len(tokens), shift=0)[0]
    b = {key: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for key, v in b.items()}
    bs, T = model.g.block_size, len(tokens)
    anchors = torch.arange(T - 1)
    with torch.no_grad():
        logits = model.block_logits(b["aux"], b["ids"], b["pos"], b["doc"], anchors).view(T - 1, bs, -1)
    top = logits.argmax(-1)
    guess = top + d2t[top]
    tokens = torch.as_tensor(tokens)
    out = {}
    for a in range(T - 1):
        n = 0
        for i in range(1, bs):
            if a + i >= T or guess[a, i] != tokens[a + i]:
                break
            n += 1
        out[a] = n
    return out
