"""Export a native head for serving: SGLang/vLLM (`LlamaForCausalLMEagle3`) or `speculators` (`Eagle3Speculator`).

    sglang | vllm    config.json (Llama config, midlayer.* weights)   one directory that both engines load
    speculators      config.json (speculators_config, layers.0.*)     `vllm serve DIR` or speculators.from_pretrained

Every export also holds model.safetensors, eyas_export.json (source head hash, bench report, settings, the
weights the head was trained against, the verifier check, sha256 of config.json and of the weights),
SERVING.md and README.md (the serving commands, with no path of this machine). Before anything is
written, the verifier is checked against the head's record (heads/verifier.py) and the tensors against
what the engine's loader allocates from the config.json being written: SGLang silently skips names it
does not know and would serve random weights, so an unknown or missing name is an error. Reading an
export back checks its config.json against the head eyas_export.json records, naming an edited field.

The serving settings (chain length K, a tree's shape) come in as a dict from `decoding_settings`
(heads/serving.py); the bench report they are usually taken from is read on the eval side
(eval/report.py `serving_settings`).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eyas.data.atomic import atomic_dir_write
from eyas.data.config import TargetConfig
from eyas.data.packages import sha256_file
from eyas.data.targets import DEFAULT_TARGETS, Target
from eyas.heads.checkpoint import WEIGHTS, head_content_hash, load_head, serving_config
from eyas.heads.eagle3 import Eagle3Config, Eagle3Head
from eyas.heads.serving import THIS_FOLDER, decoding_settings, serving_markdown
from eyas.heads.verifier import check_verifier, local_target_dir, resolve_verifier, trained_against, weights_lines

FORMATS = ("sglang", "vllm", "speculators")
EXPORT_METADATA = "eyas_export.json"
SERVING_FILE = "SERVING.md"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# Loaders accept these when present and fall back to the target's weights when absent; an Eagle3Head
# always takes the target's embedding, so load_exported drops it.
OPTIONAL_TENSORS = {"embed_tokens.weight"}


class ExportValidationError(ValueError):
    """The tensors of an export do not match what the engine's loader expects."""


# ---- tensor names --------------------------------------------------------------------------------

def engine_name(native: str, fmt: str) -> str:
    """Name of a native (midlayer.*) tensor in format `fmt`."""
    return native.replace("midlayer.", "layers.0.", 1) if fmt == "speculators" else native


def native_name(name: str) -> str:
    return name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name


