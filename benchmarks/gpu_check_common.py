"""Shared pieces of the GPU check (benchmarks/gpu_check.py): the run context, model shapes, random targets
and heads built from configs (nothing is downloaded), a synchronised timer, and look-ups of eyas names
that may move between modules."""

from __future__ import annotations

import importlib
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

# H200 SXM: dense bf16 tensor-core peak of the spec sheet (989.4 TFLOP/s; 1979 is the 2:4-sparse figure).
H200_BF16_PEAK_TFLOPS = 989.4


@dataclass(frozen=True)
class Shape:
    """A Llama-style target and the head trained for it, plus the training batch."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    layers: int
    vocab: int
    draft_vocab: int
    ttt_steps: int
    seq: int
    batch: int
    max_positions: int

    @property
    def aux_layer_ids(self) -> list[int]:
        return [2, self.layers // 2, self.layers - 3]  # EAGLE-3's default low / middle / high layers


# Llama-3.1-8B and the head of recipes/llama-3.1-8b-instruct.yaml (draft vocab 32K, TTT 7, batch 1 x 2048).
LLAMA_8B = Shape(hidden=4096, intermediate=14336, heads=32, kv_heads=8, layers=32, vocab=128256,
                 draft_vocab=32000, ttt_steps=7, seq=2048, batch=1, max_positions=131072)
# The same code paths at toy size: the --cpu mode of the check (and its test).
TINY = Shape(hidden=64, intermediate=128, heads=4, kv_heads=2, layers=6, vocab=512, draft_vocab=128,
             ttt_steps=7, seq=64, batch=2, max_positions=1024)


@dataclass
class Ctx:
    """What every section gets: the device, the mode, the output folder and the time left."""

    device: torch.device
    cpu: bool  # the reduced mode: tiny shapes, fewer repetitions
    out: Path
    deadline: float  # time.monotonic() after which no new section starts
    shape: Shape = LLAMA_8B
    shared: dict = field(default_factory=dict)  # objects two sections reuse (the big target)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        """The speed sections' dtype: bf16 on the GPU; fp32 on the CPU, where bf16 is emulated and slow."""
        return torch.bfloat16 if self.cuda else torch.float32

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def big_target(self):
        """The random Llama-3.1-8B-shaped target (toy-sized in --cpu mode), built once and shared."""
        if "target" not in self.shared:
            self.shared["target"] = random_target(llama_config(self.shape), self.device, self.dtype)
        return self.shared["target"]

    def release(self) -> None:
        self.shared.clear()
        if self.cuda:
            torch.cuda.empty_cache()


# ---- configs and random models -------------------------------------------------------------------------------

NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)  # decode to full length


def llama_config(shape: Shape):
    """A Llama-3.1 config of `shape` (llama3 rope scaling, untied embeddings)."""
    from transformers import LlamaConfig

    original = min(8192, shape.max_positions // 8)
    return LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                       num_hidden_layers=shape.layers, vocab_size=shape.vocab,
                       max_position_embeddings=shape.max_positions, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": original},
                       **NO_SPECIAL_TOKENS)


def tiny_config(arch: str, vocab_size: int = 256, layers: int = 6):
    """A small random config of a real architecture (Llama, Qwen3, Gemma3: GQA, qk-norm, sliding windows)."""
    common = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=layers, vocab_size=vocab_size, max_position_embeddings=512, **NO_SPECIAL_TOKENS)
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 128})
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common, head_dim=16)
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(**common, head_dim=16, sliding_window=16)
    raise ValueError(f"unknown architecture {arch!r}")


def random_target(config, device: torch.device, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A random-weight causal LM from `config`, initialised directly on `device` (8B: seconds on a GPU)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def draft_vocab(vocab: int, size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for `size` random target ids (sorted): the head's trimmed vocabulary."""
    if size >= vocab:
        ids = torch.arange(vocab)
    else:
        ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:size].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.numel()), t2d


def new_head(target_config, aux_layer_ids: list[int], draft_size: int | None = None, seed: int = 0,
             device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """A random EAGLE-3 head for `target_config` (full vocabulary unless `draft_size` trims it)."""
    from eyas.data.model_config import text_config
    from eyas.heads.eagle3 import Eagle3Config, build_head

    vocab = text_config(target_config).vocab_size
    d2t, t2d = draft_vocab(vocab, draft_size or vocab, seed)
    torch.manual_seed(seed)
    with torch.device(device):  # an 8B head's 0.4B parameters are initialised faster where they will live
        head = build_head(Eagle3Config.from_target(target_config, draft_vocab_size=d2t.numel(),
                                                   aux_layer_ids=aux_layer_ids), dtype=torch.float32, device=device)
    head.set_vocab(d2t.to(device), t2d.to(device))
    return head.to(device=device, dtype=dtype)


class StubTokenizer:
    """What the decoders need of a tokenizer (decode for stop strings and text; no EOS): no files to download."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


def random_prompts(n: int, length: int, vocab: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, length), generator=g) for _ in range(n)]


# ---- timing ------------------------------------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 2) -> dict:
    """Milliseconds per call of fn (synchronised on CUDA): median, min and the repetitions."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - start))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "reps": reps}


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, reps: int = 10) -> float:
    """Measured square-matmul throughput, the practical ceiling beside the spec-sheet peak."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = time_calls(lambda: a @ b, device, reps, warmup=3)["median_ms"]
    return 2 * n ** 3 / (ms / 1e3) / 1e12


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ---- names that move ---------------------------------------------------------------------------------------------

def find(*candidates: str):
    """The first importable `module:attribute` of `candidates` (eyas modules are being reorganised)."""
    errors = []
    for candidate in candidates:
        module, _, attr = candidate.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            errors.append(f"{candidate}: {exc}")
    raise ImportError("none of " + "; ".join(errors))
