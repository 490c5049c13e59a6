"""03 + 04 on real extracted SmolLM2 states: overfit, speculators equivalence (EAGLE-3 and EAGLE-3.1), stage 5 on
the validation samples and on long prompts, the printed serve command, the Kimi-K2.5 export geometry. Plan and
packing: test_train_plan.py; failures and resume: test_train_recovery.py; serving both formats with train-serve
parity: test_parity.py."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import OVERFIT, ROOT, run_script, usage_error


def test_overfits_a_few_samples(trained):
    rows = [json.loads(l) for l in (trained / "train" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    last_epoch = [r for r in train if r["epoch"] == train[-1]["epoch"]]  # one row per step (--log-interval 0)
    assert sum(r["full_acc_0"] for r in last_epoch) / len(last_epoch) >= 0.9, last_epoch
    # each row carries its step's gradient norm before clipping; memorising, it falls from the first steps' size
    assert all(r["grad_norm_max"] > 0 for r in train) and train[-1]["grad_norm_max"] < train[0]["grad_norm_max"], train
    last = train[-1]
    man = json.loads((trained / "train" / "manifest.json").read_text())
    best = man["best_validation"]
    assert man["counts"]["steps"] == last["step"]
    # this draft gets some right: measured 1.149 (full_acc_0 0.119) on a 2-core EPYC, 2026-12-07; the floors are half
    # the gain, which a validation that counts nothing (or everything) misses
    assert 1.07 < best["acceptance_length"] < 2.0 and best["full_acc_0"] > 0.05, best
    assert (trained / "train" / "curves.png").stat().st_size > 10000
    cfg = json.loads((trained / "final_draft" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["norm_before_residual"] is True
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27] and cfg["draft_vocab_size"] == 1024
    weights = load_file(str(trained / "final_draft" / "model.safetensors"))
    assert "embed_tokens.weight" not in weights and weights["d2t"].dtype == torch.int64
    assert weights["lm_head.weight"].shape == (1024, 576) and "layers.0.self_attn.q_proj.weight" in weights


def speculators_model(draft_dir):
    """speculators' own Eagle3DraftModel from our exported folder, fp32, with the verifier's embeddings."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    conf = Eagle3SpeculatorConfig.from_pretrained(str(draft_dir))
    conf.transformer_layer_config._attn_implementation = "sdpa"  # its flex attention default is GPU-only
    ref = Eagle3DraftModel.from_pretrained(str(draft_dir), config=conf)
    # embeddings are not in the draft checkpoint (vLLM shares the verifier's); HF init left them zero, not NaN
    ref._load_verifier_weights(overwrite_embed_tokens=True)
    return ref.float().eval()


def float_batch(folder, embed=None):
    from common.train_data import PackedDataset
    batch = PackedDataset(folder, [[0]], 4096, embed=embed)[0]
    return {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in batch.items()}


def same_as_speculators(ref, ours, batch):
    """Both models on one packed sample: the same draft tokens at every TTT step and the same loss; -> our logits."""
    from speculators.losses import resolve_loss_config

    from common.drafts.eagle3 import ttt_loss
    ours.eval()
    with torch.no_grad():
        draft_tokens, ref_loss, _ = ref(
            hidden_states=batch["aux"][None], input_ids=batch["ids"][None], document_ids=batch["doc"][None],
            loss_mask=batch["loss_mask"][None].bool(), position_ids=batch["pos"][None],
            verifier_last_hidden_states=batch["target_hidden"][None], ttt_steps=3, ttt_step_loss_decay=0.8,
            loss_config=resolve_loss_config("kl_div", "eager"))
        logits = ours.unroll(batch["aux"], batch["ids"], batch["pos"], batch["doc"], batch["docs"], 3)
        our_loss, _ = ttt_loss(ours, batch, 3, 0.8)
    for k in range(3):
        n = len(batch["ids"]) - k
        agree = (logits[k].argmax(-1)[:n] == draft_tokens[k][0][:n]).float().mean().item()
        assert agree > 0.99, (k, agree)
    torch.testing.assert_close(our_loss, ref_loss, rtol=2e-3, atol=2e-3)
    return logits, our_loss


