#!/usr/bin/env bash
# Create (or reuse) .venv-bridge: Python 3.12 with veRL 0.9.1, NVIDIA Megatron-Bridge 0.5.1 and
# megatron-core 0.18.2, for veRL's default Megatron route (vanilla_mbridge: false) in the CPU mode
# (docs/records/verl_cpu_mode.md, "Megatron-Bridge on CPU"). Every package comes from
# requirements/bridge-cpu.txt with --no-deps (that file says what is left out and why).
#
#   bash scripts/setup_bridge.sh          # .venv-bridge (the third-party packages cached, below)
#   PYTHON312=/path/to/python3.12 bash scripts/setup_bridge.sh
#
# The third-party packages (4.9 GB: torch's CUDA build and the CUDA libraries it links) are
# installed once into a base environment cached OUTSIDE the clone, keyed by the pin file:
# ${CPPO_CACHE:-~/.cache/cppo-megatron}/bridge-<key>. .venv-bridge itself is a small venv of this
# checkout that sees the base's packages through a .pth file and holds the editable cppo-megatron,
# so a second clone (or CI run) on the same machine reuses the base in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv-bridge}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
REQ=requirements/bridge-cpu.txt
LOCAL_WHEELS=${LOCAL_WHEELS:-/opt/pypi-more/files}   # this machine kind's copies of the CUDA wheels

if [[ -z "${PYTHON312:-}" ]]; then
  # pyenv's 3.12 (this machine kind has 3.12.1), else a python3.12 that runs (a pyenv shim may not)
  for cand in $(command -v pyenv >/dev/null && ls -d "$(pyenv root)"/versions/3.12*/bin/python 2>/dev/null) python3.12; do
    if "$cand" -V >/dev/null 2>&1; then PYTHON312=$(command -v "$cand"); break; fi
  done
fi
if [[ -z "$PYTHON312" || ! -x "$PYTHON312" ]]; then
  echo "setup_bridge: no Python 3.12 found (Megatron-Bridge needs 3.12); set PYTHON312=/path/to/python3.12" >&2
  exit 2
fi
pyver=$("$PYTHON312" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [[ "$pyver" != "3.12" ]]; then
  echo "setup_bridge: $PYTHON312 is Python $pyver; Megatron-Bridge 0.5.1 needs 3.12" >&2
  exit 2
fi

key="$( (cat "$REQ"; "$PYTHON312" -V) | sha1sum | cut -c1-12)"
CACHE=${CPPO_CACHE:-$HOME/.cache/cppo-megatron}
BASE="$CACHE/bridge-$key"
SECONDS=0
log_dir="$CACHE"; mkdir -p "$log_dir"
log="$log_dir/bridge-$key.log"

if [[ -f "$BASE/.cppo-complete" ]]; then
  echo "setup_bridge: reusing the cached base environment $BASE"
else
  echo "setup_bridge: building the base environment $BASE (cold: downloads torch 2.13.0 for Python 3.12, 527 MB)"
  rm -rf "$BASE"
  "$PYTHON312" -m venv "$BASE"
  pip_base() {
    if ! "$BASE/bin/python" -m pip install -q --no-compile --no-deps "$@" >>"$log" 2>&1; then
      tail -30 "$log"
      echo "setup_bridge: pip install $* failed; full log in $log" >&2
      exit 1
    fi
  }
  grep -E '^nvidia-(cu|nccl|nvjitlink|nvshmem)' "$REQ" > "$CACHE/bridge-$key.cuda.txt"
  grep -vE '^(#|$|nvidia-(cu|nccl|nvjitlink|nvshmem))' "$REQ" > "$CACHE/bridge-$key.rest.txt"
  if [[ -d "$LOCAL_WHEELS" ]] && ls "$LOCAL_WHEELS"/nvidia_cublas-* >/dev/null 2>&1; then
    pip_base --no-index --find-links "$LOCAL_WHEELS" -r "$CACHE/bridge-$key.cuda.txt"
  else
    pip_base -r "$CACHE/bridge-$key.cuda.txt"
  fi
  echo "setup_bridge: CUDA libraries torch links installed (${SECONDS} s so far)"
  pip_base -r "$CACHE/bridge-$key.rest.txt"
  "$BASE/bin/python" - <<'PY' >>"$log" 2>&1 || { tail -20 "$log"; echo "setup_bridge: the base environment does not import; see $log" >&2; exit 1; }
import torch, megatron.core, verl  # noqa: F401,E401
assert torch.__version__.startswith("2.13.0"), torch.__version__
PY
  touch "$BASE/.cppo-complete"
  echo "setup_bridge: base environment built in ${SECONDS} s"
fi
# byte-compile the base once (torch included): with PYTHONDONTWRITEBYTECODE=1 (set on our CI
# machines) no import writes a .pyc, and every Ray worker would compile torch, megatron-core, veRL
# and transformers anew
if [[ ! -f "$BASE/.cppo-compiled" ]]; then
  "$BASE/bin/python" -m compileall -q -j 0 "$BASE/lib" >>"$log" 2>&1 || true  # a module that does not compile stays source
  touch "$BASE/.cppo-compiled"
  echo "setup_bridge: base environment byte-compiled (${SECONDS} s so far)"
fi

site_base=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
stamp="$VENV/.cppo-setup"
want="$key $(cat pyproject.toml | sha1sum | cut -c1-12)"
if [[ -x "$VENV/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "setup_bridge: $VENV is up to date"
  exit 0
fi
rm -rf "$VENV"
"$PYTHON312" -m venv --without-pip "$VENV"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$site_base" > "$site/_cppo_bridge_base.pth"
# the editable install of this checkout (its dist-info carries the verl.plugins entry point)
if ! "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . >>"$log" 2>&1; then
  tail -20 "$log"
  echo "setup_bridge: installing this checkout into $VENV failed; see $log" >&2
  exit 1
fi
"$VENV/bin/python" -c 'import cppo_megatron, importlib.metadata as m; assert m.version("megatron-bridge") == "0.5.1"'
echo "$want" > "$stamp"
echo "setup_bridge: $VENV ready in ${SECONDS} s (Python 3.12, torch 2.13.0, Megatron-Bridge 0.5.1, megatron-core 0.18.2)"
