#!/usr/bin/env python3
"""Training-step throughput: our draft step versus speculators 0.9.0's (Eagle3DraftModel, or DFlashDraftModel with
--method dflash), same inputs.

Synthetic but realistic packed batches: documents of 200..2048 tokens, ~60% loss mask, random
(never zero) hidden states. Times forward + backward + AdamW step, median of --steps after
--warmup, synchronised on CUDA around each step; on CUDA also as a training loop runs (no sync
between steps, GPU time per step from CUDA events). Prints one table and writes JSON.

  python bench/train_throughput.py --geometry smollm2 --tokens 2048 --draft-vocab 4096      # CPU
  python bench/train_throughput.py --geometry kimi --draft-vocab 32000 --tokens 4096 8192 16384 --device cuda
  python bench/train_throughput.py --method dflash --block-size 8 --draft-layers 2 --geometry kimi ... --check

--check (GPU) also measures each implementation's own bf16-autocast gradients against its fp32 ones from the same
weights, batch and anchors: how far bf16 moves a gradient is a property of the batch, not only of our code.

Variants of ours (--variants): "sdpa" = eager, per-document SDPA; "flex" = flex attention; "flex+compile"
= flex attention plus compiled norms/SwiGLU/RoPE (what 04_train.py runs on a GPU by default).
MFU counts the standard algorithm's FLOPs (every position, every TTT step; flops_per_token below) for
every implementation, so it compares wall time on equal work; ours skips part of that work.
"""
import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.drafts import layers  # noqa: E402
from common.drafts.eagle3 import DraftGeometry, Eagle3Draft, optimize_bf16  # noqa: E402
from common.drafts.layers import take_embedding  # noqa: E402
from common.precision import use_bf16  # noqa: E402
from dflash_step import dflash_main  # noqa: E402
from step_common import (GEOMETRIES, bf16_gradient_gap, fp32_batch, make_batch, matmul_ceiling, profile, timed,  # noqa: E402
                         timed_pipelined)


def flops_per_token(g, ttt, mask_frac=0.6):
    """Training FLOPs per packed token of the standard EAGLE-3 step (all positions at every TTT step).

    per TTT step, forward multiply-adds: q/k/v 2H x (Hq + 2 Hkv) hd, o Hq hd x H, MLP 3 H I,
    draft lm_head H x V_draft; attention 2 x Hq hd x (mean causal context), context ~ doc/2 ~ 500.
    backward = 2x forward for trainable weights; the frozen lm_head needs only its input gradient (1x).
    once: fc 3H x H (trainable, x3), verifier head H x V_draft at masked positions (forward only).
    """
    H, hd, I, V = g.hidden_size, g.head_dim, g.intermediate_size, g.draft_vocab_size
    layer = 2 * H * (g.num_heads + 2 * g.num_kv_heads) * hd + g.num_heads * hd * H + 3 * H * I
    attn = 2 * g.num_heads * hd * 500
    per_step = 3 * (layer + attn) + 2 * H * V
    return 2 * (ttt * per_step + 3 * 3 * H * H + mask_frac * H * V)


def new_draft(g):
    """Random draft whose verifier head equals its lm_head, as build_model makes it."""
    model = Eagle3Draft(g)
    with torch.no_grad():
        model.verifier_lm_head.weight.copy_(model.lm_head.weight)
    return model


def ours(g, batch, device, args, variant="flex+compile"):
    os.environ["EAGLE3_ATTN"] = "sdpa" if variant == "sdpa" else "flex"
    model = new_draft(g)
    if device.type == "cuda":  # as 04_train.py: the loader looks the tokens up in host memory
        embed = take_embedding(model, torch.bfloat16 if args.bf16 else torch.float32)
        batch = dict(batch, embeds=embed[batch["ids"].cpu()].to(device))
    model = model.to(device)
    if args.bf16:
        optimize_bf16(model, compile_layers="compile" in variant and device.type == "cuda")
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=1e-4, fused=device.type == "cuda")
    ctx = torch.autocast(device.type, torch.bfloat16, enabled=args.bf16)

    def step():
        with ctx:
            loss, _ = model(batch, args.ttt, 0.8)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.trainable_parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def numerical_check(g, batch, device, args):
    """Loss and gradients of the optimised step vs the plain one (eager SDPA), both bf16 autocast,
    and vs fp32 eager, from the same weights: relative errors printed."""
    out = {}
    torch.manual_seed(0)
    base = new_draft(g)
    for name, variant, amp in (("fp32 eager", "sdpa", False), ("bf16 eager", "sdpa", True),
                               ("bf16 flex+compile", "flex+compile", True)):
        os.environ["EAGLE3_ATTN"] = "sdpa" if variant == "sdpa" else "flex"
        m = Eagle3Draft(g)
        m.load_state_dict(base.state_dict())
        m = m.to(device)
        if amp:  # bf16 frozen pieces need autocast
            optimize_bf16(m, compile_layers="compile" in variant)
        b = batch if amp else {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                               for k, v in batch.items()}
        with torch.autocast("cuda", torch.bfloat16, enabled=amp):
            loss, _ = m(b, args.ttt, 0.8)
        loss.backward()
        out[name] = (loss.item(), [p.grad.float().clone() for p in m.trainable_parameters()])
        names = [n for n, p in m.named_parameters() if p.requires_grad]
        del m
    rows = {}
    for ref in ("fp32 eager", "bf16 eager"):
        ref_loss, ref_grads = out[ref]
        for name, (loss, grads) in out.items():
            if name == ref or (ref == "bf16 eager" and name == "fp32 eager"):
                continue
            errs = {n: ((a - b).norm() / b.norm()).item() for n, a, b in zip(names, grads, ref_grads)}
            err = max(errs.values())
            rows[f"{name} vs {ref}"] = {"loss": loss, "loss_rel_err": abs(loss - ref_loss) / abs(ref_loss),
                                        "max_grad_rel_err": err, "grad_rel_err": errs}
            print("   ", "  ".join(f"{n.replace('layers.0.', '')} {e:.1e}" for n, e in errs.items()))
            print(f"check {name:18s} vs {ref:10s}: loss {loss:.6f}  rel err {abs(loss - ref_loss) / abs(ref_loss):.2e}  "
                  f"max grad rel err (per tensor, L2) {err:.2e}", flush=True)
    layers.use_compiled_rope(False)
    return rows


