"""The draft model for stage 4: its geometry from the verifier's config, its frozen pieces from the verifier's weights."""
import torch

from common.drafts import method, method_of
from common.drafts.layers import STATIC_ROPE, rope_parameters
from common.errors import UsageError
from common.models import load_verifier_pieces, read_tensor, verifier_layer_tensors


def geometry(cfg, text_cfg, draft_vocab, num_aux, tokenizer=None, log=None):
    """The draft's shapes: the verifier's unless --draft-* options say otherwise, and what its method adds.
    tokenizer: a callable -> the verifier's tokenizer (a method that feeds one of its tokens asks for it)."""
    g = method_of(cfg).geometry(cfg, _shared(cfg, text_cfg), draft_vocab, num_aux, tokenizer, log)
    if g.num_heads % g.num_kv_heads:
        raise UsageError(f"draft heads {g.num_heads} must be a multiple of draft KV heads {g.num_kv_heads}")
    return g


def _shared(cfg, text_cfg):
    heads = cfg.draft_num_heads or text_cfg.num_attention_heads
    rope = rope_parameters(text_cfg)
    if rope["rope_type"] not in STATIC_ROPE:
        raise UsageError(f"the verifier's rotary embedding is rope_type {rope['rope_type']!r}: a draft trains with "
                         f"{', '.join(STATIC_ROPE)} only (vLLM would serve it at angles training never used)")
    return dict(hidden_size=text_cfg.hidden_size, num_heads=heads,
                num_kv_heads=cfg.draft_num_kv_heads or getattr(text_cfg, "num_key_value_heads", None) or heads,
                head_dim=cfg.draft_head_dim or getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads,
                intermediate_size=cfg.draft_intermediate_size or text_cfg.intermediate_size,
                rms_norm_eps=getattr(text_cfg, "rms_norm_eps", 1e-6), rope_theta=rope["rope_theta"], rope_parameters=rope,
                max_position_embeddings=getattr(text_cfg, "max_position_embeddings", 4096),
                verifier_vocab_size=text_cfg.vocab_size)


def trainable_parameters(g, train_head=False):
    """How many parameters the draft trains, counted on the meta device (no memory, no init)."""
    with torch.device("meta"):
        model = method(g.method).model(g)
    model.lm_head.requires_grad_(train_head)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


FLOATS = ("F32", "F16", "BF16")  # weights a draft layer can start as (a quantized layer's are packed integers)


def verifier_init_plan(g, model_dir, text_cfg):
    """--draft-init verifier: draft layer j of L starts as the verifier's layer N - L + j. -> [(parameter, file, key,
    part)], checked from the checkpoint's headers before anything loads: a weight the verifier's layer lacks (Kimi-K2.5's
    MLA attention and MoE MLPs have no q_proj / gate_proj), is quantized, or has another shape stops the stage."""
    m = method(g.method)
    with torch.device("meta"):
        layers = m.model(g).layers
    n, L = text_cfg.num_hidden_layers, len(layers)
    if L > n:
        raise UsageError(f"--draft-init verifier: {L} draft layers but the verifier has {n}; lower --draft-layers")
    found, plan = verifier_layer_tensors(model_dir, range(n - L, n)), []
    for name, p in layers.named_parameters():
        j, inner = name.split(".", 1)
        src, part = m.verifier_source(int(j), inner)
        layer = n - L + int(j)
        hit = found.get((layer, src))
        if hit is None and p.dim() == 1:
            continue  # a norm the verifier's layers lack (a Qwen3 q/k norm beside a Llama verifier) keeps its ones
        if hit is None:
            raise UsageError(f"--draft-init verifier: the verifier's layer {layer} has no {src} ({model_dir}): its "
                             f"layers are not Llama-like (Kimi-K2.5: MLA attention, MoE MLPs); use --draft-init random")
        want = tuple(p.shape) if part is None else (p.shape[0], p.shape[1] // 2)
        if hit[2] != want or hit[3] not in FLOATS:
            raise UsageError(f"--draft-init verifier: draft weight layers.{name} {want} cannot start as the verifier's "
                             f"{hit[1]} ({hit[3]} {hit[2]}); drop the --draft-* options that change the draft's shapes, "
                             f"or use --draft-init random")
        plan.append((f"layers.{name}", hit[0], hit[1], part))
    return plan


def copy_verifier_layers(model, model_dir, plan):
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, file, key, part in plan:
            dst = params[name] if part is None else params[name][:, params[name].shape[1] // 2:]
            dst.copy_(read_tensor(model_dir, file, key).float())


def build_model(g, model_dir, target_ids, trained=None, train_head=False, init_plan=None):
    """Draft with frozen pieces from the verifier: embeddings, draft lm_head = verifier rows of the draft vocab
    (trained further with train_head). trained: trainable weights from a checkpoint, loaded instead of a
    random init (which takes half a minute for a Kimi-size draft on the one CPU thread torchrun leaves each rank).
    init_plan: verifier_init_plan's, for a fresh draft whose layers start as the verifier's."""
    build = method(g.method).model
    if trained is None:
        model = build(g)
    else:
        with torch.device("meta"):
            model = build(g)
        model.to_empty(device="cpu")
    model.lm_head.requires_grad_(train_head)
    if trained is not None:
        missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in trained]
        if missing:
            raise RuntimeError(f"checkpoint lacks trainable weights {missing[:3]}")
        model.load_state_dict(trained, strict=False)
    if trained is None and init_plan:
        copy_verifier_layers(model, model_dir, init_plan)
    w = load_verifier_pieces(model_dir, g.hidden_size)
    rows = torch.as_tensor(target_ids) if target_ids is not None else torch.arange(g.verifier_vocab_size)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(w["embed_tokens.weight"].float())
        head = w["lm_head.weight"].float()[rows]
        if trained is None or "lm_head.weight" not in trained:
            model.lm_head.weight.copy_(head)
        model.verifier_lm_head.weight.copy_(head)
        model.verifier_norm.weight.copy_(w["norm.weight"].float())
        model.d2t.copy_(rows - torch.arange(len(rows)))
        model.t2d.zero_()
        model.t2d[rows] = True
    return model
