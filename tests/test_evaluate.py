"""Stage 5's breakdown of vLLM's per-request verify steps by prompt category and answer position."""
from types import SimpleNamespace

import pytest

from common.errors import UsageError
from common.evaluate import acceptance_breakdown, acceptance_row, markdown_table, prompt_categories


def test_breakdown_places_each_verify_step_where_its_drafts_start():
    # prompt a: the prefill gives answer token 0; steps start at positions 1, 3 (1 + 1 accepted + 1), 4
    steps, groups = [[1, 0, 3], [0, 2]], ["writing", "math"]
    out = acceptance_breakdown(steps, groups, k=3, bucket=2)
    assert out["by_position"] == {
        "0-1": {"drafts": 2, "acceptance_length": 1.5, "per_position_acceptance": [0.5, 0.0, 0.0]},
        "2-3": {"drafts": 2, "acceptance_length": 2.0, "per_position_acceptance": [0.5, 0.5, 0.0]},
        "4-5": {"drafts": 1, "acceptance_length": 4.0, "per_position_acceptance": [1.0, 1.0, 1.0]}}
    assert out["by_category"] == {
        "math": {"drafts": 2, "acceptance_length": 2.0, "per_position_acceptance": [0.5, 0.5, 0.0]},
        "writing": {"drafts": 3, "acceptance_length": 2.3333, "per_position_acceptance": [0.6667, 0.3333, 0.3333]}}
    assert "by_category" not in acceptance_breakdown(steps, ["", ""], k=3)  # prompts without categories
    assert acceptance_breakdown([[1], None], groups, k=3) is None  # an engine without per-request metrics
    row = {"num_speculative_tokens": 3, "acceptance_length": 2.2, "per_position_acceptance": [0.6, 0.4, 0.2],
           "draft_acceptance_rate": 0.4, "tokens_per_s": 1.0, "baseline_tokens_per_s": 1.0, "speedup": 1.0,
           "outputs_equal_baseline": 2, "prompts": 2, "breakdown": out}
    md = markdown_table([row], "test")
    assert "k=3 by prompt category" in md and "| writing | 3 | 2.333 | 0.667 / 0.333 / 0.333 |" in md
    assert "| 4-5 | 1 | 4.000 | 1.000 / 1.000 / 1.000 |" in md
    # this run's own prompts: the same steps grouped by the --dataset entry each prompt came from
    by_source = acceptance_breakdown(steps, ["packaged", "verifier-prompts"], k=3, bucket=2, group_key="by_source")
    assert by_source["by_source"]["verifier-prompts"] == out["by_category"]["math"] and "by_category" not in by_source
    md = markdown_table([dict(row, breakdown=by_source)], "test")
    assert "k=3 by prompt source (--dataset entry)" in md and "| packaged | 3 | 2.333 |" in md
    # by context length: prompt a of 1,020 tokens reaches 1K at its third step (1,020 + 4); prompt b has 5,000
    ctx = acceptance_breakdown(steps, groups, k=3, prompt_lens=[1020, 5000])["by_context"]
    assert list(ctx) == ["0-1K", "1K-4K", "4K-8K"], ctx
    assert [ctx[c]["drafts"] for c in ctx] == [2, 1, 2] and ctx["0-1K"]["acceptance_length"] == 1.5
    assert ctx["1K-4K"]["per_position_acceptance"] == [1.0, 1.0, 1.0] and ctx["4K-8K"]["acceptance_length"] == 2.0
    assert "k=3 by context length" in markdown_table([dict(row, breakdown={"by_context": ctx})], "test")


def test_concurrency_one_sits_beside_the_whole_batch_figure():
    counters = {"drafts": 4, "draft_tokens": 12, "accepted": 6, "per_pos": [3, 2, 1]}
    row = acceptance_row(3, [[1] * 10, [2] * 10], 2.0, counters, [[1] * 10, [2] * 9], 1.0, (30, 1.5), (40, 4.0))
    assert (row["tokens_per_s"], row["baseline_tokens_per_s"], row["speedup"]) == (10.0, 19.0, 0.526)
    assert (row["tokens_per_s_concurrency_1"], row["baseline_tokens_per_s_concurrency_1"],
            row["speedup_concurrency_1"]) == (20.0, 10.0, 2.0)
    assert row["outputs_equal_baseline"] == 1 and row["acceptance_length"] == 2.5
    assert "| 3 | 20.0 | 10.0 | 2.00x |" in markdown_table([row], "test")
    plain = acceptance_row(3, [[1]], 1.0, counters, [[1]], 1.0)  # --latency-prompts 0: not measured, not shown
    assert "speedup_concurrency_1" not in plain and "concurrency 1" not in markdown_table([plain], "test")


def test_mtbench_prompts_carry_their_eight_categories():
    key, cats = prompt_categories("mtbench")
    assert key == "by_category" and len(cats) == 80 and sorted(set(cats.values())) == [
        "coding", "extraction", "humanities", "math", "reasoning", "roleplay", "stem", "writing"]
    assert all(list(cats.values()).count(c) == 10 for c in set(cats.values()))


