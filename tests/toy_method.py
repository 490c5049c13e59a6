"""A toy draft method, the smallest that implements common/drafts/method.DraftMethod: one linear layer predicting the
verifier's next token from the last aux layer's state (no attention, one drafted token). tests/test_draft_interface.py
registers it through EAGLE3_DRAFT_METHODS=toy_method and runs stage 4 with --draft-method toy; nothing else in the
project knows it. docs/adding-a-draft-method.md walks through it."""
from dataclasses import dataclass

import torch
from torch import nn

from common.drafts import register
from common.drafts.layers import Geometry, RMSNorm
from common.drafts.interface import DraftMethod


@dataclass(kw_only=True)
class ToyGeometry(Geometry):
    method = "toy"  # not a field: the registry's name for the method of this geometry
    num_aux: int


class ToyDraft(nn.Module):
    """Trainable: proj, norm; frozen (filled by common/build_draft.build_model from the verifier): embed_tokens,
    lm_head (the verifier's rows of the draft vocab), verifier_norm, verifier_lm_head, d2t / t2d."""

    def __init__(self, g):
        super().__init__()
        self.g = g
        H = g.hidden_size
        self.proj = nn.Linear(H, H, bias=False)
        self.norm = RMSNorm(H, g.rms_norm_eps)
        self.embed_tokens = nn.Embedding(g.verifier_vocab_size, H)
        self.lm_head = nn.Linear(H, g.draft_vocab_size, bias=False)
        self.verifier_norm = RMSNorm(H, g.rms_norm_eps)
        self.verifier_lm_head = nn.Linear(H, g.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(g.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(g.verifier_vocab_size, dtype=torch.bool))
        for m in (self.embed_tokens, self.lm_head, self.verifier_norm, self.verifier_lm_head):
            m.requires_grad_(False)
        nn.init.normal_(self.proj.weight, std=0.02)

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    def forward(self, batch):
        """-> (loss, metrics in the keys common/metrics.summarize reads) on one packed sequence. With shift 1 the
        states of token t sit beside token t + 1, and target_hidden is the verifier's final state that predicts it."""
        last = batch["aux"][:, -self.g.hidden_size:]
        logits = self.lm_head(self.norm(self.proj(last))).float()
        with torch.no_grad():
            target = self.verifier_lm_head(self.verifier_norm(batch["target_hidden"])).argmax(-1)
        mask = batch["loss_mask"].bool()
        ce = nn.functional.cross_entropy(logits, target, reduction="none")
        loss = (ce * mask).sum() / mask.sum().clamp(min=1)
        right = (logits.argmax(-1) == target) & mask
        return loss, {"loss_0": loss.detach(), "full_correct_0": right.sum(), "full_total_0": mask.sum(),
                      "cond_correct_0": right.sum(), "cond_total_0": mask.sum()}


class ToyMethod(DraftMethod):
    name = "toy"
    shift = 1

    def geometry(self, cfg, shared, draft_vocab, num_aux, tokenizer, log=None):
        return ToyGeometry(**shared, draft_vocab_size=draft_vocab, num_aux=num_aux)

    def geometry_class(self):
        return ToyGeometry

    def model(self, g):
        return ToyDraft(g)

    def positions(self, cfg):
        return 1

    def memory(self, g, cfg, longest_doc, device):
        return 4 * cfg.max_tokens_per_step * (2 * g.draft_vocab_size + 4 * g.hidden_size)

    def export_config(self, g, cfg, aux_ids, verifier_name, verifier_config):
        return {"speculators_model_type": "toy", "aux_layer_ids": list(aux_ids), "hidden_size": g.hidden_size,
                "draft_vocab_size": g.draft_vocab_size, "verifier": str(verifier_name)}


METHOD = ToyMethod()
register("toy", __name__)
