#!/usr/bin/env bash
# Set everything up from a fresh clone and run the test suite (what CI runs).
#   bash scripts/test.sh               # the whole suite
#   bash scripts/test.sh tests/core    # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONHASHSEED=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/python -m pytest -q "$@"
