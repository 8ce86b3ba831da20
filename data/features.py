"""The feature store: what the trainer reads from the target, offline (shards on disk) or online.

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

This module is the library: storage codecs, the online computation (`OnlineFeatures`, which rounds like
storage so both modes train on the same numbers), the reader (`FeatureDataset`), the teacher and
`collate`. The collect stage that writes a store is data/collect.py.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors import safe_open

from eyas.data.config import CollectConfig
from eyas.data.model_config import text_config
from eyas.data.packages import sha256_file
from eyas.data.targets import aux_layer_ids_for, bf16_autocast, logits_from_final_hidden, target_features
from eyas.data.vocab import draft_to_target

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
    training see the same numbers.  `encode` gives the storage form that the collect stage writes."""

    def __init__(self, model, vocab: tuple[torch.Tensor, torch.Tensor], cfg: CollectConfig,
                 layer_ids: list[int] | None = None):
        """model: the loaded target; vocab: (d2t, t2d) as `eyas.data.vocab.load_vocab` returns them."""
        check_config(cfg)
        self.model = model
        self.cfg = cfg
        self.layer_ids = list(layer_ids) if layer_ids is not None else aux_layer_ids_for(model)
        d2t, t2d = vocab
        weight = model.get_output_embeddings().weight
        if t2d.numel() != weight.shape[0]:
            raise FeatureStoreError(f"draft vocabulary was built for {t2d.numel()} target tokens, "
                                    f"the target's lm_head has {weight.shape[0]} rows")
        self.device = weight.device
        self.draft_ids = draft_to_target(d2t, torch.arange(d2t.numel())).to(self.device)
        self.t2d = t2d.to(self.device)
        self.d2t = d2t
        self.softcap = getattr(text_config(model.config), "final_logit_softcapping", None)
        self.bf16 = bf16_autocast(cfg.mixed_precision, self.device)

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
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
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

    def __init__(self, lm_head_rows: torch.Tensor | None, softcap: float | None, draft_vocab_size: int,
                 d2t: torch.Tensor | None = None):
        self.rows = lm_head_rows
        self.softcap = softcap or None
        self.draft_vocab_size = draft_vocab_size
        self.d2t = d2t  # the draft vocabulary the teacher was stored for (training checks it against its own)

    @classmethod
    def load(cls, features_dir: str | Path, device: str | torch.device = "cpu") -> "Teacher":
        path = Path(features_dir) / TEACHER
        if not path.exists():
            raise FeatureStoreError(f"{path}: missing. Fix: run `eyas collect <recipe>`")
        with safe_open(str(path), "pt") as fh:
            meta = fh.metadata() or {}
            rows = fh.get_tensor("lm_head_rows").to(device) if "lm_head_rows" in fh.keys() else None
            d2t = fh.get_tensor("d2t") if "d2t" in fh.keys() else None
        softcap = float(meta["softcap"]) if meta.get("softcap") not in (None, "", "none") else None
        return cls(rows, softcap, int(meta["draft_vocab_size"]), d2t)

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

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row, shard, start, end = self.items[i]
        handle = self._handle(shard)
        stored = {name: handle.get_slice(name)[start:end] for name in self.fields}
        sample = decode_fields(stored)
        sample["sample_index"] = torch.tensor(row)
        return sample


def verify_shards(features_dir: Path, shards: list[dict], checksum: bool = True) -> None:
    """Raise FeatureStoreError naming the first shard that is missing, truncated or altered.

    checksum=False is the cheap check for every read: sizes always, and the sha256 of any shard whose
    modification time is not the one recorded when it was written (same size, other bytes is caught too).
    """
    for entry in shards:
        path = Path(features_dir) / entry["file"]
        if not path.exists():
            raise FeatureStoreError(f"shard {path} is missing. Fix: rerun `eyas collect <recipe>` (it resumes)")
        stat = path.stat()
        if stat.st_size != entry["bytes"]:
            raise FeatureStoreError(f"shard {path} has {stat.st_size} bytes, {INDEX} says {entry['bytes']} "
                                    f"(truncated or replaced). Fix: delete it and rerun `eyas collect <recipe>`")
        if (checksum or stat.st_mtime_ns != entry.get("mtime_ns")) and sha256_path(path) != entry["sha256"]:
            raise FeatureStoreError(f"shard {path} is corrupt: sha256 differs from {INDEX}. "
                                    f"Fix: delete it and rerun `eyas collect <recipe>`")


def shard_name(split: str, rank: int, number: int) -> str:
    return f"{split}/r{rank:03d}-{number:05d}.safetensors"


# ---- the prepared rows (what online mode feeds the target) -------------------------------------------------

def load_splits(data_dir: Path, max_records: int | None) -> dict:
    """The train and validation splits of the prepared dataset, checked, each cut to max_records."""
    import datasets

    if not Path(data_dir).exists():
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


class PreparedRows(torch.utils.data.Dataset):
    """Rows of a prepared split as {input_ids, loss_mask, sample_index}: online mode's dataset."""

    def __init__(self, split_ds):
        self.ds = split_ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        row = self.ds[i]
        return {"input_ids": torch.tensor(row["input_ids"]), "loss_mask": torch.tensor(row["loss_mask"]),
                "sample_index": torch.tensor(i)}
