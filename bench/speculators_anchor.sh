#!/usr/bin/env bash
# Issue 39's reference anchor on the `device` H200: speculators 0.9.0's own DFlash trainer (`speculators train`, its
# defaults: block 8, 5 layers, Muon at lr 1e-3, linear decay, 20 epochs, 8192 tokens and 512 anchors a step, causal
# within the block) against ours (stage 4, our defaults, the same block, layers and tokens per step, 20 epochs: the
# same steps), on exactly the same stage 2-3 outputs and training split. Two calls, the machine kept warm between:
#   bench/speculators_anchor.sh ref    stages 2-3 of .ab/prepared.tgz (stage 1 of configs/smollm2-135m.yaml, made
#                                      on a CPU with vLLM), bench/speculators_data.py, speculators' trainer, timed
#   bench/speculators_anchor.sh ours   stage 4 (ours), timed; both drafts scored by stage 4's own validation
#                                      (bench/simulate_validation.py); both packed into $OUT as 15 MiB parts
# Needs /tmp/site (speculators and its dependencies, installed the call before, as for bench/ab_device.sh) and the
# verifier's GGUF in two parts (/tmp/gg1/part00 stashed by an earlier call, .gg2/part01 carried). Here afterwards:
#   python bench/anchor_runs.py FILES_DIR runs/ab    (run folders for stage 5), then 05_evaluate.py on each
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:?usage: bench/speculators_anchor.sh ref|ours}
source bench/device_env.sh  # PYTHONPATH=/tmp/site, assemble_verifier
A=${ANCHOR_DIR:-/tmp/anchor} W=${ANCHOR_DIR:-/tmp/anchor}/W
cfg=configs/smollm2-135m.yaml
epochs=${EPOCHS:-20}
ours=(--draft-method dflash --block-size 8 --draft-layers 5 --epochs "$epochs" --max-tokens-per-step 8192 --num-workers 4)
mkdir -p "$A"
if [[ $phase == ref ]]; then
  assemble_verifier || exit 1
  if [[ ! -f $A/data.env ]]; then
    mkdir -p "$W" && tar xzf .ab/prepared.tgz -C "$W" || exit 1
    PY=python3 bench/gpu_ab.sh "$W" "$cfg" 23 2>&1 | tail -3 || exit 1
    python3 bench/speculators_data.py "$W" "$A/data" > "$A/data.env" || exit 1
  fi
  rm -rf "$A/ref"
  # shellcheck disable=SC1091
  source "$A/data.env"; cat "$A/data.env"
  t0=$(date +%s)
  # shellcheck disable=SC2086  # LAYERS: the aux ids, one argument each
  timeout "${REF_LIMIT:-400}" python3 bench/speculators_train.py --speculator-type dflash --seed 0 \
    --verifier-name-or-path "$VERIFIER" --data-path "$A/data" --d2t-path "$A/data/d2t.npy" \
    --t2d-path "$A/data/t2d.npy" --draft-vocab-size 4096 --target-layer-ids $LAYERS --train-data-ratio "$TRAIN_RATIO" \
    --epochs "$epochs" --loss-implementation eager --on-missing raise --save-path "$A/ref/ckpt" --log-dir "$A/ref/logs" > "$A/ref.log" 2>&1
  echo "reference: exit $? after $(( $(date +%s) - t0 )) s; checkpoints: $(ls "$A/ref/ckpt" | tr '\n' ' ')"
  grep -iE "error|epoch|val" "$A/ref.log" | grep -v "^│" | tail -25
  exit 0
fi
w=$A/W-ours; mkdir -p "$w"
for d in prepared hidden_states vocab; do ln -sfn "$W/$d" "$w/$d"; done
t0=$(date +%s)
timeout "${OURS_LIMIT:-330}" python3 04_train.py --config "$cfg" --work-dir "$w" --device cuda "${ours[@]}" > "$A/ours.log" 2>&1
echo "ours: exit $? after $(( $(date +%s) - t0 )) s"
grep -E "validation @|best validation|Error|error" "$A/ours.log" | sed 's/^.*\] //' | tail -24
# the reference's last epoch as a run folder stage 5 serves (final_draft/) and the transport packs
last=$(ls "$A/ref/ckpt" | grep -E '^[0-9]+$' | sort -n | tail -1)
r=$A/W-ref; mkdir -p "$r/final_draft" "$r/logs"
cp "$A/ref/ckpt/$last/config.json" "$A/ref/ckpt/$last/model.safetensors" "$r/final_draft/"
cp "$A/ref.log" "$r/logs/04_train.log"
echo "== stage 4's validation of both (ours: its exported best; the reference: epoch $last, causal in the block)"
python3 bench/simulate_validation.py "$w/final_draft" --config "$cfg" --work-dir "$w" "${ours[@]}" 2>&1 | grep "validation @\|Error"
python3 bench/simulate_validation.py "$r/final_draft" --config "$cfg" --work-dir "$w" "${ours[@]}" \
  --block-attention causal 2>&1 | grep "validation @\|Error\|loaded"
p=$A/packs; rm -rf "$p"; mkdir -p "$p"
python3 bench/draft_transport.py pack "$p" "$r"
if [[ -f $w/final_draft/model.safetensors ]]; then
  python3 bench/draft_transport.py pack "$p" "$w"
  cp "$w/final_draft/simulated_validation.json" "$p/ours.simulated.json"
else  # stopped by the limit: its latest checkpoint's weights in bf16 (bench/anchor_runs.py exports them there)
  ck=$(ls -d "$w"/train/checkpoints/step_* | sort -t_ -k2 -n | tail -1)
  python3 -c "import sys, torch; from safetensors.torch import load_file, save_file
save_file({k: v.bfloat16() if v.is_floating_point() else v for k, v in load_file(sys.argv[1]).items()}, sys.argv[2])" \
    "$ck/trainable.safetensors" "$p/ours.checkpoint.safetensors"
  cp "$ck/meta.json" "$p/ours.checkpoint.meta.json"
fi
cp "$A/ours.log" "$A/ref.log" "$A/data.env" "$w/train/metrics.jsonl" "$p/"
cp "$r/final_draft/simulated_validation.json" "$p/ref.simulated.json"
tar cf - -C "$A" packs | split -b 15M - "$OUT/anchor.tar.part-"  # 8 files of 16 MiB come back: ~100 MiB
ls -la "$OUT"
