"""Stage 4's plan, without training: epochs cut to whole global batches, first-fit packing, the train/validation
split by conversation, --hidden-noise, a draft built from checkpoint weights, the eager loss without a C++ compiler,
the optimizer (AdamW, or Muon + AdamW) and the learning-rate schedule."""
from types import SimpleNamespace

import pytest
import torch


def test_epochs_cut_to_whole_global_batches():
    """Each epoch holds a multiple of ranks x accumulation packed sequences (no gradient carried over);
    too few sequences for one global batch is a usage error before any model is built."""
    from common.errors import UsageError
    from common.train_data import pack
    from common.trainer import plan_epochs
    lengths = {i: 100 + 37 * i for i in range(40)}
    cfg = SimpleNamespace(max_tokens_per_step=512, seed=0, epochs=3, grad_accum=2)
    full = [pack(list(lengths), lengths, 512, 0, e) for e in range(3)]
    for world in (1, 2, 3):
        bins = plan_epochs(list(lengths), lengths, cfg, world)
        for b, f in zip(bins, full):
            assert len(b) % (world * 2) == 0 and len(f) - len(b) < world * 2 and b == f[:len(b)]
    with pytest.raises(UsageError, match="grad-accum"):
        plan_epochs(list(lengths), lengths, SimpleNamespace(**{**vars(cfg), "grad_accum": 64}), 1)


