#!/usr/bin/env bash
# Stage-4 A/B on one GPU, same data, same epochs: stages 2 (HF backend) and 3 once, then one 04_train.py
# per variant, all at the same time on the one GPU; prints each run's validation lines. Where no vLLM
# is (the `device` H200), stage 1 runs elsewhere first:
#   python 01_prepare_dataset.py --config configs/smollm2-135m.yaml --work-dir W     (CPU, vLLM)
#   bench/gpu_ab.sh W [CONFIG] [STAGES] [NAME='04_train options' ...]
# STAGES: "23" (extract + vocab), "4" (the A/B), default "234". Variants default to the three
# --draft-norms values; each trains in W-NAME, whose prepared/ hidden_states/ vocab/ link to W's (a variant
# with --draft-vocab-size builds its own vocab/ there first: stage 3 takes seconds).
# Stage 5 of each needs vLLM: copy W-NAME/{final_draft,train} and W's prepared/ vocab/ back to a CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
work=${1:?WORK}; cfg=${2:-configs/smollm2-135m.yaml}; stages=${3:-234}; shift $(( $# < 3 ? $# : 3 ))
variants=("$@")
(( ${#variants[@]} )) || variants=("eagle3=--draft-norms eagle3" "norm-before-fc=--draft-norms norm-before-fc"
                                    "fc-norm=--draft-norms fc-norm")
PY=${PY:-python3}
# eagle: no speculators package needed for the export; AB_COMMON: options of stages 2-4 alike (--max-seq-len)
# shellcheck disable=SC2206
common=(--config "$cfg" --export-format eagle ${AB_COMMON:-})
if [[ $stages == *2* ]]; then "$PY" 02_extract_hidden_states.py "${common[@]}" --work-dir "$work" --backend hf || exit 1; fi
if [[ $stages == *3* ]]; then "$PY" 03_build_vocab_mapping.py "${common[@]}" --work-dir "$work" || exit 1; fi
[[ $stages == *4* ]] || exit 0
for v in "${variants[@]}"; do
  name=${v%%=*}; w="$work-$name"; mkdir -p "$w"
  for sub in prepared hidden_states; do ln -sfn "$(realpath "$work/$sub")" "$w/$sub"; done
  if [[ $v == *--draft-vocab-size* || $v == *--draft-vocab-from* ]]; then
    # shellcheck disable=SC2086
    "$PY" 03_build_vocab_mapping.py "${common[@]}" --work-dir "$w" ${v#*=} > "$w.vocab.log" 2>&1 || { cat "$w.vocab.log"; exit 1; }
  else
    ln -sfn "$(realpath "$work/vocab")" "$w/vocab"
  fi
  # shellcheck disable=SC2086  # the variant's options split on spaces
  "$PY" 04_train.py "${common[@]}" --work-dir "$w" --device cuda ${v#*=} > "$w.log" 2>&1 &
done
wait
for v in "${variants[@]}"; do
  name=${v%%=*}; echo "== $name: ${v#*=}"
  grep -E "validation @|best validation|Error|error" "$work-$name.log" | sed 's/^.*\] //'
done
