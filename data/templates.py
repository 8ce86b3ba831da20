"""Render records with the target's own chat template and mark the tokens the head must learn.

The assistant mask is found without knowing the template: for assistant turn i we render the
conversation up to turn i with the generation prompt (where the answer starts) and up to turn i
inclusive (where the turn ends), in characters. The mask then covers the answer's tokens and the
turn's tokens up to and including the first special token after the answer: the end-of-turn token
the model must emit (<|im_end|>, <|eot_id|>, <end_of_turn>, </s>), but not the newline some
templates put after it. A turn end with no special token is masked whole.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tqdm import tqdm

from eyas.data.corpora import Record


class TemplateError(ValueError):
    """The tokenizer cannot render conversations in a way we can mask."""


@dataclass
class Sample:
    record_id: str
    source: str
    category: str
    input_ids: list[int]
    loss_mask: list[int]


def parent_id(sample_id: str) -> str:
    """The record a sample came from: pieces of a document are `<record id>#<piece>`, and share its split."""
    return sample_id.split("#", 1)[0]


def render_text(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    return ids


def check_tokenizer(tokenizer) -> None:
    if not getattr(tokenizer, "is_fast", False):
        raise TemplateError(f"{type(tokenizer).__name__}: a fast tokenizer is needed (character offsets for the mask)")
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError(f"{getattr(tokenizer, 'name_or_path', 'the tokenizer')}: has no chat template; "
                            "chat corpora need one (use a text/code corpus for a base model)")


def assistant_turn_spans(tokenizer, messages: list[dict], full_text: str,
                         char_limit: int | None = None) -> list[tuple[int, int, int]]:
    """(turn start, answer end, turn end) in characters of `full_text`, for each assistant turn.

    Turns that start at or after `char_limit` are not rendered (they would be truncated anyway).
    """
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start_text = render_text(tokenizer, messages[:i], add_generation_prompt=True)
        if char_limit is not None and len(start_text) >= char_limit:
            break
        end_text = render_text(tokenizer, messages[:i + 1])
        if not (full_text.startswith(start_text) and full_text.startswith(end_text)):
            raise TemplateError("the chat template renders a conversation prefix differently from the whole "
                                f"conversation (assistant turn {i}); its assistant tokens cannot be located")
        start, end = len(start_text), len(end_text)
        found = full_text.find(message["content"], start, end)
        answer_end = found + len(message["content"]) if found >= 0 else start
        spans.append((start, answer_end, end))
    return spans


def mask_from_spans(offsets: list[tuple[int, int]], ids: list[int], spans: list[tuple[int, int, int]],
                    specials: set[int]) -> list[int]:
    mask = [0] * len(ids)
    t = 0
    for start, answer_end, end in spans:
        while t < len(ids) and offsets[t][0] < start:
            t += 1
        while t < len(ids) and offsets[t][0] < end:
            mask[t] = 1
            t += 1
            if ids[t - 1] in specials and offsets[t - 1][0] >= answer_end:
                break  # the end-of-turn token; what follows belongs to the next turn
    return mask


CHARS_PER_TOKEN_CAP = 6  # characters tokenised per wanted token; natural text and code average ~4
SAFETY_TOKENS = 16  # tokens past the cut that may merge differently; the kept ones lie before them


def tokenize_head(tokenizer, texts: list[str], max_length: int, add_special_tokens: bool = False):
    """(ids, offsets) of each text, exact over its first max_length + 1 tokens (all of them if shorter).

    Long conversations are tokenised from a prefix only: a cut far past the last kept token does not
    change the tokens before it. When the prefix yields too few tokens to be sure, the whole text is.
    """
    if not texts:
        return []
    budget = (max_length + SAFETY_TOKENS) * CHARS_PER_TOKEN_CAP
    heads = [t[:budget] for t in texts]
    enc = tokenizer(heads, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    out = []
    for text, head, ids, offsets in zip(texts, heads, enc["input_ids"], enc["offset_mapping"]):
        if len(head) < len(text) and len(ids) <= max_length + SAFETY_TOKENS:
            full = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
            ids, offsets = full["input_ids"], full["offset_mapping"]
        out.append((ids, offsets))
    return out


def _char_limit(offsets: list[tuple[int, int]], max_length: int) -> int | None:
    return offsets[max_length][0] if len(offsets) > max_length else None


def render_chat(tokenizer, records: list[Record], max_length: int, overflow: str, min_assistant_tokens: int,
                skipped: Counter) -> list[Sample]:
    """Samples for chat records: template text, tokenised in one batch, masked turn by turn."""
    if not records:
        return []
    check_tokenizer(tokenizer)
    specials = special_ids(tokenizer)
    texts, kept = [], []
    for r in records:
        try:
            texts.append(render_text(tokenizer, r.messages))
            kept.append(r)
        except Exception:  # jinja raise_exception, e.g. roles that must alternate
            skipped["template_rejected"] += 1
    samples = []
    for r, text, (ids, offsets) in zip(kept, texts, tokenize_head(tokenizer, texts, max_length)):
        if len(ids) > max_length and overflow == "drop":
            skipped["too_long"] += 1
            continue
        spans = assistant_turn_spans(tokenizer, r.messages, text, _char_limit(offsets, max_length))
        mask = mask_from_spans(offsets, ids, spans, specials)
        if len(ids) > max_length:
            skipped["truncated (kept)"] += 1
            ids, mask = ids[:max_length], mask[:max_length]
        if sum(mask) < min_assistant_tokens:
            skipped["too_few_assistant_tokens"] += 1
            continue
        samples.append(Sample(r.record_id, r.source, r.category, list(ids), mask))
    return samples


def render_completion(tokenizer, records: list[Record], max_length: int, overflow: str, min_assistant_tokens: int,
                      skipped: Counter) -> list[Sample]:
    """Samples for completion-style records, without a chat template.

    A record with a prompt (HumanEval) is one sample, its prompt unmasked. A whole document (no
    prompt) is cut into max_length pieces, each its own sample; the first token of a piece has no
    context, so it is not a target.
    """
    texts = [r.prompt + r.completion for r in records]
    enc = tokenizer(texts, add_special_tokens=True, return_offsets_mapping=True) if texts else {"input_ids": []}
    samples = []
    for r, ids, offsets in zip(records, enc["input_ids"], enc.get("offset_mapping", [])):
        if r.prompt:
            if len(ids) > max_length and overflow == "drop":
                skipped["too_long"] += 1
                continue
            # A token that straddles the boundary holds completion text, so it is a target too.
            mask = [int(b > len(r.prompt)) for a, b in offsets]
            if len(ids) > max_length:
                skipped["truncated (kept)"] += 1
            pieces = [(r.record_id, ids[:max_length], mask[:max_length])]
        else:
            pieces = [(f"{r.record_id}#{k}", ids[s:s + max_length], [0] + [1] * (len(ids[s:s + max_length]) - 1))
                      for k, s in enumerate(range(0, len(ids), max_length))]
        for record_id, piece_ids, piece_mask in pieces:
            if sum(piece_mask) < min_assistant_tokens:
                skipped["too_few_assistant_tokens"] += 1
                continue
            samples.append(Sample(record_id, r.source, r.category, list(piece_ids), piece_mask))
    return samples


def render_records(tokenizer, records: list[Record], max_length: int, overflow: str = "truncate",
                   min_assistant_tokens: int = 1, skipped: Counter | None = None, block: int = 256) -> list[Sample]:
    """Samples for chat and completion records, tokenised in blocks (batch calls) under a progress bar."""
    skipped = skipped if skipped is not None else Counter()
    samples = []
    with tqdm(total=len(records), desc="render", unit="rec", disable=len(records) <= block) as bar:
        for start in range(0, len(records), block):
            part = records[start:start + block]
            chat = [r for r in part if r.is_chat]
            completion = [r for r in part if not r.is_chat]
            samples += render_chat(tokenizer, chat, max_length, overflow, min_assistant_tokens, skipped)
            samples += render_completion(tokenizer, completion, max_length, overflow, min_assistant_tokens, skipped)
            bar.update(len(part))
    return samples