def test_speculators_loads_checkpoint_and_computes_same_outputs(trained):
    """speculators' own Eagle3DraftModel, given our exported folder, predicts the same tokens and loss."""
    from common.build_draft import build_model
    from common.drafts.eagle3 import DraftGeometry
    from common.drafts.layers import take_embedding
    from common.drafts.eagle3 import ttt_loss
    from common.train_data import PackedDataset
    ref = speculators_model(trained / "final_draft")
    batch = float_batch(trained / "hidden_states")
    # ours, from the same exported weights
    man = json.loads((trained / "train" / "manifest.json").read_text())
    ours = build_model(DraftGeometry.from_dict(man["params"]["geometry"]), ref.config.speculators_config.verifier.name_or_path,
                       target_ids(trained))
    exported = load_file(str(trained / "final_draft" / "model.safetensors"))
    ours.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in exported.items()}, strict=False)
    _, our_loss = same_as_speculators(ref, ours, batch)
    # the GPU path: embedding taken out of the model, the loader looks the tokens up on the host
    table = ours.embed_tokens.weight.detach().clone()
    host = PackedDataset(trained / "hidden_states", [[0]], 4096, embed=take_embedding(ours, torch.float32))[0]
    assert ours.embed_tokens is None and torch.equal(host["embeds"], table[host["ids"]])
    host = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in host.items()}
    with torch.no_grad():
        assert torch.equal(ttt_loss(ours, host, 3, 0.8)[0], our_loss)


def target_ids(work):
    import numpy as np
    d2t = np.load(work / "vocab" / "d2t.npy")
    return d2t + np.arange(len(d2t))


def test_evaluate_on_the_validation_samples_puts_vllm_beside_training(trained):
    proc = run_script("05_evaluate.py", "--work-dir", trained, "--eval-dataset", "validation", "--max-new-tokens", 24,
                      "--dtype", "float32", "--max-seq-len", 192, "--num-speculative-tokens", "2,3", check=True)
    man = json.loads((trained / "train" / "manifest.json").read_text())
    rows = json.loads((trained / "eval" / "acceptance.json").read_text())["results"]
    assert 1 <= rows[0]["prompts"] <= len(man["validation_samples"]) == man["counts"]["val_samples"]
    best = man["best_validation"]
    assert rows[1]["trainer_simulated_acceptance_length"] == round(best["acceptance_length"], 4)  # k=3 = TTT 3
    assert rows[0]["trainer_simulated_acceptance_length"] == round(1 + best["full_acc_0"] + best["full_acc_1"], 4)
    assert "on the validation samples: vLLM acceptance length" in proc.output


