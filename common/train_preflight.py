"""Stage 4's checks before the verifier's pieces load and training starts: its input manifests agree with each other,
the export's package is installed, one micro-batch fits in memory, the checkpoints fit on disk."""
import importlib.util
import os
from pathlib import Path

import torch

from common.drafts import method_of, method
from common.errors import UsageError
from common.io import free_disk, read_manifest
from common.prepare import load_prepared


def read_inputs(cfg):
    """Stage manifests of extraction and vocab, cross-checked: same prepared data, same tokenizer."""
    work = Path(cfg.work_dir)
    prep_man, records = load_prepared(work)
    hs_man = read_manifest(work / "hidden_states", "extract", "02_extract_hidden_states.py")
    voc_man = read_manifest(work / "vocab", "vocab", "03_build_vocab_mapping.py")
    sha = prep_man["outputs"]["tokenized_data_sha256"]
    if hs_man["params"]["prepared_sha256"] != sha:
        raise UsageError(f"{work}/hidden_states was extracted from other prepared data; re-run 02_extract_hidden_states.py")
    if voc_man["params"]["prepared_sha256"] != sha:
        raise UsageError(f"{work}/vocab was built from other prepared data; re-run 03_build_vocab_mapping.py")
    if voc_man["tokenizer"]["vocab_hash"] != prep_man["tokenizer"]["vocab_hash"]:
        raise UsageError(f"{work}/vocab was built for another tokenizer; re-run 03_build_vocab_mapping.py")
    want = voc_man["counts"]["draft_vocab_size"]
    if not voc_man["counts"]["full_vocabulary"] and cfg.draft_vocab_size != want:
        raise UsageError(f"--draft-vocab-size {cfg.draft_vocab_size} but {work}/vocab holds a {want}-token mapping; "
                         f"re-run 03_build_vocab_mapping.py --draft-vocab-size {cfg.draft_vocab_size}")
    layer_ids = hs_man["params"]["layer_ids"]
    if cfg.layer_ids and list(cfg.layer_ids) != layer_ids:
        raise UsageError(f"--layer-ids {cfg.layer_ids} but the hidden states hold layers {layer_ids}; re-extract")
    return prep_man, records, hs_man, voc_man, layer_ids


def micro_batch_memory(cfg, g, longest_doc, device):
    """-> (bytes one micro-batch needs, as its method estimates them; bytes free on the device or None)."""
    return method(g.method).memory(g, cfg, longest_doc, device), available_memory(device)


def refuse_oversized(cfg, need, have, device):
    if have is not None and need > 0.9 * have:
        raise UsageError(f"one micro-batch of {cfg.max_tokens_per_step} tokens needs ~{need / 1e9:.1f} GB but "
                         f"{device} has {have / 1e9:.1f} GB free; lower --max-tokens-per-step (and raise --grad-accum)")


def checkpoint_disk(cfg, trainable, steps, epochs, out):
    """Refuse a run whose checkpoints cannot all be on disk at once: each holds the fp32 weights and both AdamW
    moments (12 bytes a trainable parameter; 42 GB for z-lab's 6-layer Kimi DFlash geometry), and at the worst
    moment the folder holds --keep-last of them, the best, and the one being written. steps, epochs: what the run
    reaches. Checkpoints already there (a resume) count as written. -> bytes one checkpoint takes."""
    size = 12 * trainable
    saves = epochs + (steps // cfg.save_every if cfg.save_every else 0)  # one per epoch, or where it stops
    slots = min(saves, cfg.keep_last + 2)
    folder = Path(out) / "checkpoints"
    there = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0
    need = max(0, slots * size - there) + 2 * trainable  # and the exported draft, in bf16
    probe, free = free_disk(out)
    if need > free:
        raise UsageError(f"{slots} checkpoints of ~{size / 1e9:.1f} GB each (--keep-last {cfg.keep_last}, the best, "
                         f"the one being written) and the export need ~{need / 1e9:.1f} GB but {probe} has "
                         f"{free / 1e9:.1f} GB free; lower --keep-last, free space, or point --work-dir elsewhere")
    return size


def require_speculators(cfg):
    """The export builds its config with speculators' own classes: without the package, training would end in a crash."""
    needs = method_of(cfg).needs_speculators
    if (needs or cfg.export_format == "speculators") and not importlib.util.find_spec("speculators"):
        raise UsageError(f"{f'--draft-method {cfg.draft_method}' if needs else '--export-format speculators'} "
                         f"exports with the speculators package, which this environment lacks; run scripts/setup_env.sh "
                         f"(or pip install speculators==0.9.0 --no-deps)" + ("" if needs else
                                                                             ", or use --export-format eagle"))


def available_memory(device):
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