def test_first_fit_packing_fills_sequences():
    """Every sample exactly once, no sequence over budget, and sequences ~full (in-order packing: 91.6%),
    so the ranks of a multi-GPU step carry nearly equal work; the seeded order changes per epoch."""
    import random
    from common.train_data import pack
    rng = random.Random(0)
    lengths = {i: rng.randint(200, 2048) for i in range(3000)}
    bins = pack(list(lengths), lengths, 8192, 0, 0)
    assert sorted(i for b in bins for i in b) == sorted(lengths)
    used = [sum(lengths[i] - 1 for i in b) for b in bins]
    assert max(used) <= 8192 and sum(used) / (len(bins) * 8192) > 0.98, sum(used) / (len(bins) * 8192)
    assert sorted(used)[len(used) // 10] > 7800  # the 10th percentile: in-order packing left it near 6,800
    assert pack(list(lengths), lengths, 8192, 0, 1) != bins == pack(list(lengths), lengths, 8192, 0, 0)


def test_hidden_noise_scales_with_each_layers_state():
    """--hidden-noise: per token and layer, noise std = scale x that state's RMS (aux layers differ in scale
    by orders of magnitude); dtype kept; each packed sequence's own noise, the same for the same seed whatever the
    global RNG holds (a rank, an accumulating process and a resumed run draw alike)."""
    from common.trainer import add_noise
    torch.manual_seed(0)
    scales = torch.tensor([0.5, 4.0, 60.0])  # like early / middle / late residual streams
    aux = (torch.randn(64, 3, 512) * scales[None, :, None]).reshape(64, 3 * 512).bfloat16()
    a, b = add_noise(aux, 0.1, 3, seed=7), add_noise(aux, 0.1, 3, seed=8)
    assert a.dtype == torch.bfloat16 and a.shape == aux.shape and not torch.equal(a, b)
    torch.manual_seed(123)  # the global generator does not enter
    assert torch.equal(add_noise(aux, 0.1, 3, seed=7), a)
    rel = ((a.float() - aux.float()).view(64, 3, 512).pow(2).mean(-1).sqrt()
           / aux.float().view(64, 3, 512).pow(2).mean(-1).sqrt())
    assert rel.shape == (64, 3) and 0.085 < rel.min() and rel.max() < 0.115, rel


def test_a_conversations_two_answers_stay_on_one_side_of_the_split():
    from common.train_data import split_samples
    ids = [f"c{j}" for j in range(20)] + [f"c{j}#original" for j in range(20)]
    train, val = split_samples(range(40), 0.1, seed=0, conversation=lambda i: ids[i].removesuffix("#original"))
    assert len(val) == 4 and sorted(train + val) == list(range(40))
    held = {ids[i].removesuffix("#original") for i in val}
    assert len(held) == 2 and not held & {ids[i].removesuffix("#original") for i in train}
    t2, v2 = split_samples(range(40), 0.1, seed=0)  # by sample: a held-out answer's twin trains
    assert {ids[i].removesuffix("#original") for i in v2} & {ids[i].removesuffix("#original") for i in t2}


def test_build_model_from_trained_weights_skips_random_init(extracted):
    """The FSDP export path: a draft built from checkpoint weights equals one loaded the usual way."""
    from common.drafts.eagle3 import DraftGeometry
    from common.models import resolve_verifier
    from common.build_draft import build_model
    from common.checkpoints import trainable_state
    g = DraftGeometry(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=256,
                      rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=2048, verifier_vocab_size=49152,
                      draft_vocab_size=49152, num_aux=3, norm_before_residual=True)
    model_dir = resolve_verifier("embedded:smollm2-135m-instruct")
    torch.manual_seed(0)
    ref = build_model(g, model_dir, None)
    fast = build_model(g, model_dir, None, trainable_state(ref))
    a, b = ref.state_dict(), fast.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(RuntimeError, match="lacks trainable"):
        build_model(g, model_dir, None, {k: v for k, v in trainable_state(ref).items() if not k.startswith("fc")})


def test_no_cpu_compiler_means_eager_loss_with_a_warning(monkeypatch, caplog):
    """A machine without a C++ compiler trains with the eager loss instead of failing after the model load."""
    import logging
    from torch._inductor import cpp_builder
    from common.precision import cpu_compiler_found

    def missing():
        raise RuntimeError("Failed to find a working C++ compiler")
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", missing)
    log = logging.getLogger("test")
    with caplog.at_level(logging.WARNING):
        assert cpu_compiler_found(log) is False
    assert "no C++ compiler" in caplog.text and "--no-compile" in caplog.text


def small_draft(train_head=False):
    from common.drafts.eagle3 import DraftGeometry, Eagle3Draft
    torch.manual_seed(0)
    g = DraftGeometry(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, rms_norm_eps=1e-6,
                      rope_theta=1e4, max_position_embeddings=64, verifier_vocab_size=50, draft_vocab_size=20)
    model = Eagle3Draft(g)
    model.lm_head.weight.requires_grad_(train_head)
    return model


def fake_step(model, opt, sched, seed):
    """One optimizer step with seeded gradients on every trainable weight."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.trainable_parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def test_muon_takes_the_hidden_matrices_adamw_the_rest_and_a_checkpoint_resumes_both(tmp_path):
    """--optimizer muon: Muon over the 2-D hidden weights (attention, MLP, fc), AdamW over norms and a trained lm_head;
    one scheduler moves both groups' lr; a checkpoint written mid-run resumes to the weights of a run never stopped."""
    from common.checkpoints import load_checkpoint, save_checkpoint, trainable_state
    from common.optim import MuonAdamW, build_optimizer, lr_lambda, muon_split
    model = small_draft(train_head=True)
    matrices, rest = muon_split(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert matrices and all(p.ndim == 2 and "lm_head" not in names[id(p)] for p in matrices)
    assert "lm_head.weight" in {names[id(p)] for p in rest} and all(p.ndim == 1 or "lm_head" in names[id(p)]
                                                                     for p in rest)
    assert len(matrices) + len(rest) == len(model.trainable_parameters())
    cfg = SimpleNamespace(optimizer="muon", lr=1e-2, weight_decay=0.0)

    def fresh():
        m = small_draft(train_head=True)
        o = build_optimizer(m, cfg, torch.device("cpu"))
        return m, o, torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(1, 6, "linear"))
    model, opt, sched = fresh()
    assert isinstance(opt, MuonAdamW) and set(opt.parts) == {"muon", "adamw"}
    before = {k: v.clone() for k, v in trainable_state(model).items()}
    for s in range(3):
        fake_step(model, opt, sched, s)
    assert all(g["lr"] == pytest.approx(1e-2 * 0.6) for g in opt.param_groups)  # both groups scheduled
    assert all(not torch.equal(before[k], v) for k, v in trainable_state(model).items())  # every weight moved
    save_checkpoint(tmp_path / "step_3", trainable_state(model), opt.state_dict(), sched, {"step": 3})
    for s in range(3, 5):
        fake_step(model, opt, sched, s)
    model2, opt2, sched2 = fresh()
    load_checkpoint(tmp_path / "step_3", model2, opt2, sched2)
    for s in range(3, 5):
        fake_step(model2, opt2, sched2, s)
    a, b = trainable_state(model), trainable_state(model2)
    assert all(torch.equal(a[k], b[k]) for k in a)



def test_our_muon_is_torchs_in_bf16_and_runs_newton_schulz_in_fp32_where_training_does():
    """common.optim.Muon steps as torch.optim.Muon, bit for bit in bf16; in fp32 (CPUs without fast bf16, where
    torch's bf16 iteration took 25 s a step) the same update to bf16's rounding."""
    from common.optim import MUON, Muon, build_optimizer
    gen = torch.Generator().manual_seed(0)
    shapes, grads = [(48, 80), (96, 32)], [[torch.randn(48, 80, generator=gen), torch.randn(96, 32, generator=gen)]
                                           for _ in range(3)]

    def run(make):
        ps = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(1))) for s in shapes]
        opt = make(ps)
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            opt.step()
        return [p.detach() for p in ps]
    theirs = run(lambda ps: torch.optim.Muon(ps, lr=0.02, **MUON))
    ours_bf16 = run(lambda ps: Muon(ps, torch.bfloat16, lr=0.02, **MUON))
    ours_fp32 = run(lambda ps: Muon(ps, torch.float32, lr=0.02, **MUON))
    assert all(torch.equal(a, b) for a, b in zip(theirs, ours_bf16))
    for a, b in zip(theirs, ours_fp32):
        torch.testing.assert_close(b, a, rtol=0, atol=0.02 * 3 * 0.2 * 96 ** 0.5 * 0.05)
        assert not torch.equal(a, b)
    model = small_draft(train_head=True)
    cfg = SimpleNamespace(optimizer="muon", lr=1e-3, weight_decay=0.0)
    assert build_optimizer(model, cfg, torch.device("cpu"), bf16=False).parts["muon"].ns_dtype == torch.float32
    assert build_optimizer(model, cfg, torch.device("cpu"), bf16=True).parts["muon"].ns_dtype == torch.bfloat16