def test_long_prompts_are_measured_beside_short_ones(trained, tmp_path):
    """--eval-dataset mtbench-long: a question alone and after earlier conversation in the 1K-4K and 4K-8K buckets
    (past the 192 tokens this draft trained on), acceptance by category and by context length; the serve command
    then says how far acceptance was measured. A prompt that cannot fit --max-seq-len is refused before any load."""
    args = ["--work-dir", trained, "--eval-dataset", "mtbench-long", "--eval-limit", 3, "--max-new-tokens", 16,
            "--dtype", "float32", "--latency-prompts", 0, "--parity-prompts", 0]
    proc = run_script("05_evaluate.py", *args, "--max-seq-len", 5120, check=True)
    result = json.loads((trained / "eval" / "acceptance.json").read_text())
    row = result["results"][0]
    assert row["prompts"] == 3 and row["outputs_equal_baseline"] == 3
    table = row["breakdown"]["by_category"]
    assert sorted(table) == ["1K-4K", "4K-8K", "short"] and all(v["drafts"] > 0 for v in table.values()), table
    assert list(row["breakdown"]["by_context"]) == ["0-1K", "1K-4K", "4K-8K"]
    assert 4096 < result["serve"]["longest_measured_context"] <= 5120
    cap = result["serve"]["max_model_len"]
    # the farthest bucket within 10% of 0-1K: the verifier's own 8,192 positions; else the longest context measured
    ctx = row["breakdown"]["by_context"]
    within = ctx["4K-8K"]["acceptance_length"] >= 0.9 * ctx["0-1K"]["acceptance_length"]
    assert cap == (8192 if within else result["serve"]["longest_measured_context"]), (ctx, result["serve"])
    assert f"--max-model-len {cap}" in re.search(r"serve it \(OpenAI-compatible server on port 8000\): (.*)",
                                                   proc.output).group(1)
    assert "by prompt category" in (trained / "eval" / "acceptance.md").read_text() and "k=3 by category: 1K-4K" in proc.output
    short = usage_error(run_script("05_evaluate.py", *args, "--max-seq-len", 768, "--dry-run"))
    assert "--max-seq-len 768 leaves no room for a question after 1,024 tokens" in short
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n" + json.dumps({"prompt": "word " * 900}) + "\n")
    line = usage_error(run_script("05_evaluate.py", *args[:3], prompts, "--max-seq-len", 768, "--max-new-tokens", 16,
                                  "--dry-run"))
    assert f"--eval-dataset {prompts}: prompt {prompts}:2 is " in line and "tokens, more than --max-seq-len 768 - " \
        "--max-new-tokens 16 = 752, the longest the engine serves with its answer; raise --max-seq-len" in line


def test_kimi_config_export_matches_aq_medai_reference():
    """configs/kimi-k2.5.yaml exports the AQ-MedAI draft's names and shapes (meta device, no weights)."""
    from common.config import parse_config
    from common.drafts.eagle3 import Eagle3Draft
    from common.export import compare_with_reference, export_weights
    from common.build_draft import geometry
    cfg = parse_config(4, "t", ["--config", str(ROOT / "configs" / "kimi-k2.5.yaml")])
    kimi_text = SimpleNamespace(hidden_size=7168, num_attention_heads=64, num_key_value_heads=64, head_dim=None,
                                intermediate_size=18432, rms_norm_eps=1e-6, rope_theta=50000.0,
                                max_position_embeddings=262144, vocab_size=163840, num_hidden_layers=61)
    g = geometry(cfg, kimi_text, cfg.draft_vocab_size, len(cfg.layer_ids) - 1)
    with torch.device("meta"):
        model = Eagle3Draft(g)
    shapes = {k: list(v.shape) for k, v in export_weights(model, cfg.export_format).items()}
    assert compare_with_reference(shapes, ROOT / "tests" / "data" / "aq_medai_kimi_k25_eagle3_shapes.json") == []


