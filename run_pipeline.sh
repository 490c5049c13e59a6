#!/usr/bin/env bash
# Chain the stages with one config:
#   ./run_pipeline.sh [CONFIG] [--from STAGE] [--only STAGE] [--nproc N] [--rehearse] [OPTIONS...]
# Default CONFIG: configs/smollm2-135m.yaml (the embedded default). Sets up .venv first (CPU or GPU stack,
# scripts/setup_env.sh). OPTIONS pass through to every stage (one option schema), e.g. --work-dir W.
# Stage 4 runs under torchrun over every visible GPU (nvidia-smi, CUDA_VISIBLE_DEVICES); --nproc N overrides.
# --rehearse: every stage on a few samples in WORK_DIR/rehearsal (model loads included), to meet a new node's
# failures in its first hour. EAGLE3_VENV=DIR: the environment to fill and run (default .venv).
# nohup-friendly: each stage logs to WORK_DIR/logs/NN_stage.log, all of them to WORK_DIR/logs/pipeline.log.
set -uo pipefail
cd "$(dirname "$0")"

STAGES=(01_prepare_dataset 02_extract_hidden_states 03_build_vocab_mapping 04_train 05_evaluate)
die() { echo "error: $*" >&2; exit 2; }
stage_of() {  # --from/--only: 1-5, 01-05 or (part of) a script name, naming exactly one stage
  local hits=() s
  for s in "${STAGES[@]}"; do
    if [[ $1 =~ ^[0-9]+$ ]]; then [[ $1 =~ ^0?[1-5]$ && ${s:1:1} == "${1: -1}" ]] && hits+=("$s")
    elif [[ -n $1 && $s == *"$1"* ]]; then hits+=("$s"); fi
  done
  [[ ${#hits[@]} == 1 ]] || die "$2 '$1' names ${#hits[@]} stages; use 1-5 or a script name (${STAGES[*]})"
  echo "${hits[0]}"
}
config=configs/smollm2-135m.yaml
if [[ $# -gt 0 && $1 != --* ]]; then config=$1; shift; fi
[[ -f $config ]] || die "config file $config not found; pass an existing file, e.g. configs/smollm2-135m.yaml"
from="" only="" nproc="" rehearse=0 pass=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --from|--only|--nproc) [[ $# -ge 2 && $2 != --* ]] || die "$1 needs a value"
      case $1 in --from) from=$(stage_of "$2" --from) || exit 2 ;; --only) only=$(stage_of "$2" --only) || exit 2 ;;
                 --nproc) nproc=$2 ;; esac
      shift 2 ;;
    --rehearse) rehearse=1; shift ;;
    *) pass+=("$1"); shift ;;
  esac
done
gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU ' || true)
# a GPU recipe on a machine without a GPU: refused before setup (every stage refuses it too, common/config.py)
if grep -Eq '^needs_gpu: *(true|yes|on|1)\b' "$config" && (( gpus == 0 )) && [[ " ${pass[*]} " != *" --no-needs-gpu "* ]]; then
  die "$config asks for a GPU recipe (needs_gpu) and this machine has no NVIDIA GPU (nvidia-smi lists none): on a CPU run configs/smollm2-135m.yaml, or pass --no-needs-gpu to run this recipe here anyway (hours)"
fi
if [[ -z $nproc ]]; then  # training processes: one per visible GPU, else one
  nproc=$gpus
  if [[ -n ${CUDA_VISIBLE_DEVICES+x} ]]; then
    visible=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c . || true)
    (( visible < nproc )) && nproc=$visible
  fi
  (( nproc >= 1 )) || nproc=1
fi
[[ $nproc =~ ^[1-9][0-9]*$ ]] || die "--nproc must be a positive integer, got '$nproc'"

scripts/setup_env.sh || { echo "environment setup failed" >&2; exit 1; }
PY="${EAGLE3_VENV:-.venv}/bin/python"  # the environment setup_env.sh filled
work_dir=$("$PY" -c "import sys; from common.config import parse_config; print(parse_config(0, '', sys.argv[1:]).work_dir)" \
  --config "$config" "${pass[@]}") || exit 2
