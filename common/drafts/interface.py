"""The interface of a draft method: what the stages, the trainer, the export, the parity check and the bench scripts
ask of it. A method is one module of this package (eagle3.py, dflash.py) defining `METHOD = Its(DraftMethod)`;
common/drafts/__init__.py registers it by name. The defaults here are an EAGLE-style method's; a method overrides
what differs. docs/adding-a-draft-method.md walks a toy method through stage 4.
"""


class DraftMethod:
    name = ""
    shift = 1  # a batch puts token t + shift beside the states of t (EAGLE-3 predicts the next token: 1)
    options = ()  # its own stage-4 options: a resumed run keeps them; stage 4's manifest records them
    needs_speculators = False  # its export builds config.json with speculators' classes
    host_embedding = False  # on GPUs the loader looks its input embeddings up in host memory
    validation_args = ()  # extra forward arguments of a validation batch

    # ---- geometry and model
    def geometry(self, cfg, shared, draft_vocab, num_aux, tokenizer, log=None):
        """The draft's shapes. shared: the verifier-derived fields of common/drafts/layers.Geometry (heads, dims,
        RoPE, vocab sizes, with --draft-* overrides); tokenizer: a callable -> the verifier's tokenizer."""
        raise NotImplementedError

    def geometry_class(self):
        """The geometry dataclass (stage 4's manifest keeps its fields: parity and bench rebuild it)."""
        raise NotImplementedError

    def model(self, g):
        """A fresh nn.Module of geometry g with the trainable_parameters() method and the frozen pieces the builder
        fills: embed_tokens, lm_head, verifier_lm_head, verifier_norm, d2t, t2d."""
        raise NotImplementedError

    def verifier_source(self, layer, name):
        """--draft-init verifier: the weight of the verifier's layer that parameter `name` of draft layer `layer`
        starts as -> (its name in the verifier's layer, part): part None (the same shape) or "hidden" (the draft's
        input is [embeddings | hidden], twice the verifier's width: it takes the second half)."""
        return name, None

    def note(self, g, cfg):
        """One phrase for stage 4's plan line."""
        return self.name

    # ---- training
    def loss_args(self, cfg):
        """The forward's arguments after the batch: model(batch, *loss_args) -> (loss, metrics)."""
        return ()

    def step_kwargs(self, seed):
        """Keyword arguments of one training forward, from a seed that is the packed sequence's own (--seed, epoch,
        its index in the epoch): a method that draws at random draws from it, so that a run on any number of ranks,
        accumulating or resumed, draws what an uninterrupted one-process run draws."""
        return {}

    def positions(self, cfg):
        """Drafted tokens per verify step: the per-position metrics' length and the k vLLM serves."""
        raise NotImplementedError

    def prepare_bf16(self, model, cfg, device):
        """bf16 autocast on this device: frozen pieces in bf16, optional fused kernels."""

    def memory(self, g, cfg, longest_doc, device):
        """Rough peak bytes of one micro-batch (stage 4 refuses one that cannot fit, before training)."""
        raise NotImplementedError

    # ---- export and serving
    def export_config(self, g, cfg, aux_ids, verifier_name, verifier_config):
        """config.json of the exported draft, as vLLM reads it."""
        raise NotImplementedError

    def export_weights(self, sd, fmt):
        """Its weight names in export format fmt (state_dict names -> the layout vLLM loads)."""
        return sd

    def import_weights(self, sd):
        """The inverse of export_weights: an exported folder's names -> state_dict names."""
        return sd

    def exports(self, conf):
        """Whether an exported config.json holds a draft of this method."""
        return conf.get("speculators_model_type") == self.name

    def served_k(self, conf, cfg, log=None):
        """The k's stage 5 serves this exported draft at."""
        return sorted(set(cfg.num_speculative_tokens))

    def draft_passes(self, k):
        """Draft forward passes per verify step at k drafted tokens (an autoregressive draft: k; a block draft: 1):
        the cost side of common/speedup.py's prediction."""
        return k

    def trained_fields(self, g, params):
        """Its fields of common/served.py's comparison, as stage 4 trained them (g: the manifest's geometry dict)."""
        return {}

    def served_fields(self, hf, raw):
        """The same fields as vLLM reads them (hf: vLLM's config object, raw: the config.json dict)."""
        return {}

    def predict(self, model, batch, k):
        """Logits [S, k, draft vocab] of every verify step of one stored sample, and the first drafted token's
        position of each (a tensor [S]): what training simulates there (common/parity.py)."""
        raise NotImplementedError
