#!/usr/bin/env bash
# Install the CPU environment if needed (idempotent), then run the test suite.
# Extra arguments go to pytest, e.g. ./run_tests.sh -k loss_mask or ./run_tests.sh tests/test_vocab.py
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup_env.sh
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY="${EAGLE3_VENV:-.venv}/bin/python"  # the environment setup_env.sh filled
for a in "$@"; do [[ $a == tests || $a == tests/* ]] && exec "$PY" -m pytest "$@"; done
exec "$PY" -m pytest tests "$@"
