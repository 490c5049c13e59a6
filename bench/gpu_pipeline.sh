#!/usr/bin/env bash
# The pipeline and its GPU checks on the lent `device` GPU with CUDA vLLM 0.26.0 (the successor of
# ../shared/device/run_vllm026.sh: no stamp faked, nothing patched, FlashInfer's sampler left to the pipeline).
#
# Here, once:  ../shared/device/pack_vllm026.sh with KEEP_MOE=1 (the Kimi miniature's MoE kernels) -> .pk/p00..p05;
#              pytest, NVML's Python binding and py-spy as wheels into .whl/ (docs/gpu.md has the lines).
# Device calls, back to back (the machine keeps /tmp while warm: 30 s idle, 30 min held):
#   carry [".pk/pNN", ".whl"]:  bash bench/gpu_pipeline.sh part            (one call per part)
#   carry [".whl"]:             bash bench/gpu_pipeline.sh run -- CMD...   (unpack once, then CMD in the project root)
# CMD examples, as run 2026-12-07 on one H100 (README's GPU table):
#   timeout 560 ./run_pipeline.sh                          # the embedded default, every stage; re-run to resume
#   python3 -m pytest -m gpu tests/test_gpu.py -q -s       # the GPU checks, on that run
# What the run leaves that is worth bringing back: bash bench/gpu_pipeline.sh keep $OUT (report, logs, eval, draft).
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:?part|run|keep}; shift
site=/tmp/site venv=/tmp/venv-vllm026
mkdir -p /tmp/pk
cp .pk*/p?? /tmp/pk/ 2>/dev/null; echo "parts here: $(ls /tmp/pk | tr '\n' ' ')"
if [[ $phase == keep ]]; then
  out=${1:?OUT}; w=${EAGLE3_WORK:-runs/smollm2-135m}
  tar -C "$w" -czf "$out/run.tgz" report.md logs eval train/manifest.json final_draft prepared/manifest.json \
      hidden_states/manifest.json vocab 2>/dev/null
  ls -la "$out"; exit 0
fi
[[ $phase == run ]] || exit 0
[[ ${1:-} == -- ]] && shift
if [[ ! -d $site/vllm ]]; then
  mkdir -p $site && cat /tmp/pk/p?? | tar xzf - -C $site || { echo "unpack failed: carry every part first"; exit 1; }
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target $site .whl/*.whl 2>&1 | grep -v WARNING
fi
py=$(command -v python3)
mkdir -p $venv/bin
printf '#!/usr/bin/env bash\nexport PYTHONPATH=%s${PYTHONPATH:+:$PYTHONPATH}\nexec %s "$@"\n' "$site" "$py" > $venv/bin/python
chmod +x $venv/bin/python
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} EAGLE3_VENV=$venv EAGLE3_CACHE=${EAGLE3_CACHE:-/tmp/eagle3-cache} \
       PYTHONUNBUFFERED=1
python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__, torch.cuda.get_device_name())"
[[ -z ${STALL_S:-} ]] && exec "$@"
# STALL_S=N: a command with no output line for N s gets every Python process's stacks (faulthandler on SIGABRT) and
# stops: a hang shows where it waits instead of using up the call
export PYTHONFAULTHANDLER=1
log=/tmp/gpu_pipeline.out; : > $log
"$@" > >(tee -a $log) 2>&1 &
pid=$!
while kill -0 $pid 2>/dev/null; do
  sleep 5
  if (( $(date +%s) - $(stat -c %Y $log) > STALL_S )); then
    echo "[gpu_pipeline] no output for ${STALL_S} s: the stacks of every Python process follow"
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv
    below=$(ps -eo pid=,ppid= | awk -v root=$pid '{up[$1]=$2} END {for (p in up) {q=p; while ((q in up) && q != root) q=up[q]; if (q == root) print p}}')
    for p in $below; do ps -o pid=,ppid=,stat=,etime=,args= -p $p | cut -c1-160; done
    for p in $below; do  # C and Python frames where py-spy came in .whl/, then Python's own (faulthandler)
      [[ $(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null) =~ python|VLLM ]] || continue
      [[ -x $site/bin/py-spy ]] && timeout 60 $site/bin/py-spy dump --native --pid $p 2>&1 | head -60
    done
    for p in $below; do [[ $(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null) =~ python|VLLM ]] && kill -ABRT $p; done
    sleep 5; for p in $below; do kill -KILL $p 2>/dev/null; done; wait $pid; exit 124
  fi
done
wait $pid
