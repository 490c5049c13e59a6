"""What an acceptance length buys on a verifier large enough for speculation to pay, measured with a stand-in.

No package on the registries we reach ships the weights of a real 7-8B instruction model in a size the lent GPU can
receive (docs/gpu.md), so the verifier here is a model of Llama-3.1-8B's shape with random weights (vLLM's dummy
loader, SmolLM2's tokenizer) and the draft an EAGLE-3.1 draft of its shape with random weights (exported by our own
code). Random weights accept next to nothing, so what this measures is the cost side, at concurrency 1 in the dtype
users serve (bf16): the verifier's step alone, and a speculative round (one verify over k + 1 tokens plus k draft
passes). The acceptance length comes from a real run (--al, or --run's eval/acceptance.json):

    speedup(AL) = AL x (seconds per plain step) / (seconds per speculative round)

the formula stage 5 reports (common/speedup.py) with both costs measured on this machine. A round that accepts more
is not slower to first order (the same verify and draft passes), so this predicts the speedup a draft of that
acceptance gives this verifier here. The measured speedup of the random pair is printed as well, for what it is.

    python bench/gpu_speedup_standin.py --run runs/gpu               # on the GPU: 8B shape, k = 3, bf16
    python bench/gpu_speedup_standin.py --shape tiny --al 2.1        # any machine: the code path, in a minute
"""
import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # hidden, layers, heads, kv heads, MLP; Llama-3.1-8B's and a tiny one for a quick run of the code path
    "8b": (4096, 32, 32, 8, 14336),
    "tiny": (256, 8, 4, 2, 512),
}


def build_verifier(folder, shape, source):
    """Llama config of `shape` + the embedded SmolLM2's tokenizer in `folder` (no weights: vLLM's dummy loader)."""
    hidden, layers, heads, kv, mlp = SHAPES[shape]
    conf = json.loads((source / "config.json").read_text())
    conf.update(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                intermediate_size=mlp, head_dim=hidden // heads, tie_word_embeddings=False, torch_dtype="bfloat16",
                max_position_embeddings=8192, rope_theta=500000.0)
    conf.pop("rope_scaling", None)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(conf, indent=1))
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "vocab", "merges", "chat_template")):
            shutil.copy(f, folder / f.name)
    return conf


def build_draft(folder, conf, k):
    """An EAGLE-3.1 draft of the verifier's shape, random weights, exported as stage 4 exports (speculators layout)."""
    import torch
    from transformers import AutoConfig

    from common.drafts.eagle3 import DraftGeometry, Eagle3Draft
    from common.export import export_draft
    n = conf["num_hidden_layers"]
    g = DraftGeometry(hidden_size=conf["hidden_size"], num_heads=conf["num_attention_heads"],
                      num_kv_heads=conf["num_key_value_heads"], head_dim=conf["head_dim"],
                      intermediate_size=conf["intermediate_size"], rms_norm_eps=conf["rms_norm_eps"],
                      rope_theta=conf["rope_theta"], max_position_embeddings=conf["max_position_embeddings"],
                      verifier_vocab_size=conf["vocab_size"], draft_vocab_size=min(32000, conf["vocab_size"]),
                      fc_norm=True, norm_output=True)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Eagle3Draft(g).to(torch.bfloat16)
    model.d2t.zero_()  # draft token i is verifier token i
    cfg = SimpleNamespace(export_format="speculators", ttt_steps=k)
    verifier_config = AutoConfig.from_pretrained(folder.parent / "verifier")
    export_draft(model, folder, cfg, [2, n // 2, n - 3], str(folder.parent / "verifier"), verifier_config, {})
    return sum(p.numel() for n_, p in model.named_parameters() if not n_.startswith(("embed", "verifier_")))


def measure(verifier, cfg, prompts, tokens, speculative=None):
    """-> (tokens, seconds, rounds) of the prompts decoded one at a time (greedy, no stop at end of text)."""
    from vllm import SamplingParams

    from common.engine import close_llm, make_llm
    from common.generation import one_at_a_time
    extra = {"disable_log_stats": False, "load_format": "dummy"}
    if speculative:
        extra["speculative_config"] = speculative
    llm = make_llm(str(verifier), cfg, max_model_len=2048, dtype="bfloat16", **extra)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    one_at_a_time(llm, prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up, not timed
    out = one_at_a_time(llm, prompts, params)
    close_llm(llm)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per round (default 3, as stage 5 serves)")
    ap.add_argument("--al", type=float, help="acceptance length to price (default: --run's, at k)")
    ap.add_argument("--run", type=Path, help="a finished run whose eval/acceptance.json gives the acceptance length")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256, help="tokens decoded per prompt")
    ap.add_argument("--work", type=Path, help="folder for the stand-in models (default: a temporary one)")
    args = ap.parse_args()
    al = args.al
    if al is None:
        if not args.run or not (args.run / "eval" / "acceptance.json").is_file():
            ap.error("give --al, or --run with a finished stage 5 (eval/acceptance.json)")
        rows = json.loads((args.run / "eval" / "acceptance.json").read_text())["results"]
        al = next(r["acceptance_length"] for r in rows if r["num_speculative_tokens"] == args.k)

    from common.config import parse_config
    from common.models import resolve_verifier
    from common.speedup import machine_name
    cfg = parse_config(5, "", ["--config", "configs/smollm2-135m.yaml", "--no-needs-gpu"])
    work = args.work or Path(tempfile.mkdtemp(prefix="standin-"))
    conf = build_verifier(work / "verifier", args.shape, Path(resolve_verifier(cfg.verifier)))
    t0 = time.time()
    draft_params = build_draft(work / "draft", conf, args.k)
    print(f"stand-in: verifier {args.shape} shape ({conf['num_hidden_layers']} layers, hidden {conf['hidden_size']}, "
          f"vocab {conf['vocab_size']}, random weights), EAGLE-3.1 draft {draft_params / 1e6:.0f}M parameters "
          f"(built in {time.time() - t0:.0f} s); k = {args.k}; {args.prompts} prompts x {args.tokens} tokens, "
          f"one at a time, bf16, on {machine_name()}", flush=True)
    from common.evaluate import chat_ids, eval_prompts
    from common.models import load_tokenizer
    tok = load_tokenizer(work / "verifier")
    prompts = [{"prompt_token_ids": chat_ids(tok, m)} for _, m in eval_prompts("mtbench", args.prompts)]
    spec = {"method": "eagle3", "model": str(work / "draft"), "num_speculative_tokens": args.k}
    base = measure(work / "verifier", cfg, prompts, args.tokens)
    drafted = measure(work / "verifier", cfg, prompts, args.tokens, spec)
    t_step, t_round = base[1] / base[0], drafted[1] / drafted[2]
    print(f"plain decoding: {base[0]} tokens in {base[1]:.2f} s, {1e3 * t_step:.2f} ms a step "
          f"({base[0] / base[1]:.0f} tokens/s)")
    print(f"speculative (random draft): {drafted[0]} tokens in {drafted[1]:.2f} s over {drafted[2]} rounds, "
          f"{1e3 * t_round:.2f} ms a round = {t_round / t_step:.2f} plain steps; its own acceptance length "
          f"{drafted[0] / drafted[2]:.3f}, measured speedup {(drafted[0] / drafted[1]) / (base[0] / base[1]):.2f}x")
    print(f"predicted at acceptance length {al:.3f}: speedup = AL x step / round = {al * t_step / t_round:.2f}x "
          f"(break-even at AL {t_round / t_step:.2f})")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
