"""The DFlash half of bench/train_throughput.py (--method dflash): our DFlashDraft step against speculators 0.9.0's
DFlashDraftModel on the same batch and anchors, the FLOPs the step needs, and the memory floor its state sets."""
import functools
import gc
import os
import statistics

import torch

from step_common import bf16_gradient_gap, fp32_batch, gradient_gap, make_batch, profile, timed, train_step


def dflash_geometry(g, args):
    from common.drafts.dflash import DFlashGeometry
    keep = {k: getattr(g, k) for k in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                                        "rms_norm_eps", "rope_theta", "max_position_embeddings",
                                        "verifier_vocab_size", "draft_vocab_size")}
    return DFlashGeometry(**keep, num_layers=args.draft_layers, block_size=args.block_size, num_aux=3,
                          mask_token_id=g.verifier_vocab_size - 1)


def dflash_ours(dg, batch, device, args, bf16, variant="flex+compile"):
    """-> (model, loss function) as 04_train.py runs it: bf16 frozen pieces under autocast, fp32 master weights;
    variant: "flex+compile" (04_train.py on CUDA), "flex" (no compiled norms/MLP), "sdpa" (per-document products)."""
    from common.drafts.dflash import DFlashDraft
    with torch.device(device):  # built where it trains: a Kimi-size init on the host takes minutes
        model = DFlashDraft(dg)
    with torch.no_grad():
        model.verifier_lm_head.weight.copy_(model.lm_head.weight)
    if bf16:
        model.prepare_bf16(device.type == "cuda" and variant == "flex+compile")
    b = batch if bf16 else fp32_batch(batch)
    ctx = torch.autocast(device.type, torch.bfloat16, enabled=bf16)

    def loss():
        os.environ["EAGLE3_ATTN"] = "sdpa" if variant == "sdpa" else "flex"  # read by each forward's block_plan
        with ctx:
            return model(b, args.max_anchors, anchors=batch["anchors"])[0]
    return model, loss


def dflash_speculators(dg, batch, device, args, bf16):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config
    layer = Qwen3Config(vocab_size=dg.verifier_vocab_size, hidden_size=dg.hidden_size,
                        intermediate_size=dg.intermediate_size, num_hidden_layers=dg.num_layers,
                        num_attention_heads=dg.num_heads, num_key_value_heads=dg.num_kv_heads, head_dim=dg.head_dim,
                        rms_norm_eps=dg.rms_norm_eps, max_position_embeddings=dg.max_position_embeddings,
                        rope_parameters={"rope_type": "default", "rope_theta": dg.rope_theta})
    if device.type != "cuda":
        layer._attn_implementation = "sdpa"  # its flex-attention default has no CPU backward
    conf = DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=dg.draft_vocab_size, block_size=dg.block_size,
        aux_hidden_state_layer_ids=[1, 2, 3], mask_token_id=dg.mask_token_id,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=dg.block_size - 1)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[])))
    with torch.device(device):
        model = DFlashDraftModel(conf)
    with torch.no_grad():
        for p in model.parameters():
            if p.isnan().any():  # its frozen pieces start empty
                p.normal_(0, 0.02)
    hs = torch.bfloat16 if bf16 else torch.float32
    kw = dict(hidden_states=batch["aux"][None].to(hs), input_ids=batch["ids"][None],
              loss_mask=batch["loss_mask"][None], verifier_last_hidden_states=batch["target_hidden"][None].to(hs),
              document_ids=batch["doc"][None], position_ids=batch["pos"][None],
              loss_config=resolve_loss_config("ce", "eager"), gamma=4.0, max_anchors=args.max_anchors,
              per_position_loss_weight="dpace", dpace_alpha=0.5)
    ctx = torch.autocast(device.type, torch.bfloat16, enabled=bf16)

    def loss():
        torch.manual_seed(0)  # its anchors are drawn inside the forward: the same ones in every run
        with ctx:
            return model(**kw)[1]
    return model, loss


