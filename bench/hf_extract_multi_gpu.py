#!/usr/bin/env python3
"""HF extraction backend with the verifier spread over several GPUs vs on one GPU: same states?

Builds a random Llama verifier (no download), then runs stage 2's HfExtractor in two subprocesses,
CUDA_VISIBLE_DEVICES=0 and =0,1 (device_map="auto" balances the layers over the visible GPUs), on
the same token sequences, and compares the captured hidden states.

  python bench/hf_extract_multi_gpu.py --out /tmp/hfx
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(model_dir, layers, hidden):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                       num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128, max_position_embeddings=4096)
    LlamaForCausalLM(conf).to(torch.bfloat16).save_pretrained(model_dir)


def worker(model_dir, out_file, layer_ids):
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from common.extract import HfExtractor
    ex = HfExtractor(model_dir, SimpleNamespace(dtype="bfloat16", trust_remote_code=False), layer_ids)
    gen = torch.Generator().manual_seed(1)
    batch = [(i, torch.randint(0, 32000, (int(n),), generator=gen).tolist()) for i, n in enumerate([300, 1200, 2048, 77])]
    states = {f"s{idx}": hidden.contiguous() for idx, hidden, _ in ex(batch)}
    save_file(states, out_file)
    devices = sorted({str(d) for d in getattr(ex.model, "hf_device_map", {}).values()})
    print(json.dumps({"gpus": torch.cuda.device_count(), "devices": devices}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--worker", nargs=3)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker[0], args.worker[1], json.loads(args.worker[2]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / "verifier"
    build(model_dir, args.layers, args.hidden)
    n = args.layers
    layer_ids = [2, n // 2, n - 3, n]
    files = {}
    for vis in ("0", "0,1"):
        f = out / f"states_{vis.replace(',', '')}.safetensors"
        proc = subprocess.run([sys.executable, __file__, "--out", str(out), "--worker", str(model_dir), str(f),
                               json.dumps(layer_ids)], env=dict(os.environ, CUDA_VISIBLE_DEVICES=vis),
                              capture_output=True, text=True)
        print(f"CUDA_VISIBLE_DEVICES={vis}: exit {proc.returncode} {proc.stdout.strip()[-300:]} {proc.stderr.strip()[-800:]}")
        files[vis] = f
    from safetensors.torch import load_file
    a, b = load_file(str(files["0"])), load_file(str(files["0,1"]))
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    scale = max(a[k].float().abs().max().item() for k in a)
    print(f"layers {layer_ids}: max |1 GPU - 2 GPUs| = {diff:.3e} (largest |state| {scale:.3e}); "
          f"{'identical' if diff == 0 else 'differs'}")


if __name__ == "__main__":
    main()
