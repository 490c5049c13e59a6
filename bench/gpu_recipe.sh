#!/usr/bin/env bash
# The Kimi-K2.5 recipe's GPU-only pieces on one CUDA machine without vLLM (the `device` H200 here):
#   1. fork safety: the vLLM stages' preflights, then a forked child that uses CUDA (must work); and the
#      same fork after a plain torch.cuda.is_available(), which is what the fix prevents
#   2. stages 1 (no regeneration), 2 (--backend hf), 3 and 4 of the miniature Kimi-K2.5 on CUDA
# Usage: bench/gpu_recipe.sh OUT TOKENIZER_DIR CONVERSATIONS.jsonl
#   TOKENIZER_DIR: SmolLM2's tokenizer files (the miniature's tokenizer); CONVERSATIONS: ShareGPT JSONL.
# Needs transformers >= 5.19 (kimi_k25) beside torch; prints each step and writes OUT/W/ (the work dir).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT}; tok=${2:?TOKENIZER_DIR}; data=${3:?CONVERSATIONS.jsonl}
PY=${PY:-python3}
mkdir -p "$out"
mini="$out/kimi-k2.5-mini" work="$out/W"
cfg=configs/kimi-k2.5-mini.yaml
common=(--config "$cfg" --verifier "$mini" --work-dir "$work" --num-samples 24 --dataset "$data")
nvidia-smi -L; "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

echo "== miniature Kimi-K2.5"
"$PY" scripts/mini_kimi.py --out "$mini" --tokenizer "$tok" || exit 1
echo "== stage 1 (no regeneration: no vLLM here)"
"$PY" 01_prepare_dataset.py "${common[@]}" --no-regenerate || exit 1
echo "== stage 2, HF backend on CUDA"
"$PY" 02_extract_hidden_states.py "${common[@]}" --backend hf || exit 1
echo "== stage 3"
"$PY" 03_build_vocab_mapping.py "${common[@]}" || exit 1
echo "== stage 4 on CUDA (compiled flex attention), 30 steps"
"$PY" 04_train.py "${common[@]}" --max-steps 30 --warmup-steps 5 --lr 1e-3 --log-interval 5 || exit 1
echo "== fork safety: preflights of stages 1 (--regenerate), 2, 5, then a forked CUDA child"
"$PY" bench/fork_after_preflight.py -- "${common[@]}" --eval-dataset "$data"
echo "== the same fork after a plain torch.cuda.is_available() (no PYTORCH_NVML_BASED_CUDA_CHECK)"
"$PY" bench/fork_after_preflight.py --without-fix