def test_the_schedules_decay_to_zero_after_the_warmup():
    from common.optim import lr_lambda
    cos, lin = lr_lambda(2, 10, "cosine"), lr_lambda(2, 10, "linear")
    assert [cos(0), cos(1), lin(0), lin(1)] == [0.5, 1.0, 0.5, 1.0]
    assert lin(6) == pytest.approx(0.5) and cos(6) == pytest.approx(0.5) and cos(4) > lin(4)
    assert lin(10) == cos(10) == 0.0 and lin(20) == 0.0


def test_a_checkpoint_written_before_an_option_existed_resumes_at_its_default():
    """Settings added since a checkpoint was written count at their defaults (what that version did); another
    method's options recorded then are ignored; a setting that differs still differs."""
    from common.drafts.dflash import DFlashGeometry
    from common.trainer import with_later_defaults
    g = DFlashGeometry(hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=8, rms_norm_eps=1e-6,
                       rope_theta=1e4, max_position_embeddings=64, verifier_vocab_size=50, draft_vocab_size=20,
                       num_layers=1, block_size=4, num_aux=3, mask_token_id=1)
    now = {"lr": 1e-3, "optimizer": "adamw", "block_attention": "bidirectional", "geometry": g.to_dict()}
    old = {"lr": 1e-3, "ttt_steps": 3, "geometry": {k: v for k, v in g.to_dict().items() if k != "causal"}}
    assert with_later_defaults(old, now, g) == now
    assert with_later_defaults(dict(old, lr=2e-3), now, g) != now
    assert with_later_defaults(old, dict(now, optimizer="muon"), g) != dict(now, optimizer="muon")
