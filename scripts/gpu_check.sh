#!/usr/bin/env bash
# Run `cppo-megatron gpu-check` on a GPU machine, offline (docs/gpu.md).
#
#   bash scripts/gpu_check.sh --wheels DIR [gpu-check options]   # install DIR's wheels, then run
#   bash scripts/gpu_check.sh [gpu-check options]                # already installed: just run
#
# DIR comes from scripts/gpu_wheels.sh. The wheels are installed with
# `pip install --no-index --no-deps`: nothing is downloaded and nothing else is resolved,
# so the machine's own torch (and transformers, numpy, ...) stay exactly as they are; the
# script checks that torch's version is unchanged afterwards. PYTHON picks the interpreter
# (default python3). Options after --wheels DIR go to gpu-check, e.g. --out DIR, --quick,
# --device cpu. The exit status is gpu-check's: 0 only if every check passed.
set -euo pipefail
PY=${PYTHON:-python3}
WHEELS=""
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) WHEELS=${2:?--wheels needs a folder}; shift 2 ;;
    --wheels=*) WHEELS=${1#*=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [[ -n $WHEELS ]]; then
  shopt -s nullglob
  whl=("$WHEELS"/*.whl)
  if [[ ${#whl[@]} -eq 0 ]]; then
    echo "gpu_check.sh: no .whl files in $WHEELS (make them with scripts/gpu_wheels.sh)" >&2
    exit 2
  fi
  torch_before=$("$PY" -c 'import torch; print(torch.__version__)') || {
    echo "gpu_check.sh: $PY cannot import torch; gpu-check uses the machine's own torch" >&2; exit 2; }
  echo "gpu_check.sh: installing ${#whl[@]} wheels from $WHEELS offline (--no-index --no-deps)"
  "$PY" -m pip install --quiet --no-index --no-deps --force-reinstall "${whl[@]}"
  torch_after=$("$PY" -c 'import torch; print(torch.__version__)')
  if [[ $torch_before != "$torch_after" ]]; then
    echo "gpu_check.sh: torch changed from $torch_before to $torch_after; it must not" >&2
    exit 2
  fi
  echo "gpu_check.sh: torch $torch_after untouched"
  # -P: import the installed package, not a source tree in the current directory
  exec "$PY" -P -m cppo_megatron.cli gpu-check ${args[@]+"${args[@]}"}
fi
exec "$PY" -m cppo_megatron.cli gpu-check ${args[@]+"${args[@]}"}
