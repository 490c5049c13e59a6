#!/usr/bin/env bash
# Multi-GPU training check at Kimi-K2.5 draft geometry on synthetic hidden states (needs 2 GPUs):
#   1 GPU x 2 accumulated micro-batches vs torchrun 2 GPUs x 1 (same global batch): tokens/s, scaling,
#   peak memory, per-step losses; then the same with FSDP; then an FSDP run killed mid-way and resumed.
# Usage: [WORK=DIR] [RUNS="gpu1 ddp2 fsdp2 resume"] [EXTRA="--compile"] [REPEAT=1] [LOG_INTERVAL=0] [SAVE_EVERY=4]
#        bench/multi_gpu.sh OUT_DIR [STEPS]
# Throughput: REPEAT=5 (epochs of ~35 steps), SAVE_EVERY=0 (a save drains the queue and is not timed), LOG_INTERVAL=10;
# the summary's tokens/s is from step 1's end to the last step's end (cumulative tokens / train seconds).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench/multi_gpu.sh OUT_DIR [STEPS]}; steps=${2:-12}
work=${WORK:-/tmp/kimi-synth}
mkdir -p "$out"
[[ -f $work/vocab/manifest.json ]] || python bench/synthetic_workdir.py --work-dir "$work" --samples 96 --repeat "${REPEAT:-1}" > "$out/synth.log" 2>&1
args=(--config configs/kimi-k2.5.yaml --verifier "$work/verifier" --epochs 2 --max-steps "$steps" --warmup-steps 2
      --lr 1e-4 --val-fraction 0.05 --log-interval "${LOG_INTERVAL:-0}" --num-workers 4 --save-every "${SAVE_EVERY:-4}" --keep-last 3 ${EXTRA:-})
run() {  # name, then extra args; a fresh copy of the inputs per run
  local name=$1; shift
  rm -rf "$work-$name"; mkdir -p "$work-$name"
  for d in prepared hidden_states vocab; do ln -s "$work/$d" "$work-$name/$d"; done
  "$@" --work-dir "$work-$name" "${args[@]}" > "$out/$name.log" 2>&1
  echo "$name: exit $? $(grep -c '"train"' "$work-$name/train/metrics.jsonl" 2>/dev/null) train rows"
  cp "$work-$name/train/metrics.jsonl" "$out/$name.metrics.jsonl" 2>/dev/null
}
PY=python
runs=" ${RUNS:-gpu1 ddp2 fsdp2 resume} "
[[ $runs == *" gpu1 "* ]] && run gpu1 env CUDA_VISIBLE_DEVICES=0 $PY 04_train.py --grad-accum 2
[[ $runs == *" ddp2 "* ]] && run ddp2 $PY -m torch.distributed.run --nproc_per_node 2 04_train.py --grad-accum 1 --parallel ddp
[[ $runs == *" fsdp2 "* ]] && run fsdp2 $PY -m torch.distributed.run --nproc_per_node 2 04_train.py --grad-accum 1 --parallel fsdp
if [[ $runs == *" resume "* ]]; then  # kill an FSDP run after its step-4 checkpoint, re-run the same command
  name=fsdp2_resume; rm -rf "$work-$name"; mkdir -p "$work-$name"
  for d in prepared hidden_states vocab; do ln -s "$work/$d" "$work-$name/$d"; done
  cmd=($PY -m torch.distributed.run --nproc_per_node 2 04_train.py --grad-accum 1 --parallel fsdp --work-dir "$work-$name" "${args[@]}")
  "${cmd[@]}" > "$out/$name.1.log" 2>&1 &
  pid=$!
  until [[ -f $work-$name/train/checkpoints/step_4/state.pt ]] || ! kill -0 $pid 2>/dev/null; do sleep 2; done
  sleep 3; pkill -9 -f "work-dir $work-$name" ; wait $pid
  echo "killed after $(ls "$work-$name/train/checkpoints")"
  "${cmd[@]}" > "$out/$name.2.log" 2>&1; echo "resumed: exit $?"
  python - "$work-fsdp2" "$work-$name" "$steps" <<'PYEOF' | tee "$out/resume_check.txt"
import sys, torch
from safetensors.torch import load_file
a, b = (load_file(f"{w}/train/checkpoints/step_{sys.argv[3]}/trainable.safetensors") for w in sys.argv[1:3])
print("resume vs uninterrupted, max abs diff per tensor:", max((a[k].float() - b[k].float()).abs().max().item() for k in a))
PYEOF
fi
python - "$out" <<'PYEOF' | tee "$out/summary.txt"
import json, sys
out = sys.argv[1]
rows = {}
for name in ("gpu1", "ddp2", "fsdp2"):
    try:
        rows[name] = [json.loads(l) for l in open(f"{out}/{name}.metrics.jsonl") if '"train"' in l]
    except FileNotFoundError:
        continue
def rate(r):  # tokens/s from the end of step 1 to the end of the last step (checkpoint pauses excluded)
    return (r[-1]["tokens"] - r[0]["tokens"]) / (r[-1]["train_seconds"] - r[0]["train_seconds"])
for name, r in rows.items():
    print(f"{name}: {rate(r):.0f} tokens/s over steps {r[0]['step'] + 1}-{r[-1]['step']}, "
          f"peak {max(x['peak_mem_gb'] for x in r):.1f} GiB per GPU, data wait {[x['data_wait'] for x in r]}")
    print(f"  loss_0 per logged step: {[(x['step'], round(x['loss_0'], 4)) for x in r]}")
if "gpu1" in rows:
    for name in ("ddp2", "fsdp2"):
        if name in rows:
            same = [(a, b) for a, b in zip(rows["gpu1"], rows[name]) if a["step"] == b["step"]]
            diff = max((abs(a["loss_0"] - b["loss_0"]) / abs(a["loss_0"]) for a, b in same), default=float("nan"))
            print(f"{name}: scaling {rate(rows[name]) / rate(rows['gpu1']):.2f}x over 1 GPU; "
                  f"max relative loss_0 difference vs 1 GPU at the same logged step {diff:.2e}")
PYEOF
