"""Shared fixtures: tiny random targets of several architectures, and the real SmolLM2 target."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests use tiny models: one thread is as fast, and it avoids oversubscription when subprocess tests
# (2-process accelerate launches) run beside the main process on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def tiny_config(arch: str = "llama", vocab_size: int = 512, layers: int = 6):
    """A small random config of a real architecture (Llama, Qwen2, Qwen3, Gemma3)."""
    common = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=layers, vocab_size=vocab_size, max_position_embeddings=512)
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                      "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 128})
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common)
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common, head_dim=16)
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(**common, head_dim=16, sliding_window=16)
    raise ValueError(arch)


def tiny_target(arch: str = "llama", vocab_size: int = 512, layers: int = 6, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, vocab_size, layers))
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct target and tokenizer (converted once into the eyas cache)."""
    from eyas.data.config import TargetConfig
    from eyas.data.targets import load_target

    return load_target(TargetConfig(name_or_path="smollm2-135m-instruct", dtype="float32", device="cpu"))
