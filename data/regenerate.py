"""Replace assistant answers with the target's own, so the head learns what the target will say.

Only the first assistant turn is regenerated and later turns are dropped: the user's follow-ups
answered the original reply, not the target's. Completion-style records are left as they are.
Results are appended to a JSONL file keyed by record id as they finish, so a killed run resumes where it
stopped.

Two ways to generate, with the same output: `transformers_answers` (HF generate, batches of left-padded
prompts that all wait for the longest answer) and `engine_answers` (the serving engine, vLLM, as a local
server: continuous batching at high concurrency, a finished request's slot refilled at once). The
engine's figures on this machine are in docs/data-engine.md.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from eyas.data.corpora import Record, dedup
from eyas.data.templates import render_text

# todo records -> lists of {"record_id", "answer", "finish"} as they are generated
AnswerSource = Callable[[list[Record]], Iterator[list[dict]]]


def first_turn_prompt(messages: list[dict]) -> list[dict]:
    """Messages before the first assistant turn (system and user); all of a request that has no answer yet."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return messages[:first]


def request_key(messages: list[dict]) -> str:
    """The first request (the turns before the first answer), whitespace-trimmed: records with the same key
    get the same greedy answer from the target."""
    return json.dumps([[m["role"], m["content"].strip()] for m in first_turn_prompt(messages)], ensure_ascii=False)


def distinct_requests(records: list[Record], stats, seen: set[str]) -> list[Record]:
    """Chat records whose first request repeats an earlier one's are dropped (`stats.skip`) before regeneration.

    Records are distinct conversations, but regeneration keeps only the first request: two with the same one
    ("continue", "Explain quantum computing in simple terms") would become one sample twice, or the same request
    trained on in one split and benched as held out in the other."""
    return dedup(records, stats, seen, key=lambda r: request_key(r.messages) if r.is_chat else None,
                 reason="repeated_request")


def prompt_text(tokenizer, record: Record) -> str:
    """The text the target answers: the first turn's messages, chat template, generation prompt."""
    return render_text(tokenizer, first_turn_prompt(record.messages), add_generation_prompt=True)


def read_answers(path: Path) -> dict[str, str]:
    """Answers already generated; a line cut by a kill mid-write is ignored (and regenerated)."""
    done = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[item["record_id"]] = item["answer"]
    return done


