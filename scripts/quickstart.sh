#!/usr/bin/env bash
# The quickstart: set up from scratch, then data -> vocab -> hidden states -> train -> bench -> gate -> export
# on the real SmolLM2-135M-Instruct target and real prompts of five kinds (ShareGPT chat, summaries, HumanEval), on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
# The quickstart needs no serving engine; CI and `eyas bench --engine vllm` install it (EYAS_ENGINE=vllm).
EYAS_ENGINE=${EYAS_ENGINE:-none} bash scripts/setup.sh
. .venv/bin/activate
export WANDB_MODE=offline HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
set +e
eyas run recipes/smollm2-135m-cpu.yaml "$@"
code=$?
echo "quickstart wall time: $(( $(date +%s) - start )) s (set-up included)"
exit $code
