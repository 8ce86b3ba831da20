"""GPU check, section 4: `accelerate launch` with the FSDP and DeepSpeed ZeRO-3 configs starts and trains.

Everything is built in a temporary folder, from nothing: a byte-level BPE tokenizer trained on a synthetic
chat corpus (with a small chat template), a tiny random Llama target saved beside it, and a recipe. The
pipeline runs as a user runs it, through the CLI: `eyas prepare|vocab|collect RECIPE` (the CLI's main, in
this process: three more interpreter starts would cost more than the stages), then per launcher config
`accelerate launch --config_file C --num_processes 1 -m eyas train RECIPE train.max_steps=N` on its own copy
of the prepared stages. A launch passes when it exits 0 and its metrics log holds finite training losses up
to step N.

On the GPU: recipes/accelerate/gpu-fsdp.yaml and gpu-zero3.yaml. In --cpu mode one launch with a
one-process CPU config written next to the recipe (cheap: the point there is that the section cannot rot).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_check_common import Ctx

REPO = Path(__file__).resolve().parents[1]
SPECIALS = ["<|pad|>", "<|begin|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
WORDS = ("draft head target token verify accept cache layer tree chain sample greedy batch train step loss "
         "vocab feature hidden state model speed forward").split()
CPU_ACCELERATE_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: 'NO'
num_machines: 1
num_processes: 1
machine_rank: 0
mixed_precision: 'no'
use_cpu: true
"""


def corpus(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    sentence = lambda k: " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."  # noqa: E731
    return [{"messages": [{"role": "user", "content": sentence(rng.randint(4, 8)) + " Why?"},
                          {"role": "assistant", "content": " ".join(sentence(rng.randint(5, 9)) for _ in range(3))}]}
            for _ in range(n)]


def build_target(folder: Path, records: list[dict]) -> None:
    """A byte-level BPE tokenizer trained on the corpus and a random 8-layer Llama with its vocabulary."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    texts = [m["content"] for r in records for m in r["messages"]]
    raw.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIALS, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<|pad|>", bos_token="<|begin|>",
                                        eos_token="<|end|>", additional_special_tokens=SPECIALS[3:])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)


def write_recipe(path: Path, target: Path, corpus_file: Path, run_dir: Path, cuda: bool) -> None:
    import yaml

    recipe = {
        "name": "gpu-check-tiny", "output_dir": str(run_dir),
        "target": {"name_or_path": str(target), "dtype": "auto", "device": "auto"},
        "data": {"corpora": [{"kind": "jsonl", "path": str(corpus_file)}], "max_length": 96,
                 "validation_fraction": 0.2, "min_assistant_tokens": 4, "regenerate": False},
        "vocab": {"draft_vocab_size": 64, "sizes": [32, 64], "shrink_to_distinct": True, "argmax_positions": 256},
        "collect": {"mode": "offline", "batch_size": 8, "shard_tokens": 4096},
        "train": {"ttt_steps": 2, "batch_size": 2, "max_steps": 2, "eval_every": 1000, "save_every": 1000,
                  "log_every": 1, "warmup_steps": 1, "eval_max_batches": 1, "mixed_precision": "bf16" if cuda else "fp32"},
    }
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_command(cmd: list[str], env: dict, timeout: float, cwd: Path) -> dict:
    """Run `cmd` (never from the checkout's root, whose eyas/ folder would shadow the package)."""
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              timeout=timeout, cwd=str(cwd))
        rc, output = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        rc, output = "timeout", out.decode(errors="replace") if isinstance(out, bytes) else out
    row = {"command": " ".join(cmd[1:]), "rc": rc, "seconds": round(time.monotonic() - start, 1)}
    if rc != 0:
        row["output_tail"] = output[-3000:]
    return row


def run_stage(stage: str, recipe: Path) -> dict:
    from eyas.cli import main as eyas_main

    start = time.monotonic()
    row = {"command": f"eyas {stage} RECIPE"}
    try:
        row["rc"] = eyas_main([stage, str(recipe)])
    except Exception as exc:  # noqa: BLE001 (a bug's traceback goes into the report)
        import traceback

        row.update(rc=f"{type(exc).__name__}: {exc}", output_tail=traceback.format_exc(limit=8))
    return dict(row, seconds=round(time.monotonic() - start, 1))


def train_losses(head_dir: Path) -> list[tuple[int, float]]:
    path = head_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]


