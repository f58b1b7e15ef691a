#!/usr/bin/env bash
# Create (or reuse) .venv-verl-vllm: the main .venv (veRL 0.9.1, torch 2.13.0 CPU build) plus
# vllm-cpu 0.28.0, for veRL's own vLLM rollout in the CPU mode (docs/records/verl_cpu_mode.md,
# "veRL's vLLM rollout on CPU"). `cppo-megatron verl` runs it by itself when a CPU recipe asks
# for `rollout.name=vllm` and this environment lacks vLLM.
#
#   bash scripts/setup_verl_vllm.sh       # .venv-verl-vllm (runs scripts/setup.sh first)
#
# vLLM's packages (requirements/verl-vllm-cpu.txt, 1.3 GB) are installed once into a folder cached
# OUTSIDE the clone, keyed by that file: ${CPPO_CACHE:-~/.cache/cppo-megatron}/verl-vllm-<key>.
# .venv-verl-vllm itself is a venv without packages: one .pth file puts that folder first on the
# path and the main .venv's site-packages after it, so everything else (veRL, torch, the editable
# cppo-megatron and its entry points) is the main environment's, and a second clone or CI run
# on the same machine is ready in about a second.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv-verl-vllm}
MAIN=${MAIN_VENV:-.venv}
REQ=requirements/verl-vllm-cpu.txt
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

bash scripts/setup.sh >/dev/null || { echo "setup_verl_vllm: scripts/setup.sh failed (run it for the message)" >&2; exit 1; }
PY="$MAIN/bin/python"
key="$( (cat "$REQ"; "$PY" -V) | sha1sum | cut -c1-12)"
CACHE=${CPPO_CACHE:-$HOME/.cache/cppo-megatron}
LAYER="$CACHE/verl-vllm-$key"
mkdir -p "$CACHE"
log="$CACHE/verl-vllm-$key.log"
SECONDS=0

if [[ -f "$LAYER/.cppo-complete" ]]; then
  echo "setup_verl_vllm: reusing the cached vLLM layer $LAYER"
else
  echo "setup_verl_vllm: installing vllm-cpu 0.28.0 and what it needs beyond $MAIN into $LAYER (once per machine)"
  rm -rf "$LAYER"
  if ! "$PY" -m pip install -q --no-compile --no-deps --target "$LAYER" -c constraints/cpu.txt -r "$REQ" >"$log" 2>&1; then
    tail -30 "$log"
    echo "setup_verl_vllm: pip install -r $REQ failed; full log in $log" >&2
    exit 1
  fi
  touch "$LAYER/.cppo-complete"
  echo "setup_verl_vllm: vLLM layer installed in ${SECONDS} s"
fi
# byte-compile the layer once: with PYTHONDONTWRITEBYTECODE=1 (set on our CI machines) no import
# writes a .pyc, and every process of a run (the vLLM server, its engine core and workers, veRL's
# workers) would compile vLLM's 10,000 modules anew (about 3 s of CPU each, per process)
if [[ ! -f "$LAYER/.cppo-compiled" ]]; then
  "$PY" -m compileall -q -j 0 "$LAYER" >>"$log" 2>&1 || true  # a module that does not compile stays source
  touch "$LAYER/.cppo-compiled"
  echo "setup_verl_vllm: layer byte-compiled (${SECONDS} s so far)"
fi

stamp="$VENV/.cppo-setup"
main_site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
main_site=$(cd "$main_site" && pwd)
want="$key $main_site"
if [[ -x "$VENV/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "setup_verl_vllm: $VENV is up to date"
  exit 0
fi
rm -rf "$VENV"
"$PY" -m venv --without-pip "$VENV"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# the layer first (its numpy, fastapi, setuptools win), then the main environment with its own
# .pth files processed (the editable cppo-megatron)
printf '%s\nimport site; site.addsitedir(%s)\n' "$LAYER" "'$main_site'" > "$site/_cppo_verl_vllm.pth"
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'PY' || { echo "setup_verl_vllm: $VENV does not import vLLM and veRL together" >&2; exit 1; }
import importlib.metadata as md
import torch, verl, vllm, cppo_megatron  # noqa: F401,E401
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"setup_verl_vllm: vllm-cpu {md.version('vllm-cpu')}, veRL {verl.__version__}, torch {torch.__version__}")
PY
echo "$want" > "$stamp"
echo "setup_verl_vllm: $VENV ready in ${SECONDS} s"