if [[ $rehearse == 1 ]]; then
  # every stage, model loads included, on a slice in its own folder: a new node meets its failures in the
  # first hour, not after stage 1's hours. 3 samples; under torchrun 8 per rank, so that every rank gets a
  # packed sequence of 512 tokens (short samples share one).
  work_dir="$work_dir/rehearsal"
  slice=$(( nproc == 1 ? 3 : 8 * nproc ))
  pass+=(--work-dir "$work_dir" --num-samples $slice --max-seq-len 512 --max-new-tokens 32
         --max-tokens-per-step 512 --epochs 2 --max-steps 2
         --grad-accum 1 --val-fraction 0.2 --save-every 1 --eval-limit 2 --self-check-samples 2)
  echo "pipeline: rehearsal of $config on $slice samples in $work_dir (the real run's folder is untouched)"
fi
mkdir -p "$work_dir/logs"
combined="$work_dir/logs/pipeline.log"
echo "pipeline: config $config, work dir $work_dir; follow with: tail -f $combined"

# `kill PID` of the wrapper: pass SIGTERM to the running stage, which stops cleanly (vLLM's engine with it,
# finished work kept), and wait for it; Ctrl-C reaches the stage itself (same process group), so only wait.
stage=""
stop() {
  echo "$(date '+%F %T') [pipeline] $1: stopping${stage:+ stage $stage}; re-run the same command to resume" | tee -a "$combined"
  [[ $1 == SIGTERM && -n $stage ]] && pkill -TERM -P $$ -f "$stage\.py"
  wait
  exit "$2"
}
trap 'stop SIGTERM 143' TERM
trap 'stop SIGINT 130' INT

timings="$work_dir/logs/timings.json"
[[ -f $timings ]] || echo '{}' > "$timings"
started=0 forced=0
for stage in "${STAGES[@]}"; do
  num=${stage%%_*}
  [[ -z $from || $started == 1 || $stage == "$from" ]] && started=1
  [[ $started == 1 ]] || continue
  [[ -z $only || $stage == "$only" ]] || continue
  log="$work_dir/logs/$stage.log"
  # skip a stage whose manifest is complete and matches this config, unless an earlier stage just ran
  if [[ $forced == 0 && -z $only ]] && "$PY" -m common.pipeline done "$stage" --config "$config" "${pass[@]}" 2>/dev/null; then
    echo "$(date '+%F %T') [pipeline] stage $stage: complete and up to date, skipped" | tee -a "$combined"
    continue
  fi
  forced=1
  run=("$PY" "$stage.py")
  if [[ $stage == 04_train && $nproc -gt 1 ]]; then
    run=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$nproc" "$stage.py")
  fi
  echo "$(date '+%F %T') [pipeline] stage $stage: starting (log $log)$([[ ${#run[@]} -gt 2 ]] && echo "; torchrun --nproc_per_node $nproc")" | tee -a "$combined"
  t0=$(date +%s)
  # in the background: bash runs a trap only between commands, and `wait` returns on a signal
  PYTHONUNBUFFERED=1 "${run[@]}" --config "$config" "${pass[@]}" 2>&1 | tee "$log" \
    | sed -u "s/^/[$num] /" >> "$combined" &
  wait $!; rc=$?  # with pipefail: the stage's status
  if [[ $rc != 0 ]]; then
    echo "$(date '+%F %T') [pipeline] stage $stage FAILED with exit status $rc; last lines of $log:" | tee -a "$combined"
    tail -n 15 "$log" | sed 's/^/    /'
    echo "fix the cause and re-run the same command: completed stages are skipped, $stage resumes" >&2
    exit "$rc"
  fi
  secs=$(( $(date +%s) - t0 ))
  "$PY" -c "import json,sys; p=sys.argv[1]; d=json.load(open(p)); d[sys.argv[2]]=int(sys.argv[3]); json.dump(d, open(p,'w'))" \
    "$timings" "$stage" "$secs"
  echo "$(date '+%F %T') [pipeline] stage $stage: done in ${secs}s" | tee -a "$combined"
done
report=$("$PY" -m common.pipeline report --config "$config" "${pass[@]}")
echo "pipeline: finished; report: $report"
