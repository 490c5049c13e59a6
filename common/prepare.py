"""Stage 1 logic: select conversations, optionally regenerate answers with the verifier, tokenize."""
import hashlib
import json
import re
import time
from collections import Counter
from pathlib import Path

from common.chat import Skip, tokenize_conversation
from common.errors import UsageError
from common.io import atomic_path, read_manifest, sha256_file
from common.log import Progress

# --keep-original-answers: the id of a conversation kept with the dataset's own answer (beside its regenerated twin)
DATASET_ANSWER = "#original"
THINK_RE = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


REGEN_SETTINGS = ("temperature", "max_new_tokens", "repetition_penalty", "seed", "max_seq_len", "regenerate_chunk",
                  "chat_template")


def regen_settings(cfg, model_id):
    """What regeneration depends on, by name. The verifier by its resolved path: two different models can share
    file names and sizes, so only the path is a safe identity without hashing the weights."""
    return {"verifier_path": model_id, **{k: cfg[k] for k in REGEN_SETTINGS}}


def regen_key(settings):
    """Hash of regen_settings' values (in their order: the folder names of earlier runs): the folder name, so other
    settings never reuse a chunk."""
    return hashlib.sha256(json.dumps(list(settings.values())).encode()).hexdigest()[:16]


def other_regen_folders(out_dir, folder, settings):
    """-> one line naming the regen folders of other settings and, where they recorded theirs, what differs."""
    notes, path_only = [], False
    for other in sorted(p for p in Path(out_dir).glob("regen-*") if p.is_dir() and p != folder):
        try:
            theirs = json.loads((other / "settings.json").read_text())
        except (OSError, ValueError):  # made before the settings were recorded
            notes.append(f"{other.name}: settings not recorded")
            continue
        diff = [k for k, v in settings.items() if theirs.get(k) != v]
        path_only = path_only or diff == ["verifier_path"]
        notes.append(f"{other.name}: " + ", ".join(f"{k} {theirs.get(k)!r} (now {settings[k]!r})" for k in diff))
    if not notes:
        return None
    note = f"regeneration: chunks made with other settings ({'; '.join(notes)}) are kept but not reused"
    if path_only:  # a moved model cache, or a hub id against a local copy: the user knows whether it is one model
        note += f"; if both paths hold the same model, move that folder's chunk files into {folder.name} to reuse them"
    return note


def chunk_file(folder, c, chunk):
    """A chunk's file, named by its conversations: a larger --num-samples (the same shuffle, more of it)
    reuses every finished chunk it shares with an earlier run."""
    h = hashlib.sha256()
    for ref, msgs in chunk:
        h.update(ref.encode())
        h.update(json.dumps([m["content"] for m in msgs if m["role"] != "assistant"]).encode())
    return Path(folder) / f"chunk_{c:05d}-{h.hexdigest()[:12]}.jsonl"


def _chunk_round(llm, tok, cfg, chunk, answers, finishes, token_ids, turn, offset):
    """Generate the `turn`-th assistant answer of every conversation in the chunk that has one."""
    from vllm import SamplingParams

    prompts, params, where = [], [], []
    for j, (_, msgs) in enumerate(chunk):
        user_idx = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        if turn >= len(user_idx) or len(answers[j]) < turn or finishes[j][-1:] == ["too_long"]:
            continue
        history = _with_answers(msgs[:user_idx[turn] + 1], answers[j])
        ids = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=False)
        room = cfg.max_seq_len - len(ids)
        if room < 8:  # not even a short answer fits: stop this conversation here
            finishes[j].append("too_long")
            continue
        prompts.append({"prompt_token_ids": list(ids)})
        params.append(SamplingParams(temperature=cfg.temperature, max_tokens=min(cfg.max_new_tokens, room),
                                     repetition_penalty=cfg.repetition_penalty, seed=cfg.seed + offset + j))
        where.append(j)
    if not prompts:
        return 0
    outs = llm.generate(prompts, params, use_tqdm=False)
    for j, out in zip(where, outs):
        text = out.outputs[0].text
        if cfg.drop_reasoning:
            text = THINK_RE.sub("", text)
        answers[j].append(text)
        finishes[j].append(out.outputs[0].finish_reason)
        token_ids[j] = list(out.outputs[0].token_ids)  # the last turn's: what the verifier wrote, id for id
    return sum(len(o.outputs[0].token_ids) for o in outs)


def _with_answers(msgs, answers):
    out, k = [], 0
    for m in msgs:
        if m["role"] == "assistant":
            if k >= len(answers):
                break
            out.append({"role": "assistant", "content": answers[k]})
            k += 1
        else:
            out.append(m)
    return out


