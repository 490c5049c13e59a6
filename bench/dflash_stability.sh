#!/usr/bin/env bash
# Stage 4 at z-lab's Kimi-K2.5 DFlash geometry (configs/kimi-k2.5-dflash.yaml: 6 layers of hidden 7168, 64 / 8
# heads of 128, block 8, 512 anchors, 8192 tokens a step) on synthetic states (bench/synthetic_workdir.py), one GPU:
# does the loss or the gradient norm spike, or go non-finite (z-lab/dflash #115: NaN norms at step ~240, lr 6e-4)?
#   bench/dflash_stability.sh OUT_DIR [STEPS] [LR ...] [-- 04_train options]   (default: 300 steps at lr 1e-4, the
#   config's, and 6e-4; e.g. `-- --optimizer muon --no-compile`)
# Each lr runs with a 30-step warm-up (the config's 500 would never reach the peak) in one epoch of STEPS steps, and
# is stopped once its last step is logged: its end-of-run checkpoint (weights + AdamW moments, ~42 GB at this
# geometry) would not fit a 64 GB disk beside the states. Prints each run's logged steps: loss, grad norm (the
# window's largest, before clipping), lr.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench/dflash_stability.sh OUT_DIR [STEPS] [LR ...]}; steps=${2:-300}; shift $(( $# < 2 ? $# : 2 ))
lrs=(); while (( $# )) && [[ $1 != -- ]]; do lrs+=("$1"); shift; done; [[ ${1:-} == -- ]] && shift
(( ${#lrs[@]} )) || lrs=(1e-4 6e-4)
work=${WORK:-/tmp/kimi-dflash-synth}
mkdir -p "$out"
# 48 distinct samples (~54K tokens, 5.4 GB of states), listed often enough for one epoch of STEPS steps
repeat=$(( steps * 8192 / 50000 + 2 ))
[[ -f $work/vocab/manifest.json ]] || python bench/synthetic_workdir.py --work-dir "$work" --samples 48 \
  --repeat "$repeat" --layer-ids 2 13 25 36 48 59 61 > "$out/synth.log" 2>&1 || { cat "$out/synth.log"; exit 1; }
for lr in "${lrs[@]}"; do
  w=$work-lr$lr; rm -rf "$w"; mkdir -p "$w"
  for d in prepared hidden_states vocab; do ln -s "$work/$d" "$w/$d"; done
  log=$out/lr$lr.log
  python 04_train.py --config configs/kimi-k2.5-dflash.yaml --work-dir "$w" --verifier "$work/verifier" \
    --max-steps "$steps" --epochs 1 --lr "$lr" --warmup-steps 30 --val-fraction 0.02 --save-every 0 --log-interval 0 \
    --num-workers 4 "$@" > "$log" 2>&1 &
  pid=$!
  until grep -q "step $steps/$steps \|^error:\|Error:\|Traceback" "$log" || ! kill -0 $pid 2>/dev/null; do sleep 2; done
  kill $pid 2>/dev/null; wait $pid 2>/dev/null
  rm -rf "$w"
  echo "== lr $lr: $(grep -c '\] step [0-9]*/' "$log") steps logged"
  grep -E "not finite|^error:|Error:" "$log" | tail -3
  python - "$log" <<'PYEOF'
import re, sys
rows = [(int(m[1]), float(m[2]), float(m[3])) for m in
        re.finditer(r"step (\d+)/\d+ epoch \d+ \| loss ([\d.naninf]+) / .*?\| grad norm ([\d.e+naninf-]+) \|", open(sys.argv[1]).read())]
for lo, hi in ((1, 30), (31, 100), (101, 200), (201, 10**9)):
    part = [r for r in rows if lo <= r[0] <= hi]
    if part:
        print(f"steps {lo}-{min(hi, part[-1][0])}: loss first {part[0][1]:.3f} last {part[-1][1]:.3f} max "
              f"{max(r[1] for r in part):.3f}; grad norm median {sorted(r[2] for r in part)[len(part) // 2]:.3g} "
              f"max {max(r[2] for r in part):.3g}")
PYEOF
done