def launch(name: str, config: Path, prepared: Path, recipe: Path, root: Path, env: dict, steps: int,
           timeout: float) -> dict:
    """One `accelerate launch` on a copy of the prepared stages; passes on exit 0 and finite losses to `steps`."""
    run_dir = root / f"run-{name}"
    for stage in ("data", "vocab", "features"):
        shutil.copytree(prepared / stage, run_dir / stage)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "1",
           "--main_process_port", str(free_port()), "-m", "eyas", "train", str(recipe),
           f"output_dir={run_dir}", f"train.max_steps={steps}"]
    row = run_command(cmd, env, timeout, cwd=root)
    losses = train_losses(run_dir / "head")
    row.update(config=str(config.relative_to(REPO) if config.is_relative_to(REPO) else config.name),
               losses=losses, ok=row["rc"] == 0 and bool(losses) and losses[-1][0] == steps
               and all(math.isfinite(loss) for _, loss in losses))
    return row


def run(ctx: Ctx) -> dict:
    root = Path(tempfile.mkdtemp(prefix="eyas-gpu-check-"))
    results, failures = {"folder": str(root), "stages": [], "launches": {}}, []
    try:
        records = corpus(48)
        corpus_file = root / "corpus.jsonl"
        corpus_file.write_text("".join(json.dumps(r) + "\n" for r in records))
        build_target(root / "target", records)
        recipe = root / "recipe.yaml"
        write_recipe(recipe, root / "target", corpus_file, root / "run", ctx.cuda)
        offline = dict(WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                       HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
        os.environ.update(offline)
        env = dict(os.environ, **offline)
        env.pop("ACCELERATE_USE_CPU", None)
        for stage in ("prepare", "vocab", "collect"):
            row = run_stage(stage, recipe)
            results["stages"].append(row)
            if row["rc"] != 0:
                failures.append(f"`eyas {stage}` exited {row['rc']}")
                return dict(results, failures=failures)
        if ctx.cpu:
            cpu_config = root / "cpu-1proc.yaml"
            cpu_config.write_text(CPU_ACCELERATE_CONFIG)
            configs = {"cpu": cpu_config}
        else:
            configs = {"fsdp": REPO / "recipes/accelerate/gpu-fsdp.yaml", "zero3": REPO / "recipes/accelerate/gpu-zero3.yaml"}
        results["deepspeed_installed"] = importlib.util.find_spec("deepspeed") is not None
        for name, config in configs.items():
            if name == "zero3" and not results["deepspeed_installed"]:
                results["launches"][name] = {"ok": False, "skipped": "deepspeed is not installed (carry .whl)"}
                failures.append("zero3: deepspeed is not installed on this machine")
                continue
            if ctx.remaining() < 30:
                results["launches"][name] = {"ok": False, "skipped": "time budget spent"}
                failures.append(f"{name}: not launched, the time budget was spent")
                continue
            row = launch(name, config, root / "run", recipe, root, env, steps=2 if ctx.cpu else 3,
                         timeout=120 if ctx.cpu else 240)
            results["launches"][name] = row
            if not row["ok"]:
                failures.append(f"{name}: launch exited {row['rc']} with losses {row['losses']}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return dict(results, failures=failures)


def markdown(results: dict) -> list[str]:
    lines = ["| step | rc | seconds |", "|---|---|---|"]
    for row in results.get("stages", []):
        lines.append(f"| `{row['command']}` | {row['rc']} | {row['seconds']} |")
    for name, row in results.get("launches", {}).items():
        if "skipped" in row:
            lines.append(f"| launch {name} | skipped: {row['skipped']} | - |")
        else:
            lines.append(f"| launch {name} ({row['config']}): losses {row['losses']} | {row['rc']} | {row['seconds']} |")
    for row in list(results.get("stages", [])) + list(results.get("launches", {}).values()):
        if row.get("output_tail"):
            lines += ["", f"Output of `{row.get('command', '')[:120]}` (tail):", "```", row["output_tail"][-1500:], "```"]
    return lines
