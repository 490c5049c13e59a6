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
