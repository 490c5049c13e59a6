"""Draft vocabulary: the most frequent assistant tokens, as vLLM/speculators d2t and t2d arrays.

d2t[draft_id] = target_id - draft_id (int64 offsets; vLLM crashes on absolute ids);
t2d[target_id] = True if the token is in the draft vocabulary (bool over the verifier vocab).
"""
from collections import Counter

import numpy as np


def count_assistant_tokens(records):
    counts = Counter()
    for r in records:
        counts.update(t for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    return counts


def select_draft_vocab(counts, draft_vocab, verifier_vocab, first=None):
    """-> (sorted target ids of the draft vocab, number of padding ids added).

    Most frequent first (by `first`'s counts where given, then by `counts`), ties broken by the smaller id;
    when fewer distinct tokens were seen than the draft vocab holds, the smallest unseen ids fill it
    (deterministic padding).
    """
    bad = [t for t in counts if not 0 <= t < verifier_vocab]
    if bad:
        raise ValueError(f"token ids {bad[:5]} outside the verifier vocabulary of {verifier_vocab}")
    first = first or Counter()
    ranked = sorted(counts, key=lambda t: (-first[t], -counts[t], t))[:draft_vocab]
    chosen = set(ranked)
    pad = draft_vocab - len(chosen)
    if pad:
        fill = (t for t in range(verifier_vocab) if t not in chosen)
        chosen.update(next(fill) for _ in range(pad))
    return np.array(sorted(chosen), dtype=np.int64), pad


def mapping_arrays(target_ids, verifier_vocab):
    d2t = target_ids - np.arange(len(target_ids), dtype=np.int64)
    t2d = np.zeros(verifier_vocab, dtype=bool)
    t2d[target_ids] = True
    return d2t, t2d


def coverage(counts, target_ids):
    total = sum(counts.values())
    kept = sum(counts[t] for t in target_ids.tolist() if t in counts)
    return kept / total if total else 0.0
