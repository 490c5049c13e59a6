"""The DFlash block draft in plain PyTorch, with speculators 0.9.0's weight names and maths.

A DFlash draft reads the same features as EAGLE-3 (aux taps, the final pre-norm state for targets) but drafts
a whole block in one forward: for an anchor position a (a token the verifier has accepted), its block holds
the anchor token and block_size - 1 mask tokens; slot i predicts the token at a + i.

  fc + hidden_norm:  [aux_1 | .. | aux_n] (nH) -> H, the context c_t for every position t
  layers (Qwen3):    queries from the block's stream; keys/values from [c_t for t < a in a's document | the
                     block's own stream] (all of the block, or with --block-attention causal the slots up to
                     the query's); q/k RMS-normed per head, RoPE at the context's positions and a + i
                     for slot i
  norm + lm_head:    the block's logits; the target of slot i is the verifier's distribution at a + i - 1
                     (verifier_lm_head(verifier_norm(h_N))), restricted to the draft vocabulary
Loss at loss-masked slots 1..block_size-1: cross-entropy to the verifier's top token (speculators' DFlash recipe)
or KL to its distribution, weighted per slot (fixed exponential decay, or D-PACE: each slot by the smoothed
chance that the block gets that far), divided by the masked slot count.
Slots whose token lies past the anchor's document are masked (speculators lets a block run into the next
packed document; blocks that stay inside one document compute exactly what speculators computes).
"""
from dataclasses import dataclass

import torch
from torch import nn

from common.drafts import layers
from common.drafts.acceptance import block_metrics
from common.drafts.block_plan import block_plan
from common.drafts.layers import MLP, Geometry, RMSNorm, Rotary
from common.drafts.losses import LOSS_EPS, row_loss, slot_weights
from common.drafts.interface import DraftMethod
from common.errors import UsageError


@dataclass(kw_only=True)
class DFlashGeometry(Geometry):
    method = "dflash"  # not a field: the registry's name of the method this geometry is for
    num_layers: int
    block_size: int
    num_aux: int
    mask_token_id: int
    causal: bool = False  # a slot sees only the slots before it in its block (speculators' DFlash default)


class BlockAttention(nn.Module):
    """Qwen3 attention whose keys/values are [context | the block's own stream] (speculators' Qwen3DFlashAttention)."""

    def __init__(self, g):
        super().__init__()
        self.g = g
        self.q_proj = nn.Linear(g.hidden_size, g.num_heads * g.head_dim, bias=False)
        self.k_proj = nn.Linear(g.hidden_size, g.num_kv_heads * g.head_dim, bias=False)
        self.v_proj = nn.Linear(g.hidden_size, g.num_kv_heads * g.head_dim, bias=False)
        self.o_proj = nn.Linear(g.num_heads * g.head_dim, g.hidden_size, bias=False)
        self.q_norm = RMSNorm(g.head_dim, g.rms_norm_eps)
        self.k_norm = RMSNorm(g.head_dim, g.rms_norm_eps)

    def forward(self, x, ctx, rope_ctx, rope_block, plan):
        """x [Q, H] the blocks' stream, ctx [T, H] the context, rope_*: (cos, sin) tables, plan: block_plan()."""
        g = self.g
        kv_in = torch.cat([ctx, x])
        q = self.q_norm(self.q_proj(x).view(-1, g.num_heads, g.head_dim))
        k = self.k_norm(self.k_proj(kv_in).view(-1, g.num_kv_heads, g.head_dim))
        v = self.v_proj(kv_in).view(-1, g.num_kv_heads, g.head_dim)
        q = layers.apply_rope(q, rope_block[0][:, None], rope_block[1][:, None])
        k = layers.apply_rope(k, torch.cat([rope_ctx[0], rope_block[0]])[:, None],
                              torch.cat([rope_ctx[1], rope_block[1]])[:, None])
        out = plan.attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.head_dim ** -0.5)
        return self.o_proj(out.transpose(0, 1).reshape(x.shape[0], -1))


