"""Target features for training the draft head: offline shards on disk, or computed online.

Per sample (positions aligned with the target, NOT shifted; the trainer does the EAGLE-3 shift):
    input_ids        int32 [T]
    loss_mask        uint8 [T]
    aux              [T, 3H] the streams entering the three aux layers, concatenated in layer order;
                     bf16, or fp8 e4m3 plus `aux_exp` int8 [T, 3] (a power-of-two scale per token and layer,
                     so dequantising to bf16 is exact)
    target_in_draft  bool [T]: the target's argmax over its FULL vocabulary at t is in the draft vocab
    teacher, at t the target's distribution over token t+1:
      "last_hidden": teacher_hidden bf16 [T, H], the final normed hidden; draft logits are recomputed as
                     hidden @ lm_head_rows[draft vocab].T (+ softcap) from features/teacher.safetensors.
                     Exact up to the bf16 rounding of the hidden: the whole draft-vocab distribution.
      "topk":        teacher_topk_ids int16/int32 [T, k] (draft ids) + teacher_topk_logits fp16 [T, k].
                     Approximate: the distribution is renormalised over the k kept ids, the tail is dropped.

Layout of features/:
    index.json                      meta + per split the shards (file, sha256, bytes, samples, tokens)
    teacher.safetensors             lm_head rows of the draft vocab [Vd, H], softcap, d2t
    {train,validation}/rRRR-SSSSS.safetensors
        one safetensors file per shard: the per-token fields above concatenated over its samples, plus
        `offsets` int64 [n+1] (sample i is rows offsets[i]:offsets[i+1]) and `sample_index` int64 [n]
        (the row of the sample in the prepared split)
    {train,validation}/progress.rRRR.json   what each rank finished (resume)
    DONE.json

Each rank (accelerate) takes every world-th sample of the split sorted by length, writes its own shards
(temp name, fsync, os.replace, then its progress file atomically); rank 0 merges the index.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes
from tqdm.auto import tqdm

from eyas.data.config import CollectConfig
from eyas.data.prepare import DONE, read_done, write_done
from eyas.data.targets import (aux_layer_ids_for, load_target, logits_from_final_hidden, resolve_target,
                               target_features, target_hash, text_config)
from eyas.data.vocab import draft_to_target, load_vocab
from eyas.data.atomic import atomic_write_bytes as write_atomic, atomic_write_json as write_json_atomic

FORMAT = "eyas-features/1"
INDEX = "index.json"
TEACHER = "teacher.safetensors"
SPLITS = ("train", "validation")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FEATURE_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float8_e4m3": FP8, "float8_e4m3fn": FP8,
                  "fp8": FP8}
TOPK_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
TEACHERS = ("last_hidden", "topk")


class FeatureStoreError(RuntimeError):
    """A feature store (or its inputs) that is missing, corrupt or does not fit; the message names the file."""


# ---- small file helpers ------------------------------------------------------------------------------

def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise FeatureStoreError(f"{path}: not valid JSON ({exc})") from exc


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_path(path: Path) -> str:
    from eyas.data.packages import sha256_file

    return sha256_file(Path(path))


# ---- storage form of the per-position fields ---------------------------------------------------------

def check_config(cfg: CollectConfig) -> None:
    if cfg.mode not in ("offline", "online"):
        raise FeatureStoreError(f"collect.mode must be 'offline' or 'online', got '{cfg.mode}'")
    if cfg.teacher not in TEACHERS:
        raise FeatureStoreError(f"collect.teacher must be one of {TEACHERS}, got '{cfg.teacher}'")
    if cfg.feature_dtype not in FEATURE_DTYPES:
        raise FeatureStoreError(f"collect.feature_dtype must be one of {sorted(FEATURE_DTYPES)}, "
                                f"got '{cfg.feature_dtype}'")
    if cfg.topk_dtype not in TOPK_DTYPES:
        raise FeatureStoreError(f"collect.topk_dtype must be one of {sorted(TOPK_DTYPES)}, got '{cfg.topk_dtype}'")
    if cfg.teacher == "topk" and cfg.topk < 1:
        raise FeatureStoreError(f"collect.topk must be >= 1, got {cfg.topk}")
    if cfg.batch_size < 1 or cfg.shard_tokens < 1:
        raise FeatureStoreError("collect.batch_size and collect.shard_tokens must be >= 1")


def draft_id_dtype(draft_vocab_size: int) -> torch.dtype:
    return torch.int16 if draft_vocab_size <= 1 << 15 else torch.int32


def bytes_per_token(hidden: int, cfg: CollectConfig, draft_vocab_size: int) -> int:
    """Bytes one token takes in a shard (per-sample offsets are extra, 16 bytes a sample)."""
    fixed = 4 + 1 + 1  # input_ids int32, loss_mask uint8, target_in_draft bool
    fp8 = FEATURE_DTYPES[cfg.feature_dtype] == FP8
    aux = 3 * hidden + 3 if fp8 else 3 * hidden * 2
    if cfg.teacher == "last_hidden":
        teacher = hidden * 2
    else:
        id_bytes = torch.empty(0, dtype=draft_id_dtype(draft_vocab_size)).element_size()
        teacher = cfg.topk * (id_bytes + torch.empty(0, dtype=TOPK_DTYPES[cfg.topk_dtype]).element_size())
    return fixed + aux + teacher


def quantize_fp8(x: torch.Tensor, groups: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., groups*H] -> (fp8 [..., groups*H], int8 exponents [..., groups]) with x ~= q * 2**exp.

    A power-of-two scale keeps the largest |x| of each group in (224, 448], and makes q * 2**exp exact in bf16.
    """
    shape = x.shape
    g = x.float().reshape(*shape[:-1], groups, shape[-1] // groups)
    amax = g.abs().amax(-1)
    mantissa, exponent = torch.frexp(amax / FP8_MAX)  # amax/448 = m * 2**e, m in [0.5, 1)
    exp = torch.where(mantissa == 0.5, exponent - 1, exponent)  # smallest e with amax/448 <= 2**e
    exp = torch.where(amax > 0, exp, torch.zeros_like(exp)).clamp(-127, 127)
    scaled = torch.ldexp(g, -exp[..., None].float()).clamp(-FP8_MAX, FP8_MAX)
    return scaled.to(FP8).reshape(shape), exp.to(torch.int8)


def dequantize_fp8(q: torch.Tensor, exp: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    shape = q.shape
    groups = exp.shape[-1]
    g = q.float().reshape(*shape[:-1], groups, shape[-1] // groups)
    return torch.ldexp(g, exp[..., None].float()).reshape(shape).to(dtype)


def encode_aux(aux: torch.Tensor, cfg: CollectConfig) -> dict[str, torch.Tensor]:
    """The aux features [..., 3H] in their storage form."""
    dtype = FEATURE_DTYPES[cfg.feature_dtype]
    if dtype == FP8:
        q, exp = quantize_fp8(aux)
        return {"aux": q, "aux_exp": exp}
    return {"aux": aux.to(dtype)}


def decode_fields(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Storage form -> what the trainer reads (fp8 aux dequantised to bf16, ids as int64, flags as bool)."""
    out = {}
    for name, value in stored.items():
        if name == "aux_exp":
            continue
        if name == "aux" and value.dtype == FP8:
            value = dequantize_fp8(value, stored["aux_exp"])
        elif name in ("input_ids", "loss_mask", "teacher_topk_ids", "sample_index"):
            value = value.long()
        elif name == "target_in_draft":
            value = value.bool()
        out[name] = value
    return out


# ---- computing the features with the target -------------------------------------------------------------

class OnlineFeatures:
    """Runs the target on a batch {input_ids, loss_mask, attention_mask} and returns the same batch dict
    that `collate` builds from stored shards (the same storage rounding included), so offline and online
    training see the same numbers.  `encode` gives the storage form that `run_collect` writes."""

    def __init__(self, target, vocab: tuple[torch.Tensor, torch.Tensor], cfg: CollectConfig,
                 layer_ids: list[int] | None = None):
        """vocab: (d2t, t2d) as `eyas.data.vocab.load_vocab` returns them."""
        check_config(cfg)
        self.model = target
        self.cfg = cfg
        self.layer_ids = list(layer_ids) if layer_ids is not None else aux_layer_ids_for(target)
        d2t, t2d = vocab
        weight = target.get_output_embeddings().weight
        if t2d.numel() != weight.shape[0]:
            raise FeatureStoreError(f"draft vocabulary was built for {t2d.numel()} target tokens, "
                                    f"the target's lm_head has {weight.shape[0]} rows")
        self.device = weight.device
        self.draft_ids = draft_to_target(d2t, torch.arange(d2t.numel())).to(self.device)
        self.t2d = t2d.to(self.device)
        self.d2t = d2t
        self.softcap = getattr(text_config(target.config), "final_logit_softcapping", None)

    @property
    def draft_vocab_size(self) -> int:
        return self.draft_ids.numel()

    @property
    def hidden_size(self) -> int:
        return text_config(self.model.config).hidden_size

    def teacher(self) -> "Teacher":
        """The dense teacher (lm_head rows of the draft vocab) for last_hidden batches."""
        rows = self.model.get_output_embeddings().weight[self.draft_ids].detach()
        return Teacher(rows, self.softcap, self.draft_vocab_size)

    @torch.no_grad()
    def encode(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-position fields in storage form, [B,T,...] on the target's device (padding not zeroed)."""
        ids = batch["input_ids"].to(self.device)
        mask = batch["attention_mask"].to(self.device).long()
        aux, final = target_features(self.model, ids, self.layer_ids, attention_mask=mask)
        out = encode_aux(aux.to(self.device), self.cfg)
        out.update(self.teacher_fields(final))
        return out

    def teacher_fields(self, final: torch.Tensor) -> dict[str, torch.Tensor]:
        """target_in_draft and the teacher from the final normed hidden [B,T,H], in chunks of positions."""
        b, t, h = final.shape
        flat = final.to(self.device).reshape(b * t, h)  # with device_map the lm_head may sit on another GPU
        in_draft, top_ids, top_logits = [], [], []
        for start in range(0, flat.shape[0], self.cfg.logits_chunk):
            logits = logits_from_final_hidden(self.model, flat[start:start + self.cfg.logits_chunk])
            in_draft.append(self.t2d[logits.argmax(-1)])
            if self.cfg.teacher == "topk":
                k = min(self.cfg.topk, self.draft_vocab_size)
                values, idx = logits[:, self.draft_ids].topk(k, dim=-1)
                top_ids.append(idx.to(draft_id_dtype(self.draft_vocab_size)))
                top_logits.append(values.to(TOPK_DTYPES[self.cfg.topk_dtype]))
        out = {"target_in_draft": torch.cat(in_draft).reshape(b, t)}
        if self.cfg.teacher == "topk":
            out["teacher_topk_ids"] = torch.cat(top_ids).reshape(b, t, -1)
            out["teacher_topk_logits"] = torch.cat(top_logits).reshape(b, t, -1)
        else:
            out["teacher_hidden"] = final.to(self.device, torch.bfloat16)
        return out

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        stored = self.encode(batch)
        out = {k: v for k, v in batch.items()}
        out.update({k: v.to(self.device) for k, v in batch.items() if torch.is_tensor(v)})
        keep = out["attention_mask"].bool()
        for name, value in decode_fields(stored).items():
            # Padding is zero in collated shards too.
            mask = keep.view(*keep.shape, *([1] * (value.dim() - 2)))
            out[name] = torch.where(mask, value, torch.zeros((), dtype=value.dtype, device=value.device))
        return out


class Teacher:
    """Dense draft-vocabulary logits for the loss: lm_head rows [Vd, H] + softcap (last_hidden), or the
    top-k logits scattered into -inf (topk), so softmax gives the renormalised teacher in both layouts."""

    def __init__(self, lm_head_rows: torch.Tensor | None, softcap: float | None, draft_vocab_size: int):
        self.rows = lm_head_rows
        self.softcap = softcap or None
        self.draft_vocab_size = draft_vocab_size

    @classmethod
    def load(cls, features_dir: str | Path, device: str | torch.device = "cpu") -> "Teacher":
        path = Path(features_dir) / TEACHER
        if not path.exists():
            raise FeatureStoreError(f"{path}: missing. Fix: run `eyas collect <recipe>`")
        with safe_open(str(path), "pt") as fh:
            meta = fh.metadata() or {}
            rows = fh.get_tensor("lm_head_rows").to(device) if "lm_head_rows" in fh.keys() else None
        softcap = float(meta["softcap"]) if meta.get("softcap") not in (None, "", "none") else None
        return cls(rows, softcap, int(meta["draft_vocab_size"]))

    def to(self, device) -> "Teacher":
        if self.rows is not None:
            self.rows = self.rows.to(device)
        return self

    def draft_logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, T, Vd] float32."""
        if "teacher_hidden" in batch:
            if self.rows is None:
                raise FeatureStoreError("teacher.safetensors has no lm_head_rows (collected with teacher=topk)")
            hidden = batch["teacher_hidden"].float()
            logits = hidden @ self.rows.to(hidden.device).float().T
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            return logits
        ids, values = batch["teacher_topk_ids"], batch["teacher_topk_logits"].float()
        dense = torch.full((*ids.shape[:-1], self.draft_vocab_size), float("-inf"), device=ids.device)
        return dense.scatter(-1, ids, values)


# ---- batching --------------------------------------------------------------------------------------------

def collate(samples: list[dict], pad_to_multiple: int = 8) -> dict[str, torch.Tensor]:
    """Right-pad per-sample tensors [T, ...] to a batch [B, T_pad, ...] with zeros, plus attention_mask.

    Works on FeatureDataset items and on rows of the prepared dataset ({input_ids, loss_mask, ...}; text
    columns are dropped) for online mode.  input_ids/loss_mask come out int64, the rest in their own dtype.
    """
    if not samples:
        raise ValueError("collate: no samples")
    lengths = [len(s["input_ids"]) for s in samples]
    t = max(lengths)
    if pad_to_multiple > 1:
        t = -(-t // pad_to_multiple) * pad_to_multiple
    out: dict[str, torch.Tensor] = {}
    for name, first in samples[0].items():
        if isinstance(first, str) or (isinstance(first, list) and first and isinstance(first[0], str)):
            continue
        values = [torch.as_tensor(s[name]) for s in samples]
        if values[0].dim() == 0:  # per-sample scalars (sample_index)
            out[name] = torch.stack(values).long()
            continue
        padded = values[0].new_zeros((len(samples), t, *values[0].shape[1:]))
        for i, v in enumerate(values):
            padded[i, : v.shape[0]] = v
        out[name] = padded.long() if name in ("input_ids", "loss_mask", "teacher_topk_ids") else padded
    out["attention_mask"] = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    return out


# ---- the feature store (reader) -------------------------------------------------------------------------

class FeatureDataset(torch.utils.data.Dataset):
    """Map-style: item i is the sample with the i-th smallest row index in the prepared split.

    Shards are opened lazily (safetensors mmap) and kept in a small LRU; only the rows of one sample are read.
    Sizes are always checked; verify=True also checks every shard's sha256.
    """

    def __init__(self, features_dir: str | Path, split: str, verify: bool = False, max_open_shards: int = 4):
        self.dir = Path(features_dir)
        index_path = self.dir / INDEX
        if not index_path.exists():
            raise FeatureStoreError(f"{index_path}: missing; the feature store is incomplete. "
                                    f"Fix: run `eyas collect <recipe>` (it resumes)")
        self.index = read_json(index_path)
        if self.index.get("format") != FORMAT:
            raise FeatureStoreError(f"{index_path}: field 'format' is {self.index.get('format')!r}, "
                                    f"expected {FORMAT!r}")
        if split not in self.index["splits"]:
            raise FeatureStoreError(f"{index_path}: no split '{split}' (has {sorted(self.index['splits'])})")
        self.split = split
        self.shards = self.index["splits"][split]["shards"]
        verify_shards(self.dir, self.shards, checksum=verify)
        self.max_open_shards = max_open_shards
        self._open: OrderedDict[int, object] = OrderedDict()
        items = []  # (sample_index, shard, start, end)
        for s, entry in enumerate(self.shards):
            handle = self._handle(s)
            offsets = handle.get_tensor("offsets").tolist()
            rows = handle.get_tensor("sample_index").tolist()
            if len(rows) != entry["samples"] or offsets[-1] != entry["tokens"]:
                raise FeatureStoreError(f"{self.dir / entry['file']}: holds {len(rows)} samples / {offsets[-1]} "
                                        f"tokens, {INDEX} says {entry['samples']} / {entry['tokens']}")
            items += [(row, s, offsets[i], offsets[i + 1]) for i, row in enumerate(rows)]
        items.sort()
        if len({row for row, *_ in items}) != len(items):
            raise FeatureStoreError(f"{index_path}: split '{split}' stores some sample twice")
        self.items = items
        self.fields = [k for k in self._handle(0).keys() if k not in ("offsets", "sample_index")] \
            if self.shards else []

    @staticmethod
    def shard_rows(path: str | Path) -> list[int]:
        """Rows of the prepared split that one shard holds, in shard order."""
        with safe_open(str(path), "pt") as fh:
            return fh.get_tensor("sample_index").tolist()

    @property
    def meta(self) -> dict:
        return {k: v for k, v in self.index.items() if k != "splits"}

    def __len__(self) -> int:
        return len(self.items)

    def _handle(self, shard: int):
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard]
        handle = safe_open(str(self.dir / self.shards[shard]["file"]), "pt")
        self._open[shard] = handle
        while len(self._open) > self.max_open_shards:
            self._open.popitem(last=False)
        return handle

    def __getstate__(self):  # DataLoader workers reopen their own shards
        state = dict(self.__dict__)
        state["_open"] = OrderedDict()
        return state

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row, shard, start, end = self.items[i]
        handle = self._handle(shard)
        stored = {name: handle.get_slice(name)[start:end] for name in self.fields}
        sample = decode_fields(stored)
        sample["sample_index"] = torch.tensor(row)
        return sample


def verify_shards(features_dir: Path, shards: list[dict], checksum: bool = True) -> None:
    """Raise FeatureStoreError naming the first shard that is missing, truncated or (checksum) altered."""
    for entry in shards:
        path = Path(features_dir) / entry["file"]
        if not path.exists():
            raise FeatureStoreError(f"shard {path} is missing. Fix: rerun `eyas collect <recipe>` (it resumes)")
        if path.stat().st_size != entry["bytes"]:
            raise FeatureStoreError(f"shard {path} has {path.stat().st_size} bytes, {INDEX} says {entry['bytes']} "
                                    f"(truncated or replaced). Fix: delete it and rerun `eyas collect <recipe>`")
        if checksum and sha256_path(path) != entry["sha256"]:
            raise FeatureStoreError(f"shard {path} is corrupt: sha256 differs from {INDEX}. "
                                    f"Fix: delete it and rerun `eyas collect <recipe>`")


# ---- planning and writing shards ---------------------------------------------------------------------------

def plan_shards(lengths: list[int], rank: int, world: int, batch_size: int,
                shard_tokens: int) -> list[list[list[int]]]:
    """Shards -> batches -> sample rows for one rank: samples sorted by length (longest first, so padding is
    small and memory peaks early), every world-th to this rank, batches of batch_size, shards of ~shard_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))[rank::world]
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    shards, current, tokens = [], [], 0
    for batch in batches:
        current.append(batch)
        tokens += sum(lengths[i] for i in batch)
        if tokens >= shard_tokens:
            shards.append(current)
            current, tokens = [], 0
    if current:
        shards.append(current)
    return shards


def shard_name(split: str, rank: int, number: int) -> str:
    return f"{split}/r{rank:03d}-{number:05d}.safetensors"


def progress_path(out: Path, split: str, rank: int) -> Path:
    return out / split / f"progress.r{rank:03d}.json"


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> dict:
    data = safetensors_bytes({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": FORMAT})
    write_atomic(path, data)
    return {"sha256": sha256_bytes(data), "bytes": len(data)}


def batch_tokens(split_ds, rows: list[int], where: str, vocab_size: int) -> list[dict[str, torch.Tensor]]:
    """input_ids/loss_mask of some rows of the prepared split, checked."""
    records = split_ds[rows]
    record_ids = records.get("record_id") or rows
    samples = []
    for row, rid, ids, mask in zip(rows, record_ids, records["input_ids"], records["loss_mask"]):
        if not ids:
            raise FeatureStoreError(f"{where}: record {rid} (row {row}): field 'input_ids' is empty")
        if len(mask) != len(ids):
            raise FeatureStoreError(f"{where}: record {rid} (row {row}): field 'loss_mask' has {len(mask)} "
                                    f"values, 'input_ids' has {len(ids)}")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise FeatureStoreError(f"{where}: record {rid} (row {row}): field 'input_ids' holds id "
                                    f"{max(ids) if max(ids) >= vocab_size else min(ids)} outside the target "
                                    f"vocabulary [0, {vocab_size}); was the data prepared with another tokenizer?")
        samples.append({"input_ids": torch.tensor(ids, dtype=torch.int32),
                        "loss_mask": torch.tensor(mask, dtype=torch.uint8)})
    return samples


def collect_shard(features: OnlineFeatures, split_ds, batches: list[list[int]], where: str, bar) -> dict:
    """Run the target over one shard's batches; return the flat tensors of the shard."""
    parts: dict[str, list[torch.Tensor]] = {}
    rows, lengths = [], []
    for batch_rows in batches:
        samples = batch_tokens(split_ds, batch_rows, where, features.t2d.numel())
        stored = {k: v.cpu() for k, v in features.encode(collate(samples)).items()}
        for i, sample in enumerate(samples):
            n = len(sample["input_ids"])
            for name, value in [*sample.items(), *stored.items()]:
                parts.setdefault(name, []).append(value[i, :n] if name in stored else value)
            lengths.append(n)
        rows += batch_rows
        bar.update(sum(len(s["input_ids"]) for s in samples))
    tensors = {name: torch.cat(values) for name, values in parts.items()}
    tensors["offsets"] = torch.tensor([0] + lengths).cumsum(0)
    tensors["sample_index"] = torch.tensor(rows, dtype=torch.int64)
    return tensors


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def check_disk(out: Path, need: int, per_token: int, tokens: int) -> None:
    gb = 1 << 30
    print(f"[collect] storage: {per_token} bytes/token, {tokens:,} tokens to collect -> {need / gb:.3f} GiB "
          f"({need:,} bytes) under {out}", flush=True)
    free = _free_bytes(out)
    margin = 64 << 20  # temp copy of a shard and the index
    if free < need + margin:
        raise FeatureStoreError(
            f"not enough disk for the feature store in {out}: needs {need / gb:.2f} GiB ({per_token} bytes/token x "
            f"{tokens:,} tokens) + {margin >> 20} MiB margin, only {free / gb:.2f} GiB free. Fix: free space, "
            f"or store less: collect.feature_dtype=float8_e4m3, collect.teacher=topk, collect.max_records=N, "
            f"or collect.mode=online (no storage)")


# ---- the stage ------------------------------------------------------------------------------------------------

def upstream_hash(stage_dir: Path) -> str | None:
    """input_hash of an upstream stage's DONE.json (None when that stage did not write one)."""
    done = read_done(stage_dir)
    return done.get("input_hash") if done else None


def inputs_hash(recipe) -> str:
    parts = {"sections": recipe.section_hash("target", "data", "vocab", "collect"),
             "data": upstream_hash(recipe.stage_dir("data")), "vocab": upstream_hash(recipe.stage_dir("vocab"))}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def sample_lengths(ds, chunk: int = 65536) -> list[int]:
    """Token count of every row, read through Arrow (no Python lists of all the ids)."""
    import pyarrow.compute as pc

    table = ds.with_format("arrow")
    lengths: list[int] = []
    for start in range(0, len(ds), chunk):
        lengths += pc.list_value_length(table[start:start + chunk]["input_ids"]).to_pylist()
    return lengths


def load_splits(data_dir: Path, max_records: int | None) -> dict:
    import datasets

    if not data_dir.exists():
        raise FeatureStoreError(f"{data_dir}: no prepared dataset. Fix: run `eyas prepare <recipe>` first")
    dd = datasets.load_from_disk(str(data_dir))
    out = {}
    for split in SPLITS:
        if split not in dd:
            raise FeatureStoreError(f"{data_dir}: no split '{split}' (has {sorted(dd)})")
        ds = dd[split]
        for column in ("input_ids", "loss_mask"):
            if column not in ds.column_names:
                raise FeatureStoreError(f"{data_dir}: split '{split}' has no column '{column}'")
        if max_records is not None:
            ds = ds.select(range(min(max_records, len(ds))))
        out[split] = ds
    return out


def write_teacher(out: Path, features: OnlineFeatures) -> None:
    tensors = {"d2t": features.d2t.contiguous()}
    if features.cfg.teacher == "last_hidden":
        tensors["lm_head_rows"] = features.teacher().rows.cpu().contiguous()
    meta = {"softcap": str(features.softcap or "none"), "draft_vocab_size": str(features.draft_vocab_size),
            "teacher": features.cfg.teacher}
    write_atomic(out / TEACHER, safetensors_bytes(tensors, metadata=meta))


def run_collect(recipe) -> Path:
    """`eyas collect`: store the target's features of the train and validation splits under features/."""
    from accelerate import PartialState

    cfg: CollectConfig = recipe.collect
    check_config(cfg)
    out = recipe.stage_dir("features")
    # PartialState does not read ACCELERATE_USE_CPU itself; without cpu=True, CPU processes would not join a group.
    use_cpu = (os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
               or recipe.target.device == "cpu" or not torch.cuda.is_available())
    state = PartialState(cpu=use_cpu)
    rank, world = state.process_index, state.num_processes
    key = inputs_hash(recipe)
    if (done := read_done(out)) and done.get("input_hash") == key:
        if state.is_main_process:
            print(f"[collect] {out} is up to date ({DONE} matches)", flush=True)
        return out
    if cfg.mode == "online":
        if state.is_main_process:
            out.mkdir(parents=True, exist_ok=True)
            write_done(out, key, mode="online")
            print("[collect] mode=online: nothing stored, the trainer runs the target (OnlineFeatures)", flush=True)
        state.wait_for_everyone()
        return out

    # A store begun with other inputs or another number of processes is stale: start over.
    started = out / "inputs.json"
    if state.is_main_process:
        stamp = {"hash": key, "num_processes": world}
        if out.exists() and (not started.exists() or read_json(started) != stamp):
            print(f"[collect] {out} holds features of other inputs; starting over", flush=True)
            shutil.rmtree(out)
        for split in SPLITS:
            (out / split).mkdir(parents=True, exist_ok=True)
            for tmp in (out / split).glob(".*.tmp-*"):
                tmp.unlink()  # leftovers of a killed write
        write_json_atomic(started, stamp)
    state.wait_for_everyone()

    target_dir = resolve_target(recipe.target.name_or_path)
    from transformers import AutoConfig

    tconf = text_config(AutoConfig.from_pretrained(target_dir, trust_remote_code=recipe.target.trust_remote_code))
    vocab = load_vocab(recipe.stage_dir("vocab"))
    splits = load_splits(recipe.stage_dir("data"), cfg.max_records)
    per_token = bytes_per_token(tconf.hidden_size, cfg, vocab[0].numel())

    plans, done_shards, lengths_of = {}, {}, {}
    need_tokens = need_samples = 0
    for split, ds in splits.items():
        lengths = lengths_of[split] = sample_lengths(ds)
        plans[split] = [plan_shards(lengths, r, world, cfg.batch_size, cfg.shard_tokens) for r in range(world)]
        for r in range(world):
            # Each rank checksums only its own shards; the others' progress is only counted.
            finished = read_progress(out, split, r, plans[split][r], verify=r == rank)
            if r == rank:
                done_shards[split] = finished
            for n, shard in enumerate(plans[split][r]):
                if shard_name(split, r, n) not in finished:
                    need_tokens += sum(lengths[i] for b in shard for i in b)
                    need_samples += sum(len(b) for b in shard)
    # Every rank computes the same figure, so all refuse together (no rank left waiting at a barrier).
    if state.is_main_process:
        check_disk(out, need_tokens * per_token + 16 * need_samples, per_token, need_tokens)
    elif _free_bytes(out) < need_tokens * per_token + 16 * need_samples + (64 << 20):
        raise FeatureStoreError(f"not enough disk for the feature store in {out} (see rank 0's message)")

    device = state.device if recipe.target.device == "auto" else recipe.target.device
    model, _ = load_target(recipe.target, device=device)
    features = OnlineFeatures(model, vocab, cfg, aux_layer_ids_for(model, recipe.target))
    if state.is_main_process:
        write_teacher(out, features)

    for split, ds in splits.items():
        where = f"{recipe.stage_dir('data')} ({split} split)"
        collect_split(out, split, ds, lengths_of[split], plans[split][rank], done_shards[split], features,
                      rank, state, where)
    state.wait_for_everyone()

    if state.is_main_process:
        index = merge_index(out, plans, world)
        index.update({
            "teacher": cfg.teacher, "feature_dtype": cfg.feature_dtype, "topk": cfg.topk if cfg.teacher == "topk" else None,
            "topk_dtype": cfg.topk_dtype if cfg.teacher == "topk" else None,
            "hidden_size": features.hidden_size, "aux_layer_ids": features.layer_ids,
            "draft_vocab_size": features.draft_vocab_size, "target_vocab_size": int(vocab[1].numel()),
            "target": recipe.target.name_or_path, "target_hash": target_hash(recipe.target.name_or_path),
            "target_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "bytes_per_token": per_token, "num_processes": world, "inputs_hash": key,
            "positions": "unshifted: aux/teacher at t belong to token t; the trainer shifts",
        })
        write_json_atomic(out / INDEX, index)
        write_done(out, key, mode="offline", sections=recipe.section_hash("target", "data", "vocab", "collect"),
                   upstream={"data": upstream_hash(recipe.stage_dir("data")),
                             "vocab": upstream_hash(recipe.stage_dir("vocab"))})
        print(f"[collect] wrote {out}", flush=True)
    state.wait_for_everyone()
    return out


def read_progress(out: Path, split: str, rank: int, plan, verify: bool = True) -> dict:
    """Shards a rank finished, verified against their checksums; bad ones are dropped (recollected)."""
    path = progress_path(out, split, rank)
    if not path.exists():
        return {}
    progress = read_json(path)
    if progress.get("plan") != plan_digest(plan):
        raise FeatureStoreError(f"{path}: field 'plan' does not match this run's shard plan; "
                                f"delete {out} and rerun")
    finished = {}
    for name, entry in progress["shards"].items():
        try:
            verify_shards(out, [entry], checksum=verify)
        except FeatureStoreError as exc:
            print(f"[collect] {exc}; collecting it again", flush=True)
            continue
        finished[name] = entry
    return finished


def plan_digest(plan) -> str:
    return sha256_bytes(json.dumps(plan).encode())[:16]


def collect_split(out: Path, split: str, ds, lengths: list[int], plan, finished: dict, features: OnlineFeatures,
                  rank: int, state, where: str) -> None:
    todo = [(n, shard) for n, shard in enumerate(plan) if shard_name(split, rank, n) not in finished]
    tokens = sum(lengths[i] for _, shard in todo for b in shard for i in b)
    progress = {"plan": plan_digest(plan), "shards": dict(finished)}
    with tqdm(total=tokens, unit="tok", unit_scale=True, desc=f"collect {split} r{rank}",
              disable=not state.is_local_main_process) as bar:
        for n, shard in todo:
            tensors = collect_shard(features, ds, shard, where, bar)
            name = shard_name(split, rank, n)
            entry = write_shard(out / name, tensors)
            entry.update(file=name, samples=int(tensors["sample_index"].numel()), tokens=int(tensors["offsets"][-1]))
            progress["shards"][name] = entry
            write_json_atomic(progress_path(out, split, rank), progress)


def merge_index(out: Path, plans: dict, world: int) -> dict:
    index = {"format": FORMAT, "splits": {}}
    for split, rank_plans in plans.items():
        shards = []
        for r in range(world):
            progress = read_json(progress_path(out, split, r)) if progress_path(out, split, r).exists() \
                else {"shards": {}}
            for n in range(len(rank_plans[r])):
                name = shard_name(split, r, n)
                if name not in progress["shards"]:
                    raise FeatureStoreError(f"{progress_path(out, split, r)}: shard {name} was not written")
                shards.append(progress["shards"][name])
        index["splits"][split] = {"num_samples": sum(s["samples"] for s in shards),
                                  "num_tokens": sum(s["tokens"] for s in shards), "shards": shards}
    return index
