#!/usr/bin/env bash
# Set everything up from a fresh clone and run the project's main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/cppo-megatron doctor
.venv/bin/cppo-megatron demo "$@"