def drop_partial_line(path: Path) -> None:
    """Cut a last line left unfinished by a kill, so the next append starts on a line of its own."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as fh:
            fh.truncate(data.rfind(b"\n") + 1)


def _append(path: Path, items: list[dict]) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        for item in items:
            fh.write(json.dumps(item, ensure_ascii=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int,
                     temperature: float = 0.0, seed: int = 0) -> list[tuple[str, str]]:
    """(answer text, "eos"|"length") for a batch of chat prompts, left-padded so all end together."""
    texts = [render_text(tokenizer, p, add_generation_prompt=True) for p in prompts]
    pad_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        batch = tokenizer(texts, add_special_tokens=False, return_tensors="pt", padding=True).to(model.device)
    finally:
        tokenizer.padding_side = pad_side
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    if temperature > 0:
        torch.manual_seed(seed)
    out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                         top_k=None, top_p=None, **sampling)
    new = out[:, batch["input_ids"].shape[1]:]
    eos = _stop_ids(model, tokenizer)
    answers = []
    for row in new.tolist():
        stop = next((j for j, t in enumerate(row) if t in eos), None)
        answers.append((tokenizer.decode(row[:stop], skip_special_tokens=True).strip(),
                        "length" if stop is None else "eos"))
    return answers


def _stop_ids(model, tokenizer) -> set[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, list) else [ids]) if ids is not None else set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def prompt_lengths(tokenizer, records: list[Record]) -> list[int]:
    texts = [prompt_text(tokenizer, r) for r in records]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []


def transformers_answers(model, tokenizer, max_new_tokens: int, batch_size: int = 16,
                         temperature: float = 0.0, seed: int = 0) -> AnswerSource:
    """Answers from HF generate, `batch_size` prompts at a time."""
    def answers(todo: list[Record]) -> Iterator[list[dict]]:
        for b in range(0, len(todo), batch_size):
            batch = todo[b:b + batch_size]
            found = generate_answers(model, tokenizer, [first_turn_prompt(r.messages) for r in batch],
                                     max_new_tokens, temperature, seed + b)
            yield [{"record_id": r.record_id, "answer": a, "finish": f} for r, (a, f) in zip(batch, found)]
    return answers


def engine_answers(start_server: Callable, tokenizer, max_new_tokens: int, concurrency: int = 64,
                   temperature: float = 0.0, seed: int = 0, request_timeout_s: float = 1800.0) -> AnswerSource:
    """Answers from the serving engine: `start_server()` gives a context manager for a running vLLM server
    (started only when something is left to answer), `concurrency` requests in flight.

    The prompt goes as token ids rendered here by the target's chat template, so the engine answers
    exactly the prompt HF generate would get; its text is detokenized as `generate_answers` does
    (special tokens skipped, stripped)."""
    from eyas.data.engine import http_json

    def answers(todo: list[Record]) -> Iterator[list[dict]]:
        with start_server() as server:
            model = server.served_model()
            pool = ThreadPoolExecutor(concurrency)

            def one(i: int, record: Record) -> dict:
                ids = tokenizer(prompt_text(tokenizer, record), add_special_tokens=False)["input_ids"]
                body = {"model": model, "prompt": ids,
                        "max_tokens": max_new_tokens, "temperature": temperature, "seed": seed + i,
                        "skip_special_tokens": True}
                choice = http_json(server.url + "/v1/completions", body, request_timeout_s)["choices"][0]
                return {"record_id": record.record_id, "answer": choice["text"].strip(),
                        "finish": "length" if choice["finish_reason"] == "length" else "eos"}

            futures = [pool.submit(one, i, r) for i, r in enumerate(todo)]
            try:
                for future in as_completed(futures):
                    if future.exception() is not None:
                        server.check_alive()  # a dead server says why in its log
                        raise server.failure(f"a regeneration request failed ({future.exception()}); the answers "
                                             "so far are kept: rerun to resume")
                    yield [future.result()]
            finally:  # on an error or Ctrl-C: drop what has not started, stop the server, keep what is written
                pool.shutdown(wait=False, cancel_futures=True)
    return answers


def take_mix(records: list[Record], n: int | None, mix: dict[str, float] | None) -> list[Record]:
    """The first `n` records (all when None), or with `mix`, shares of them per category (largest remainder),
    the first ones of each category in order; a category short of its share leaves the rest to the others in
    proportion to theirs, and categories the mix does not name are left out."""
    if not mix:
        return records if n is None else records[:n]
    by_cat: dict[str, list[Record]] = {}
    for r in records:
        if mix.get(r.category, 0) > 0:
            by_cat.setdefault(r.category, []).append(r)
    n = sum(len(v) for v in by_cat.values()) if n is None else n
    quota = {c: 0 for c in by_cat}
    while sum(quota.values()) < n:
        open_cats = [c for c in by_cat if quota[c] < len(by_cat[c])]
        if not open_cats:
            break
        left = n - sum(quota.values())
        total = sum(mix[c] for c in open_cats)
        exact = {c: left * mix[c] / total for c in open_cats}
        grant = {c: min(int(exact[c]), len(by_cat[c]) - quota[c]) for c in open_cats}
        if not any(grant.values()):  # fewer left than categories: the largest remainders
            grant = {c: 0 for c in open_cats}
            for c in sorted(open_cats, key=lambda c: -(exact[c] - int(exact[c])))[:left]:
                grant[c] = 1
        for c, g in grant.items():
            quota[c] += g
    chosen = {id(r) for c, rs in by_cat.items() for r in rs[:quota[c]]}
    return [r for r in records if id(r) in chosen]


def regenerate(answer_source: AnswerSource, tokenizer, records: list[Record], cache: Path,
               max_records: int | None = None, max_prompt_tokens: int | None = None,
               category_mix: dict[str, float] | None = None) -> list[Record]:
    """Chat records with their first answer replaced by the target's; empty answers drop the record.

    Prompts longer than `max_prompt_tokens` are not regenerated (and dropped): their answer would
    fall past max_length, and one long prompt in a left-padded batch multiplies everyone's cost.
    `category_mix` (shares per category) chooses which of the rest are answered (`take_mix`).
    `answer_source` is called only when some record is still without an answer in `cache`.
    """
    cache = Path(cache)
    cache.parent.mkdir(parents=True, exist_ok=True)
    chat = [r for r in records if r.is_chat]
    lengths = dict(zip((r.record_id for r in chat), prompt_lengths(tokenizer, chat)))
    if max_prompt_tokens is not None:
        chat = [r for r in chat if lengths[r.record_id] <= max_prompt_tokens]
    chat = take_mix(chat, max_records, category_mix)
    drop_partial_line(cache)
    done = read_answers(cache)
    todo = [r for r in chat if r.record_id not in done]
    # Similar prompt lengths in a batch waste less left padding.
    todo.sort(key=lambda r: lengths[r.record_id])
    if todo:
        with tqdm(total=len(chat), initial=len(chat) - len(todo), desc="regenerate", unit="rec") as bar:
            for items in answer_source(todo):
                _append(cache, items)
                done.update((i["record_id"], i["answer"]) for i in items)
                bar.update(len(items))
    out = []
    for r in chat:
        if done.get(r.record_id):
            messages = first_turn_prompt(r.messages) + [{"role": "assistant", "content": done[r.record_id]}]
            out.append(Record(r.record_id, r.source, r.category, messages=messages))
    return out + [r for r in records if not r.is_chat]
