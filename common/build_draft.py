"""The draft model for stage 4: its geometry from the verifier's config, its frozen pieces from the verifier's weights."""
import torch

from common.drafts import method, method_of
from common.errors import UsageError
from common.models import load_verifier_pieces


def geometry(cfg, text_cfg, draft_vocab, num_aux, tokenizer=None, log=None):
    """The draft's shapes: the verifier's unless --draft-* options say otherwise, and what its method adds.
    tokenizer: a callable -> the verifier's tokenizer (a method that feeds one of its tokens asks for it)."""
    g = method_of(cfg).geometry(cfg, _shared(cfg, text_cfg), draft_vocab, num_aux, tokenizer, log)
    if g.num_heads % g.num_kv_heads:
        raise UsageError(f"draft heads {g.num_heads} must be a multiple of draft KV heads {g.num_kv_heads}")
    return g


def _shared(cfg, text_cfg):
    heads = cfg.draft_num_heads or text_cfg.num_attention_heads
    rope_theta = getattr(text_cfg, "rope_theta", None) or \
        (getattr(text_cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return dict(hidden_size=text_cfg.hidden_size, num_heads=heads,
                num_kv_heads=cfg.draft_num_kv_heads or getattr(text_cfg, "num_key_value_heads", None) or heads,
                head_dim=cfg.draft_head_dim or getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads,
                intermediate_size=cfg.draft_intermediate_size or text_cfg.intermediate_size,
                rms_norm_eps=getattr(text_cfg, "rms_norm_eps", 1e-6), rope_theta=float(rope_theta),
                max_position_embeddings=getattr(text_cfg, "max_position_embeddings", 4096),
                verifier_vocab_size=text_cfg.vocab_size)


def trainable_parameters(g, train_head=False):
    """How many parameters the draft trains, counted on the meta device (no memory, no init)."""
    with torch.device("meta"):
        model = method(g.method).model(g)
    model.lm_head.requires_grad_(train_head)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def build_model(g, model_dir, target_ids, trained=None, train_head=False):
    """Draft with frozen pieces from the verifier: embeddings, draft lm_head = verifier rows of the draft vocab
    (trained further with train_head). trained: trainable weights from a checkpoint, loaded instead of a
    random init (which takes half a minute for a Kimi-size draft on the one CPU thread torchrun leaves each rank)."""
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
