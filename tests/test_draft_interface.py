"""The draft interface is complete: a method the project has never heard of (tests/toy_method.py, registered through
EAGLE3_DRAFT_METHODS) trains through stage 4 on the embedded data, checkpoints, resumes and exports, with no edit
anywhere else. And the stages name no method outside common/drafts/ (the option's choices and help aside)."""
import json
import re

import pytest
from safetensors.torch import load_file

from conftest import copy_work, ROOT, run_script, usage_error

TOY = {"EAGLE3_DRAFT_METHODS": "toy_method", "PYTHONPATH": str(ROOT / "tests")}
ARGS = ["--draft-method", "toy", "--draft-vocab-size", 1024, "--epochs", 3, "--max-tokens-per-step", 256,
        "--num-workers", 0, "--val-fraction", 0.5, "--lr", 3e-3, "--warmup-steps", 2, "--max-seq-len", 192,
        "--amp", "off", "--log-interval", 0, "--save-every", 2, "--keep-last", 1]


@pytest.fixture(scope="module")
def toy_run(extracted, tmp_path_factory):
    work = copy_work(extracted, tmp_path_factory.mktemp("toy") / "w")
    run_script("03_build_vocab_mapping.py", "--work-dir", work, "--draft-vocab-size", 1024, check=True)
    proc = run_script("04_train.py", "--work-dir", work, *ARGS, env=TOY)
    assert proc.returncode == 0, proc.output[-3000:]
    return work, proc.output


def test_a_registered_toy_method_trains_checkpoints_resumes_and_exports(toy_run):
    work, out = toy_run
    man = json.loads((work / "train" / "manifest.json").read_text())
    assert man["params"]["draft_method"] == "toy" and man["params"]["positions"] == 1
    assert "plan:" in out and ", toy, " in out  # the method's own phrase in the plan line
    rows = [json.loads(line) for line in (work / "train" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == man["counts"]["steps"] >= 4 and train[-1]["loss_0"] < train[0]["loss_0"], train
    assert train[-1]["full_acc_0"] > 0.05  # the verifier's next token from its own last aux state: learnable
    conf = json.loads((work / "final_draft" / "config.json").read_text())
    assert conf["speculators_model_type"] == "toy" and conf["aux_layer_ids"] == [2, 15, 27]
    first = load_file(str(work / "final_draft" / "model.safetensors"))
    assert sorted(first) == ["d2t", "lm_head.weight", "norm.weight", "proj.weight", "t2d"]
    # the same command again: resumed from its last checkpoint, nothing trained, the same export
    again = run_script("04_train.py", "--work-dir", work, *ARGS, env=TOY, check=True)
    assert "resumed from" in again.output and re.search(r"checkpoints/step_\d+", again.output)
    second = load_file(str(work / "final_draft" / "model.safetensors"))
    assert all((first[k] == second[k]).all() for k in first)


def test_an_unregistered_method_is_one_line_naming_the_choices(toy_run):
    work, _ = toy_run
    proc = run_script("04_train.py", "--work-dir", work, *ARGS)  # no EAGLE3_DRAFT_METHODS: no toy
    usage_error(proc)
    assert "--draft-method: invalid choice: 'toy' (choose from 'eagle3', 'dflash')" in proc.stderr, proc.stderr


def test_no_stage_names_a_method_outside_the_draft_package():
    """Every method-specific choice lives in common/drafts/; elsewhere a method is named only in --draft-method's
    option (its choices and help, common/config.py), in comments, docstrings and log text, and in common/engine.py's
    copy of vLLM's runner rule (vLLM's method names, not ours)."""
    files = [*ROOT.glob("[0-9]*.py"), *(ROOT / "common").glob("*.py")]
    branch = re.compile(r"""(==|!=|\bin\b|\bnot in\b)\s*\(?["'](eagle3|dflash)["']|["'](eagle3|dflash)["']\s*(==|!=)"""
                        r"""|hasattr\([^)]*block_size""")
    hits = []
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if branch.search(code) and path.name not in ("config.py", "engine.py"):
                hits.append(f"{path.name}:{n}: {line.strip()}")
    assert not hits, hits
