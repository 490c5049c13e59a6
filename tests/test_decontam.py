"""Every MT-bench turn is kept out of training, whichever way a prompt reaches stage 1: each of the 160 turns (both
turns of the 80 questions) is found by the decontamination index, and a prompt the verifier writes that repeats one
is dropped by the verifier-prompt judge (common/verifier_prompts.py), not kept as training data."""
from types import SimpleNamespace

from common.decontam import EvalPrompts
from common.sources import mtbench_questions
from common.verifier_prompts import _judge, degenerate


def turns():
    return [(f"{qid}/turn{t + 1}", text) for qid, ts, _ in mtbench_questions() for t, text in enumerate(ts)]


def test_all_160_turns_are_indexed():
    evals = EvalPrompts()
    every = turns()
    assert len(every) == 160
    assert [evals.overlaps(text) for _, text in every] == [qid for qid, _ in every]
    # quoted inside a longer request, as a user might paste one: every turn of 5 words or more (a 4-word turn such as
    # "Prove the Pythagorean theorem." inside another request is another prompt; alone it is caught above)
    long = [(qid, text) for qid, text in every if len(text.split()) >= 5]
    assert len(long) >= 155
    assert [evals.overlaps(f"Please help me with this. {text} Thanks!") for _, text in long] == [q for q, _ in long]


def test_a_written_prompt_that_repeats_an_mtbench_turn_is_dropped():
    evals, judged = EvalPrompts(), {}
    for qid, text in turns():
        out = SimpleNamespace(text=f" {text}\n", finish_reason="stop")
        why, _ = _judge(out, set(), evals)
        judged[qid] = why
    dropped = {qid for qid, why in judged.items() if why == "eval_prompt_overlap"}
    kept = [qid for qid, why in judged.items() if why is None]
    assert kept == [], kept  # no MT-bench turn survives the judge
    # every turn that is not dropped for its shape (too short: "Why?") is dropped as an evaluation prompt
    shaped = {qid for qid, text in turns() if degenerate(text, "stop")}
    assert dropped == {qid for qid, _ in turns()} - shaped and len(dropped) >= 150, (len(dropped), shaped)
    plain = SimpleNamespace(text="Write a short poem about the sea at night.", finish_reason="stop")
    assert _judge(plain, set(), evals)[0] is None