def expected_tensors(cfg: dict, fmt: str) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """name -> (shape, dtype or None for 'the float export dtype'), as the engine's loader allocates them
    from the config.json `cfg` of that format (SGLang's and vLLM's LlamaForCausalLMEagle3; speculators'
    Eagle3DraftModel)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format '{fmt}'; choose one of {', '.join(FORMATS)}")
    layer = cfg["transformer_layer_config"] if fmt == "speculators" else cfg
    hidden = layer["hidden_size"]
    heads, kv_heads = layer["num_attention_heads"], layer.get("num_key_value_heads") or layer["num_attention_heads"]
    head_dim = layer.get("head_dim") or hidden // heads
    inter = layer["intermediate_size"]
    vocab, draft_vocab = layer["vocab_size"], cfg.get("draft_vocab_size") or layer["vocab_size"]
    if fmt == "speculators":
        # Eagle3DraftModel sizes fc from the *draft* hidden size times the number of aux layers.
        fc_in = len(cfg.get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0]) * hidden
        prefix = "layers.0."
    else:
        fc_in = 3 * (cfg.get("target_hidden_size") or hidden)
        prefix = "midlayer."
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {
        "fc.weight": ((hidden, fc_in), None),
        f"{prefix}hidden_norm.weight": ((hidden,), None),
        f"{prefix}input_layernorm.weight": ((hidden,), None),
        f"{prefix}self_attn.q_proj.weight": ((heads * head_dim, 2 * hidden), None),
        f"{prefix}self_attn.k_proj.weight": ((kv_heads * head_dim, 2 * hidden), None),
        f"{prefix}self_attn.v_proj.weight": ((kv_heads * head_dim, 2 * hidden), None),
        f"{prefix}self_attn.o_proj.weight": ((hidden, heads * head_dim), None),
        f"{prefix}post_attention_layernorm.weight": ((hidden,), None),
        f"{prefix}mlp.gate_proj.weight": ((inter, hidden), None),
        f"{prefix}mlp.up_proj.weight": ((inter, hidden), None),
        f"{prefix}mlp.down_proj.weight": ((hidden, inter), None),
        "norm.weight": ((hidden,), None),
        "lm_head.weight": ((draft_vocab, hidden), None),
    }
    if layer.get("attention_bias"):
        for proj, size in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim),
                           ("o", hidden)):
            shapes[f"{prefix}self_attn.{proj}_proj.bias"] = ((size,), None)
    if layer.get("mlp_bias"):
        for proj, size in (("gate", inter), ("up", inter), ("down", hidden)):
            shapes[f"{prefix}mlp.{proj}_proj.bias"] = ((size,), None)
    shapes["embed_tokens.weight"] = ((vocab, hidden), None)  # optional: every loader takes a draft's own
    # speculators only allocates the mappings when the draft vocabulary is trimmed.
    if fmt != "speculators" or draft_vocab != vocab:
        shapes["d2t"] = ((draft_vocab,), torch.int64)
        shapes["t2d"] = ((vocab,), torch.bool)
    return shapes


def check_engine_support(cfg: dict, fmt: str, where: str) -> None:
    """Refuse settings a loader would silently get wrong."""
    layer = cfg["transformer_layer_config"] if fmt == "speculators" else cfg
    if fmt == "sglang" and (layer.get("attention_bias") or layer.get("mlp_bias")):
        # SGLang's LlamaForCausalLMEagle3 builds qkv_proj and the MLP without bias and drops bias tensors.
        raise ExportValidationError(f"{where}: SGLang's EAGLE-3 loader has no attention/MLP bias; this head has one")
    if fmt == "speculators":
        target_hidden = cfg.get("target_hidden_size") or layer["hidden_size"]
        if layer["hidden_size"] != target_hidden:
            # Eagle3DraftModel takes fc's input and the embedding width from the draft hidden size.
            raise ExportValidationError(
                f"{where}: speculators needs the draft hidden size ({layer['hidden_size']}) to equal the target's "
                f"({target_hidden}); export this head as sglang/vllm instead"
            )


def validate_tensors(tensors: dict[str, torch.Tensor], cfg: dict, fmt: str, where: str = "export",
                     float_dtype: torch.dtype | None = None) -> None:
    """Every name present, none unknown, every shape and dtype as the loader expects, d2t/t2d consistent."""
    check_engine_support(cfg, fmt, where)
    expected = expected_tensors(cfg, fmt)
    unknown = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors) - OPTIONAL_TENSORS)
    problems = []
    if unknown:
        problems.append(f"unknown tensors {unknown} (the {fmt} loader would skip or reject them)")
    if missing:
        problems.append(f"missing tensors {missing}")
    for name in sorted(set(expected) & set(tensors)):
        shape, dtype = expected[name]
        got = tensors[name]
        if tuple(got.shape) != shape:
            problems.append(f"tensor '{name}': shape {tuple(got.shape)}, the {fmt} loader expects {shape}")
        want = dtype or float_dtype
        if want is not None and got.dtype != want:
            problems.append(f"tensor '{name}': dtype {got.dtype}, expected {want}")
        elif dtype is None and not got.is_floating_point():
            problems.append(f"tensor '{name}': dtype {got.dtype}, expected a float dtype")
        elif got.is_floating_point() and not torch.isfinite(got).all():
            problems.append(f"tensor '{name}': has NaN or inf values")
    if not problems and "d2t" in tensors:
        problems += vocab_mapping_problems(tensors["d2t"], tensors["t2d"])
    if problems:
        raise ExportValidationError(f"{where} ({fmt}): " + "; ".join(problems))


def vocab_mapping_problems(d2t: torch.Tensor, t2d: torch.Tensor) -> list[str]:
    """d2t must map draft ids to distinct, in-range target ids that are exactly the ones t2d marks."""
    targets = torch.arange(d2t.numel()) + d2t.cpu()
    if targets.numel() and (targets.min() < 0 or targets.max() >= t2d.numel()):
        return [f"d2t maps draft ids outside the target vocabulary [0, {t2d.numel()})"]
    marked = t2d.cpu().nonzero().flatten()
    if marked.numel() != d2t.numel() or not torch.equal(targets.sort().values, marked):
        return [f"d2t and t2d disagree: t2d marks {marked.numel()} target ids, d2t maps {d2t.numel()} draft ids "
                "to a different set (a stale or unset vocabulary mapping)"]
    return []


# ---- configs of each format -------------------------------------------------------------------------

def engine_config(c: Eagle3Config, dtype: str) -> dict:
    """config.json for SGLang and vLLM: the native one without eyas-only keys, in the exported dtype."""
    cfg = serving_config(c)
    cfg.pop("eyas_head_config", None)
    cfg["torch_dtype"] = dtype
    return cfg


def speculators_config(c: Eagle3Config, dtype: str, num_speculative_tokens: int, verifier: str,
                       verifier_architectures: list[str]) -> dict:
    """config.json of the speculators format (speculators.models.eagle3.Eagle3SpeculatorConfig)."""
    layer = {k: v for k, v in serving_config(c).items()
             if k not in ("architectures", "eyas_head_config", "eagle_config", "eagle_aux_hidden_state_layer_ids",
                          "draft_vocab_size", "target_hidden_size", "norm_before_residual")}
    layer["torch_dtype"] = dtype
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": c.draft_vocab_size,
        # speculators defaults this to true in some versions; eyas heads keep the un-normed residual.
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "target_hidden_size": c.target_hidden_size,
        # speculators uses the "stream entering layer k" ids, like vLLM.
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


# ---- export and load back ---------------------------------------------------------------------------

def target_embedding(folder: Path) -> torch.Tensor | None:
    """The target's input embedding read from its safetensors (no model load), or None when it has none."""
    try:
        return Target.resolve(TargetConfig(name_or_path=str(folder))).input_embedding()
    except FileNotFoundError:
        return None


