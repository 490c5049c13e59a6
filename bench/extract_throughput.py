#!/usr/bin/env python3
"""Extraction throughput versus plain prefill, on a run's prepared data, in one process.

1. plain prefill: the verifier in vLLM, SamplingParams(max_tokens=1), no extraction;
2. extraction: the same engine settings plus the extract_hidden_states method and the connector,
   including our per-sample checks and safetensors writes (the stage's real code path);
3. the HF backend (transformers forward + hook), same samples.
Same samples, same token budget per engine call. Prints a table (tokens/s and ratio to prefill).

  python bench/extract_throughput.py --config configs/smollm2-135m.yaml --work-dir runs/smollm2-135m --num-samples 64
"""
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    from common.config import parse_config
    from common.engine import make_llm
    from common.extract import HfExtractor, VllmExtractor, default_layer_ids, extract, file_meta
    from common.prepare import load_prepared
    from common.log import setup_logging
    from common.models import load_verifier_config, resolve_verifier

    cfg = parse_config(2, __doc__, sys.argv[1:])
    log = setup_logging("bench_extract")
    _, records = load_prepared(cfg.work_dir)
    n = cfg.num_samples or len(records)
    todo = list(range(min(n, len(records))))
    tokens = sum(len(records[i]["input_ids"]) for i in todo)
    model_dir = resolve_verifier(cfg.verifier)
    text_cfg = load_verifier_config(model_dir)
    layer_ids = list(cfg.layer_ids or default_layer_ids(text_cfg.num_hidden_layers))
    rows = []

    from vllm import SamplingParams
    from common.extract import token_batches
    llm = make_llm(model_dir, cfg, max_model_len=cfg.max_seq_len + 1, enable_chunked_prefill=False,
                   enable_prefix_caching=False, max_num_batched_tokens=max(cfg.max_tokens_per_batch, cfg.max_seq_len + 1))
    items = [(i, records[i]["input_ids"]) for i in todo]
    llm.generate([{"prompt_token_ids": items[0][1]}], SamplingParams(max_tokens=1), use_tqdm=False)
    t0 = time.time()
    for batch in token_batches(items, cfg.max_tokens_per_batch):
        llm.generate([{"prompt_token_ids": ids} for _, ids in batch], SamplingParams(max_tokens=1), use_tqdm=False)
    rows.append(("vLLM plain prefill", time.time() - t0))
    del llm

    out = Path(tempfile.mkdtemp(prefix="bench_hs_"))
    meta = file_meta(cfg, layer_ids, text_cfg.hidden_size, model_dir, "bench")
    ex = VllmExtractor(model_dir, cfg, layer_ids, out / ".staging")
    list(ex(items[:1]))
    stats = extract(ex, todo, records, out, meta, cfg, log)
    rows.append(("vLLM extraction (stage 2 path)", stats["seconds"]))
    del ex
    hf = HfExtractor(model_dir, cfg, layer_ids)
    stats = extract(hf, todo, records, out, meta, cfg, log)
    rows.append(("HF backend", stats["seconds"]))
    shutil.rmtree(out, ignore_errors=True)

    base = tokens / rows[0][1]
    print(f"\n{len(todo)} samples, {tokens} tokens, layers {layer_ids}, dtype {cfg.dtype}, batch budget "
          f"{cfg.max_tokens_per_batch}")
    print("| path | tokens/s | vs plain prefill |\n|---|---|---|")
    for name, secs in rows:
        print(f"| {name} | {tokens / secs:.0f} | {tokens / secs / base:.2f} |")


if __name__ == "__main__":
    main()