def dflash_need(dg, batch):
    """What one step must do whatever the implementation -> (FLOPs, bytes of state). FLOPs: every matmul's forward,
    twice more for the backward of trainable weights, once more for the frozen draft head (its input gradient), the
    verifier head forward only. State: the trainable part's fp32 weights, gradients and AdamW moments (16 bytes a
    parameter), the frozen embedding and heads in bf16: a floor under any implementation's peak memory."""
    from common.drafts.dflash import trainable_count
    H, L, hd, bs = dg.hidden_size, dg.num_layers, dg.head_dim, dg.block_size
    T, anchors = batch["ids"].numel(), batch["anchors"]
    queries = anchors.numel() * bs
    visible = float((batch["pos"][anchors].float() - 1 + bs).mean())  # its document before its anchor, its block
    per_context = 2 * (dg.num_aux * H * H + L * H * 2 * dg.num_kv_heads * hd)  # fc, each layer's K/V
    per_query = 2 * L * (H * (dg.num_heads + 2 * dg.num_kv_heads) * hd + dg.num_heads * hd * H
                         + 3 * H * dg.intermediate_size + 2 * dg.num_heads * hd * visible)
    flops = 3 * (T * per_context + queries * per_query) + 3 * queries * 2 * H * dg.draft_vocab_size
    state = 16 * trainable_count(dg) + 2 * H * (dg.verifier_vocab_size + 2 * dg.draft_vocab_size)
    return flops, state


def dflash_main(g, args, device, result):
    from common.drafts.dflash import select_anchors
    dg = dflash_geometry(g, args)
    impls = [(f"ours {v}", functools.partial(dflash_ours, variant=v)) for v in args.variants] + ([] if args.skip_speculators else
                                                     [("speculators 0.9.0", dflash_speculators)])
    rows = result["rows"]
    for T in args.tokens:
        batch = make_batch(T, g, device, seed=T, max_doc=args.max_doc, bf16=args.bf16)
        batch["loss_mask"] = batch["loss_mask"].bool()
        batch["anchors"] = select_anchors(batch["loss_mask"], args.max_anchors, dg.block_size).to(device)
        flops, state = dflash_need(dg, batch)
        print(f"T={T}: one step needs {flops / 1e12:.1f} TFLOP ({batch['anchors'].numel()} blocks of {dg.block_size}); "
              f"its state (fp32 weights, gradients, AdamW; frozen pieces in bf16) holds {state / 2**30:.1f} GiB",
              flush=True)
        if args.check and len(args.variants) > 1:  # ours: each variant against the first, both fp32
            for name, make in impls[1:len(args.variants)]:
                loss_err, errs = gradient_gap((impls[0][1], False), (make, False), dg, batch, device, args)
                print(f"check {name} vs {impls[0][0]}, fp32: loss rel err {loss_err:.1e}; grads (per tensor, L2) "
                      f"max {max(errs.values()):.1e}, median {statistics.median(errs.values()):.1e}", flush=True)
        if args.check:
            for name, make in impls:
                loss_err, errs = bf16_gradient_gap(make, dg, batch, device, args)
                print(f"check {name}: bf16 vs fp32 loss rel err {loss_err:.1e}; grads (per tensor, L2) max "
                      f"{max(errs.values()):.1e}, median {statistics.median(errs.values()):.1e}", flush=True)
                result.setdefault("check", {})[name] = {"loss_rel_err": loss_err, "grad_rel_err": errs}
        for name, make in impls:
            torch.manual_seed(0)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                step = train_step(*make(dg, batch, device, args, args.bf16))
                sec = timed(step, args.warmup, args.steps, device)
                if args.profile and device.type == "cuda":
                    profile(step, name)
            except torch.OutOfMemoryError:
                print(f"{name:24s} T={T:6d}  out of memory", flush=True)
                rows.append({"impl": name, "tokens": T, "oom": True})
                continue
            mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            mfu = flops / sec / (result["ceiling_tflops"] * 1e12)
            rows.append({"impl": name, "tokens": T, "step_s": round(sec, 4), "tokens_per_s": round(T / sec, 1),
                         "peak_gib": round(mem, 2), "mfu": round(mfu, 3), "state_gib": round(state / 2**30, 2)})
            print(f"{name:24s} T={T:6d}  {sec:8.3f} s/step  {T / sec:10.1f} tokens/s  peak {mem:6.2f} GiB "
                  f"(state {state / 2**30:.1f})  MFU {mfu:.2f}", flush=True)
            del step
            gc.collect()  # the next implementation's weights and optimizer state need the room
    ref = {r["tokens"]: r for r in rows if r["impl"].startswith("speculators") and not r.get("oom")}
    for r in rows:
        if r["impl"].startswith("ours") and r["tokens"] in ref and not r.get("oom"):
            b = ref[r["tokens"]]
            print(f"T={r['tokens']}: ours / speculators = {r['tokens_per_s'] / b['tokens_per_s']:.2f}x tokens/s, "
                  f"{r['peak_gib'] / b['peak_gib']:.2f}x memory")
