"""Config and flag handling: one schema, YAML + overrides, exit 2 with a suggestion."""
import pytest

from common.config import parse_config
from common.errors import UsageError
from conftest import ROOT, run_script


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
    with pytest.raises(UsageError, match="--max-seq-len must be >= 1"):
        parse_config(1, "t", ["--max-seq-len", "0"])
    with pytest.raises(UsageError, match="shard-index"):
        parse_config(2, "t", ["--shard-index", "2", "--num-shards", "2"])
    with pytest.raises(UsageError, match="invalid int value"):
        parse_config(1, "t", ["--num-samples", "many"])
    with pytest.raises(UsageError, match="--hidden-noise must be >= 0"):
        parse_config(4, "t", ["--hidden-noise", "-0.1"])


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


def test_shipped_configs_parse():
    for name in ("smollm2-135m.yaml", "kimi-k2.5.yaml"):
        cfg = parse_config(1, "t", ["--config", str(ROOT / "configs" / name)])
        assert cfg.layer_ids[-1] in (30, 61)
    kimi = parse_config(4, "t", ["--config", str(ROOT / "configs" / "kimi-k2.5.yaml")])
    assert kimi.layer_ids == [2, 30, 58, 61] and kimi.tensor_parallel_size == 8
    assert (kimi.draft_num_heads, kimi.draft_num_kv_heads, kimi.draft_head_dim,
            kimi.draft_intermediate_size, kimi.draft_vocab_size, kimi.max_seq_len) == (64, 64, 128, 18432, 32000, 2048)


def test_five_option_command_from_another_pipeline_gets_every_replacement_at_once():
    # what a Kimi-K2.5 engineer typed, guessing another script's flags (and a sample count as batch size)
    proc = run_script("02_extract_hidden_states.py", "--model-path", "/models/kimi-k2.5-int4", "--data-path",
                      "data_1k/prepared/tokenized_data.jsonl", "--output-dir", "data_1k/hidden_states", "--tp-size", 8,
                      "--max-seq-len", 2048, "--batch-size", 2000)
    assert proc.returncode == 2 and "Traceback" not in proc.output, proc.output[-2000:]
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