def test_validation_comparison_puts_the_verifiers_own_answers_beside_the_blend():
    import logging
    from common.evaluate import compare_with_training
    from common.prepare import validation_groups
    records = [{"id": "a_0"}, {"id": "a_0#original"}, {"id": "b_3"}, {"id": "b_3#original"}]
    assert validation_groups(records, [0, 1, 2], regenerated=True) == {"verifier answers": [0, 2],
                                                                      "dataset answers": [1]}
    assert validation_groups(records, [0, 2], regenerated=True) is None  # one kind only: nothing to split
    assert validation_groups(records, [0, 1], regenerated=False) is None  # no regeneration: all the dataset's
    best = {"full_acc_0": 0.5, "full_acc_1": 0.3, "full_acc_2": 0.1, "acceptance_length": 1.9,
            "groups": {"verifier answers": {"full_acc_0": 0.6, "full_acc_1": 0.4, "full_acc_2": 0.2},
                       "dataset answers": {"full_acc_0": 0.4, "full_acc_1": 0.2, "full_acc_2": 0.0}}}
    rows = [{"num_speculative_tokens": 2, "acceptance_length": 2.0, "per_position_acceptance": [0.6, 0.4]}]
    compare_with_training(rows, best, logging.getLogger("test"))
    assert rows[0]["trainer_simulated_acceptance_length"] == 1.8  # 1 + 0.5 + 0.3
    assert rows[0]["trainer_simulated_on_verifier_answers"] == 2.0  # 1 + 0.6 + 0.4: what vLLM serves
    assert rows[0]["trainer_full_accuracy_on_verifier_answers"] == [0.6, 0.4]


def test_a_saved_baseline_is_reused_only_for_the_same_verifier_prompts_and_settings(tmp_path, verifier_dir):
    """Stage 5 keeps the verifier's own decoding in eval/baseline.json (a draft engine that fails next, or a second
    draft, skips a model load: 22 minutes of 8 GPUs for Kimi-K2.5); any change to what that decoding depends on
    decodes again."""
    import os
    import shutil

    from common.config import parse_config
    from common.evaluate import baseline_key, load_baseline, save_baseline
    cfg = parse_config(5, "t", ["--max-new-tokens", "32"])
    prompts = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}]
    key = baseline_key(verifier_dir, cfg, prompts)
    assert load_baseline(tmp_path, key) is None  # nothing saved yet
    save_baseline(tmp_path, key, [[7, 8], [9]], 1.5, (3, 0.5))
    (tokens, seconds, single), when = load_baseline(tmp_path, key)
    assert (tokens, seconds, single) == ([[7, 8], [9]], 1.5, (3, 0.5)) and when[:4].isdigit()
    assert baseline_key(verifier_dir, cfg, prompts) == key  # the same inputs, the same key
    changed = [baseline_key(verifier_dir, parse_config(5, "t", ["--max-new-tokens", "33"]), prompts),
               baseline_key(verifier_dir, parse_config(5, "t", ["--max-new-tokens", "32", "--temperature", "0.7"]),
                            prompts),
               baseline_key(verifier_dir, parse_config(5, "t", ["--max-new-tokens", "32", "--latency-prompts", "2"]),
                            prompts),
               baseline_key(verifier_dir, cfg, prompts[:1]),
               baseline_key(verifier_dir, cfg, [{"prompt_token_ids": [1, 2, 4]}, prompts[1]])]
    copy = shutil.copytree(verifier_dir, tmp_path / "verifier")  # same files, another folder
    changed.append(baseline_key(copy, cfg, prompts))
    weights = next(p for p in copy.iterdir() if p.suffix == ".safetensors")
    before = baseline_key(copy, cfg, prompts)
    os.utime(weights, (weights.stat().st_atime, weights.stat().st_mtime + 60))  # the weights replaced
    changed.append(baseline_key(copy, cfg, prompts))
    assert changed[-1] != before and len({key, *changed}) == len(changed) + 1, changed
    assert all(load_baseline(tmp_path, k) is None for k in changed)
    (tmp_path / "baseline.json").write_text("{half written")
    assert load_baseline(tmp_path, key) is None  # a damaged file decodes again


