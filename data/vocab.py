"""`eyas vocab`: the draft vocabulary, the target tokens the head can propose.

Keep the `draft_vocab_size` target tokens seen most often under the loss mask of the training split,
sorted by id, and write them the way SGLang and vLLM load them:

    d2t  int64 [draft_vocab_size]   offsets: target_id = draft_id + d2t[draft_id]
    t2d  bool  [target_vocab_size]  true where the target token is in the draft vocabulary

Coverage (the share of masked tokens, and of the target's own argmax predictions, that the draft
vocabulary can express) is reported for several sizes in coverage.json/.md/.png.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from eyas.data.atomic import atomic_write, atomic_write_text
from eyas.data.config import VocabConfig
from eyas.data.targets import Target

VOCAB_FILE = "vocab.safetensors"


class VocabError(ValueError):
    """A vocabulary that cannot be built or a vocab file in the wrong format."""


# ---- counting ---------------------------------------------------------------------------------

def masked_token_counts(split, vocab_size: int, where: str) -> np.ndarray:
    """Counts per target id of the tokens under the loss mask; ids outside the vocab are an error."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in tqdm(range(0, len(split), 1024), desc=f"count {where}", unit="batch", leave=False):
        rows = split[start:start + 1024]
        for i, (ids, mask) in enumerate(zip(rows["input_ids"], rows["loss_mask"])):
            ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)
            if len(ids) != len(mask):
                raise VocabError(f"{where}: record {rows['record_id'][i]}: field 'loss_mask' has {len(mask)} "
                                 f"entries for {len(ids)} input_ids")
            if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
                raise VocabError(f"{where}: record {rows['record_id'][i]}: field 'input_ids' holds id {ids.max()} "
                                 f"outside the target vocabulary [0, {vocab_size}); was data prepared with "
                                 "another tokenizer?")
            counts += np.bincount(ids[mask], minlength=vocab_size)
    return counts


def ranked_ids(counts: np.ndarray) -> np.ndarray:
    """Seen token ids, most frequent first; ties by id so the choice is deterministic."""
    seen = np.flatnonzero(counts)
    return seen[np.lexsort((seen, -counts[seen]))]