def regenerate(convs, tok, cfg, model_dir, out_dir, log, engine):
    """Replace assistant answers with the verifier's own, in resumable chunks on disk (`engine`: the stage's
    common.engine.LazyEngine, built only if a chunk is missing).

    Each chunk of `regenerate_chunk` conversations is written atomically as one JSONL file; a
    re-run loads finished chunks and generates only the missing ones, so a kill loses at most
    the chunk in flight. Returns (conversations, stats).
    """
    settings = regen_settings(cfg, model_dir)
    folder = Path(out_dir) / f"regen-{regen_key(settings)}"
    note = other_regen_folders(out_dir, folder, settings)  # a resume with another verifier, length, seed...
    if note:
        log.info("%s", note)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "settings.json").is_file():
        with atomic_path(folder / "settings.json") as tmp:
            tmp.write_text(json.dumps(settings, indent=1) + "\n")
    size = cfg.regenerate_chunk
    chunks = [convs[i:i + size] for i in range(0, len(convs), size)]
    files = [chunk_file(folder, c, chunk) for c, chunk in enumerate(chunks)]
    todo = [c for c in range(len(chunks)) if not files[c].is_file()]
    log.info("regeneration: %d conversations in %d chunks, %d already done (%s)", len(convs), len(chunks),
             len(chunks) - len(todo), folder)
    gen_tokens, t0 = 0, time.time()
    if todo:
        llm = engine.get()
        t0 = time.time()
        prog = Progress(len(todo), "regenerate", unit="chunks", interval=cfg.log_interval, extra_unit="tokens")
        for c in todo:
            chunk = chunks[c]
            answers, finishes, token_ids = [[] for _ in chunk], [[] for _ in chunk], [None] * len(chunk)
            turns = max(sum(m["role"] == "user" for m in msgs) for _, msgs in chunk)
            n = sum(_chunk_round(llm, tok, cfg, chunk, answers, finishes, token_ids, t, c * size)
                    for t in range(turns))
            gen_tokens += n
            with atomic_path(files[c]) as tmp:
                tmp.write_text("".join(json.dumps({"id": ref, "answers": a, "finish": f, "last_answer_ids": ids}) + "\n"
                                       for (ref, _), a, f, ids in zip(chunk, answers, finishes, token_ids)))
            prog.update(1, extra=n)
        prog.close()
    new_convs, finish = _apply_regenerated(convs, files, cfg)
    stats = {"folder": str(folder), "answers": sum(v for k, v in finish.items() if k != "too_long"),
             "prompts_too_long": finish.get("too_long", 0), "finish_reasons": dict(finish),
             "hit_length_cap": finish.get("length", 0), "generated_tokens_this_run": gen_tokens,
             "generation_seconds_this_run": round(time.time() - t0, 1)}
    log.info("regenerated answers: %d, hit the %d-token cap: %d (%.0f%%)", stats["answers"], cfg.max_new_tokens,
             stats["hit_length_cap"], 100 * stats["hit_length_cap"] / max(stats["answers"], 1))
    return new_convs, stats


def _apply_regenerated(convs, files, cfg):
    rows = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    out, finish = [], Counter()
    for (ref, msgs), row in zip(convs, rows):
        assert row["id"] == ref, "regeneration chunk out of order; delete the regen folder"
        finish.update(row["finish"])
        if cfg.drop_capped_answers and "length" in row["finish"]:
            out.append((ref, "regenerated_answer_capped"))
            continue
        new = _with_answers(msgs, row["answers"])
        if not new or new[-1]["role"] != "assistant":
            new = "prompt_too_long" if "too_long" in row["finish"] else "regeneration_empty"
        elif row.get("last_answer_ids") and not cfg.drop_reasoning and sum(m["role"] == "assistant" for m in new) == 1:
            new[-1]["token_ids"] = row["last_answer_ids"]  # single-turn: the sample keeps the verifier's own ids
        out.append((ref, new))
    return out, finish


def verifier_sample(tok, msgs, max_seq_len):
    """A single-turn regenerated conversation as the verifier produced it: the prompt as it was rendered for
    generation, then the answer's own token ids (ending in its end-of-turn token where it stopped; none after
    a capped answer, whose continuation is unknown). Re-tokenizing the answer's text can split it otherwise
    ("I" + "CS" written, "ICS" re-tokenized), and vLLM then serves token sequences training never saw.
    -> (ids, mask)."""
    prompt = list(tok.apply_chat_template([{k: m[k] for k in ("role", "content")} for m in msgs[:-1]],
                                          add_generation_prompt=True, tokenize=True, return_dict=False))
    ids = (prompt + list(msgs[-1]["token_ids"]))[:max_seq_len]
    return ids, [0] * len(prompt) + [1] * (len(ids) - len(prompt))


