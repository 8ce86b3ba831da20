"""`eyas prepare`: corpora -> rendered, masked, split samples in `data/` (a DatasetDict on disk).

    data/                 DatasetDict (save_to_disk): train, validation; columns input_ids, loss_mask,
                          source, record_id, category
    data/prompts.jsonl    held-out prompts from validation, ending right before an assistant turn
    data/stats.json       records in/out per reason per corpus, tokens, masked tokens
    data/regenerated-<settings hash>.jsonl  the target's answers when data.regenerate (resume log)
    data/reference_counts.safetensors  `counts` int64 [target vocab]: tokens of the corpora's original answers
                          and documents (train split, before regeneration): the vocab stage fills the draft
                          vocabulary from these past the tokens the training answers use
    data/DONE.json        hash of the inputs, written last (by the stage runner, data/stage.py)
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from eyas.data.atomic import atomic_write, atomic_write_text
from eyas.data.config import DataConfig
from eyas.data.corpora import CorpusError, CorpusStats, Record, dedup, read_corpus, select, split_of
from eyas.data.regenerate import (AnswerSource, distinct_requests, engine_answers, first_turn_prompt, prompt_lengths,
                                  regenerate, request_key, transformers_answers)
from eyas.data.stage import hash_json
from eyas.data.targets import Target, pick_device, pick_dtype
from eyas.data.templates import Sample, parent_id, render_records

COLUMNS = ("input_ids", "loss_mask", "source", "record_id", "category")
REFERENCE_COUNTS = "reference_counts.safetensors"


def load_corpora(cfg: DataConfig) -> list[tuple[CorpusStats, list[Record]]]:
    """Every corpus read, deduplicated (also across corpora) and subsampled as configured."""
    seen: set[str] = set()
    groups = []
    for corpus in cfg.corpora:
        found, stats = read_corpus(corpus, cfg.max_turns)
        found = select(dedup(found, stats, seen), corpus.weight, corpus.max_records, cfg.seed)
        stats.kept = len(found)
        groups.append((stats, found))
    return groups


def reference_counts(tokenizer, groups, vocab_size: int, validation_fraction: float, block: int = 256):
    """Token counts of the original answers (chat) and documents of the train-split records, as read.

    The target's own answers to a few hundred prompts use only a few thousand distinct tokens; these counts,
    over every record read (also the ones not regenerated), rank the tokens the draft vocabulary adds past those.
    """
    import numpy as np

    texts = []
    for _, found in groups:
        for r in found:
            if split_of(r.record_id, validation_fraction) != "train":
                continue
            texts += [m["content"] for m in r.messages if m["role"] == "assistant"] if r.is_chat else [r.completion]
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(texts), block):
        for ids in tokenizer(texts[start:start + block], add_special_tokens=False)["input_ids"]:
            ids = np.asarray(ids, dtype=np.int64)
            counts += np.bincount(ids[ids < vocab_size], minlength=vocab_size)
    return counts


def save_reference_counts(counts, path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {"counts": torch.from_numpy(counts)}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))


def regeneration_log(cfg: DataConfig, target: Target, out: Path) -> Path:
    """The resume log, one per target and generation settings, so changed settings never reuse old answers."""
    # Every target setting but the aux layers (which only collection reads) can change the answers.
    generation = {k: v for k, v in vars(target.cfg).items() if k != "aux_layer_ids"}
    settings = [hash_json(generation), target.hash, cfg.regenerate_max_new_tokens, cfg.regenerate_temperature,
                cfg.seed]
    if cfg.regenerate_engine != "transformers":  # another engine's numerics: other greedy answers
        settings += [cfg.regenerate_engine, engine_dtype(cfg, target)]
    return out / f"regenerated-{hash_json(settings, 12)}.jsonl"


def engine_dtype(cfg: DataConfig, target: Target) -> str:
    if cfg.regenerate_dtype != "auto":
        return cfg.regenerate_dtype
    return str(pick_dtype(target.cfg.dtype, pick_device(target.cfg.device))).removeprefix("torch.")


def answer_source(cfg: DataConfig, target: Target, out: Path, max_prompt: int,
                  tune_for_rows: Callable | None = None) -> AnswerSource:
    """What answers the prompts: the engine as a local server, or the target loaded here (only when called)."""
    if cfg.regenerate_engine == "vllm":
        from eyas.data.engine import VllmServer

        def start_server() -> VllmServer:
            return VllmServer(target.path, out, dtype=engine_dtype(cfg, target), log_name="vllm-regenerate.log",
                              max_model_len=min(max_prompt + cfg.regenerate_max_new_tokens,
                                                getattr(target.config, "max_position_embeddings", 1 << 20)),
                              extra_args=["--max-num-seqs", str(cfg.regenerate_concurrency)])

        return engine_answers(start_server, target.tokenizer, cfg.regenerate_max_new_tokens,
                              cfg.regenerate_concurrency, cfg.regenerate_temperature, cfg.seed)

    def answers(todo):
        model = target.load_model()
        if tune_for_rows is not None:
            # Every decode step of a batch has batch_size rows: let the caller pick the matmul layout for that.
            tune_for_rows(model, row_counts=(cfg.regenerate_batch_size,))
        yield from transformers_answers(model, target.tokenizer, cfg.regenerate_max_new_tokens,
                                        cfg.regenerate_batch_size, cfg.regenerate_temperature, cfg.seed)(todo)
    return answers


def regenerates(cfg: DataConfig, corpus) -> bool:
    return cfg.regenerate if corpus.regenerate is None else corpus.regenerate


def max_prompt_tokens(cfg: DataConfig) -> int:
    """The longest prompt answered (and held out): room for min_assistant_tokens, and the regeneration cap."""
    longest = cfg.max_length - cfg.min_assistant_tokens
    if cfg.regenerate_max_prompt_tokens is not None:
        longest = min(longest, cfg.regenerate_max_prompt_tokens)
    return longest


_GAP = object()  # fills the shorter lists in interleave (None could be an item)


def interleave(lists: list[list]) -> list:
    """The first item of every list, then the second of every list, ... (each list keeps its order)."""
    return [x for row in itertools.zip_longest(*lists, fillvalue=_GAP) for x in row if x is not _GAP]


def regenerate_groups(cfg: DataConfig, target: Target, groups, out: Path,
                      tune_for_rows: Callable | None = None) -> list[tuple[CorpusStats, list[Record]]]:
    """The corpora that regenerate get the target's answers (their other chat records are dropped); the rest
    keep their own. The budget (regenerate_max_records, category_mix) is taken over the corpora in turn."""
    chosen = [regenerates(cfg, corpus) for corpus in cfg.corpora]
    seen: set[str] = set()  # first requests, across the corpora
    # Round-robin over the corpora, so a budget smaller than the first corpus still answers every corpus.
    records = interleave([distinct_requests(found, stats, seen) for (stats, found), regen in zip(groups, chosen)
                          if regen])
    max_prompt = max_prompt_tokens(cfg)
    source = answer_source(cfg, target, out, max_prompt, tune_for_rows)
    answered = {r.record_id: r for r in regenerate(source, target.tokenizer, records,
                                                   regeneration_log(cfg, target, out), cfg.regenerate_max_records,
                                                   max_prompt_tokens=max_prompt, category_mix=cfg.category_mix)}
    return [(stats, [answered[r.record_id] for r in found if r.record_id in answered] if regen else found)
            for (stats, found), regen in zip(groups, chosen)]


def check_usable(stats: CorpusStats, cfg: DataConfig, corpus) -> None:
    """A corpus that yields no sample is an error at prepare (an empty file, a folder of binaries, ...)."""
    if stats.samples:
        return
    reasons = {**stats.skipped, **stats.render_skipped}
    why = ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) or "none skipped"
    hint = (" (regeneration is on: only records the target answered count)" if regenerates(cfg, corpus) else
            " (requests need the target's answers: regenerate this corpus)" if corpus.request else "")
    raise CorpusError(f"{stats.source}: no usable records: read {stats.read}, kept {stats.kept}, "
                      f"samples 0 ({why}){hint}")


def held_out_prompts(read: list[Record], samples: list[Sample], records: dict[str, Record], tokenizer,
                     per_category: int, max_prompt: int, validation_fraction: float) -> list[dict]:
    """Up to `per_category` prompts per kind of traffic from the validation split, in this order: every chat
    record read (answered by the target or not: the bench needs only the prompt) whose first turn fits in
    `max_prompt` tokens, up to that turn; then documents with a real prompt (HumanEval); then the first half
    of a validation document piece. A request that a training record starts with (another conversation with
    the same first turn) is not held out, nor is one already taken."""
    prompts, taken = [], Counter()
    seen = {request_key(r.messages) for r in records.values()
            if r.is_chat and split_of(r.record_id, validation_fraction) == "train"}

    def take(item: dict, category: str, record_id: str) -> None:
        if taken[category] < per_category:
            prompts.append({**item, "category": category, "record_id": record_id})
            taken[category] += 1

    chat = [r for r in read if r.is_chat and split_of(r.record_id, validation_fraction) == "validation"]
    for r, length in zip(chat, prompt_lengths(tokenizer, chat)):
        key = request_key(r.messages)
        if length <= max_prompt and key not in seen:
            seen.add(key)
            take({"messages": first_turn_prompt(r.messages)}, r.category, r.record_id)
    for s in sorted((s for s in samples if not records[parent_id(s.record_id)].is_chat),
                    key=lambda s: "#" in s.record_id):
        record = records[parent_id(s.record_id)]
        if record.prompt:
            take({"prompt": record.prompt}, s.category, s.record_id)
        else:
            take({"prompt": tokenizer.decode(s.input_ids[:max(1, min(256, len(s.input_ids) // 2))],
                                             skip_special_tokens=True)}, s.category, s.record_id)
    return prompts


def token_stats(samples: list[Sample]) -> dict:
    return {"samples": len(samples), "tokens": sum(len(s.input_ids) for s in samples),
            "masked_tokens": sum(sum(s.loss_mask) for s in samples)}


def to_dataset(samples: list[Sample]):
    from datasets import Dataset, Features, Sequence, Value

    features = Features({"input_ids": Sequence(Value("int32")), "loss_mask": Sequence(Value("int8")),
                         "source": Value("string"), "record_id": Value("string"), "category": Value("string")})
    return Dataset.from_dict({c: [getattr(s, c) for s in samples] for c in COLUMNS}, features=features)


def save_dataset(splits: dict[str, list[Sample]], out: Path) -> None:
    """save_to_disk into a staging folder, then move its entries over the old ones."""
    from datasets import DatasetDict

    staging = out / f".staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    # An empty split needs an explicit shard, or save_to_disk writes none and load_from_disk fails.
    DatasetDict({name: to_dataset(s) for name, s in splits.items()}).save_to_disk(
        str(staging), num_shards={name: 1 if not s else None for name, s in splits.items()})
    for entry in staging.iterdir():
        target = out / entry.name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(entry, target)
    staging.rmdir()


def prepare(cfg: DataConfig, target: Target, out: Path, tune_for_rows: Callable | None = None) -> dict:
    """Read, (regenerate,) render and split the corpora into `out`; returns the split sizes for DONE.

    `tune_for_rows(model, row_counts=...)`, when given, prepares the target's layers for regeneration's
    batch size (the decoding-time matmul layout lives beside the decoder, above this layer)."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    groups = load_corpora(cfg)
    tokenizer = target.tokenizer
    save_reference_counts(reference_counts(tokenizer, groups, target.vocab_size, cfg.validation_fraction),
                          out / REFERENCE_COUNTS)
    read = groups
    if any(regenerates(cfg, corpus) for corpus in cfg.corpora):
        groups = regenerate_groups(cfg, target, groups, out, tune_for_rows)
    t_read = time.time()

    samples: list[Sample] = []
    for (stats, found), corpus in zip(groups, cfg.corpora):
        rendered = render_records(tokenizer, found, cfg.max_length, cfg.overflow, cfg.min_assistant_tokens,
                                  stats.render_skipped)
        stats.samples = len(rendered)
        check_usable(stats, cfg, corpus)
        samples += rendered
    t_render = time.time()
    splits: dict[str, list[Sample]] = {"train": [], "validation": []}
    for s in samples:
        splits[split_of(parent_id(s.record_id), cfg.validation_fraction)].append(s)
    for name, split in splits.items():
        if not split:  # training needs both: say so here, not at train's first evaluation
            raise CorpusError(f"data: the {name} split is empty ({len(samples)} samples, validation_fraction "
                              f"{cfg.validation_fraction}); add records or change data.validation_fraction")

    save_dataset(splits, out)
    by_id = {r.record_id: r for _, found in groups for r in found}
    prompts = held_out_prompts([r for _, found in read for r in found], splits["validation"], by_id, tokenizer,
                               cfg.prompts_per_category, max_prompt_tokens(cfg), cfg.validation_fraction)
    atomic_write_text(out / "prompts.jsonl", "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts))
    stats = {
        "corpora": [stats.to_dict() for stats, _ in groups],
        "records": len(by_id),
        "render_skipped": dict(sum((stats.render_skipped for stats, _ in groups), Counter())),
        "splits": {name: {**token_stats(s), "by_category": {c: token_stats([x for x in s if x.category == c])
                                                              for c in sorted({x.category for x in s})}}
                   for name, s in splits.items()},
        "prompts": len(prompts),
        "seconds": {"read": round(t_read - t0, 2), "render": round(t_render - t_read, 2),
                    "total": round(time.time() - t0, 2)},
    }
    atomic_write_text(out / "stats.json", json.dumps(stats, indent=2))
    return {"samples": {k: len(v) for k, v in splits.items()}}
