"""The native head checkpoint: the SGLang/vLLM directory layout plus `eyas_head.json` metadata.

    config.json          LlamaForCausalLMEagle3 config (what both engines read)
    model.safetensors    midlayer.*, fc, norm, lm_head, d2t, t2d
    eyas_head.json       target id and content hash, tokenizer hash, aux ids, vocab source, training summary
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eyas.data.atomic import atomic_dir_write
from eyas.heads.eagle3 import Eagle3Config, Eagle3Head

METADATA = "eyas_head.json"
WEIGHTS = "model.safetensors"


class HeadMismatchError(ValueError):
    """A head was loaded against a target whose tokenizer or vocabulary differs from its own."""


def serving_config(c: Eagle3Config) -> dict:
    """config.json that SGLang and vLLM both load for an EAGLE-3 head."""
    llama = c.llama_config().to_dict()
    rope = dict(c.rope_parameters)
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": rope.get("rope_theta", 10000.0),
        # transformers 4.x reads rope_scaling, 5.x rope_parameters; write both.
        "rope_scaling": rope if rope.get("rope_type", "default") != "default" else None,
        "rope_parameters": rope,
        "attention_bias": c.attention_bias,
        "mlp_bias": c.mlp_bias,
        "tie_word_embeddings": False,
        "norm_before_residual": False,
        "torch_dtype": "float32",
        # vLLM reads the top-level ids as "stream entering layer k".
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        # SGLang reads eagle_config's ids as "output of layer i" and adds 1.
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": c.sglang_aux_layer_ids(),
            "use_aux_hidden_state": True,
        },
        "eyas_head_config": c.to_dict(),
    }
    cfg["bos_token_id"] = llama.get("bos_token_id")
    cfg["eos_token_id"] = llama.get("eos_token_id")
    return cfg


def save_head(head: Eagle3Head, path: str | Path, metadata: dict | None = None) -> Path:
    state = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(serving_config(head.config), indent=2))
        meta = dict(metadata or {})
        meta.setdefault("head_config", head.config.to_dict())
        (tmp / METADATA).write_text(json.dumps(meta, indent=2, default=str))

    return atomic_dir_write(Path(path), write)


def head_content_hash(path: str | Path) -> str:
    """sha256 of a head's model.safetensors: the identity bench reports and the gate record for a head."""
    from eyas.data.packages import sha256_file

    weights = Path(path) / WEIGHTS
    if not weights.exists():
        raise FileNotFoundError(f"{path}: no {WEIGHTS}, not an eyas head")
    return sha256_file(weights)


def read_metadata(path: str | Path) -> dict:
    meta = Path(path) / METADATA
    return json.loads(meta.read_text()) if meta.exists() else {}


def load_head(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
              tokenizer=None, target_vocab_size: int | None = None) -> tuple[Eagle3Head, dict]:
    """Load a native head; refuse it when the given tokenizer/vocab differs from the one it was trained on."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists() or not (path / WEIGHTS).exists():
        raise FileNotFoundError(f"{path}: not an eyas head (needs config.json and {WEIGHTS})")
    cfg = json.loads(cfg_file.read_text())
    if "eyas_head_config" not in cfg:
        raise ValueError(f"{cfg_file}: no 'eyas_head_config'; export directories are not native heads")
    config = Eagle3Config.from_dict(cfg["eyas_head_config"])
    meta = read_metadata(path)
    check_compatible(path, config, meta, tokenizer=tokenizer, target_vocab_size=target_vocab_size)
    head = Eagle3Head(config)
    state = load_file(str(path / WEIGHTS))
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path / WEIGHTS}: missing tensors {missing}, unexpected tensors {unexpected}")
    return head.to(device=device, dtype=dtype), meta


def check_compatible(path, config: Eagle3Config, meta: dict, tokenizer=None, target_vocab_size: int | None = None):
    if target_vocab_size is not None and target_vocab_size != config.vocab_size:
        raise HeadMismatchError(
            f"{path}: head was trained for a target vocabulary of {config.vocab_size} tokens, this target has "
            f"{target_vocab_size}; its drafts would never be accepted"
        )
    if tokenizer is not None and meta.get("tokenizer_hash"):
        from eyas.data.targets import tokenizer_hash

        got = tokenizer_hash(tokenizer)
        if got != meta["tokenizer_hash"]:
            raise HeadMismatchError(
                f"{path}: head was trained with tokenizer {meta['tokenizer_hash'][:12]} "
                f"(target {meta.get('target', '?')}), this target's tokenizer is {got[:12]}; token ids differ, "
                "so acceptance would collapse to zero"
            )
