#!/usr/bin/env bash
# Issue 50's data A/B, the GPU half, on the `device` H200: several stage-1 outputs (made here on the CPU, where vLLM
# is), each with its own stages 2-3 (HF backend) and one stage 4, all side by side on the one GPU; the drafts, two
# held-out samples' states per data set and the logs come back in 15 MiB parts ($OUT/ab.tar.part-*).
#   tar czf .ab/data/NAME.tgz -C RUN prepared     (here, for each data set: stage 1's folder only)
#   bench/ab_data.sh VARIANTS_FILE                (there; lines NAME=04_train options, NAME naming .ab/data/NAME.tgz)
# AB_SHARDS=N extracts each data set in N processes first. Needs what bench/ab_device.sh needs (/tmp/site, the GGUF's two parts). Here afterwards:
#   cat FILES/ab.tar.part-* | tar x -C runs/abd && bench/ab_serve.sh runs/abd/W-NAME runs/abd/NAME ... per data set
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh  # PYTHONPATH=/tmp/site, assemble_verifier
assemble_verifier || exit 1
mapfile -t variants < <(grep -Ev "^[[:space:]]*(#|$)" "${1:?VARIANTS_FILE}")
root=/tmp/abd; mkdir -p "$root"
one() {  # NAME OPTIONS: stages 2-4 of one data set
  local name=$1 opts=$2 W=$root/W-$1
  if [[ ! -f $W/hidden_states/manifest.json ]]; then
    mkdir -p "$W" && tar xzf ".ab/data/$name.tgz" -C "$W" || return 1
  fi
  if (( ${AB_SHARDS:-1} > 1 )); then  # extraction is the GPU half's bottleneck: N processes, one folder
    for ((i = 0; i < AB_SHARDS; i++)); do
      OMP_NUM_THREADS=2 timeout "${AB_XLIMIT:-${AB_LIMIT:-520}}" python3 02_extract_hidden_states.py --config configs/smollm2-135m.yaml \
        --work-dir "$W" --backend hf --shard-index $i --num-shards "$AB_SHARDS" > "$root/$name.x$i.log" 2>&1 &
    done
    wait
  fi
  # shellcheck disable=SC2086
  PY=python3 timeout "${AB_LIMIT:-520}" bench/gpu_ab.sh "$W" configs/smollm2-135m.yaml 234 "$name=$opts" \
    > "$root/$name.ab.log" 2>&1  # timeout ends the whole group (the training too), so the packing below runs
}
for v in "${variants[@]}"; do one "${v%%=*}" "${v#*=}" & done
wait
for v in "${variants[@]}"; do echo "== ${v%%=*}"; tail -4 "$root/${v%%=*}.ab.log"; done
packs=/tmp/abd-packs; rm -rf "$packs"; mkdir -p "$packs"
python3 bench/draft_transport.py pack "$packs" $(ls -d "$root"/W-*-*/final_draft 2>/dev/null | xargs -r -n1 dirname)
for v in "${variants[@]}"; do
  run=$root/W-${v%%=*}-${v%%=*}
  [[ -f $run/train/manifest.json ]] && mkdir -p "$packs/states-${v%%=*}" &&
    python3 bench/draft_transport.py states "$packs/states-${v%%=*}" "$run" "${PARITY_PROMPTS:-2}"
done
tar czf "$packs/logs.tgz" "$root"/*.log "$root"/W-*/logs 2>/dev/null
tar cf - -C "$packs" . | split -b 15M - "$OUT/ab.tar.part-"
ls -la "$OUT"
