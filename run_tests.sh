#!/usr/bin/env bash
# Install the CPU environment if needed (idempotent), then run the test suite.
# Extra arguments go to pytest, e.g. ./run_tests.sh -k loss_mask or ./run_tests.sh tests/test_vocab.py
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup_env.sh
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
for a in "$@"; do [[ $a == tests || $a == tests/* ]] && exec .venv/bin/python -m pytest "$@"; done
exec .venv/bin/python -m pytest tests "$@"
