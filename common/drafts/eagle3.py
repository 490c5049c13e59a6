"""The EAGLE-3 draft model in plain PyTorch, with speculators 0.9.0's weight names and math.

  fc:      [aux_1 | aux_2 | aux_3] (3H) -> H
  layer:   one Llama decoder layer whose q/k/v read [input_layernorm(embed) | hidden_norm(h)] (2H)
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

from common.drafts import layers
from common.drafts.layers import MLP, Geometry, Linear, RMSNorm, rope
from common.drafts.losses import ttt_loss
from common.drafts.ttt_plan import index_plan, make_plan


@dataclass(kw_only=True)
class DraftGeometry(Geometry):
    num_aux: int = 3
    norm_before_residual: bool = True
    # EAGLE-3.1 (speculators >= 0.7): one RMSNorm over the concatenated aux states before fc (norm_before_fc)
    # or one per aux layer (fc_norm); norm_output: the post-norm state, not the pre-norm one, feeds the next step
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    rope_scaling: dict = None


class Attention(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.g = g
        self.q_proj = Linear(2 * g.hidden_size, g.num_heads * g.head_dim, bias=False)
        self.k_proj = Linear(2 * g.hidden_size, g.num_kv_heads * g.head_dim, bias=False)
        self.v_proj = Linear(2 * g.hidden_size, g.num_kv_heads * g.head_dim, bias=False)
        self.o_proj = Linear(g.num_heads * g.head_dim, g.hidden_size, bias=False)

    def forward(self, x, xq, pos, qpos, plan, step):
        """x [N, 2H] the step's rows (keys/values); xq [Nq, 2H] its query rows; pos/qpos their positions."""
        g = self.g
        q = self.q_proj(xq).view(-1, g.num_heads, g.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(-1, g.num_kv_heads, g.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(-1, g.num_kv_heads, g.head_dim).transpose(0, 1)
        q, k = rope(q, qpos, g.rope_theta), rope(k, pos, g.rope_theta)
        plan.cache.append((k, v))
        out = plan.attend(q, step)
        return self.o_proj(out.transpose(0, 1).reshape(q.shape[1], -1))


class DecoderLayer(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.g = g
        self.self_attn = Attention(g)
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


class Eagle3Draft(nn.Module):
    def __init__(self, g: DraftGeometry):
        super().__init__()
        self.g = g
        self.embed_tokens = nn.Embedding(g.verifier_vocab_size, g.hidden_size)
        self.input_norm = RMSNorm(g.num_aux * g.hidden_size, g.rms_norm_eps) if g.norm_before_fc else None
        self.fc_norm = nn.ModuleList([RMSNorm(g.hidden_size, g.rms_norm_eps) for _ in range(g.num_aux)]) \
            if g.fc_norm else None
        self.fc = Linear(g.num_aux * g.hidden_size, g.hidden_size, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(g)])
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

    def forward(self, batch, ttt_steps, decay):
        """Training: -> (loss, metrics); see ttt_loss. A forward() so DDP can wrap the model."""
        return ttt_loss(self, batch, ttt_steps, decay)

    def run_steps(self, aux, embeds, pos, plan):
        """Teacher-forced TTT unroll over plan.rows; yields (step, output hidden [len(rows[k]), H]).
        embeds [T, H]: the input embeddings of the tokens (token i+1 at row i)."""
        hidden = self.fc(self.normed_aux(aux))
        layer = self.layers[0]
        h = layer(embeds, hidden, pos, plan, 0, qsel=plan.rows[0])
        yield 0, h
        for k in range(1, len(plan.rows)):
            rows = plan.rows[k]
            # rows[k] is a subset of rows[k-1]: carry each row's hidden state forward
            carried = self.norm(h) if self.g.norm_output else h
            h = layer(embeds[rows + k], carried[plan.lookup[k - 1][rows]], pos[rows] + k, plan, k)
            yield k, h

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
        layer = model.layers[0]
        for m in (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, layer.mlp, model.norm,
                  model.verifier_norm, model.input_norm, *(model.fc_norm or [])):
            if m is not None:
                m.compile(dynamic=True)
    layers.use_compiled_rope(compile_layers)
    return model


def take_embedding(model, dtype):
    """Remove the frozen input embedding from the model; -> its weight in `dtype`, a host tensor. On GPUs the
    loader looks up each batch's tokens in it, so only [T, H] rows travel and the table (163840 x 7168 =
    2.3 GB in bf16 at Kimi scale) takes no GPU memory."""
    w = model.embed_tokens.weight.detach().to(dtype)
    model.embed_tokens = None
    return w
