"""What a measured acceptance length buys in decoding speed: measured on the machine that served it, and predicted for
the verifier a config targets (the served verifier itself at its tensor-parallel size).

At concurrency 1 decoding is memory-bound: a step costs about the bytes of weights it reads. A speculative round
reads the verifier once over k + 1 tokens and the draft `passes` times (EAGLE-3: k, one per drafted token; a block
draft: 1), and yields `AL` tokens on average, so

    speedup = AL / (r_verify + passes * c)      c = draft bytes / verifier bytes (one token)
                                                r_verify = verifier bytes for k + 1 tokens / for one token

r_verify is 1 for a dense verifier; a MoE verifier reads the union of the experts its k + 1 tokens route to
(expected E * (1 - (1 - topk/E)^(k+1)) of E, against topk for one token). Per-step fixed costs (kernel launches,
tensor-parallel all-reduces, the scheduler) are left out: they weigh on small models and make the real figure lower.
The same formula with the step times measured here (c = draft pass / verifier step) says what was served.
"""
import json
import struct
from pathlib import Path

def tensor_bytes(folder):
    """{tensor name: bytes} from the safetensors headers in `folder` (no weights read)."""
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, meta in header.items():
            if name != "__metadata__":
                start, end = meta["data_offsets"]
                out[name] = end - start
    return out


def _is_routed_expert(name):
    return ".experts." in name and "shared_expert" not in name


def verifier_bytes(folder, text_cfg):
    """-> {dense, routed, experts, topk}: bytes a decode step reads outside the routed experts (the input embedding
    excluded: one row), bytes of all routed experts, and the MoE's experts and experts per token (0 for a dense
    model)."""
    sizes = tensor_bytes(folder)
    routed = sum(b for n, b in sizes.items() if _is_routed_expert(n))
    dense = sum(b for n, b in sizes.items() if not _is_routed_expert(n) and "embed_tokens" not in n)
    if not any("lm_head" in n for n in sizes):  # tied embeddings: the output projection reads the embedding matrix
        dense += sum(b for n, b in sizes.items() if "embed_tokens" in n)
    experts = getattr(text_cfg, "n_routed_experts", None) or getattr(text_cfg, "num_experts", None) or \
        getattr(text_cfg, "num_local_experts", None) or 0
    return {"dense": dense, "routed": routed if experts else 0, "experts": experts if routed else 0,
            "topk": getattr(text_cfg, "num_experts_per_tok", 0) if routed else 0}


def draft_bytes(draft_dir):
    """Bytes one draft pass reads: every exported weight but the input embedding (one row per token)."""
    return sum(b for n, b in tensor_bytes(draft_dir).items() if "embed_tokens" not in n)


def step_bytes(v, tokens):
    """Bytes the verifier reads for one forward over `tokens` tokens at concurrency 1."""
    if not v["experts"]:
        return v["dense"]
    per_expert = v["routed"] / v["experts"]
    touched = v["experts"] * (1 - (1 - v["topk"] / v["experts"]) ** tokens)
    return v["dense"] + per_expert * touched


def predict(al, k, passes, v, draft):
    """-> the bytes model's inputs and predicted speedup for acceptance length `al` at k drafted tokens."""
    one = step_bytes(v, 1)
    r, c = step_bytes(v, k + 1) / one, draft / one
    return {"acceptance_length": round(al, 4), "k": k, "draft_passes": passes, "verifier_gb_per_token": round(one / 1e9, 4),
            "draft_gb_per_pass": round(draft / 1e9, 4), "c": round(c, 4), "r_verify": round(r, 4),
            "predicted_speedup": round(al / (r + passes * c), 3)}


