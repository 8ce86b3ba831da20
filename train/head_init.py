"""The head a training run starts from: freshly built and seeded, then (as the recipe asks) its lm_head rows
and its decoder layer taken from the target's own weights."""

from __future__ import annotations

import random

import numpy as np
import torch

from eyas.data.features import Teacher
from eyas.data.targets import Target
from eyas.heads.config import HeadConfig
from eyas.heads.eagle3 import Eagle3Config, Eagle3Head, build_head
from eyas.train.data import TrainingError


def initial_head(head_cfg: HeadConfig, target: Target, vocab: tuple[torch.Tensor, torch.Tensor], seed: int,
                 teacher: Teacher) -> Eagle3Head:
    """The seeded head with the initialisations the recipe's head section asks for."""
    head = build_training_head(head_cfg, target, vocab, seed)
    if head_cfg.init_lm_head_from_target:
        init_lm_head_from_target(head, teacher, target)
    if head_cfg.init_from_target_layer is not None:
        init_from_target_layer(head, target, head_cfg.init_from_target_layer)
    return head


def build_training_head(head_cfg: HeadConfig, target: Target, vocab: tuple[torch.Tensor, torch.Tensor],
                        seed: int) -> Eagle3Head:
    """A freshly initialised head (seeded, so every rank and every rerun starts from the same weights)."""
    config = Eagle3Config.from_target(
        target.config, draft_vocab_size=vocab[0].numel(), aux_layer_ids=target.aux_layer_ids,
        hidden_size=head_cfg.hidden_size, intermediate_size=head_cfg.intermediate_size,
        num_attention_heads=head_cfg.num_attention_heads, num_key_value_heads=head_cfg.num_key_value_heads)
    seed_everything(seed)
    head = build_head(config)
    head.set_vocab(*vocab)
    return head


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def init_lm_head_from_target(head: Eagle3Head, teacher: Teacher, target: Target) -> None:
    """The target's lm_head rows of the draft vocabulary: the teacher's (last_hidden stores, online), or read
    from the target's files (top-k stores keep no rows)."""
    rows = teacher.rows
    if rows is None:
        try:
            rows = target.output_embedding()[head.draft_target_ids().cpu()]
        except FileNotFoundError as exc:
            raise TrainingError(f"head.init_lm_head_from_target: {exc}; the feature store keeps no lm_head rows "
                                "(collect.teacher=topk): set head.init_lm_head_from_target=false") from None
    head.lm_head.weight.data.copy_(rows.float().cpu())


LAYERS_LIKE_THE_HEAD = {"llama", "mistral"}  # decoder layers of the head's own form (plain RMSNorm, no biases)


def init_from_target_layer(head: Eagle3Head, target: Target, layer: int) -> None:
    """The decoder layer from target layer `layer`, read from the target's safetensors: the layer's q/k/v
    weights in both halves of the head's (embedding | aux stream) input, o_proj, MLP and norms copied, fc
    passing the highest aux layer through unchanged, and the final norm the target's."""
    c = head.config
    check_layer_init(target, layer, c.hidden_size)
    m, h = head.midlayer, c.hidden_size
    prefix = f"layers.{layer}."
    copies = {"self_attn.o_proj": m.self_attn.o_proj, "mlp.gate_proj": m.mlp.gate_proj, "mlp.up_proj": m.mlp.up_proj,
              "mlp.down_proj": m.mlp.down_proj, "input_layernorm": m.input_layernorm,
              "post_attention_layernorm": m.post_attention_layernorm}
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            dst = getattr(m.self_attn, name).weight  # [out, 2H]: the same weight on each half
            weight = read_target_tensor(target, prefix + f"self_attn.{name}.weight", (dst.shape[0], h))
            dst[:, :h] = weight
            dst[:, h:] = weight
        for name, module in copies.items():
            module.weight.copy_(read_target_tensor(target, prefix + f"{name}.weight", tuple(module.weight.shape)))
        m.hidden_norm.weight.copy_(m.input_layernorm.weight)
        head.norm.weight.copy_(read_target_tensor(target, "norm.weight", tuple(head.norm.weight.shape)))
        highest = c.aux_layer_ids.index(max(c.aux_layer_ids))
        head.fc.weight.zero_()
        head.fc.weight[:, highest * h:(highest + 1) * h] = torch.eye(h)


def check_layer_init(target: Target, layer: int, head_hidden_size: int | None) -> None:
    """What init_from_target_layer needs of the target's config; `eyas run` calls it before its first stage,
    so a recipe that cannot train fails before prepare and collect have run (None: the target's size)."""
    kind = getattr(target.config, "model_type", None)
    biased = getattr(target.config, "attention_bias", False) or getattr(target.config, "mlp_bias", False)
    if kind not in LAYERS_LIKE_THE_HEAD or biased:
        # Others differ from the head's layer (Gemma's 1 + w norms and extra norms, Qwen3's q/k norms, biases).
        raise TrainingError(f"head.init_from_target_layer: a {kind} target's layers are not the head's "
                            f"(supported: {', '.join(sorted(LAYERS_LIKE_THE_HEAD))} without biases); set it to null")
    layers = target.config.num_hidden_layers
    if not 0 <= layer < layers:
        raise TrainingError(f"head.init_from_target_layer: {layer} is not a layer of the target (0..{layers - 1})")
    target_hidden = target.config.hidden_size
    if head_hidden_size not in (None, target_hidden):
        raise TrainingError("head.init_from_target_layer: fc cannot pass an aux layer through when the head's "
                            f"hidden size ({head_hidden_size}) differs from the target's ({target_hidden})")


def read_target_tensor(target: Target, name: str, shape: tuple) -> torch.Tensor:
    """A tensor of the target's files, as float32, checked against the shape it must fill."""
    try:
        tensor = target.local_tensor(name).float()
    except FileNotFoundError as exc:
        raise TrainingError(f"head.init_from_target_layer: {exc}") from None
    if tuple(tensor.shape) != tuple(shape):
        raise TrainingError(f"head.init_from_target_layer: the target's {name} is {tuple(tensor.shape)}, the "
                            f"head needs {shape}: the head's sizes must be the target's")
    return tensor
