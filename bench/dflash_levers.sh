#!/usr/bin/env bash
# Issue 39's DFlash recipe levers on the `device` H200, on the reference anchor's data (bench/speculators_anchor.sh):
# our stage 4 at its DFlash settings (block 8, 5 layers, 6 epochs, 8,192 tokens a step: the anchor's "ours") with one
# of speculators' defaults switched on at a time, and all of them at once, trained side by side on the one GPU;
# validation per epoch from each run's log (docs/dflash.md, the recipe levers). After a call that installed /tmp/site
# (speculators, for the DFlash export) and stashed the GGUF's first part in /tmp/gg1, as speculators_anchor.sh:
#   EPOCHS=4 DEADLINE=570 bench/dflash_levers.sh all   stages 2-3 of .ab/prepared.tgz (~3 min), then every variant
#                                                      at once until DEADLINE s from the start (4 epochs: ~280 s)
#   bench/dflash_levers.sh ab                          the variants only (stages 2-3 done), at most LIMIT s
# Then the validation lines, and the drafts named in PACK (default: base spec; finished runs only) packed into $OUT.
# EAGER=1 (implied by `all`): no torch.compile (--no-compile, which also takes the per-document attention, equal to
# flex in tests/test_dflash.py): at this width the compiled first step alone took 208 s, six eager runs 282 s in all.
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:?usage: bench/dflash_levers.sh all|ab}
start=$(date +%s)
source bench/device_env.sh  # PYTHONPATH=/tmp/site, assemble_verifier
A=${ANCHOR_DIR:-/tmp/anchor} W=${ANCHOR_DIR:-/tmp/anchor}/W
cfg=configs/smollm2-135m.yaml
base=(--draft-method dflash --block-size 8 --draft-layers 5 --epochs "${EPOCHS:-6}" --max-tokens-per-step 8192
      --num-workers 2)
[[ $phase == all ]] && EAGER=1
if [[ ${EAGER:-} == 1 ]]; then base+=(--no-compile); fi
declare -A lever=([base]="" [muon]="--optimizer muon" [linear]="--lr-schedule linear"
                  [causal]="--block-attention causal" [b16]="--block-size 16"
                  [spec]="--optimizer muon --lr-schedule linear --block-attention causal --block-size 16 --weight-decay 0.01")

train() {  # NAME LIMIT: one variant in $A/lv-NAME, its log $A/lv-NAME.log, in the background
  local name=$1 limit=$2 w=$A/lv-$1; rm -rf "$w"; mkdir -p "$w"
  for d in prepared hidden_states vocab; do ln -sfn "$W/$d" "$w/$d"; done
  # shellcheck disable=SC2086  # the lever's options split on spaces
  TORCH_LOGS=recompiles timeout "$limit" python3 04_train.py --config "$cfg" --work-dir "$w" --device cuda \
    "${base[@]}" ${lever[$name]} > "$w.log" 2>&1 &
}

if [[ $phase == all ]]; then
  assemble_verifier || exit 1
  if [[ ! -f $W/vocab/manifest.json ]]; then
    mkdir -p "$W" && tar xzf .ab/prepared.tgz -C "$W" || exit 1
    t0=$(date +%s)
    PY=python3 bench/gpu_ab.sh "$W" "$cfg" 23 2>&1 | tail -2 || exit 1
    echo "stages 2-3: $(( $(date +%s) - t0 )) s"
  fi
  LIMIT=$(( ${DEADLINE:-560} - ($(date +%s) - start) ))
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