def export_state(head: Eagle3Head, fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's tensors under the format's names: floats in `dtype`, d2t int64 and t2d bool unchanged."""
    state = {}
    trimmed = head.config.draft_vocab_size != head.config.vocab_size
    for name, tensor in head.state_dict().items():
        if name in ("d2t", "t2d") and fmt == "speculators" and not trimmed:
            continue
        tensor = tensor.detach().cpu()
        state[engine_name(name, fmt)] = (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()
    return state


def export_head(head_dir: str | Path, fmt: str, out_dir: str | Path, dtype: str = "bfloat16",
                settings: dict | None = None, verifier: str | None = None, force_verifier: bool = False) -> Path:
    """Write the head in `head_dir` as format `fmt` into `out_dir` (atomically); returns `out_dir`.

    `settings` (from `decoding_settings`, or eval's `serving_settings` of a bench report) decide the chain
    length in the speculators config and the serving snippets; None: chain defaults. A `verifier` that is
    not the head's target (heads/verifier.py `check_verifier`) is refused unless `force_verifier`.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format '{fmt}'; choose one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise ValueError(f"export dtype '{dtype}' is not one of {', '.join(DTYPES)}")
    head_dir, out_dir = Path(head_dir), Path(out_dir)
    head_hash = head_content_hash(head_dir)  # before loading: the hash names what was read, not what came after
    head, meta = load_head(head_dir)
    settings = dict(settings or decoding_settings())
    bench_report = settings.pop("report", None)
    verifier = resolve_verifier(verifier, meta)
    if fmt == "speculators" and not verifier:
        raise ValueError(f"{head_dir}: the head records no target; pass verifier= (the target's path or Hub id)")
    verifier_check = check_verifier(verifier, meta, head.config.vocab_size, force=force_verifier)
    target_dir = local_target_dir(meta.get("target")) or local_target_dir(verifier)
    target_cfg = json.loads((target_dir / "config.json").read_text()) if target_dir else {}
    c = head.config
    if fmt == "speculators":
        cfg = speculators_config(c, dtype, settings["num_speculative_tokens"], verifier,
                                 target_cfg.get("architectures") or [])
    else:
        cfg = engine_config(c, dtype)
    state = export_state(head, fmt, DTYPES[dtype])
    if fmt == "speculators":
        # speculators 0.9.0 under transformers 5 leaves embed_tokens as uninitialised memory when the
        # checkpoint lacks it (its NaN sentinel is lost in from_pretrained), so ship the target's embedding.
        # vLLM loads it too and shares the target's when they are equal.
        embedding = target_embedding(target_dir) if target_dir else None
        if embedding is None:
            warnings.warn(f"{head_dir}: target weights not found locally; the speculators export has no "
                          "embed_tokens.weight (vLLM is fine; the speculators package would not load it)")
        else:
            state["embed_tokens.weight"] = embedding.to(DTYPES[dtype]).contiguous()
    validate_tensors(state, cfg, fmt, where=f"export of {head_dir}", float_dtype=DTYPES[dtype])

    target_for_snippet = verifier or "TARGET"
    info = {
        "format": fmt,
        "dtype": dtype,
        "source_head": str(head_dir.resolve()),
        "source_head_hash": head_hash,
        "bench_report": bench_report,
        "verifier": verifier,
        "target": meta.get("target"),
        "target_hash": meta.get("target_hash"),
        "tokenizer_hash": meta.get("tokenizer_hash"),
        "target_license": getattr(DEFAULT_TARGETS.get(meta.get("target")), "license", None)
        or target_cfg.get("license"),
        "trained_against": trained_against(meta),
        "verifier_check": verifier_check,
        "verifier_architectures": target_cfg.get("architectures") or [],
        "settings": settings,
        "head_config": c.to_dict(),
    }

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        # push checks both, so an export edited afterwards is never published under the gated head's name
        info["weights_sha256"] = sha256_file(tmp / WEIGHTS)
        info["config_sha256"] = sha256_file(tmp / "config.json")
        (tmp / EXPORT_METADATA).write_text(json.dumps(info, indent=2))
        # No path of this machine: the folder is moved, copied and uploaded as it is.
        serving = "\n".join(weights_lines(info) + [serving_markdown(fmt, target_for_snippet, THIS_FOLDER, settings)])
        (tmp / SERVING_FILE).write_text(f"# Serving this EAGLE-3 head\n\n{serving}")
        (tmp / "README.md").write_text(export_readme(fmt, info, serving))

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return atomic_dir_write(out_dir, write)


def export_readme(fmt: str, info: dict, serving: str) -> str:
    layout = ("`LlamaForCausalLMEagle3`, `midlayer.*` weights: loads in SGLang and vLLM" if fmt != "speculators"
              else "`Eagle3Speculator` (speculators format, `layers.0.*` weights): loads in vLLM and `speculators`")
    c = info["head_config"]
    return (f"# EAGLE-3 draft head ({fmt})\n\n"
            f"{layout}. Target: `{info.get('verifier') or info.get('target')}`; weights {info['dtype']}; "
            f"draft vocabulary {c['draft_vocab_size']} of {c['vocab_size']}; aux layers {c['aux_layer_ids']} "
            f"(stream entering layer k). Exported by eyas from head `{info['source_head_hash'][:12]}`.\n\n"
            f"## Serving\n\n{serving}")


def detect_format(cfg: dict) -> str:
    if cfg.get("speculators_model_type") == "eagle3":
        return "speculators"
    if "LlamaForCausalLMEagle3" in (cfg.get("architectures") or []):
        return "sglang"
    raise ValueError(f"config is neither speculators eagle3 nor LlamaForCausalLMEagle3 "
                     f"(architectures {cfg.get('architectures')})")


def config_from_export(cfg: dict, fmt: str) -> Eagle3Config:
    """Rebuild the head config from an export's config.json alone (third-party exports have no eyas metadata)."""
    layer = cfg["transformer_layer_config"] if fmt == "speculators" else cfg
    if fmt == "speculators" or "eagle_aux_hidden_state_layer_ids" in cfg:
        aux = list(cfg["eagle_aux_hidden_state_layer_ids"])
    else:  # only SGLang's "output of layer i" ids
        aux = [i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    rope = layer.get("rope_parameters") or {"rope_type": "default", "rope_theta": layer.get("rope_theta", 10000.0)}
    hidden, heads = layer["hidden_size"], layer["num_attention_heads"]
    return Eagle3Config(
        hidden_size=hidden, intermediate_size=layer["intermediate_size"], num_attention_heads=heads,
        num_key_value_heads=layer.get("num_key_value_heads") or heads,
        head_dim=layer.get("head_dim") or hidden // heads, vocab_size=layer["vocab_size"],
        draft_vocab_size=cfg.get("draft_vocab_size") or layer["vocab_size"],
        target_hidden_size=cfg.get("target_hidden_size") or hidden, aux_layer_ids=aux,
        num_target_layers=aux[-1] + 3,  # the usual [2, N//2, N-3] choice; eyas exports record the real N
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        max_position_embeddings=layer.get("max_position_embeddings", 2048),
        rope_parameters=rope, hidden_act=layer.get("hidden_act", "silu"),
        attention_bias=bool(layer.get("attention_bias")), mlp_bias=bool(layer.get("mlp_bias")),
    )


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt", device="cpu") as fh:
        return {name: fh.get_tensor(name) for name in fh.keys()}


def expected_config(info: dict) -> dict:
    """The config.json `export_head` wrote for the head and settings that eyas_export.json records."""
    c = Eagle3Config.from_dict(info["head_config"])
    if info["format"] == "speculators":
        cfg = speculators_config(c, info["dtype"], info["settings"]["num_speculative_tokens"], info["verifier"],
                                 info.get("verifier_architectures") or [])
    else:
        cfg = engine_config(c, info["dtype"])
    return json.loads(json.dumps(cfg))


def first_difference(got, want, prefix: str = "") -> tuple[str, object, object] | None:
    """(dotted field, value found, value expected) of the first field where two JSON objects differ."""
    if not (isinstance(got, dict) and isinstance(want, dict)):
        return None if got == want else (prefix.rstrip("."), got, want)
    for key in list(want) + [k for k in got if k not in want]:
        if key not in got or key not in want:
            return f"{prefix}{key}", got.get(key, "missing"), want.get(key, "absent")
        if diff := first_difference(got[key], want[key], f"{prefix}{key}."):
            return diff
    return None


def check_export_config(cfg: dict, info: dict, where: str) -> None:
    """Refuse a config.json that is not the one exported for the recorded head (aux ids, rope, sizes, ...)."""
    if diff := first_difference(cfg, expected_config(info)):
        field, got, want = diff
        raise ExportValidationError(f"{where}: field '{field}' is {got!r}, the head's own config gives {want!r} "
                                    "(config.json was edited after `eyas export`; re-export the head)")


def read_validated_export(path: str | Path) -> tuple[str, dict, dict]:
    """(format, config.json, tensors) of an export directory, its tensors checked against its own config and
    that config against the head eyas_export.json records (when it records one)."""
    path = Path(path)
    cfg_file, weights = path / "config.json", path / WEIGHTS
    if not cfg_file.exists() or not weights.exists():
        raise FileNotFoundError(f"{path}: not an export (needs config.json and {WEIGHTS})")
    cfg = json.loads(cfg_file.read_text())
    info_file = path / EXPORT_METADATA
    info = json.loads(info_file.read_text()) if info_file.exists() else {}
    if "config_sha256" in info:  # exports older than the config check cannot be checked field by field
        check_export_config(cfg, info, str(cfg_file))
    fmt = detect_format(cfg)
    tensors = read_safetensors(weights)
    validate_tensors(tensors, cfg, fmt, where=str(weights))
    return fmt, cfg, tensors


def validate_export(path: str | Path) -> str:
    """Check an export directory's tensors against its own config.json; returns its format."""
    return read_validated_export(path)[0]


def load_exported(path: str | Path, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> tuple[Eagle3Head, dict]:
    """Load any of the three export formats back into an Eagle3Head; returns (head, eyas_export.json or {})."""
    path = Path(path)
    fmt, cfg, tensors = read_validated_export(path)
    info = json.loads((path / EXPORT_METADATA).read_text()) if (path / EXPORT_METADATA).exists() else {}
    config = Eagle3Config.from_dict(info["head_config"]) if "head_config" in info else config_from_export(cfg, fmt)
    head = Eagle3Head(config)
    state = {native_name(k): v for k, v in tensors.items() if k not in OPTIONAL_TENSORS}
    if "d2t" not in state:  # a full-vocabulary speculators export: the identity mapping
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    head.load_state_dict(state, strict=True)
    return head.to(device=device, dtype=dtype), info