def fill_ranking(ranked: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """`ranked`, then the ids it lacks that `reference` counts, most frequent first (ties by id)."""
    rest = reference.copy()
    rest[ranked] = 0
    return np.concatenate([ranked, ranked_ids(rest)])


def read_reference_counts(data_dir: Path, vocab_size: int) -> np.ndarray:
    from eyas.data.prepare import REFERENCE_COUNTS

    path = data_dir / REFERENCE_COUNTS
    if not path.exists():
        raise VocabError(f"{path} does not exist (vocab.fill_from_corpora reads it); rerun `eyas prepare`")
    counts = load_file(str(path)).get("counts")
    if counts is None or counts.dim() != 1 or counts.numel() != vocab_size:
        raise VocabError(f"{path}: tensor 'counts' must be 1-d with {vocab_size} entries (the target's vocabulary), "
                         f"got {None if counts is None else tuple(counts.shape)}; rerun `eyas prepare`")
    return counts.numpy().astype(np.int64)


def coverage(counts: np.ndarray, kept: np.ndarray) -> float | None:
    total = counts.sum()
    return float(counts[kept].sum() / total) if total else None


# ---- the mapping ------------------------------------------------------------------------------

def build_mapping(kept_ids: np.ndarray | torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for a set of target ids; draft ids follow target id order."""
    target_ids = torch.as_tensor(np.sort(np.asarray(kept_ids)), dtype=torch.long)
    d2t = target_ids - torch.arange(len(target_ids), dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t, t2d


def draft_to_target(d2t: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    return draft_ids + d2t[draft_ids]


def target_to_draft(t2d: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """Draft ids of target ids in the draft vocab (the rank among kept ids); -1 for the others."""
    rank = torch.cumsum(t2d.long(), 0) - 1
    return torch.where(t2d[target_ids], rank[target_ids], torch.full_like(target_ids, -1))


def save_vocab(path: Path, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    tensors = {"d2t": d2t.to(torch.long).contiguous(), "t2d": t2d.to(torch.bool).contiguous()}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))


def load_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from vocab/vocab.safetensors (or its folder), checked for the serving format."""
    path = Path(path)
    if path.is_dir():
        path = path / VOCAB_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; run `eyas vocab <recipe>` first")
    tensors = load_file(str(path))
    for name, dtype, ndim in (("d2t", torch.int64, 1), ("t2d", torch.bool, 1)):
        if name not in tensors:
            raise VocabError(f"{path}: missing tensor '{name}' (found {sorted(tensors)})")
        if tensors[name].dtype != dtype or tensors[name].dim() != ndim:
            raise VocabError(f"{path}: tensor '{name}' must be {dtype} with {ndim} dim, got "
                             f"{tensors[name].dtype} {tuple(tensors[name].shape)}")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    target_ids = torch.arange(len(d2t)) + d2t
    if int(t2d.sum()) != len(d2t):
        raise VocabError(f"{path}: t2d marks {int(t2d.sum())} target ids but d2t has {len(d2t)} entries")
    if len(d2t) and (target_ids.min() < 0 or target_ids.max() >= len(t2d) or not bool(t2d[target_ids].all())
                     or not bool((target_ids[1:] > target_ids[:-1]).all())):
        raise VocabError(f"{path}: d2t offsets do not map draft ids to the increasing target ids marked in t2d")
    return d2t, t2d


# ---- target argmax coverage ---------------------------------------------------------------------

@torch.no_grad()
def target_argmax_counts(target: Target, split, vocab_size: int, max_positions: int, batch_size: int) -> np.ndarray:
    """Counts of the target's greedy next token at up to `max_positions` masked positions of `split`."""
    from eyas.data.targets import logits_from_final_hidden, target_features

    model = target.load_model()
    layer_ids = target.aux_layer_ids
    counts = np.zeros(vocab_size, dtype=np.int64)
    rows, budget = [], max_positions
    for ids, mask in zip(split["input_ids"], split["loss_mask"]):
        # The prediction at position t-1 is the target's guess for the masked token at t.
        positions = [t - 1 for t in range(1, len(ids)) if mask[t]][:budget]
        if positions:
            rows.append((ids[:positions[-1] + 1], positions))
            budget -= len(positions)
        if budget <= 0:
            break
    for b in tqdm(range(0, len(rows), batch_size), desc="target argmax", unit="batch"):
        batch = rows[b:b + batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.zeros(len(batch), width, dtype=torch.long)
        attention = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (ids, _) in enumerate(batch):
            input_ids[i, :len(ids)] = torch.as_tensor(ids)
            attention[i, :len(ids)] = 1
        device = next(model.parameters()).device
        _, hidden = target_features(model, input_ids.to(device), layer_ids, attention.to(device))
        picked = torch.cat([hidden[i, pos] for i, (_, pos) in enumerate(batch)])
        guesses = logits_from_final_hidden(model, picked).argmax(-1).cpu().numpy()
        counts += np.bincount(guesses, minlength=vocab_size)[:vocab_size]
    return counts


# ---- the stage --------------------------------------------------------------------------------

def choose_size(cfg, distinct: int, table: list[dict], data_dir: Path,
                what: str = "the training split holds {n} distinct masked tokens") -> int:
    size = cfg.draft_vocab_size
    if cfg.coverage_target is not None:
        key = "validation" if table[0]["validation"] is not None else "train"
        reached = [row["size"] for row in table if row[key] >= cfg.coverage_target]
        if not reached:
            best = max(table, key=lambda row: row["size"])
            raise VocabError(f"vocab.coverage_target {cfg.coverage_target} is not reached by any of vocab.sizes "
                             f"{cfg.sizes} ({key} coverage at {best['size']}: {best[key]:.4f})")
        size = min(reached)
    if distinct < size:
        if not cfg.shrink_to_distinct:
            raise VocabError(f"{data_dir}: {what.format(n=distinct)}, fewer than "
                             f"the draft vocabulary size {size}. Use a smaller vocab.draft_vocab_size, more data, "
                             "or vocab.shrink_to_distinct=true")
        size = distinct
    return size


def coverage_table(sizes, ranked: np.ndarray, counts: dict[str, np.ndarray]) -> list[dict]:
    table = []
    for size in sorted(set(sizes)):
        kept = ranked[:size]
        table.append({"size": size, "kept": int(len(kept)), **{k: coverage(c, kept) for k, c in counts.items()}})
    return table


def coverage_markdown(table: list[dict], chosen: int, totals: dict[str, int]) -> str:
    cols = [k for k in ("train", "validation", "target_argmax") if k in table[0]]
    lines = ["| draft vocab size | " + " | ".join(f"{c} coverage" for c in cols) + " |",
             "|---:|" + "---:|" * len(cols)]
    for row in table:
        mark = " (chosen)" if row["size"] == chosen else ""
        size = f"{row['size']}{mark}" + ("" if row["kept"] == row["size"] else f" ({row['kept']} seen)")
        lines.append(f"| {size} | " + " | ".join("n/a" if row[c] is None else f"{100 * row[c]:.2f}%" for c in cols) + " |")
    lines.append("")
    lines.append("Masked tokens counted: " + ", ".join(f"{k} {v:,}" for k, v in totals.items()) + ".")
    return "\n".join(lines) + "\n"


def plot_coverage(table: list[dict], chosen: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    sizes = [row["size"] for row in table]
    for key in ("train", "validation", "target_argmax"):
        if table[0].get(key) is not None:
            ax.plot(sizes, [100 * row[key] for row in table], marker="o", label=key)
    ax.axvline(chosen, color="grey", linestyle="--", label=f"chosen {chosen}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft vocabulary size")
    ax.set_ylabel("coverage of masked tokens (%)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    plt.close(fig)


def build_vocab(cfg: VocabConfig, target: Target, data_dir: Path, out: Path) -> dict:
    """The draft vocabulary of the prepared data in `data_dir`, written to `out`; returns its sizes for DONE."""
    from datasets import load_from_disk

    out.mkdir(parents=True, exist_ok=True)
    vocab_size = target.vocab_size
    data = load_from_disk(str(data_dir))
    for name in ("train", "validation"):
        if name not in data:
            raise VocabError(f"{data_dir}: no '{name}' split (found {sorted(data)}); rerun `eyas prepare`")
        missing = {"input_ids", "loss_mask", "record_id"} - set(data[name].column_names)
        if missing:
            raise VocabError(f"{data_dir}/{name}: missing column '{sorted(missing)[0]}' "
                             f"(columns: {data[name].column_names})")
    counts = {name: masked_token_counts(data[name], vocab_size, f"{data_dir}/{name}")
              for name in ("train", "validation")}
    if counts["train"].sum() == 0:
        raise VocabError(f"{data_dir}/train: no masked tokens to build a vocabulary from")
    ranked = ranked_ids(counts["train"])
    distinct_train = len(ranked)
    if cfg.fill_from_corpora:
        ranked = fill_ranking(ranked, read_reference_counts(data_dir, vocab_size))
    sizes = list(cfg.sizes) + [cfg.draft_vocab_size]
    what = ("the training split's masked tokens and the corpora's original text hold {n} distinct tokens"
            if cfg.fill_from_corpora else "the training split holds {n} distinct masked tokens")
    size = choose_size(cfg, len(ranked), coverage_table(sizes, ranked, counts), data_dir, what)
    # The target's argmax is the costly part; it comes after the size is known to be valid.
    if cfg.argmax_positions > 0 and len(data["validation"]):
        counts["target_argmax"] = target_argmax_counts(target, data["validation"], vocab_size,
                                                       cfg.argmax_positions, cfg.argmax_batch_size)
    table = coverage_table(sizes + [size], ranked, counts)
    d2t, t2d = build_mapping(ranked[:size], vocab_size)

    save_vocab(out / VOCAB_FILE, d2t, t2d)
    totals = {k: int(c.sum()) for k, c in counts.items()}
    report = {"draft_vocab_size": size, "target_vocab_size": vocab_size, "distinct_train_tokens": distinct_train,
              "filled_from_corpora": max(0, size - distinct_train) if cfg.fill_from_corpora else 0,
              "coverage_target": cfg.coverage_target, "masked_tokens": totals, "table": table}
    atomic_write_text(out / "coverage.json", json.dumps(report, indent=2))
    atomic_write_text(out / "coverage.md", coverage_markdown(table, size, totals))
    plot_coverage(table, size, out / "coverage.png")
    return {"draft_vocab_size": size, "target_vocab_size": vocab_size}
