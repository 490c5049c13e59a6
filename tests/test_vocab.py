"""Vocab mapping: offsets round-trip, coverage arithmetic, padding, full vocabulary, mismatch refusal."""
import json
from collections import Counter

import numpy as np

from common.vocab import coverage, mapping_arrays, select_draft_vocab
from conftest import run_script, usage_error, write_jsonl


def test_offsets_round_trip_and_ties():
    counts = Counter({50: 5, 7: 5, 3: 9, 99: 1, 12: 2})
    ids, pad = select_draft_vocab(counts, 3, 100)
    assert ids.tolist() == [3, 7, 50] and pad == 0  # 3 most frequent; tie 7/50 both kept, 12 loses to them
    ids2, _ = select_draft_vocab(Counter({50: 5, 7: 5, 3: 9}), 2, 100)
    assert ids2.tolist() == [3, 7]  # tie broken by the smaller id
    d2t, t2d = mapping_arrays(ids, 100)
    assert d2t.dtype == np.int64 and (np.arange(3) + d2t).tolist() == [3, 7, 50]  # target = draft + d2t
    assert t2d.dtype == bool and t2d.sum() == 3 and np.flatnonzero(t2d).tolist() == [3, 7, 50]
    assert abs(coverage(counts, ids) - (9 + 5 + 5) / 22) < 1e-12


def test_padding_when_fewer_tokens_seen():
    ids, pad = select_draft_vocab(Counter({5: 3, 2: 1}), 5, 10)
    assert pad == 3 and ids.tolist() == [0, 1, 2, 3, 5]  # smallest unseen ids fill the rest


def test_verifier_answers_rank_first():
    counts = Counter({1: 9, 2: 8, 3: 2, 4: 1})  # every answer: 1 and 2 lead
    own = Counter({3: 2, 4: 1, 2: 1})  # the verifier's own answers: 3 leads, then 2 and 4 tie (2 has more overall)
    assert select_draft_vocab(counts, 2, 10, own)[0].tolist() == [2, 3]
    assert select_draft_vocab(counts, 3, 10, own)[0].tolist() == [2, 3, 4]
    assert select_draft_vocab(counts, 2, 10, Counter())[0].tolist() == [1, 2]  # none regenerated: as `all`


def prepared_work(tmp_path, name="w"):
    rows = [{"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello hello!"}]},
            {"id": "b", "conversations": [{"from": "human", "value": "Yo"}, {"from": "gpt", "value": "Hello there."}]}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    work = tmp_path / name
    run_script("01_prepare_dataset.py", "--dataset", data, "--work-dir", work, "--no-shuffle", check=True)
    return work