def measured(single, base_single, k, passes):
    """From the concurrency-1 runs (tokens, seconds, verify steps): the verifier's seconds per token, the speculative
    round's seconds, the draft pass they imply (round - one verifier step, over the passes) and the formula's
    speedup with those measured costs, beside the speedup measured. None when either run is missing."""
    if not single or not base_single or len(single) < 3 or not single[2]:
        return None
    tokens, seconds, rounds = single
    t_verify = base_single[1] / base_single[0]
    t_round = seconds / rounds
    al = tokens / rounds
    t_draft = max(t_round - t_verify, 0.0) / passes
    return {"verifier_ms_per_step": round(1e3 * t_verify, 3), "round_ms": round(1e3 * t_round, 3),
            "draft_ms_per_pass": round(1e3 * t_draft, 3), "c": round(t_draft / t_verify, 4),
            "acceptance_length_concurrency_1": round(al, 4), "formula_speedup": round(al * t_verify / t_round, 3),
            "measured_speedup": round((tokens / seconds) / (base_single[0] / base_single[1]), 3)}


def speedup_lines(s):
    """report.md's section from the row's `speedup_model`."""
    p, m = s["predicted"], s.get("measured")
    lines = ["", "Speedup at concurrency 1: speedup = AL / (r_verify + passes x c), memory-bound decoding (common/"
                 "speedup.py): c = draft bytes / verifier bytes per token as stored, r_verify = verifier bytes for k + 1 "
                 "tokens / for one (MoE: the union of experts the tokens route to)", "",
             "| | AL | k | draft passes | verifier GB/token | draft GB/pass | c | r_verify | speedup |",
             "|---|---|---|---|---|---|---|---|---|",
             f"| predicted for {s['target']} | {p['acceptance_length']:.3f} | {p['k']} | {p['draft_passes']} | "
             f"{p['verifier_gb_per_token']:.3f} | {p['draft_gb_per_pass']:.3f} | {p['c']:.3f} | {p['r_verify']:.2f} | "
             f"{p['predicted_speedup']:.2f}x |"]
    if m:
        lines += ["", f"Measured on {s['machine']} ({s['dtype']}), the first prompts one at a time: verifier step "
                      f"{m['verifier_ms_per_step']:.2f} ms, speculative round {m['round_ms']:.2f} ms, draft pass "
                      f"{m['draft_ms_per_pass']:.2f} ms (c = {m['c']:.3f}), acceptance length "
                      f"{m['acceptance_length_concurrency_1']:.3f}: formula {m['formula_speedup']:.2f}x, measured "
                      f"{m['measured_speedup']:.2f}x. Where c measured is far above the bytes model's, per-step "
                      f"fixed costs dominate: a small verifier on a fast GPU, or a CPU."]
    else:
        lines += ["", "Measured step costs: not measured (--latency-prompts 0)."]
    return lines


def machine_name():
    """The GPU's name (nvidia-smi: no CUDA initialised here, vLLM still forks its workers), else the CPU's model."""
    from common.engine import nvidia_smi, visible_gpus
    gpus = visible_gpus(nvidia_smi("index", "name"))
    if gpus:
        return gpus[0][1]
    import os

    from common.precision import cpu_identity
    model, isa = cpu_identity().split(" | ")[:2]
    kind = next((name for flag, name in (("amx", "AMX"), ("avx512_bf16", "AVX-512-BF16"), ("avx512f", "AVX-512"),
                                         ("avx2", "AVX2")) if flag in isa), "no AVX2")  # the machine kind
    return f"{model} ({kind}), {os.cpu_count()} cores"


def speedup_model(cfg, text_cfg, model_dir, draft_dir, k, passes, al, single, base_single, dtype):
    """Stage 5's row entry: the bytes model's prediction for the served verifier at its TP, and what was measured."""
    return {"target": f"{cfg.verifier} at TP={cfg.tensor_parallel_size}", "machine": machine_name(), "dtype": dtype,
            "predicted": predict(al, k, passes, verifier_bytes(model_dir, text_cfg), draft_bytes(draft_dir)),
            "measured": measured(single, base_single, k, passes)}
