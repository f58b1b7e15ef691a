#!/usr/bin/env bash
# Download exactly the wheels an offline GPU machine needs for `cppo-megatron gpu-check`,
# for Python 3.12 on manylinux x86-64 (docs/gpu.md):
#   this package (built here as a wheel), megatron-core, omegaconf and omegaconf's
#   pure-Python antlr4 runtime, and gguf (pure Python: `gpu-check --study` reads SmolLM2's GGUF
#   file with it; its numpy, PyYAML and tqdm are there, requests is imported only to download).
# Not included, because the GPU machine already has them: torch (CUDA), transformers
# (and its dependencies: packaging, PyYAML, ...), numpy, safetensors, pytest, tqdm.
#
#   bash scripts/gpu_wheels.sh DIR                      # Python 3.12 (default)
#   PYTHON_VERSION=3.11 bash scripts/gpu_wheels.sh DIR  # another interpreter version
#
# Then copy DIR and this repository's scripts/gpu_check.sh to the GPU machine and run
#   bash scripts/gpu_check.sh --wheels DIR
# DIR must be new or empty, or a folder this script filled before (it is refilled).
# PYTHON picks the interpreter whose pip downloads and builds (default .venv/bin/python, else python3).
set -euo pipefail
DIR=${1:?usage: bash scripts/gpu_wheels.sh DIR}
PYVER=${PYTHON_VERSION:-3.12}
LIMIT_MIB=${LIMIT_MIB:-60}
MEGATRON_CORE=0.16.1   # the version the megatron path is tested with (tests/megatron)
OMEGACONF=2.3.1
GGUF=0.19.0           # transformers' GGUF loader needs it (the train extra's gguf>=0.10)
ANTLR=4.9.3            # omegaconf pins antlr4-python3-runtime==4.9.*; PyPI has only its sdist
MARK=.cppo-gpu-wheels

if [[ -d $DIR && -n "$(ls -A "$DIR")" && ! -f $DIR/$MARK ]]; then
  echo "gpu_wheels.sh: $DIR is not empty and was not made by this script; choose a new folder" >&2
  exit 2
fi
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)   # absolute, relative to where the script was started
rm -f "$DIR"/*.whl
cd "$(dirname "$0")/.."   # the repository: its package is built below
if [[ -x .venv/bin/python ]]; then PY=${PYTHON:-.venv/bin/python}; else PY=${PYTHON:-python3}; fi
abi=cp${PYVER/./}
echo "gpu_wheels.sh: wheels for CPython $PYVER manylinux x86-64 -> $DIR"

# 1. this package, pure Python
"$PY" -m pip wheel --quiet --no-deps -w "$DIR" .
# 2. binary wheels for the target interpreter (megatron-core ships manylinux_2_28 wheels,
#    the tag torch's own Linux wheels carry)
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --abi "$abi" --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$DIR" \
  "megatron-core==$MEGATRON_CORE" "omegaconf==$OMEGACONF" "gguf==$GGUF"
# 3. the antlr runtime exists only as an sdist: build its (pure-Python, py3-none-any) wheel here
"$PY" -m pip wheel --quiet --no-deps -w "$DIR" "antlr4-python3-runtime==$ANTLR"

ls -1 "$DIR"/*.whl | xargs -n1 basename > "$DIR/$MARK"
echo
ls -l "$DIR"/*.whl | awk '{printf "  %8.2f MiB  %s\n", $5 / 1048576, $NF}' | sed "s#$DIR/##"
total=$(cat "$DIR"/*.whl | wc -c)
mib=$(awk -v b="$total" 'BEGIN { printf "%.2f", b / 1048576 }')
echo "gpu_wheels.sh: $(wc -l < "$DIR/$MARK") wheels, total $mib MiB (limit $LIMIT_MIB MiB)"
if awk -v b="$total" -v l="$LIMIT_MIB" 'BEGIN { exit !(b > l * 1048576) }'; then
  echo "gpu_wheels.sh: over the $LIMIT_MIB MiB limit" >&2
  exit 1
fi
