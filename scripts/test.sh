#!/usr/bin/env bash
# The test suite as CI runs it: everything except tests marked slow (run those with `-m slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
export WANDB_MODE=offline HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python -m pytest -q -m "not slow" "$@"
