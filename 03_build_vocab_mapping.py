#!/usr/bin/env python3
"""Stage 3: verifier vocabulary -> draft vocabulary from assistant-token frequencies.

Reads <work-dir>/prepared/; writes <work-dir>/vocab/d2t.npy (int64 offsets: target = draft + d2t),
t2d.npy (bool over the verifier vocab) and manifest.json (coverage, unique tokens, top tokens).
A draft vocab >= the verifier vocab writes no mapping and records "full vocabulary".
"""
from pathlib import Path

import numpy as np

from common.errors import UsageError, run_main
from common.prepare import load_prepared, verifier_written
from common.io import atomic_path, write_manifest
from common.models import load_tokenizer, open_verifier
from common.stage import ensure_writable, start
from common.vocab import count_assistant_tokens, coverage, mapping_arrays, select_draft_vocab


def main():
    cfg, log = start(3, "03_vocab", __doc__)
    prep_man, records = load_prepared(cfg.work_dir)
    model_dir, text_cfg = open_verifier(cfg, log)
    verifier_vocab = text_cfg.vocab_size
    out = Path(cfg.work_dir) / "vocab"
    if cfg.draft_vocab_size > verifier_vocab:  # a typo more likely than a wish for the full vocabulary
        raise UsageError(f"--draft-vocab-size {cfg.draft_vocab_size} exceeds the verifier's vocabulary of "
                         f"{verifier_vocab}; pass {verifier_vocab} for the full vocabulary (no mapping) or a smaller size")
    full = cfg.draft_vocab_size == verifier_vocab
    log.info("plan: %d prepared samples -> draft vocab %d of verifier vocab %d%s -> %s", len(records),
             cfg.draft_vocab_size, verifier_vocab, " (full vocabulary: no mapping)" if full else "", out)
    if cfg.dry_run:
        log.info("dry run: nothing written")
        return 0
    ensure_writable(out)
    counts = count_assistant_tokens(records)
    # --draft-vocab-from verifier: the verifier's own answers rank first (serving drafts its tokens, not a dataset's);
    # the dataset's answers break their ties and fill the rest. No regenerated answers: the same ranking as `all`.
    regenerated = prep_man["params"].get("regenerate", False)
    own = count_assistant_tokens(r for r in records if verifier_written(r, regenerated))
    top = [{"id": t, "count": c} for t, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:20]]
    tok = load_tokenizer(model_dir, trust_remote_code=cfg.trust_remote_code)
    for row in top:
        row["text"] = tok.decode([row["id"]])
    stats = {"assistant_tokens": sum(counts.values()), "unique_assistant_tokens": len(counts), "top_tokens": top}
    if full:
        for name in ("d2t.npy", "t2d.npy"):
            (out / name).unlink(missing_ok=True)  # a stale mapping must not survive
        stats.update(full_vocabulary=True, draft_vocab_size=verifier_vocab, coverage=1.0, padded_ids=0)
        log.info("draft vocab %d >= verifier vocab %d: full vocabulary, no mapping written",
                 cfg.draft_vocab_size, verifier_vocab)
    else:
        target_ids, pad = select_draft_vocab(counts, cfg.draft_vocab_size, verifier_vocab,
                                             own if cfg.draft_vocab_from == "verifier" else None)
        d2t, t2d = mapping_arrays(target_ids, verifier_vocab)
        for name, arr in (("d2t.npy", d2t), ("t2d.npy", t2d)):
            with atomic_path(out / name) as tmp:
                with open(tmp, "wb") as fh:
                    np.save(fh, arr)
        stats.update(full_vocabulary=False, draft_vocab_size=cfg.draft_vocab_size, padded_ids=pad,
                     coverage=round(coverage(counts, target_ids), 6), verifier_answer_tokens=sum(own.values()),
                     verifier_coverage=round(coverage(own, target_ids), 6) if own else None)
        if pad:
            log.info("only %d distinct assistant tokens seen: padded the draft vocab with the %d smallest unseen "
                     "ids (they will never be predicted usefully)", len(counts), pad)
        ranked = "the verifier's answers first" if cfg.draft_vocab_from == "verifier" and own else "every answer"
        of_own = (f"{100 * stats['verifier_coverage']:.2f}% of the {stats['verifier_answer_tokens']} in the verifier's "
                  "own answers" if own else "no answer is the verifier's own")
        log.info("%d unique assistant tokens; the draft vocab of %d (ranked by %s) covers %.2f%% of %d assistant "
                 "tokens (%s)", len(counts), cfg.draft_vocab_size, ranked, 100 * stats["coverage"],
                 stats["assistant_tokens"], of_own)
    params = {"draft_vocab_size": cfg.draft_vocab_size, "draft_vocab_from": cfg.draft_vocab_from,
              "verifier_vocab_size": verifier_vocab,
              "verifier": cfg.verifier, "prepared_sha256": prep_man["outputs"]["tokenized_data_sha256"]}
    write_manifest(out, "vocab", params, tokenizer=prep_man["tokenizer"], counts=stats)
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    run_main(main)
