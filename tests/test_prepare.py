"""01_prepare_dataset.py end to end on small real inputs: counts, skips, bad input, dry run."""
import json

from conftest import run_script, write_jsonl

GOOD = [
    {"id": "a", "conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi!"}]},
    {"id": "b", "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
                             {"role": "assistant", "content": "4"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hello."}]},  # dup
    {"id": "d", "conversations": []},  # empty
    {"id": "e", "conversations": [{"from": "human", "value": "alone"}]},  # no assistant
    {"id": "f", "messages": [{"role": "user", "content": "x"}, {"role": "narrator", "content": "y"}]},  # unknown
    {"id": "g", "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]},  # tool role
]


def prepare(tmp_path, data, *extra):
    return run_script("01_prepare_dataset.py", "--dataset", data, "--work-dir", tmp_path / "w", "--no-shuffle",
                      "--max-seq-len", 256, *extra)


def test_counts_and_skips(tmp_path, verifier_dir, tokenizer):
    proc = prepare(tmp_path, write_jsonl(tmp_path / "d.jsonl", GOOD))
    assert proc.returncode == 0, proc.output
    out = tmp_path / "w" / "prepared"
    rows = [json.loads(l) for l in (out / "tokenized_data.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b"]
    masked = [tokenizer.decode([t for t, m in zip(r["input_ids"], r["loss_mask"]) if m]) for r in rows]
    assert masked == ["Hi!<|im_end|>", "4<|im_end|>"]
    man = json.loads((out / "manifest.json").read_text())
    assert man["status"] == "complete" and man["stage"] == "prepare"
    c = man["counts"]
    assert c["records_read"] == 7 and c["samples"] == 2
    assert c["dropped"] == {"duplicate": 1, "empty": 1, "no_assistant": 1, "unknown_role": 1, "tool_role": 1}
    assert c["total_tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert c["assistant_tokens"] == sum(sum(r["loss_mask"]) for r in rows)
    assert man["tokenizer"]["vocab_size"] == 49152 and man["tokenizer"]["chat_template_hash"]


def test_packaged_sharegpt_recovers_complete_conversations(tmp_path):
    from common.sources import iter_packaged
    n = sum(1 for _ in iter_packaged())
    assert 17000 < n < 18500  # the file is cut off part-way; every complete record is recovered


def test_num_samples_and_dry_run(tmp_path, verifier_dir):
    proc = run_script("01_prepare_dataset.py", "--work-dir", tmp_path / "w", "--num-samples", 5, "--dry-run")
    assert proc.returncode == 0, proc.output
    assert "dry run" in proc.output and not (tmp_path / "w").exists()
    proc = run_script("01_prepare_dataset.py", "--work-dir", tmp_path / "w", "--num-samples", 5, "--max-turns", 1)
    assert proc.returncode == 0, proc.output
    man = json.loads((tmp_path / "w" / "prepared" / "manifest.json").read_text())
    assert man["counts"]["selected"] == 5 and 3 <= man["counts"]["samples"] <= 5


def assert_clean_error(proc, *needles):
    assert proc.returncode == 2, proc.output
    assert "Traceback" not in proc.output
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), proc.stderr
    for n in needles:
        assert n in err[0], err[0]


def test_bad_inputs_fail_cleanly_and_keep_existing_output(tmp_path):
    out = tmp_path / "w" / "prepared"
    out.mkdir(parents=True)
    (out / "tokenized_data.jsonl").write_text("previous\n")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(json.dumps(GOOD[0]) + "\n{not json\n")
    assert_clean_error(prepare(tmp_path, bad_json), f"{bad_json}:2", "malformed JSON")
    missing = write_jsonl(tmp_path / "missing.jsonl", [GOOD[0], {"id": "x", "text": "hello"}])
    assert_clean_error(prepare(tmp_path, missing), f"{missing}:2", "neither 'conversations'")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(json.dumps(GOOD[0]).encode() + b"\n" + '{"conversations": "caf\xe9"}'.encode("latin-1") + b"\n")
    assert_clean_error(prepare(tmp_path, latin), f"{latin}:2", "UTF-8")
    assert_clean_error(prepare(tmp_path, tmp_path / "nope.jsonl"), "nope.jsonl", "not found")
    empty = write_jsonl(tmp_path / "empty.jsonl", [GOOD[3], GOOD[4]])
    assert_clean_error(prepare(tmp_path, empty), "no usable conversation")
    offline = run_script("01_prepare_dataset.py", "--dataset", "no-such-org/no-such-dataset-xyz", "--work-dir",
                         tmp_path / "w", env={"HF_HUB_OFFLINE": "1"})
    assert_clean_error(offline, "cannot load HF dataset", "Offline?")
    alone = run_script("01_prepare_dataset.py", "--dataset", write_jsonl(tmp_path / "ok.jsonl", GOOD[:1]),
                       "--work-dir", tmp_path / "w", "--keep-original-answers")
    assert_clean_error(alone, "--keep-original-answers", "add --regenerate, or --no-keep-original-answers")
    assert (out / "tokenized_data.jsonl").read_text() == "previous\n"  # nothing already written is lost