def test_printed_serve_command_starts_a_server_that_serves_the_draft(trained, tmp_path):
    """The command stage 4 prints, run exactly as printed in a shell whose PATH starts with this venv (as a user's
    activated venv): an OpenAI-compatible server; a chat through the openai client; vLLM's spec-decode counters
    on /metrics."""
    import shlex
    import socket
    import urllib.request
    from openai import OpenAI
    log = run_script("04_train.py", "--work-dir", trained, *OVERFIT).output  # finished run: prints it again
    command = re.search(r"serve it \(OpenAI-compatible server on port 8000\): (.*)", log).group(1)
    assert shlex.split(command)[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    words = shlex.split(command)
    assert words[words.index("--max-model-len") + 1] == "192"  # the context the draft trained on
    assert "context: the draft trained on samples of up to 192 tokens (--max-seq-len) with the verifier's rotary " \
           "embedding (plain RoPE, theta 100000, exported with it for 8192 positions)" in log
    # run as printed, in a shell, this venv first on PATH, on a free port instead of 8000 (another server may hold it)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert " --port 8000" in command
    command = command.replace(" --port 8000", f" --port {port}")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    server = subprocess.Popen(["bash", "-c", command], cwd=tmp_path, env=env, stdout=open(tmp_path / "server.log", "w"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 420
        while time.time() < deadline:
            try:
                if urllib.request.urlopen(f"{base}/health", timeout=2).status == 200:
                    break
            except OSError:
                assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
                time.sleep(2)
        client = OpenAI(base_url=f"{base}/v1", api_key="none")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, temperature=0, max_tokens=48,
                                               messages=[{"role": "user", "content": "Name three colours."}])
        assert reply.choices[0].message.content.strip()
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
        count = {name: sum(float(v) for v in re.findall(rf"^vllm:spec_decode_{name}_total{{[^}}]*}} (\S+)$",
                                                        metrics, re.M))
                 for name in ("num_drafts", "num_accepted_tokens")}
        assert count["num_drafts"] > 0, count
        assert 1 + count["num_accepted_tokens"] / count["num_drafts"] > 1.0, count
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)


@pytest.mark.parametrize("norms,layers", [("norm-before-fc", 1), ("fc-norm", 1), ("fc-norm", 2)])
def test_eagle31_norms_compute_what_speculators_computes(extracted, verifier_dir, tmp_path, norms, layers):
    """EAGLE-3.1 drafts (speculators' default since v0.7): our export, loaded by speculators' Eagle3DraftModel,
    gives the same logits at every TTT step and the same loss; the config carries the fields vLLM reads. Two layers
    (--draft-layers 2): the second a plain Llama layer, as speculators and vLLM's llama_eagle3 stack them."""
    from types import SimpleNamespace

    import numpy as np
    from common.build_draft import build_model, geometry
    from common.export import export_draft
    from common.models import load_verifier_config
    text_cfg = load_verifier_config(verifier_dir)
    # fc-norm at the shipped Kimi EAGLE config's relations: heads x head dim (12 x 64) != hidden (576), 4 KV heads,
    # norm_before_residual false; norm-before-fc at SmolLM2's own (9 x 64, 3 KV heads, norm_before_residual true)
    kimi = norms == "fc-norm"
    cfg = SimpleNamespace(draft_num_heads=12 if kimi else 0, draft_num_kv_heads=4 if kimi else 0,
                          draft_head_dim=64 if kimi else 0, draft_intermediate_size=256,
                          norm_before_residual=not kimi, draft_norms=norms, draft_layers=layers)
    g = geometry(cfg, text_cfg, 1024, 3)
    assert g.num_layers == layers
    assert (g.norm_before_fc, g.fc_norm, g.norm_output) == (norms == "norm-before-fc", norms == "fc-norm", True)
    assert (g.num_heads * g.head_dim != g.hidden_size, g.norm_before_residual) == (kimi, not kimi)
    torch.manual_seed(0)
    ours = build_model(g, verifier_dir, np.arange(1024))
    with torch.no_grad():  # norms away from their all-ones init, so that a skipped or misplaced norm shows
        for name, p in ours.named_parameters():
            if p.requires_grad and p.dim() == 1:
                p.uniform_(0.5, 1.5)
    names = {"norm-before-fc": "input_norm.weight", "fc-norm": "fc_norm.2.weight"}
    export_draft(ours, tmp_path / "d", SimpleNamespace(export_format="speculators", ttt_steps=3), [2, 15, 27],
                 verifier_dir, text_cfg, {})
    exported = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert names[norms] in exported
    saved = json.loads((tmp_path / "d" / "config.json").read_text())
    assert (saved["norm_before_fc"], saved["fc_norm"], saved["norm_output"]) == (g.norm_before_fc, g.fc_norm, True)
    assert saved["norm_before_residual"] is (not kimi)
    assert saved["transformer_layer_config"]["num_hidden_layers"] == layers and ("layers.1.mlp.up_proj.weight" in exported) == (layers == 2)
    ours.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in exported.items()}, strict=False)
    batch = float_batch(extracted / "hidden_states")
    logits, _ = same_as_speculators(speculators_model(tmp_path / "d"), ours, batch)
    # the same draft without its norm_output: step 0 unchanged, later steps differ (the flag is live)
    ours.g.norm_output = False
    with torch.no_grad():
        plain = ours.unroll(batch["aux"], batch["ids"], batch["pos"], batch["doc"], batch["docs"], 3)
    assert torch.equal(plain[0], logits[0]) and not torch.allclose(plain[2], logits[2], atol=1e-3)


