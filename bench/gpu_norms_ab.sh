#!/usr/bin/env bash
# EAGLE-3 against EAGLE-3.1 drafts on one GPU, same data, same epochs: stages 2 (HF backend) and 3 once,
# then stage 4 once per --draft-norms value, all at the same time on the one GPU; prints each run's
# validation line per epoch. Where no vLLM is (the `device` H200), stage 1 runs elsewhere:
#   python 01_prepare_dataset.py --config configs/smollm2-135m.yaml --work-dir W     (CPU, vLLM)
#   bench/gpu_norms_ab.sh W [CONFIG] [stages]     stages: "23" (extract + vocab), "4" (the A/B), default "234"
set -uo pipefail
cd "$(dirname "$0")/.."
work=${1:?WORK}; cfg=${2:-configs/smollm2-135m.yaml}; stages=${3:-234}
PY=${PY:-python3}
common=(--config "$cfg" --export-format eagle)  # eagle: no speculators package needed for the export
if [[ $stages == *2* ]]; then "$PY" 02_extract_hidden_states.py "${common[@]}" --work-dir "$work" --backend hf || exit 1; fi
if [[ $stages == *3* ]]; then "$PY" 03_build_vocab_mapping.py "${common[@]}" --work-dir "$work" || exit 1; fi
[[ $stages == *4* ]] || exit 0
for norms in eagle3 norm-before-fc fc-norm; do
  w="$work-$norms"; mkdir -p "$w"
  for sub in prepared hidden_states vocab; do ln -sfn "$(realpath "$work/$sub")" "$w/$sub"; done
  "$PY" 04_train.py "${common[@]}" --work-dir "$w" --device cuda --draft-norms "$norms" > "$w.log" 2>&1 &
done
wait
for norms in eagle3 norm-before-fc fc-norm; do
  echo "== --draft-norms $norms"
  grep -E "validation @|best validation|Error|error" "$work-$norms.log" | sed 's/^.*\] //'
done
