#!/usr/bin/env python3
"""Write a work dir that 04_train.py accepts, with random hidden states at a chosen verifier geometry.

For GPU benchmarks of the real training script at production scale without the 1T verifier:
a stand-in verifier folder (config.json + random embed_tokens / lm_head / norm), prepared samples
(documents of 200..2048 tokens, prompt unmasked, answer masked), their hidden states, and a vocab
mapping, each with the manifest the stages would write.

  python bench/synthetic_workdir.py --work-dir /tmp/kimi-synth --samples 64
  torchrun --nproc_per_node 2 04_train.py --config configs/kimi-k2.5.yaml --work-dir /tmp/kimi-synth \
      --verifier /tmp/kimi-synth/verifier --max-steps 20
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.hidden_states import sample_path, write_sample  # noqa: E402
from common.io import sha256_file, write_manifest  # noqa: E402

KIMI = dict(hidden_size=7168, vocab_size=163840, num_hidden_layers=61, num_attention_heads=64,
            num_key_value_heads=64, head_dim=128, intermediate_size=18432, rms_norm_eps=1e-6, rope_theta=50000.0,
            max_position_embeddings=262144)


def write_tokenizer(folder):
    """A two-token tokenizer with a chat template: stage 4 reads a DFlash draft's mask token from the verifier's tokenizer."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "<|mask|>": 1}, "<unk>")),
                                  unk_token="<unk>", mask_token="<|mask|>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # stage 4 asks for one
    tok.save_pretrained(folder)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=1,
                    help="list every sample this many times (hidden-state files linked, not rewritten): long epochs "
                         "for throughput runs at the disk cost of --samples")
    ap.add_argument("--draft-vocab-size", type=int, default=32000)
    ap.add_argument("--layer-ids", type=int, nargs="+", default=[2, 30, 58, 61])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="hidden 256, vocab 8000: a CPU smoke test of the plumbing")
    args = ap.parse_args()
    work, g = Path(args.work_dir), dict(KIMI)
    if args.small:
        g.update(hidden_size=256, vocab_size=8000)
    H, V = g["hidden_size"], g["vocab_size"]
    gen = torch.Generator().manual_seed(args.seed)
    ver = work / "verifier"
    ver.mkdir(parents=True, exist_ok=True)
    (ver / "config.json").write_text(json.dumps(dict(g, model_type="llama", architectures=["LlamaForCausalLM"],
                                                     torch_dtype="bfloat16", tie_word_embeddings=False)))
    save_file({"model.embed_tokens.weight": (torch.randn(V, H, generator=gen) * 0.02).bfloat16(),
               "lm_head.weight": (torch.randn(V, H, generator=gen) * 0.02).bfloat16(),
               "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}, str(ver / "model.safetensors"))
    write_tokenizer(ver)
    tok = {"vocab_hash": "synthetic", "name": "synthetic"}
    prep = work / "prepared"
    prep.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(args.samples):
        n = int(torch.randint(200, 2049, (1,), generator=gen))
        start = int(n * float(torch.empty(1).uniform_(0.25, 0.55, generator=gen)))
        ids = torch.randint(0, V, (n,), generator=gen)
        records.append({"id": f"synthetic-{i}", "input_ids": ids.tolist(), "loss_mask": [0] * start + [1] * (n - start)})
    unique, records = len(records), records * args.repeat
    data = prep / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    sha = sha256_file(data)
    write_manifest(prep, "prepare", {"synthetic": True, "max_seq_len": 2048}, tokenizer=tok,  # documents <= 2,048
                   outputs={"tokenized_data": data.name, "tokenized_data_sha256": sha})
    hs = work / "hidden_states"
    hs.mkdir(parents=True, exist_ok=True)
    for i, r in enumerate(records):
        if i >= unique:  # a repeat: the same states (the loader may read them from the page cache)
            sample_path(hs, i).unlink(missing_ok=True)
            sample_path(hs, i).hardlink_to(sample_path(hs, i % unique))
            continue
        n = len(r["input_ids"])
        hidden = torch.randn(n, len(args.layer_ids), H, generator=gen)
        write_sample(sample_path(hs, i), hidden, torch.tensor(r["input_ids"]), torch.tensor(r["loss_mask"]),
                     {"synthetic": "1", "params_hash": "synthetic"})  # what stage 4's file check compares
    write_manifest(hs, "extract", {"prepared_sha256": sha, "layer_ids": args.layer_ids}, params_hash="synthetic",
                   counts={"samples": len(records)})
    voc = work / "vocab"
    voc.mkdir(parents=True, exist_ok=True)
    targets = np.sort(np.random.default_rng(args.seed).choice(V, args.draft_vocab_size, replace=False))
    np.save(voc / "d2t.npy", (targets - np.arange(args.draft_vocab_size)).astype(np.int64))
    write_manifest(voc, "vocab", {"prepared_sha256": sha}, tokenizer=tok,
                   counts={"draft_vocab_size": args.draft_vocab_size, "full_vocabulary": False})
    print(f"wrote {work}: {len(records)} samples, {sum(len(r['input_ids']) for r in records)} tokens, verifier {ver}")


if __name__ == "__main__":
    main()
