"""Config and flag handling: one schema, YAML + overrides, exit 2 with a suggestion."""
import pytest

from common.config import parse_config
from common.errors import UsageError
from conftest import ROOT, run_script, usage_error


def test_yaml_then_command_line_precedence(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("num_samples: 7\nmax_seq_len: 512\nlayer_ids: [1, 2, 3, 4]\n")
    cfg = parse_config(1, "t", ["--config", str(cfg_file), "--max-seq-len", "256"])
    assert cfg.num_samples == 7 and cfg.source["num_samples"] == "config"
    assert cfg.max_seq_len == 256 and cfg.source["max_seq_len"] == "command line"
    assert cfg.layer_ids == [1, 2, 3, 4]
    assert cfg.seed == 0 and cfg.source["seed"] == "default"


def test_unknown_yaml_key_suggests(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("max_seq_lenn: 5\n")
    with pytest.raises(UsageError, match="did you mean max_seq_len"):
        parse_config(1, "t", ["--config", str(cfg_file)])


def test_bad_values_refused():
    with pytest.raises(UsageError, match="--max-seq-len must be >= 2"):
        parse_config(1, "t", ["--max-seq-len", "0"])
    with pytest.raises(UsageError, match="shard-index"):
        parse_config(2, "t", ["--shard-index", "2", "--num-shards", "2"])
    with pytest.raises(UsageError, match="invalid int value"):
        parse_config(1, "t", ["--num-samples", "many"])
    with pytest.raises(UsageError, match="--hidden-noise must be >= 0"):
        parse_config(4, "t", ["--hidden-noise", "-0.1"])
    with pytest.raises(UsageError, match="invalid choice: 'adam'"):
        parse_config(4, "t", ["--optimizer", "adam"])
    with pytest.raises(UsageError, match="--optimizer muon does not run with --parallel fsdp"):
        parse_config(4, "t", ["--optimizer", "muon", "--parallel", "fsdp"])


def test_every_stage_accepts_every_option():
    # the wrapper passes one flag set to all stages
    for stage in (1, 2, 3, 4, 5):
        cfg = parse_config(stage, "t", ["--draft-vocab-size", "100", "--num-samples", "3", "--eval-limit", "2"])
        assert (cfg.draft_vocab_size, cfg.num_samples, cfg.eval_limit) == (100, 3, 2)


def test_unknown_flag_exits_2_with_suggestion():
    proc = run_script("01_prepare_dataset.py", "--num-sample", "5")
    assert proc.returncode == 2
    assert "unknown option --num-sample; did you mean --num-samples?" in proc.stderr
    assert "Traceback" not in proc.output


def test_a_gpu_recipe_is_refused_by_every_stage_where_no_gpu_is_visible(tmp_path):
    """configs/smollm2-135m-gpu.yaml (needs_gpu: true) on this CPU-only machine: one line, exit 2, before any load;
    --no-needs-gpu runs it anyway."""
    from common.engine import has_gpu
    if has_gpu():
        pytest.skip("a GPU is visible here")
    gpu = str(ROOT / "configs" / "smollm2-135m-gpu.yaml")
    proc = run_script("01_prepare_dataset.py", "--config", gpu, "--work-dir", tmp_path)
    usage_error(proc)
    assert f"{gpu} asks for a GPU recipe" in proc.stderr and "--no-needs-gpu" in proc.stderr
    for stage in (2, 3, 4, 5):  # every stage parses its options through the same check
        with pytest.raises(UsageError, match="asks for a GPU recipe"):
            parse_config(stage, "t", ["--config", gpu])
    cfg = parse_config(1, "t", ["--config", str(ROOT / "configs" / "smollm2-135m-gpu.yaml"), "--no-needs-gpu"])
    assert cfg.num_samples == 6400 and cfg.needs_gpu is False


def test_the_gpu_recipe_is_the_cpu_default_with_gpu_sizes():
    """configs/smollm2-135m-gpu.yaml differs from the CPU default only in what a GPU makes cheap."""
    import yaml
    cpu = yaml.safe_load((ROOT / "configs" / "smollm2-135m.yaml").read_text())
    gpu = yaml.safe_load((ROOT / "configs" / "smollm2-135m-gpu.yaml").read_text())
    changed = {k for k in set(cpu) | set(gpu) if cpu.get(k) != gpu.get(k)}
    assert changed == {"work_dir", "needs_gpu", "cpu_kv_cache_gb", "num_samples", "regenerate_chunk",
                       "max_tokens_per_batch", "draft_vocab_size", "max_tokens_per_step"}, changed


def test_shipped_configs_parse():
    for name in ("smollm2-135m.yaml", "kimi-k2.5.yaml", "smollm2-135m-gpu.yaml"):
        cfg = parse_config(1, "t", ["--config", str(ROOT / "configs" / name), "--no-needs-gpu"])
        assert cfg.layer_ids[-1] in (30, 61)
    kimi = parse_config(4, "t", ["--config", str(ROOT / "configs" / "kimi-k2.5.yaml")])
    assert kimi.layer_ids == [2, 30, 58, 61] and kimi.tensor_parallel_size == 8
    assert (kimi.draft_num_heads, kimi.draft_num_kv_heads, kimi.draft_head_dim,
            kimi.draft_intermediate_size, kimi.draft_vocab_size, kimi.max_seq_len) == (64, 64, 128, 18432, 32000, 4096)


def test_five_option_command_from_another_pipeline_gets_every_replacement_at_once():
    # what a Kimi-K2.5 engineer typed, guessing another script's flags (and a sample count as batch size)
    proc = run_script("02_extract_hidden_states.py", "--model-path", "/models/kimi-k2.5-int4", "--data-path",
                      "data_1k/prepared/tokenized_data.jsonl", "--output-dir", "data_1k/hidden_states", "--tp-size", 8,
                      "--max-seq-len", 2048, "--batch-size", 2000)
    assert proc.returncode == 2 and "Traceback" not in proc.output, proc.output[-2000:]  # several lines: one each
    err = proc.stderr
    assert "error: 5 unknown options, nothing was loaded" in err
    for given, fix in [("--model-path /models/kimi-k2.5-int4", "use --verifier /models/kimi-k2.5-int4"),
                       ("--data-path data_1k/prepared/tokenized_data.jsonl", "use --work-dir data_1k"),
                       ("--output-dir data_1k/hidden_states", "use --work-dir data_1k"),
                       ("--tp-size 8", "use --tensor-parallel-size 8"),
                       ("--batch-size 2000", "use --max-tokens-per-batch (tokens per engine call, not samples")]:
        line = next(l for l in err.splitlines() if l.strip().startswith(given + " "))
        assert fix in line, line
    assert "--max-seq-len" not in err  # a valid option is not reported


@pytest.mark.parametrize("stage,args,fix", [
    (1, ["--model", "m"], "use --verifier m"),
    (4, ["--target-model-path", "m"], "use --verifier m"),
    (1, ["--prepared-data", "runs/x/prepared"], "use --work-dir runs/x"),
    (3, ["--output-dir", "out"], "use --work-dir ("),
    (2, ["--tp", "4"], "use --tensor-parallel-size 4"),
    (4, ["--batch-size", "8"], "use --max-tokens-per-step (packed tokens per micro-batch, not samples"),
    (0, ["--batch-size", "8"], "--max-tokens-per-batch (stage 2) or --max-tokens-per-step (stage 4)"),
    (4, ["--num-epochs", "3"], "use --epochs 3"),
    (4, ["--learning-rate", "1e-4"], "use --lr 1e-4"),
    (3, ["--draft-vocab", "32000"], "use --draft-vocab-size 32000"),
    (1, ["--max-length", "4096"], "use --max-seq-len 4096"),
    (4, ["--ttt-length", "7"], "use --ttt-steps 7"),
    (4, ["--warmup-ratio", "0.03"], "use --warmup-steps (a step count, not a fraction"),
    (4, ["--gradient-accumulation-steps", "4"], "use --grad-accum 4"),
    (5, ["--num-spec-tokens", "3"], "use --num-speculative-tokens 3"),
    (2, ["--eagle-aux-hidden-state-layer-ids", "2,30,58,61"], "use --layer-ids 2,30,58,61"),
])
def test_names_from_other_pipelines_map_to_ours(stage, args, fix):
    with pytest.raises(UsageError) as err:
        parse_config(stage, "t", args)
    assert fix in str(err.value) and str(err.value).startswith(f"unknown option {args[0]}"), str(err.value)


def test_kimi_mini_config_is_the_kimi_recipe_with_sizes_changed():
    import yaml
    full = yaml.safe_load((ROOT / "configs" / "kimi-k2.5.yaml").read_text())
    mini = yaml.safe_load((ROOT / "configs" / "kimi-k2.5-mini.yaml").read_text())
    sizes = {"work_dir", "verifier", "dataset", "max_seq_len", "tensor_parallel_size", "max_new_tokens", "layer_ids",
             "max_tokens_per_batch", "draft_vocab_size", "draft_num_heads", "draft_num_kv_heads", "draft_head_dim",
             "draft_intermediate_size", "max_tokens_per_step", "eval_dtype"}
    changed = {k for k in set(full) | set(mini) if full.get(k) != mini.get(k)}
    assert changed <= sizes, changed - sizes
    assert mini["export_format"] == "eagle" and mini["layer_ids"][-1] == 8
    cfg = parse_config(2, "t", ["--config", str(ROOT / "configs" / "kimi-k2.5-mini.yaml")])
    assert cfg.verifier == "embedded:kimi-k2.5-mini" and cfg.layer_ids == [2, 4, 5, 8]


def test_stage_help_shows_its_own_options_and_points_to_the_rest():
    short = run_script("02_extract_hidden_states.py", "--help")
    out = short.stdout
    assert short.returncode == 0 and len(out.splitlines()[0]) < 80, out.splitlines()[0]  # a short usage line
    assert out.index("stage 2 options") < out.index("options of every stage")
    assert "--max-tokens-per-batch N" in out and "--ttt-decay" not in out and "--eval-limit" not in out
    assert "--help-all lists them" in out
    full = run_script("02_extract_hidden_states.py", "--help-all").stdout
    assert "options of the other stages" in full and "--ttt-decay" in full and "--eval-limit" in full
    assert len(full.splitlines()) > len(out.splitlines()) + 60


def test_every_alias_maps_to_an_option_we_have_and_keeps_the_value_where_it_means_the_same():
    from common.config import BY_NAME, flag_name
    from common.flag_aliases import ALIASES, KEEP_VALUE
    ours = {flag_name(n) for n in BY_NAME}
    for alias, (target, _) in ALIASES.items():
        assert target in ours, (alias, target)
        with pytest.raises(UsageError) as err:
            parse_config(4, "t", [alias, "runs/x/prepared" if target == "--work-dir" else "7"])
        msg = str(err.value)
        assert msg.startswith(f"unknown option {alias}") and "Traceback" not in msg, msg
        if target in KEEP_VALUE:
            assert f"use {target} 7 (" in msg, msg
        elif target == "--work-dir":
            assert "use --work-dir runs/x (" in msg, msg
        else:
            assert f"use {target} (" in msg, msg
    assert len(ALIASES) >= 39


def outside(o):
    """A value just outside the option's declared range (ints and floats; list options: one bad element)."""
    lo, lo_open, hi, hi_open = o.bounds()
    bad = lo - (0 if lo_open else 1) if lo > float("-inf") else hi + 1
    if o.type is float and not lo_open:
        bad = lo - 0.5
    if hi != float("inf") and o.type is float:
        bad = hi + (0 if hi_open else 0.5)
    return bad


def test_every_ranged_option_is_refused_outside_its_range_on_the_command_line_and_in_a_file(tmp_path):
    from common.config import OPTIONS, flag_name
    ranged = [o for o in OPTIONS if o.range]
    assert {"lr", "epochs", "ttt_decay", "val_fraction", "gpu_memory_utilization", "num_speculative_tokens",
            "layer_ids", "max_tokens_per_step", "grad_clip"} <= {o.name for o in ranged}
    for o in ranged:
        bad = outside(o)
        text = str(int(bad) if o.type is not float else bad)
        with pytest.raises(UsageError) as err:
            parse_config(0, "t", [flag_name(o.name), text])
        assert str(err.value).startswith(f"{flag_name(o.name)} must be "), (o.name, str(err.value))
        cfg_file = tmp_path / f"{o.name}.yaml"
        cfg_file.write_text(f"{o.name}: {text}\n")
        with pytest.raises(UsageError, match=f"from {cfg_file}"):
            parse_config(0, "t", ["--config", str(cfg_file)])


@pytest.mark.parametrize("script,args,needle", [
    ("04_train.py", ["--lr", "-1"], "--lr must be > 0, got -1.0"),
    ("04_train.py", ["--epochs", "0"], "--epochs must be >= 1, got 0"),
    ("04_train.py", ["--ttt-decay", "1.5"], "--ttt-decay must be in (0, 1], got 1.5"),
    ("05_evaluate.py", ["--num-speculative-tokens", "3,0"], "--num-speculative-tokens must be >= 1, got [3, 0]"),
    ("02_extract_hidden_states.py", ["--gpu-memory-utilization", "1.2"], "--gpu-memory-utilization must be in (0, 1], got 1.2"),
])
def test_a_bad_value_is_one_line_and_exit_2_before_anything_runs(script, args, needle, tmp_path):
    proc = run_script(script, "--work-dir", tmp_path / "nothing-here", *args)
    usage_error(proc)
    assert proc.stderr.strip().splitlines() == [f"error: {needle}"], proc.stderr


@pytest.mark.parametrize("args,needle", [
    (["configs/nope.yaml"], "error: config file configs/nope.yaml not found"),
    (["--from", "9"], "error: --from '9' names 0 stages"),
    (["--only", "train", "--from"], "error: --from needs a value"),
    (["--only", "0"], "error: --only '0' names 0 stages"),
    (["--only", "_"], "error: --only '_' names 5 stages"),
    (["--nproc", "two"], "error: --nproc must be a positive integer, got 'two'"),
    (["configs/smollm2-135m-gpu.yaml"], "error: configs/smollm2-135m-gpu.yaml asks for a GPU recipe (needs_gpu) and "
     "this machine has no NVIDIA GPU"),
    (["configs/smollm2-135m-gpu.yaml", "--no-needs-gpu", "--nproc", "two"],  # let through: the next check speaks
     "error: --nproc must be a positive integer, got 'two'"),
])
def test_the_wrapper_checks_its_own_arguments_before_setup(args, needle, tmp_path):
    import subprocess

    from common.engine import has_gpu
    if args[0].endswith("-gpu.yaml") and "--no-needs-gpu" not in args and has_gpu():
        pytest.skip("a GPU is visible here: the GPU recipe is not refused")
    env = dict(__import__("os").environ, EAGLE3_VENV=str(tmp_path / "never-made"))
    proc = subprocess.run(["bash", str(ROOT / "run_pipeline.sh"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[0].startswith(needle), proc.stderr
    assert not (tmp_path / "never-made").exists()  # refused before the environment is set up


def test_the_wrapper_names_stages_by_number_or_name():
    import subprocess
    for given, stage in [("1", "01_prepare_dataset"), ("04", "04_train"), ("train", "04_train"),
                         ("evaluate", "05_evaluate"), ("vocab", "03_build_vocab_mapping")]:
        script = f'source <(sed -n "/^STAGES=/,/^}}/p" {ROOT}/run_pipeline.sh); stage_of {given} --only'
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True).stdout.strip()
        assert out == stage, (given, out)
