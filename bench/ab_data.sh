#!/usr/bin/env bash
# Issue 50's data A/B, the GPU half, on the `device` H200: several stage-1 outputs (made here on the CPU, where vLLM
# is), each with its own stages 2-3 (HF backend) and one stage 4, all side by side on the one GPU; the drafts, two
# held-out samples' states per data set and the logs come back in 15 MiB parts ($OUT/ab.tar.part-*).
#   tar czf .ab/data/NAME.tgz -C RUN prepared     (here, for each data set: stage 1's folder only)
#   bench/ab_data.sh VARIANTS_FILE                (there; lines NAME=04_train options, NAME naming .ab/data/NAME.tgz;
#                                                  NAME.TAG: another stage 4 of the same data set, extracted once;
#                                                  .ab/data/NAME.opts, if there: options of its stages 2-4, e.g. --layer-ids)
# AB_SHARDS=N extracts each data set in N processes first. Needs what bench/ab_device.sh needs (/tmp/site, the GGUF's two parts). Here afterwards:
#   cat FILES/ab.tar.part-* | tar x -C runs/abd && bench/ab_serve.sh runs/abd/W-NAME runs/abd/NAME ... per data set
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh  # PYTHONPATH=/tmp/site, assemble_verifier
assemble_verifier || exit 1
mapfile -t variants < <(grep -Ev "^[[:space:]]*(#|$)" "${1:?VARIANTS_FILE}")
root=/tmp/abd; mkdir -p "$root"
one() {  # DATA NAME=OPTIONS...: stages 2-3 of one data set, then its stage 4s side by side
  local data=$1 W=$root/W-$1; shift
  if [[ ! -f $W/hidden_states/manifest.json ]]; then
    mkdir -p "$W" && tar xzf ".ab/data/$data.tgz" -C "$W" || return 1
  fi
  # stages 2-4 at stage 1's --max-seq-len (a data set of longer samples than the config's)
  local AB_COMMON; AB_COMMON="--max-seq-len $(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['params']['max_seq_len'])" "$W/prepared/manifest.json")"
  [[ -f .ab/data/$data.opts ]] && AB_COMMON+=" $(cat ".ab/data/$data.opts")"  # the data set's own stage 2-4 options
  export AB_COMMON
  if (( ${AB_SHARDS:-1} > 1 )); then  # extraction is the GPU half's bottleneck: N processes, one folder
    for ((i = 0; i < AB_SHARDS; i++)); do
      OMP_NUM_THREADS=2 timeout "${AB_XLIMIT:-${AB_LIMIT:-520}}" python3 02_extract_hidden_states.py --config configs/smollm2-135m.yaml \
        --work-dir "$W" $AB_COMMON --backend hf --shard-index $i --num-shards "$AB_SHARDS" > "$root/$data.x$i.log" 2>&1 &
    done
    wait
  fi
  PY=python3 timeout "${AB_LIMIT:-520}" bench/gpu_ab.sh "$W" configs/smollm2-135m.yaml 234 "$@" \
    > "$root/$data.ab.log" 2>&1  # timeout ends the whole group (the training too), so the packing below runs
}
datas=$(for v in "${variants[@]}"; do n=${v%%=*}; echo "${n%%.*}"; done | sort -u)
for d in $datas; do
  mine=(); for v in "${variants[@]}"; do n=${v%%=*}; [[ ${n%%.*} == "$d" ]] && mine+=("$v"); done
  one "$d" "${mine[@]}" &
done
wait
for d in $datas; do echo "== $d"; tail -8 "$root/$d.ab.log"; done
packs=/tmp/abd-packs; rm -rf "$packs"; mkdir -p "$packs"
python3 bench/draft_transport.py pack "$packs" $(ls -d "$root"/W-*-*/final_draft 2>/dev/null | xargs -r -n1 dirname)
for d in $datas; do  # the held-out samples' states: the same split for every stage 4 of a data set
  run=$(ls -d "$root/W-$d-"*/train/manifest.json 2>/dev/null | head -1 | xargs -r dirname | xargs -r dirname)
  [[ -n $run ]] && mkdir -p "$packs/states-$d" &&
    python3 bench/draft_transport.py states "$packs/states-$d" "$run" "${PARITY_PROMPTS:-2}"
done
tar czf "$packs/logs.tgz" "$root"/*.log "$root"/W-*/logs 2>/dev/null
tar cf - -C "$packs" . | split -b 15M - "$OUT/ab.tar.part-"
ls -la "$OUT"