def tokenize_all(convs, tok, cfg, log, sources):
    """-> (records, skip Counter, truncated count, counts of answers kept as the verifier's token ids); each record
    names its prompt source (`sources`: {conversation id: --dataset entry})."""
    records, skips, truncated = [], Counter(), 0
    own = {"answers_as_verifier_token_ids": 0, "of_which_retokenize_differently": 0}
    prog = Progress(len(convs), "tokenize", interval=cfg.log_interval)
    for ref, msgs in convs:
        prog.update()
        if isinstance(msgs, str):  # dropped during regeneration, with its reason
            skips[msgs] += 1
            continue
        try:
            ids, mask, was_truncated = tokenize_conversation(
                tok, [{k: m[k] for k in ("role", "content")} for m in msgs], cfg.max_seq_len)
        except Skip as s:
            skips[s.reason] += 1
            continue
        if "token_ids" in msgs[-1]:
            own["answers_as_verifier_token_ids"] += 1
            text_ids = ids
            ids, mask = verifier_sample(tok, msgs, cfg.max_seq_len)
            own["of_which_retokenize_differently"] += text_ids[:len(ids)] != ids
        truncated += was_truncated
        records.append({"id": ref, "source": sources[conversation_id(ref)], "input_ids": ids, "loss_mask": mask})
    prog.close()
    if own["answers_as_verifier_token_ids"]:
        log.info("regenerated single-turn answers kept as the verifier's own token ids: %d (%d of them "
                 "re-tokenize differently from their text)", *own.values())
    return records, skips, truncated, own


def per_source(records, mix_stats):
    """Stage 1's mix rows completed with each source's kept samples and tokens."""
    for row in mix_stats:
        mine = [r for r in records if r.get("source") == row["source"]]
        row.update(samples=len(mine), tokens=sum(len(r["input_ids"]) for r in mine),
                   assistant_tokens=sum(sum(r["loss_mask"]) for r in mine))
    return mix_stats


def token_stats(records):
    lens = [len(r["input_ids"]) for r in records]
    assistant = Counter()
    for r in records:
        assistant.update(t for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    return {"samples": len(records), "total_tokens": sum(lens),
            "assistant_tokens": sum(assistant.values()), "unique_assistant_tokens": len(assistant),
            "max_len": max(lens, default=0), "mean_len": round(sum(lens) / max(len(lens), 1), 1)}


def load_prepared(work_dir):
    """The prepared samples, after checking stage 1's manifest and the data file's hash."""
    folder = Path(work_dir) / "prepared"
    man = read_manifest(folder, "prepare", "01_prepare_dataset.py")
    path = folder / man["outputs"]["tokenized_data"]
    if not path.is_file():
        raise UsageError(f"{path} missing though {folder}/manifest.json says complete; re-run 01_prepare_dataset.py")
    if sha256_file(path) != man["outputs"]["tokenized_data_sha256"]:
        raise UsageError(f"{path} changed after its manifest was written; re-run 01_prepare_dataset.py")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return man, records


def follow_stage1_length(cfg, prep_man, log):
    """--max-seq-len is the prepared data's (stage 1's manifest) unless this command line sets it: a config's shorter
    value would refuse stage 1's longer samples, and the serve command would cap the draft below what it trained on."""
    theirs = prep_man["params"]["max_seq_len"]
    if cfg.max_seq_len != theirs and cfg.source.get("max_seq_len") != "command line":
        log.info("--max-seq-len %d: stage 1's, which prepared the data (the %s says %d)", theirs,
                 cfg.source.get("max_seq_len", "default"), cfg.max_seq_len)
        cfg["max_seq_len"], cfg.source["max_seq_len"] = theirs, "stage 1's manifest"


def conversation_id(sample_id):
    """The conversation a sample comes from: a dataset-answer twin shares its regenerated sample's."""
    return sample_id.removesuffix(DATASET_ANSWER)


def split_by_conversation(records, present, val_fraction, seed):
    """Stage 4's fixed train/validation split of the samples `present` -> (train, val): a conversation's two
    answers stay on one side (common.train_data.split_samples)."""
    from common.train_data import split_samples
    return split_samples(present, val_fraction, seed, lambda i: conversation_id(records[i]["id"]))


def verifier_written(record, regenerated):
    """Whether a sample's answers are the verifier's own (regenerated), not a dataset's."""
    return regenerated and not record["id"].endswith(DATASET_ANSWER)


def validation_groups(records, val_idx, regenerated):
    """Held-out samples by whose answer they hold: the verifier's own (regenerated; what serving sees, so their
    simulated acceptance is the one vLLM should reproduce) or the dataset's. None unless both are present."""
    groups = {"verifier answers": [], "dataset answers": []}
    for i in val_idx:
        groups["verifier answers" if verifier_written(records[i], regenerated) else "dataset answers"].append(i)
    return groups if all(groups.values()) else None