def eagle_speculators(g, batch, device, args, bf16):
    """speculators' Eagle3DraftModel -> (model, loss function)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig
    tl = LlamaConfig(vocab_size=g.verifier_vocab_size, hidden_size=g.hidden_size, intermediate_size=g.intermediate_size,
                     num_hidden_layers=1, num_attention_heads=g.num_heads, num_key_value_heads=g.num_kv_heads,
                     head_dim=g.head_dim, rms_norm_eps=g.rms_norm_eps, rope_theta=g.rope_theta)
    tl._attn_implementation = "simple_flex_attention" if device.type == "cuda" else "sdpa"
    conf = Eagle3SpeculatorConfig(transformer_layer_config=tl, draft_vocab_size=g.draft_vocab_size,
                                  norm_before_residual=True, eagle_aux_hidden_state_layer_ids=[1, 2, 3],
                                  speculators_config=SpeculatorsConfig(
                                      algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig()],
                                      default_proposal_method="greedy",
                                      verifier=VerifierConfig(name_or_path=None, architectures=[])))
    model = Eagle3DraftModel(conf).to(device)
    with torch.no_grad():
        for p in model.parameters():
            if p.isnan().any():
                p.normal_(0, 0.02)
    loss_cfg = resolve_loss_config("kl_div", "eager")  # its fused loss is Triton/GPU only
    ctx = torch.autocast(device.type, torch.bfloat16, enabled=bf16)
    hs = torch.bfloat16 if bf16 else torch.float32
    kw = dict(hidden_states=batch["aux"][None].to(hs), input_ids=batch["ids"][None], document_ids=batch["doc"][None],
              loss_mask=batch["loss_mask"][None].bool(), position_ids=batch["pos"][None],
              verifier_last_hidden_states=batch["target_hidden"][None].to(hs), ttt_steps=args.ttt,
              ttt_step_loss_decay=0.8, loss_config=loss_cfg)

    def loss():
        with ctx:
            return model(**kw)[1]
    return model, loss


def eagle_ours(g, batch, device, args, bf16):
    """Our Eagle3Draft (eager: per-document attention on CPUs, flex on CUDA) -> (model, loss function)."""
    os.environ["EAGLE3_ATTN"] = "auto"
    model = new_draft(g).to(device)
    if bf16:
        optimize_bf16(model, compile_layers=False)
    b = batch if bf16 else fp32_batch(batch)
    ctx = torch.autocast(device.type, torch.bfloat16, enabled=bf16)

    def loss():
        with ctx:
            return model(b, args.ttt, 0.8)[0]
    return model, loss


def speculators_step(g, batch, device, args):
    model, loss = eagle_speculators(g, batch, device, args, args.speculators_bf16)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")

    def step():
        loss().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step




def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", choices=GEOMETRIES, default="smollm2")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048])
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--max-doc", type=int, default=2048,
                    help="longest synthetic document (the embedded default's max_seq_len is 768)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--variants", nargs="+", default=["flex+compile"], choices=["sdpa", "flex", "flex+compile"])
    ap.add_argument("--skip-speculators", action="store_true")
    ap.add_argument("--check", action="store_true", help="GPU: compare loss/gradients of the variants first")
    ap.add_argument("--profile", action="store_true", help="GPU: print the top kernels of 2 steps per variant")
    ap.add_argument("--amp", default="auto", choices=["auto", "bf16", "off"], help="ours, as 04_train.py --amp")
    ap.add_argument("--speculators-amp", default="auto", choices=["auto", "bf16", "off"],
                    help="speculators' step: auto = bf16 autocast on CUDA, fp32 on CPU")
    ap.add_argument("--method", default="eagle3", choices=["eagle3", "dflash"])
    ap.add_argument("--block-size", type=int, default=8, help="DFlash")
    ap.add_argument("--draft-layers", type=int, default=2, help="DFlash")
    ap.add_argument("--max-anchors", type=int, default=512, help="DFlash: blocks per packed sequence")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    device = torch.device(args.device)
    args.bf16 = use_bf16(device, args.amp)
    args.speculators_bf16 = args.speculators_amp == "bf16" or (args.speculators_amp == "auto" and device.type == "cuda")
    g = DraftGeometry(**GEOMETRIES[args.geometry], draft_vocab_size=args.draft_vocab)
    fpt = flops_per_token(g, args.ttt)
    ceiling = matmul_ceiling(device) if device.type == "cuda" else float("nan")
    print(f"{args.geometry}: " + ("" if args.method == "dflash" else f"{fpt / 1e9:.2f} GFLOP per token (standard "
          f"step, TTT {args.ttt}); ") + f"bf16 matmul ceiling {ceiling / 1e12:.0f} TFLOP/s", flush=True)
    result = {"geometry": args.geometry, "device": str(device), "draft_vocab": args.draft_vocab,
              "gflop_per_token": fpt / 1e9, "ceiling_tflops": ceiling / 1e12, "rows": []}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    if args.method == "dflash":
        dflash_main(g, args, device, result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return
    if args.check:
        batch = make_batch(min(args.tokens), g, device, seed=1, max_doc=args.max_doc)
        result["check"] = numerical_check(g, batch, device, args) if device.type == "cuda" else {}
        # each implementation's own bf16 gap on the same batch (on a CPU: ours on its per-document path)
        for name, make in [("ours", eagle_ours)] + ([] if args.skip_speculators else [("speculators", eagle_speculators)]):
            loss_err, errs = bf16_gradient_gap(make, g, batch, device, args)
            print(f"check {name} bf16 vs its fp32: loss rel err {loss_err:.1e}; grads (per tensor, L2) max "
                  f"{max(errs.values()):.1e}, median {statistics.median(errs.values()):.1e}", flush=True)
            print("   ", "  ".join(f"{n.replace('layers.0.', '')} {e:.1e}" for n, e in errs.items()))
            result["check"][f"{name} bf16 vs its fp32"] = {"loss_rel_err": loss_err, "grad_rel_err": errs}
    rows = result["rows"]
    for T in args.tokens:
        batch = make_batch(T, g, device, seed=T, max_doc=args.max_doc, bf16=args.bf16)
        impls = [(f"ours {v}" if device.type == "cuda" else "ours", ours, v)
                 for v in (args.variants if device.type == "cuda" else ["sdpa"])]
        impls += [] if args.skip_speculators else [("speculators 0.9.0", speculators_step, None)]
        for name, make, variant in impls:
            torch.manual_seed(0)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                step = make(g, batch, device, args, variant) if variant else make(g, batch, device, args)
                sec = timed(step, args.warmup, args.steps, device)
                sec_loop = timed_pipelined(step, args.steps, device) if device.type == "cuda" else sec
                if args.profile and device.type == "cuda":
                    profile(step, name)
            except torch.OutOfMemoryError:
                print(f"{name:24s} T={T:6d}  out of memory", flush=True)
                rows.append({"impl": name, "tokens": T, "oom": True})
                step = None
                continue
            mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            mfu = T / sec * fpt / ceiling if device.type == "cuda" else float("nan")
            rows.append({"impl": name, "tokens": T, "step_s": round(sec, 4), "tokens_per_s": round(T / sec, 1),
                         "loop_tokens_per_s": round(T / sec_loop, 1), "peak_gib": round(mem, 2), "mfu": round(mfu, 3)})
            print(f"{name:24s} T={T:6d}  {sec:8.3f} s/step  {T / sec:10.1f} tokens/s (in a loop without syncs "
                  f"{T / sec_loop:.1f})  peak {mem:6.2f} GiB  MFU {mfu:.2f}", flush=True)
            del step
    base = {r["tokens"]: r for r in rows if r["impl"].startswith("speculators") and not r.get("oom")}
    for r in rows:
        if r["impl"].startswith("ours") and r["tokens"] in base and not r.get("oom"):
            b = base[r["tokens"]]
            print(f"T={r['tokens']}: {r['impl']} / speculators = {r['tokens_per_s'] / b['tokens_per_s']:.2f}x tokens/s "
                  f"(in a loop without syncs {r['loop_tokens_per_s'] / b['loop_tokens_per_s']:.2f}x), "
                  f"{r['peak_gib'] / b['peak_gib']:.2f}x memory")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
