#!/usr/bin/env python3
"""Stage 2: verifier hidden states (aux layers + final pre-norm layer) for every prepared sample.

Reads <work-dir>/prepared/; writes <work-dir>/hidden_states/hs_{idx}.safetensors and manifest.json.
Crash-safe and resumable: re-running the same command skips every valid finished file.
--shard-index/--num-shards split the samples across independent processes writing the same folder.
"""
import time
from pathlib import Path

from common.engine import compute_dtype
from common.errors import UsageError, run_main
from common.extract import (HfExtractor, VllmExtractor, check_layer_ids, default_layer_ids, extract, file_meta,
                            self_check)
from common.hidden_states import LAYER_CONVENTION, disk_estimate, is_valid, sample_path
from common.io import check_free_disk, sha256_text, write_json_atomic, write_manifest
from common.log import fmt_duration
from common.models import open_verifier
from common.prepare import follow_stage1_length, load_prepared
from common.stage import ensure_writable, start


def preflight(cfg, log):
    """Everything that can fail, in seconds, before the model loads."""
    prep_man, records = load_prepared(cfg.work_dir)
    follow_stage1_length(cfg, prep_man, log)
    model_dir, text_cfg = open_verifier(cfg, log, extra_positions=1)
    if prep_man["params"]["model_dir"] != model_dir and prep_man["params"]["verifier"] != cfg.verifier:
        raise UsageError(f"prepared data was tokenized for verifier {prep_man['params']['verifier']}, not "
                         f"{cfg.verifier}; re-run 01_prepare_dataset.py or pass the same --verifier")
    n = text_cfg.num_hidden_layers
    layer_ids = list(cfg.layer_ids or default_layer_ids(n))
    check_layer_ids(layer_ids, n, getattr(text_cfg, "model_type", ""))
    if cfg.backend == "vllm":
        from common.engine import check_parallel, cpu_mla_fallback
        check_parallel(cfg, text_cfg)
        cpu_mla_fallback(text_cfg, log, cfg.dtype, draft=False)
    longest = max(len(r["input_ids"]) for r in records)
    if longest > cfg.max_seq_len:
        raise UsageError(f"longest prepared sample has {longest} tokens > --max-seq-len {cfg.max_seq_len}; "
                         f"use the --max-seq-len of stage 1 ({prep_man['params']['max_seq_len']})")
    if longest > cfg.max_tokens_per_batch:
        raise UsageError(f"longest prepared sample has {longest} tokens > --max-tokens-per-batch "
                         f"{cfg.max_tokens_per_batch}; raise it to at least {longest}")
    return prep_man, records, model_dir, text_cfg, layer_ids


