#!/usr/bin/env bash
# The GPU check (issue 14; docs/gpu-check.md): lossless decoding on CUDA (fp32, bf16, sampling), head training
# speed at the Llama-3.1-8B head shape (offline and with the target in the loop), the GPU cost model against
# autotune's shapes, and `accelerate launch` with the FSDP and ZeRO-3 configs. Everything is random-initialised
# from configs; nothing is downloaded.
#
#   bash scripts/gpu_check.sh OUT_DIR [--cpu] [--sections lossless,cost_model] [--budget-s 420]
#
# Writes OUT_DIR/gpu_check.json, OUT_DIR/gpu_check.md and OUT_DIR/gpu_check.log. Exit 0 when every section is ok.
#
# On the device machine (one H200, no network there), as ONE call of the device tool:
#     command:   bash scripts/gpu_check.sh $OUT
#     carry:     [".whl"]
#     timeout_s: 480
# The sections take about 5 minutes; none starts after --budget-s (420 s by default), and the JSON is
# rewritten after every section, so a run cut short still returns what it measured. To rerun only some
# sections, e.g. after a fix: `bash scripts/gpu_check.sh $OUT --sections cost_model,accelerate_launch`.
# Afterwards: commit $OUT's gpu_check.md as docs/results-gpu.md (with the date of the run, which it holds),
# fix what it finds, and mark the GPU run done in docs/gpu-check.md.
#
# Wheels: the GPU machine's python3 (/opt/torch/.venv) has torch, transformers, accelerate, safetensors,
# pyyaml, tqdm, matplotlib, numpy, pandas, pyarrow, but not datasets or deepspeed. Those travel as wheels in
# .whl/ (git-ignored, about 6 MiB) and are installed into a temporary folder on that machine only when
# missing there. To fetch them (here, with network; deepspeed has no wheel on PyPI: build one, DS_BUILD_OPS=0):
#     P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl --platform manylinux_2_28_x86_64
#        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
#     python3 -m pip download $P datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19 hjson==3.1.0 pydantic==2.14.4 \
#         pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
#     DS_BUILD_OPS=0 python3 -m pip wheel --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
#
# eyas is imported from this checkout without installing it: pyproject maps folders to subpackages (data/ ->
# eyas.data, ...), so a temporary `eyas` folder of symbolic links goes first on PYTHONPATH (the processes
# that section 4 starts inherit it).
set -euo pipefail

if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
    echo "usage: bash scripts/gpu_check.sh OUT_DIR [--cpu] [--sections a,b] [--budget-s S]" >&2
    exit 2
fi
OUT="$1"
shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
CPU=0
for arg in "$@"; do [ "$arg" = "--cpu" ] && CPU=1; done
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/eyas-gpu-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# The eyas package as pyproject lays it out, made of links into the checkout.
mkdir "$WORK/pkg" "$WORK/pkg/eyas"
for entry in "$ROOT"/eyas/*; do
    ln -s "$entry" "$WORK/pkg/eyas/$(basename "$entry")"
done
for sub in data heads train eval recipes; do
    ln -s "$ROOT/$sub" "$WORK/pkg/eyas/$sub"
done
export PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}"

# Carried wheels, installed only when datasets or deepspeed is missing; the few this machine also has
# (typing_extensions) are then shadowed by the carried, newer ones.
if [ "$CPU" = 0 ] && compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    if ! "$PY" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(n) is None for n in ('datasets', 'deepspeed')))"; then
        echo "[gpu_check] installing the carried wheels into $WORK/site"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "$ROOT"/.whl/*.whl
        export PYTHONPATH="$PYTHONPATH:$WORK/site"
    fi
fi

# Not from the checkout's root: its eyas/ folder (the CLI alone) would shadow the linked package.
cd "$WORK"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
"$PY" -c "import eyas, sys; print('[gpu_check] eyas from', eyas.__file__, '| python', sys.version.split()[0])"
"$PY" "$ROOT/benchmarks/gpu_check.py" --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