def test_draft_init_verifier_starts_the_layers_as_the_verifiers_last(verifier_dir):
    """--draft-init verifier on the real SmolLM2 (30 layers): a 2-layer EAGLE-3 draft starts as layers 28 and 29,
    the first layer's q/k/v taking them into the hidden half of their [embeddings | hidden] input."""
    import numpy as np
    from common.build_draft import build_model, geometry, verifier_init_plan
    from common.errors import UsageError
    from common.models import load_verifier_config, read_tensor, verifier_layer_tensors
    text_cfg = load_verifier_config(verifier_dir)
    cfg = SimpleNamespace(draft_num_heads=0, draft_num_kv_heads=0, draft_head_dim=0, draft_intermediate_size=0,
                          norm_before_residual=True, draft_norms="fc-norm", draft_layers=2)
    g = geometry(cfg, text_cfg, 1024, 3)
    plan = verifier_init_plan(g, verifier_dir, text_cfg)
    torch.manual_seed(0)
    draft = build_model(g, verifier_dir, np.arange(1024), init_plan=plan)
    found = verifier_layer_tensors(verifier_dir, [28, 29])
    verifier = lambda layer, name: read_tensor(verifier_dir, *found[layer, name][:2]).float()
    q = draft.layers[0].self_attn.q_proj.weight
    assert torch.equal(q[:, 576:], verifier(28, "self_attn.q_proj.weight"))
    assert abs(q[:, :576].std().item() - 0.02) < 0.002  # the embeddings' half: the random init
    assert torch.equal(draft.layers[0].hidden_norm.weight, verifier(28, "input_layernorm.weight"))
    assert torch.equal(draft.layers[1].mlp.down_proj.weight, verifier(29, "mlp.down_proj.weight"))
    assert len(plan) == 10 + 9 and all(p.requires_grad for p in draft.layers.parameters())
    with pytest.raises(UsageError, match="cannot start as the verifier's"):  # another MLP width
        verifier_init_plan(geometry(SimpleNamespace(**{**vars(cfg), "draft_intermediate_size": 256}), text_cfg,
                                    1024, 3), verifier_dir, text_cfg)


@pytest.mark.parametrize("script, seq, fix", [("01_prepare_dataset.py", 8192, 8191), ("02_extract_hidden_states.py", 8192, 8191),
                                              ("04_train.py", 8193, 8192), ("05_evaluate.py", 9000, 8192)])
def test_a_context_beyond_the_verifiers_is_refused_before_any_load(trained, script, seq, fix):
    """SmolLM2 has 8,192 positions: a longer --max-seq-len would start no engine (vLLM refuses it) or train a draft
    at positions its verifier never serves. Stages 1-2 keep one position for the token stage 2's engine generates."""
    run = ["--draft-vocab-size", 1024] if script == "04_train.py" else []  # the run's own vocab, checked first
    proc = run_script(script, "--work-dir", trained, "--max-seq-len", seq, "--dry-run", *run)
    usage_error(proc)
    assert f"error: --max-seq-len {seq}: the verifier embedded:smollm2-135m-instruct has 8192 positions " \
           f"(max_position_embeddings in its config)" in proc.stderr
    assert proc.stderr.strip().endswith(f"use --max-seq-len {fix} or less"), proc.stderr
