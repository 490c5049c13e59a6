#!/usr/bin/env bash
# Where stage 4's first step spends its time at z-lab's Kimi-K2.5 DFlash geometry (configs/kimi-k2.5-dflash.yaml) on
# one GPU, synthetic states (bench/synthetic_workdir.py): per --draft-layers count, the seconds from the model build
# ("precision:") to step 1's line, with every thread's stack dumped into the log (SIGUSR1, common/stage.py) at each
# of DUMPS seconds while step 1 has not come, and torch.compile's recompilations logged (TORCH_LOGS=recompiles).
#   bench/first_step.sh OUT_DIR [LIMIT_S] [LAYERS ...] [-- 04_train options]   (default: 240 s, layers 6)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:-/tmp/site}  # DFlash's export needs speculators (the device installs it there)
out=${1:?usage: bench/first_step.sh OUT_DIR [LIMIT_S] [LAYERS ...] [-- options]}; limit=${2:-240}
shift $(( $# < 2 ? $# : 2 ))
layers=(); while (( $# )) && [[ $1 != -- ]]; do layers+=("$1"); shift; done; [[ ${1:-} == -- ]] && shift
(( ${#layers[@]} )) || layers=(6)
work=${WORK:-/tmp/kimi-dflash-synth}
mkdir -p "$out"
[[ -f $work/vocab/manifest.json ]] || python bench/synthetic_workdir.py --work-dir "$work" --samples 16 --repeat 4 \
  --layer-ids 2 13 25 36 48 59 61 > "$out/synth.log" 2>&1 || { cat "$out/synth.log"; exit 1; }
for n in "${layers[@]}"; do
  w=$work-l$n; rm -rf "$w"; mkdir -p "$w"
  for d in prepared hidden_states vocab; do ln -s "$work/$d" "$w/$d"; done
  log=$out/layers$n.log
  TORCH_LOGS=recompiles python 04_train.py --config configs/kimi-k2.5-dflash.yaml --work-dir "$w" \
    --verifier "$work/verifier" --draft-layers "$n" --max-steps 3 --epochs 1 --warmup-steps 1 --val-fraction 0.1 \
    --log-interval 0 --num-workers 2 "$@" > "$log" 2>&1 &
  pid=$! t0=$(date +%s) dumped=0
  until grep -q "step 2/\|^error:\|Error:\|Traceback" "$log" || ! kill -0 $pid 2>/dev/null; do
    sleep 2; t=$(( $(date +%s) - t0 ))
    if (( t >= limit )); then echo "layers $n: no step 2 in $limit s" >> "$log"; break; fi
    if (( t >= 90 * (dumped + 1) )) && ! grep -q "step 1/" "$log"; then kill -USR1 $pid; dumped=$((dumped + 1)); fi
  done
  kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$w"
  echo "== $n layers: $(grep -c 'Recompiling' "$log") recompilations"
  grep -E "precision:|compiles the GPU|step [12]/|no step|^error:|Error:" "$log" | sed 's/^\(.\{240\}\).*/\1/'
  # the main thread's innermost frames at each dump
  awk '/Current thread|Thread 0x/{p=0} /Current thread/{p=1; n=0} p && n++ < 14' "$log" | head -60
done