def test_long_prompts_put_each_question_in_every_context_bucket_the_engine_reaches(tokenizer):
    """mtbench-long at SmolLM2's 8K: every MT-bench first turn alone (short), then after the same ShareGPT
    conversation cut to fill 1K-4K and 4K-8K with its answer (prompt + 256 new tokens stay inside the bucket),
    grouped per question so that --eval-limit keeps groups; at 5,120 the second context stops short of 5,120."""
    from common.evaluate import chat_ids, eval_prompts
    for seq, buckets in ((8192, {"1K-4K": (1024, 4096), "4K-8K": (4096, 8192)}),
                         (5120, {"1K-4K": (1024, 4096), "4K-8K": (4096, 5120)})):
        items = eval_prompts("mtbench-long", 0, tok=tokenizer, cfg=SimpleNamespace(max_seq_len=seq, max_new_tokens=256))
        cats = prompt_categories("mtbench-long", refs=[ref for ref, _ in items])[1]
        assert len(items) == 240 and [cats[ref] for ref, _ in items[:4]] == ["short", "1K-4K", "4K-8K", "short"]
        assert items[1][0] == f"{items[0][0]}@1K-4K"
        for ref, msgs in items:
            if cats[ref] == "short":
                question = msgs
                continue
            assert msgs[-1] == question[-1] and [m["role"] for m in msgs[:2]] == ["user", "assistant"]
            lo, hi = buckets[cats[ref]]
            n = len(chat_ids(tokenizer, msgs))
            assert lo <= n and n + 256 < hi, (ref, n)
        contexts = {cats[ref]: msgs[:-1] for ref, msgs in items[:3] if cats[ref] != "short"}
        assert contexts["4K-8K"][:len(contexts["1K-4K"])] == contexts["1K-4K"]  # one conversation: prefix cached
    with pytest.raises(UsageError, match="--max-seq-len 768 leaves no room for a question after 1,024 tokens"):
        eval_prompts("mtbench-long", 0, tok=tokenizer, cfg=SimpleNamespace(max_seq_len=768, max_new_tokens=256))


def test_the_serve_command_allows_what_was_measured():
    """Stage 5's serve command: the verifier's own context where acceptance at the farthest context measured (past
    the trained length) stays within 10% of 0-1K; otherwise the longest context measured; only the trained length
    where no long context was measured."""
    from common.evaluate import serve_context
    table = lambda far: {"0-1K": {"acceptance_length": 2.0}, "1K-4K": {"acceptance_length": 1.9},  # noqa: E731
                         "4K-8K": {"acceptance_length": far}}
    cap, why = serve_context(table(1.81), 7950, 768, 8192)
    assert cap == 8192 and "1.810 at 4K-8K against 2.000 at 0-1K (-9%), within 10%" in why
    cap, why = serve_context(table(1.78), 7950, 768, 8192)
    assert cap == 7950 and "(-11%): the serve command caps --max-model-len at 7,950" in why
    assert serve_context(table(1.95), 700, 768, 8192)[0] == 768  # measured no further than it trained
    cap, why = serve_context({"0-1K": {"acceptance_length": 2.0}}, 650, 768, 8192)
    assert cap == 768 and "no longer context measured" in why
    assert serve_context(None, 650, 768, 8192)[0] == 768  # an engine without per-request metrics


def test_served_steps_are_compared_where_both_sequences_agree():
    """A verify step counts when its k drafts lie inside the prefix the served output shares with the stored
    answer; each disagreement is listed with the draft's margin at the first position where the two differ."""
    from common.parity import NEAR_TIE, compare_steps, served_steps, verdict
    tokens = list(range(100, 120))  # prompt of 5 tokens, answer 15
    served = tokens[5:15] + [7, 7]  # the same for 10 tokens, then other tokens
    # steps start at answer positions 1, 3 (1 + 1 + 1), 4, 7 (4 + 2 + 1), 10: the last one's drafts lie past the
    # shared prefix; a step at answer position q drafts sequence position t = 5 + q first
    assert served_steps(tokens, 5, served, [1, 0, 2, 2, 0], 2) == [(6, 1), (8, 0), (9, 2), (12, 2)]
    predicted = {6: (1, [3.0, 0.2]), 8: (1, [0.3, 2.0]), 9: (2, [2.5, 1.5])}
    pairs = [(a, predicted[t], f"x@{t - 5}") for t, a in [(6, 1), (8, 0), (9, 2)]]
    c = compare_steps(pairs, 2)
    assert (c["steps"], c["agree"]) == (3, 2) and c["served_per_position"] == [0.6667, 0.3333]
    assert c["predicted_per_position"] == [1.0, 0.3333] and c["beyond_near_ties"] == 0
    assert c["disagreements"] == [{"step": "x@3", "served": 0, "predicted": 1, "margin": 0.3}]
    assert "at 1 of 3 verify steps (0 beyond near-ties" in verdict(c)  # 2 of 3: below 95%, whatever the margins
    many = pairs + [(1, (1, [2.0, 2.0]), f"y@{q}") for q in range(57)]  # 59 of 60 agree, the flip a near-tie
    assert verdict(compare_steps(many, 2)) == ""
    many[0] = (0, (1, [NEAR_TIE + 2, 0.1]), "x@1")  # a confident prediction vLLM did not accept: not numerics
    bad = compare_steps(many, 2)
    assert bad["beyond_near_ties"] == 1 and "likely causes" in verdict(bad)
    none = dict(compare_steps([], 2), prompts=1)  # a check that compared nothing does not pass
    assert none["steps"] == 0 and "compared no verify step (1 held-out samples" in verdict(none)