def main():
    cfg, log = start(2, "02_extract", __doc__)
    prep_man, records, model_dir, text_cfg, layer_ids = preflight(cfg, log)
    out = Path(cfg.work_dir) / "hidden_states"
    hidden = text_cfg.hidden_size
    params = {"verifier": cfg.verifier, "model_dir": model_dir, "layer_ids": layer_ids, "hs_dtype": cfg.hs_dtype,
              "backend": cfg.backend, "dtype": compute_dtype(cfg.dtype),
              "prepared_sha256": prep_man["outputs"]["tokenized_data_sha256"]}
    params_hash = sha256_text(repr(sorted((k, str(v)) for k, v in params.items() if k != "backend")))
    mine = [i for i in range(len(records)) if i % cfg.num_shards == cfg.shard_index]
    done = [i for i in mine if sample_path(out, i).exists()
            and is_valid(sample_path(out, i), records[i]["input_ids"], params_hash)] if out.exists() else []
    todo = sorted(set(mine) - set(done))
    stale = [i for i in todo if sample_path(out, i).exists()]
    if stale:  # a resume with other layers, dtype, verifier or data, or files damaged by a crash or a disk
        log.info("%d existing files do not match this extraction (other --layer-ids, --hs-dtype, verifier or prepared "
                 "data, or damaged): they are redone", len(stale))
    tokens_todo = sum(len(records[i]["input_ids"]) for i in todo)
    need = disk_estimate(tokens_todo, len(layer_ids), hidden, cfg.hs_dtype)
    log.info("plan: %d samples (shard %d/%d), %d already done, %d to extract = %d tokens; layers %s of %d "
             "(vLLM numbering), hidden %d, %s -> ~%.2f GB in %s; backend %s, TP=%d, batch budget %d tokens",
             len(mine), cfg.shard_index, cfg.num_shards, len(done), len(todo), tokens_todo, layer_ids,
             text_cfg.num_hidden_layers, hidden, cfg.hs_dtype, need / 1e9, out, cfg.backend,
             cfg.tensor_parallel_size, cfg.max_tokens_per_batch)
    if cfg.dry_run:
        check_free_disk(out, need, "hidden states")
        log.info("dry run: preflight passed; nothing written")
        return 0
    ensure_writable(out)
    check_free_disk(out, need, "hidden states")
    meta = file_meta(cfg, layer_ids, hidden, model_dir, params_hash)
    stats, load_s = {"samples": 0, "tokens": 0, "bytes": 0, "bad": {}, "seconds": 0.0}, 0.0
    engine = None
    if todo:
        t0 = time.time()
        if cfg.backend == "vllm":
            extractor = VllmExtractor(model_dir, cfg, layer_ids, out / f".staging-{cfg.shard_index}")
        else:
            extractor = HfExtractor(model_dir, cfg, layer_ids)
        load_s = time.time() - t0
        engine = extractor.engine_facts
        log.info("model loaded in %s; engine: %s", fmt_duration(load_s), engine)
        stats = extract(extractor, todo, records, out, meta, cfg, log)
        log.info("extracted %d samples, %d tokens in %.1fs (%.0f tokens/s), wrote %.3f GB; %d bad samples excluded",
                 stats["samples"], stats["tokens"], stats["seconds"], stats["tokens_per_s"], stats["bytes"] / 1e9,
                 len(stats["bad"]))
    write_json_atomic(out / f"shard_{cfg.shard_index}_of_{cfg.num_shards}.json",
                      dict(stats, load_seconds=round(load_s, 1), skipped_valid=len(done)))
    return finish(cfg, log, out, records, params, params_hash, model_dir, text_cfg, stats, load_s, engine)


def finish(cfg, log, out, records, params, params_hash, model_dir, text_cfg, stats, load_s, engine):
    """Write the stage manifest once every sample of every shard is on disk."""
    present = [i for i in range(len(records)) if sample_path(out, i).exists()]
    missing = len(records) - len(present)
    if missing > len(stats["bad"]) and cfg.num_shards > 1:
        log.info("this shard is done; %d samples are left to other shards (manifest written by the last one)",
                 missing)
        return 0
    check = self_check(model_dir, text_cfg, out, present[:cfg.self_check_samples], log) \
        if cfg.self_check_samples and present else None
    total_tokens = sum(len(records[i]["input_ids"]) for i in present)
    write_manifest(out, "extract", params, layer_convention=LAYER_CONVENTION,
                   verifier_config={"num_hidden_layers": text_cfg.num_hidden_layers, "hidden_size": text_cfg.hidden_size,
                                    "vocab_size": getattr(text_cfg, "vocab_size", None)},
                   params_hash=params_hash,
                   counts={"samples": len(present), "samples_expected": len(records), "tokens": total_tokens,
                           "bad_samples": stats["bad"], "bytes": sum(sample_path(out, i).stat().st_size for i in present)},
                   timings={"model_load_seconds": round(load_s, 1), "extract_seconds": stats["seconds"],
                            "tokens_per_s_this_run": stats.get("tokens_per_s")},
                   self_check=check, engine=engine)
    log.info("wrote %s/manifest.json: %d/%d samples, %d tokens", out, len(present), len(records), total_tokens)
    if missing:
        log.warning("%d samples missing (bad or not extracted); re-run to retry them", missing)
    return 0


if __name__ == "__main__":
    run_main(main)