class BlockLayer(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.input_layernorm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.self_attn = BlockAttention(g)
        self.post_attention_layernorm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.mlp = MLP(g)

    def forward(self, x, ctx, rope_ctx, rope_block, plan):
        h = x + self.self_attn(self.input_layernorm(x), ctx, rope_ctx, rope_block, plan)
        return h + self.mlp(self.post_attention_layernorm(h))


def select_anchors(loss_mask, max_anchors, block_size, generator=None):
    """Up to max_anchors loss-masked positions, at random, sorted; the last block_size positions of the packed
    sequence are never anchors (as speculators). -> LongTensor [n]."""
    valid = loss_mask.bool().clone()
    valid[-block_size:] = False
    idx = valid.nonzero().squeeze(-1)
    # drawn on the host: the generator the trainer passes is a CPU one (seeded per sequence, common/trainer.py)
    perm = torch.randperm(idx.numel(), generator=generator)[:max_anchors].to(idx.device)
    return idx[perm].sort().values


class DFlashDraft(nn.Module):
    """Trainable: fc, hidden_norm, layers, norm (and lm_head with --train-lm-head); frozen: embed_tokens, the draft
    lm_head (the verifier's rows of the draft vocab), verifier_norm, verifier_lm_head."""
    shift = 0  # its batches are not shifted: position t holds token t and the states computed at t

    def __init__(self, g):
        super().__init__()
        self.g = g
        self.embed_tokens = nn.Embedding(g.verifier_vocab_size, g.hidden_size)
        self.fc = nn.Linear(g.num_aux * g.hidden_size, g.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(g) for _ in range(g.num_layers))
        self.norm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.lm_head = nn.Linear(g.hidden_size, g.draft_vocab_size, bias=False)
        self.verifier_lm_head = nn.Linear(g.hidden_size, g.draft_vocab_size, bias=False)
        self.verifier_norm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.register_buffer("d2t", torch.zeros(g.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(g.verifier_vocab_size, dtype=torch.bool))
        self.rotary = Rotary(g)
        for m in (self.embed_tokens, self.lm_head, self.verifier_lm_head, self.verifier_norm):
            m.requires_grad_(False)
        for p in self.parameters():
            if p.requires_grad and p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    @property
    def positions(self):
        """Drafted tokens per block: the per-position metrics' length."""
        return self.g.block_size - 1

    def prepare_bf16(self, compile_layers=False):
        """bf16 autocast: the frozen pieces in bf16 (the head's rows stored once when the draft head is frozen); on
        CUDA also the elementwise chains (RMSNorms, SwiGLU, RoPE) compiled into fused kernels, as EAGLE-3's."""
        self.embed_tokens.to(torch.bfloat16)
        if not self.lm_head.weight.requires_grad:
            self.lm_head.to(torch.bfloat16)
        if not self.lm_head.weight.requires_grad and torch.equal(self.verifier_lm_head.weight.to(torch.bfloat16),
                                                                 self.lm_head.weight):
            self.verifier_lm_head.weight = self.lm_head.weight
        else:
            self.verifier_lm_head.to(torch.bfloat16)
        if compile_layers:
            for m in (self.hidden_norm, self.norm, self.verifier_norm, *(m for layer in self.layers for m in (
                    layer.input_layernorm, layer.post_attention_layernorm, layer.mlp, layer.self_attn.q_norm,
                    layer.self_attn.k_norm))):
                m.compile(dynamic=True)
        layers.use_compiled_rope(compile_layers)

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    def block_logits(self, aux, ids, pos, doc, anchors):
        """-> logits [n * block_size, draft vocab] of the blocks anchored at `anchors` (positions in the packed
        sequence); aux [T, n_aux * H], ids/pos/doc [T] (pos: position in its document)."""
        g, bs = self.g, self.g.block_size
        stream = torch.full((anchors.numel() * bs,), g.mask_token_id, dtype=torch.long, device=ids.device)
        stream[::bs] = ids[anchors]
        x = self.embed_tokens(stream)
        ctx = self.hidden_norm(self.fc(aux))
        offsets = torch.arange(bs, device=ids.device)
        block_pos = (pos[anchors][:, None] + offsets[None]).reshape(-1)
        rope_ctx, rope_block = self.rotary.cos_sin(pos, x.dtype), self.rotary.cos_sin(block_pos, x.dtype)
        plan = block_plan(doc, anchors, bs, g.causal)
        for layer in self.layers:
            x = layer(x, ctx, rope_ctx, rope_block, plan)
        return self.lm_head(self.norm(x))

    def targets_and_mask(self, target_hidden, loss_mask, doc, anchors):
        """The verifier's logits for each slot (at a + i - 1) and the slots that count: loss-masked, inside the
        anchor's document, not slot 0."""
        bs, T = self.g.block_size, target_hidden.shape[0]
        idx = (anchors[:, None] + torch.arange(bs, device=anchors.device)[None]).reshape(-1)
        with torch.no_grad():
            targets = self.verifier_lm_head(self.verifier_norm(target_hidden[(idx - 1) % T]))
        inside = idx < T
        idx = idx.clamp(max=T - 1)
        mask = loss_mask[idx].bool() & inside & (doc[idx] == doc[anchors].repeat_interleave(bs))
        mask = mask.view(-1, bs)
        mask[:, 0] = False
        return targets, mask.view(-1)

    def forward(self, batch, max_anchors=512, weighting="dpace", loss="ce", gamma=4.0, dpace_alpha=0.5, anchors=None,
                generator=None):
        """-> (loss, metrics) on one packed sequence. batch: aux [T, n_aux * H], target_hidden [T, H], ids,
        loss_mask, doc, pos [T], unshifted (position t holds token t and the states computed at t)."""
        bs = self.g.block_size
        if isinstance(anchors, str):  # "all": every loss-masked anchor, max_anchors at a time (validation)
            return self._every_anchor(batch, max_anchors, weighting, loss, gamma, dpace_alpha)
        if anchors is None:
            anchors = select_anchors(batch["loss_mask"], max_anchors, bs, generator)
        logits = self.block_logits(batch["aux"], batch["ids"], batch["pos"], batch["doc"], anchors)
        targets, mask = self.targets_and_mask(batch["target_hidden"], batch["loss_mask"], batch["doc"], anchors)
        per_slot = row_loss(loss, logits, targets) * mask
        slot = torch.arange(logits.shape[0], device=logits.device) % bs
        w = slot_weights(weighting, slot, mask, per_slot, bs, gamma, dpace_alpha)
        total = (per_slot * w).sum() / (mask.sum() + LOSS_EPS)
        return total, block_metrics(logits, targets, mask, per_slot, bs)


    def _every_anchor(self, batch, chunk, *loss_args):
        """Validation: every position that can anchor a block does, so the simulated acceptance length is not a
        sample; the loss is the mean over the chunks."""
        every = select_anchors(batch["loss_mask"], batch["loss_mask"].numel(), self.g.block_size)
        losses, sums = [], {}
        for i in range(0, max(every.numel(), 1), chunk):
            loss, m = self(batch, chunk, *loss_args, anchors=every[i:i + chunk])
            losses.append(loss)
            for k, v in m.items():
                sums[k] = sums.get(k, 0) + v
        n = len(losses)
        for k in sums:
            if k.startswith("loss_"):
                sums[k] = sums[k] / n
        return torch.stack(losses).mean(), sums


def trainable_count(g):
    """Parameters a DFlash draft trains (its layers and fc; norms aside)."""
    return g.num_layers * (2 * g.hidden_size * g.num_heads * g.head_dim + 2 * g.hidden_size * g.num_kv_heads
                           * g.head_dim + 3 * g.hidden_size * g.intermediate_size) + g.num_aux * g.hidden_size ** 2


def geometry_note(g):
    """One line for logs and dry runs."""
    params = trainable_count(g)
    causal = " (causal)" if g.causal else ""
    return (f"DFlash: {g.num_layers} layers, block {g.block_size}{causal}, heads {g.num_heads}/{g.num_kv_heads} x "
            f"{g.head_dim}, MLP {g.intermediate_size}, {params / 1e6:.1f}M trainable, mask token {g.mask_token_id}")




def resolve_mask_token(tok, vocab_size):
    """The token DFlash feeds for the positions it drafts, as speculators resolves it: the tokenizer's mask token,
    else the first embedding row no token uses, else pad / eos / unk. -> (id, where it came from)."""
    if tok.mask_token_id is not None:
        return tok.mask_token_id, f"the tokenizer's mask token {tok.mask_token!r}"
    if len(tok) < vocab_size:
        return len(tok), f"the first embedding row no token uses ({len(tok)} of {vocab_size})"
    for name in ("pad", "eos", "unk"):
        if getattr(tok, f"{name}_token_id", None) is not None:
            return getattr(tok, f"{name}_token_id"), f"the {name} token {getattr(tok, f'{name}_token')!r} (no mask " \
                f"token, no unused embedding row)"
    raise UsageError(f"the verifier's tokenizer ({tok.name_or_path}) has no mask token, no unused embedding row and no "
                     f"pad/eos/unk token: a DFlash draft has nothing to feed for the positions it drafts; use "
                     f"--draft-method eagle3, or add a mask token to the verifier's tokenizer")


def dflash_config(g, aux_ids, verifier_name, verifier_config):
    """speculators' DFlash format, built with its own config class (what vLLM's speculators reader and speculators
    load): a Qwen3 layer config, the block, the mask token, the aux ids in vLLM numbering (vLLM derives DFlash's own
    numbering from them), plus the aux ids at the top level, where Model Runner V2 reads them."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config
    layer = Qwen3Config(
        vocab_size=g.verifier_vocab_size, hidden_size=g.hidden_size, intermediate_size=g.intermediate_size,
        num_hidden_layers=g.num_layers, num_attention_heads=g.num_heads, num_key_value_heads=g.num_kv_heads,
        head_dim=g.head_dim, hidden_act=g.hidden_act, max_position_embeddings=g.max_position_embeddings,
        rms_norm_eps=g.rms_norm_eps, rope_parameters=Rotary(g).params,
        tie_word_embeddings=False, attention_bias=False)
    archs = list(getattr(verifier_config, "architectures", None) or [])
    conf = DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=g.draft_vocab_size, block_size=g.block_size,
        aux_hidden_state_layer_ids=list(aux_ids), mask_token_id=g.mask_token_id, sample_from_anchor=False,
        # the block as trained: vLLM (0.32 and 0.33) serves every layer causally when this is false (speculators'
        # default), though speculators itself trains full-attention layers non-causally
        sliding_window_non_causal=not g.causal,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=g.block_size - 1)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=verifier_name, architectures=archs)))
    d = conf.to_dict()
    d["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    return d


class DFlashMethod(DraftMethod):
    """A block of --block-size tokens (the anchor and its drafts) per forward of a stack of --draft-layers Qwen3
    layers, bidirectional within the block unless --block-attention causal; speculators' export layout only."""
    name = "dflash"
    shift = 0
    options = ("max_anchors", "block_weights", "block_decay_gamma", "dpace_alpha", "block_attention")
    needs_speculators = True
    validation_args = ("all",)  # every block a loss-masked position can anchor (a sample of them would be noise)

    def geometry(self, cfg, shared, draft_vocab, num_aux, tokenizer, log=None):
        if cfg.answer_start_weight != 1:
            raise UsageError(f"--answer-start-weight {cfg.answer_start_weight:g} is an EAGLE-3 option: DFlash weighs "
                             f"its block slots instead (--block-weights); drop it or use --draft-method eagle3")
        mask_id, why = resolve_mask_token(tokenizer(), shared["verifier_vocab_size"])
        if log:
            log.info("DFlash mask token: id %d, %s", mask_id, why)
        return DFlashGeometry(**shared, draft_vocab_size=draft_vocab, num_aux=num_aux, num_layers=cfg.draft_layers or 5,
                              block_size=cfg.block_size, mask_token_id=mask_id,
                              causal=cfg.block_attention == "causal")

    def geometry_class(self):
        return DFlashGeometry

    def model(self, g):
        return DFlashDraft(g)

    def note(self, g, cfg):
        return geometry_note(g)

    def step_kwargs(self, seed):
        # its anchors: a generator per packed sequence, so they depend on neither rank, world size, accumulation
        # nor a resume (the global generator is per process and only rank 0's state is checkpointed)
        return {"generator": torch.Generator().manual_seed(seed)}

    def loss_args(self, cfg):
        return cfg.max_anchors, cfg.block_weights, cfg.loss or "ce", cfg.block_decay_gamma, cfg.dpace_alpha

    def positions(self, cfg):
        return cfg.block_size - 1

    def prepare_bf16(self, model, cfg, device):
        model.prepare_bf16(cfg.compile and device.type == "cuda" and layers.attention_backend(device) == "flex")

    def memory(self, g, cfg, longest_doc, device):
        return block_memory(g, cfg.max_tokens_per_step, cfg.max_anchors, longest_doc,
                            layers.attention_backend(device) == "flex")

    def export_config(self, g, cfg, aux_ids, verifier_name, verifier_config):
        return dflash_config(g, aux_ids, verifier_name, verifier_config)

    def served_k(self, conf, cfg, log=None):
        if log:
            log.info("DFlash draft, block %d: k = %d drafted tokens per verify step (--num-speculative-tokens is "
                     "EAGLE-3's)", conf["block_size"], conf["block_size"] - 1)
        return [conf["block_size"] - 1]

    def draft_passes(self, k):
        return 1  # the whole block in one forward

    def trained_fields(self, g, params):
        return dict(num_layers=g["num_layers"], causal=[g.get("causal", False)] * g["num_layers"],
                    mask_token_id=g["mask_token_id"], drafted_tokens=g["block_size"] - 1)

    def served_fields(self, hf, raw):
        from vllm.model_executor.models.qwen3_dflash import _dflash_layer_causal
        dc = hf.dflash_config
        view = dict(causal=[_dflash_layer_causal(hf, i) for i in range(hf.num_hidden_layers)],
                    mask_token_id=dc["mask_token_id"], drafted_tokens=raw["block_size"] - 1)
        # the model's own numbering of the taps: vLLM's id - 1 (its reader derives it; a mismatch feeds other layers)
        top = list(getattr(hf, "eagle_aux_hidden_state_layer_ids", None) or [])
        if [i + 1 for i in dc["target_layer_ids"]] != top:
            view["aux_layer_ids"] = {"top-level": top, "dflash_config + 1": [i + 1 for i in dc["target_layer_ids"]]}
        return view

    def predict(self, model, batch, k):
        """The block anchored at t - 1 (the last accepted token): slot i predicts token t - 1 + i."""
        b, T = batch, batch["ids"].shape[0]
        anchors = torch.arange(T - 1, device=b["ids"].device)
        logits = model.block_logits(b["aux"], b["ids"], b["pos"], b["doc"], anchors)
        return logits.view(T - 1, model.g.block_size, -1)[:, 1:k + 1].float(), torch.arange(1, T)


def block_memory(g, tokens, anchors, longest_doc, flex=False):
    """Rough peak bytes of DFlash training: its weights with their gradients and AdamW state (fp32, 16 bytes a
    parameter: a stack of Kimi-size layers is most of it), the frozen embedding and heads, and one micro-batch in
    fp32: the blocks' logits and softmax, every layer's activations, the per-document attention scores (none with
    flex attention). Measured on an H200 at Kimi geometry, block 8, 8192 tokens: 2 layers per document, peak
    33.8 GB, this says ~48; z-lab's 6 layers with flex attention, peak 61.0 GB, this says ~80."""
    q = min(anchors, tokens) * g.block_size
    per_query = 4 * (4 * g.draft_vocab_size + g.num_layers * (14 * g.hidden_size + 3 * g.intermediate_size
                                                             + 2 * (g.num_heads + 2 * g.num_kv_heads) * g.head_dim))
    attn = 0 if flex else 4 * g.num_heads * q * (longest_doc + g.block_size) * g.num_layers * 3
    context = 4 * tokens * (g.num_aux * g.hidden_size + g.num_layers * 4 * g.num_kv_heads * g.head_dim)
    weights = 16 * trainable_count(g) + 2 * g.hidden_size * (g.verifier_vocab_size + 2 * g.draft_vocab_size)
    return weights + q * per_query + attn + context


METHOD = DFlashMethod()