def test_script_counts_padding_and_full_vocab(tmp_path, verifier_dir, tokenizer):
    work = prepared_work(tmp_path)
    rows = [json.loads(l) for l in (work / "prepared" / "tokenized_data.jsonl").read_text().splitlines()]
    masked = Counter(t for r in rows for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    proc = run_script("03_build_vocab_mapping.py", "--work-dir", work, "--draft-vocab-size", 4, check=True)
    assert "(no answer is the verifier's own)" in proc.output  # no regeneration: no second coverage figure
    man = json.loads((work / "vocab" / "manifest.json").read_text())
    d2t = np.load(work / "vocab" / "d2t.npy")
    top4 = sorted(sorted(masked, key=lambda t: (-masked[t], t))[:4])
    assert (np.arange(4) + d2t).tolist() == top4
    assert man["counts"]["unique_assistant_tokens"] == len(masked)
    assert abs(man["counts"]["coverage"] - sum(masked[t] for t in top4) / sum(masked.values())) < 1e-6
    assert man["counts"]["top_tokens"][0]["id"] == sorted(masked, key=lambda t: (-masked[t], t))[0]
    proc = run_script("03_build_vocab_mapping.py", "--work-dir", work, "--draft-vocab-size", 100, check=True)
    man = json.loads((work / "vocab" / "manifest.json").read_text())
    assert man["counts"]["padded_ids"] == 100 - len(masked) and "padded" in proc.output
    run_script("03_build_vocab_mapping.py", "--work-dir", work, "--draft-vocab-size", 49152, check=True)
    man = json.loads((work / "vocab" / "manifest.json").read_text())
    assert man["counts"]["full_vocabulary"] and not (work / "vocab" / "d2t.npy").exists()
    # larger than the verifier's vocabulary: a typo, refused before anything is written
    proc = run_script("03_build_vocab_mapping.py", "--work-dir", work, "--draft-vocab-size", 60000)
    usage_error(proc)
    assert "exceeds the verifier's vocabulary of 49152; pass 49152" in proc.stderr.strip().splitlines()[-1]
    assert json.loads((work / "vocab" / "manifest.json").read_text())["counts"]["full_vocabulary"]


def test_training_refuses_mismatched_vocab(tmp_path, verifier_dir):
    work = prepared_work(tmp_path)
    run_script("03_build_vocab_mapping.py", "--work-dir", work, "--draft-vocab-size", 16, check=True)
    # vocab built from other prepared data
    man_path = work / "vocab" / "manifest.json"
    man = json.loads(man_path.read_text())
    hs = work / "hidden_states"
    hs.mkdir()
    prep = json.loads((work / "prepared" / "manifest.json").read_text())
    (hs / "manifest.json").write_text(json.dumps({"stage": "extract", "status": "complete", "params": {
        "prepared_sha256": prep["outputs"]["tokenized_data_sha256"], "layer_ids": [2, 15, 27, 30]}}))
    proc = run_script("04_train.py", "--work-dir", work, "--draft-vocab-size", 32)
    assert proc.returncode == 2 and "re-run 03_build_vocab_mapping.py --draft-vocab-size 32" in proc.stderr
    man["tokenizer"]["vocab_hash"] = "0" * 16
    man_path.write_text(json.dumps(man))
    proc = run_script("04_train.py", "--work-dir", work, "--draft-vocab-size", 16)
    assert proc.returncode == 2 and "another tokenizer" in proc.stderr and "Traceback" not in proc.output
    man["params"]["prepared_sha256"] = "x"
    man_path.write_text(json.dumps(man))
    proc = run_script("04_train.py", "--work-dir", work, "--draft-vocab-size", 16)
    assert proc.returncode == 2 and "other prepared data" in proc.stderr


def test_script_ranks_the_verifiers_answers_first(tmp_path, verifier_dir):
    """Stage 1's regenerated samples (their ids without '#original') rank the draft vocab under
    --draft-vocab-from verifier; the dataset-answer twin only fills what is left."""
    import hashlib
    work = prepared_work(tmp_path)
    path, man_path = work / "prepared" / "tokenized_data.jsonl", work / "prepared" / "manifest.json"
    rows = [json.loads(l) for l in path.read_text().splitlines()]
    rows[1]["id"] += "#original"  # b: a dataset answer; a: the verifier's
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prep = json.loads(man_path.read_text())
    prep["params"]["regenerate"] = True
    prep["outputs"]["tokenized_data_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    man_path.write_text(json.dumps(prep))
    masked = [Counter(t for t, m in zip(r["input_ids"], r["loss_mask"]) if m) for r in rows]
    only_b = sorted(set(masked[1]) - set(masked[0]))
    size = len(masked[0])  # exactly the verifier's answer's distinct tokens
    run_script("03_build_vocab_mapping.py", "--work-dir", work, "--draft-vocab-size", size,
               "--draft-vocab-from", "verifier", check=True)
    man = json.loads((work / "vocab" / "manifest.json").read_text())
    kept = (np.arange(size) + np.load(work / "vocab" / "d2t.npy")).tolist()
    assert sorted(kept) == sorted(masked[0]) and man["params"]["draft_vocab_from"] == "verifier"
    assert man["counts"]["verifier_coverage"] == 1.0 and man["counts"]["verifier_answer_tokens"] == sum(masked[0].values())
    run_script("03_build_vocab_mapping.py", "--work-dir", work, "--draft-vocab-size", size, check=True)
    kept_all = (np.arange(size) + np.load(work / "vocab" / "d2t.npy")).tolist()
    total = masked[0] + masked[1]
    assert sorted(kept_all) == sorted(sorted(total, key=lambda t: (-total[t], t))[:size])
    assert set(kept_all) & set(only_b)  # `all` takes a token only the dataset's answer holds
