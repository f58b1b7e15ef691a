#!/usr/bin/env bash
# Set everything up from a fresh clone and run the project's main job: the default recipe
# (a small model learns arithmetic: supervised warm-up, then CPPO at P = 0.875), ~10 min on
# 2 CPU cores. Extra arguments are recipe overrides, e.g. `bash scripts/main.sh train.steps=20`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/cppo-megatron doctor
.venv/bin/cppo-megatron train recipes/tiny_cpu.yaml "$@"
