"""Corpus readers: tolerant ShareGPT reading, clear errors on bad structure, skip counts, split stability."""

import gzip
import json

import pytest

from eyas.data.config import CorpusConfig, DataConfig
from eyas.data.corpora import (CorpusError, CorpusStats, Record, content_hash, dedup, read_corpus, select,
                               split_of)


def turns(*pairs):
    return [{"from": r, "value": v} for r, v in pairs]


def sharegpt(tmp_path, records, name="corpus.json", tail=""):
    path = tmp_path / name
    path.write_text(json.dumps(records, indent=2)[:-1] + tail if tail else json.dumps(records, indent=2))
    return path


GOOD = {"id": "a", "conversations": turns(("human", "What is 2+2?"), ("gpt", "4"))}


def test_real_sharegpt_file_is_read_up_to_its_cut_off_tail():
    records, stats = read_corpus(CorpusConfig(kind="sharegpt"))
    assert stats.read == 17671  # whole records before the file is cut off
    assert stats.skipped["truncated_record"] == 1 and "cut off" in stats.examples["truncated_record"][0]
    assert stats.skipped["unknown_role"] == 4 and "'bing'" in stats.examples["unknown_role"][0]
    assert stats.skipped["no_assistant_turn"] > 0 and stats.skipped["empty_turn"] > 0
    assert len(records) == stats.read - sum(v for k, v in stats.skipped.items() if k != "truncated_record")
    assert all(m["role"] in ("system", "user", "assistant") for r in records for m in r.messages)
    assert all(any(m["role"] == "assistant" for m in r.messages) for r in records)


def test_truncated_tail_keeps_every_whole_record(tmp_path):
    items = [GOOD, {"id": "b", "conversations": turns(("human", "hi"), ("gpt", "hello there"))}]
    path = tmp_path / "cut.json"
    text = json.dumps(items + [{"id": "c", "conversations": turns(("human", "x"), ("gpt", "y"))}], indent=2)
    path.write_text(text[:text.rindex('"y"') + 2])  # cut inside the last record's last string
    records, stats = read_corpus(CorpusConfig(kind="json", path=str(path)))
    assert [r.messages[1]["content"] for r in records] == ["4", "hello there"]
    assert stats.read == 2 and stats.skipped["truncated_record"] == 1


def test_roles_are_normalised_and_leading_answers_dropped(tmp_path):
    items = [{"conversations": turns(("system", "Be nice."), ("gpt", "orphan reply"), ("human", "hi"),
                                     ("chatgpt", "hello"), ("user", "and?"), ("bard", "done"))},
             {"messages": [{"role": "user", "content": "q"}, {"role": "model", "content": "a"}]}]
    records, stats = read_corpus(CorpusConfig(kind="json", path=str(sharegpt(tmp_path, items))))
    assert [m["role"] for m in records[0].messages] == ["system", "user", "assistant", "user", "assistant"]
    assert records[0].messages[1]["content"] == "hi"
    assert [m["role"] for m in records[1].messages] == ["user", "assistant"]
    assert stats.repaired["dropped_leading_assistant_turns"] == 1


def test_unusable_records_are_skipped_and_counted_per_reason(tmp_path):
    items = [GOOD,
             {"id": "role", "conversations": turns(("human", "q"), ("bing", "a"))},
             {"id": "empty", "conversations": turns(("human", "q"), ("gpt", "   "))},
             {"id": "noans", "conversations": turns(("human", "q"))},
             {"id": "none", "conversations": []},
             dict(GOOD, id="dup")]
    path = sharegpt(tmp_path, items)
    records, stats = read_corpus(CorpusConfig(kind="json", path=str(path)))
    assert stats.read == 6 and len(records) == 2
    assert stats.skipped == {"unknown_role": 1, "empty_turn": 1, "no_assistant_turn": 2}
    assert "record 1 (id role)" in stats.examples["unknown_role"][0] and str(path) in stats.examples["unknown_role"][0]
    assert "turn 1" in stats.examples["empty_turn"][0]
    kept = dedup(records, stats, set())
    assert len(kept) == 1 and stats.skipped["duplicate"] == 1


@pytest.mark.parametrize("item,field", [
    ("just a string", "expected an object"),
    ({"id": "x", "turns": []}, "missing field 'conversations'"),
    ({"id": "x", "conversations": "hello"}, "field 'conversations' must be a list"),
    ({"id": "x", "conversations": [{"from": "human"}]}, "field 'conversations[0]': missing field 'value'"),
    ({"id": "x", "conversations": [{"value": "hi"}]}, "field 'conversations[0]': missing field 'from'"),
    ({"id": "x", "conversations": [{"from": "human", "value": 3}]}, "conversations[0]'.value/content"),
    ({"id": "x", "messages": [{"role": "user", "content": ["a"]}]}, "messages[0]'.value/content"),
    ({"id": "x", "conversations": ["hi"]}, "field 'conversations[0]': expected an object"),
])
def test_bad_structure_is_an_error_naming_file_record_and_field(tmp_path, item, field):
    path = sharegpt(tmp_path, [GOOD, item])
    with pytest.raises(CorpusError) as err:
        read_corpus(CorpusConfig(kind="json", path=str(path)))
    assert str(path) in str(err.value) and "record 1" in str(err.value) and field in str(err.value)


def test_invalid_json_mid_file_is_an_error_not_a_truncation(tmp_path):
    path = tmp_path / "bad.json"
    good = json.dumps(GOOD)
    path.write_text(f"[{good}, {{\"id\": \"b\", \"conversations\": [oops]}}, {good}]")
    with pytest.raises(CorpusError, match=r"bad.json: record 1: invalid JSON"):
        read_corpus(CorpusConfig(kind="json", path=str(path)))


def test_not_an_array_is_an_error(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text(json.dumps(GOOD))
    with pytest.raises(CorpusError, match="expected a JSON array"):
        read_corpus(CorpusConfig(kind="json", path=str(path)))


def test_jsonl_messages_and_bad_line(tmp_path):
    path = tmp_path / "c.jsonl"
    line = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    path.write_text(line + "\n\n" + line.replace('"a"', '"b"') + "\n")
    records, stats = read_corpus(CorpusConfig(kind="jsonl", path=str(path)))
    assert len(records) == 2 and stats.read == 2
    path.write_text(line + "\n{not json\n")
    with pytest.raises(CorpusError, match=r"c.jsonl: line 2: invalid JSON"):
        read_corpus(CorpusConfig(kind="jsonl", path=str(path)))
    path.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(CorpusError, match=r"c.jsonl: line 1: field 'messages\[0\]': missing field 'value'"):
        read_corpus(CorpusConfig(kind="jsonl", path=str(path)))


def test_hf_datasets_directory(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = {"messages": [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
                         for i in range(3)]}
    DatasetDict({"train": Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "hf"))
    records, stats = read_corpus(CorpusConfig(kind="hf", path=str(tmp_path / "hf")))
    assert [r.messages[1]["content"] for r in records] == ["a0", "a1", "a2"] and stats.read == 3
    Dataset.from_dict({"text": ["x"]}).save_to_disk(str(tmp_path / "plain"))
    with pytest.raises(CorpusError, match="plain: split train: missing column 'conversations'"):
        read_corpus(CorpusConfig(kind="hf", path=str(tmp_path / "plain")))


def test_real_chitchat_alternates_speakers():
    records, stats = read_corpus(CorpusConfig(kind="chitchat"))
    assert stats.read == 7168 and len(records) + sum(stats.skipped.values()) == 7168
    assert len(records) > 3500 and set(stats.skipped) <= {"empty_turn", "no_assistant_turn"}
    assert all(r.messages[-1]["role"] == "assistant" for r in records)
    first = records[0].messages
    assert first[0]["role"] == "user" and first[1]["role"] == "assistant"
    assert first[0]["content"] == "Hello\nHow are you doing today?"


def test_real_humaneval_and_stdlib_are_completion_style():
    records, stats = read_corpus(CorpusConfig(kind="humaneval"))
    assert len(records) == 164 and all(r.category == "code" and not r.is_chat for r in records)
    assert records[0].prompt.startswith("from typing import List") and "return" in records[0].completion
    records, stats = read_corpus(CorpusConfig(kind="stdlib", glob="json/*.py"))
    names = sorted(r.source.rsplit("/", 1)[-1] for r in records)
    assert "decoder.py" in names and "__init__.py" in names and all(r.source.endswith(".py") for r in records)
    assert all(r.completion and not r.prompt for r in records)


def test_text_directory_skips_empty_and_binary(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("A real document.")
    (tmp_path / "docs" / "b.txt").write_text("  \n")
    (tmp_path / "docs" / "c.txt").write_bytes(b"\xff\xfe\x00bad")
    records, stats = read_corpus(CorpusConfig(kind="text", path=str(tmp_path / "docs")))
    assert [r.completion for r in records] == ["A real document."]
    assert stats.skipped == {"empty_document": 1, "not_utf8": 1} and stats.examples["not_utf8"][0].endswith("c.txt")


def test_missing_path_and_unknown_kind_are_clear():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_corpus(CorpusConfig(kind="json", path="/nonexistent/file.json"))
    with pytest.raises(ValueError, match="unknown corpus kind 'csv'"):
        read_corpus(CorpusConfig(kind="csv", path="/tmp"))
    with pytest.raises(ValueError, match="needs a path"):
        read_corpus(CorpusConfig(kind="jsonl"))


def test_data_config_builds_corpora_from_mappings():
    from eyas.configbase import from_dict

    cfg = from_dict(DataConfig, {"corpora": [{"kind": "stdlib", "max_records": 5}]}, "data")
    assert isinstance(cfg.corpora[0], CorpusConfig) and cfg.corpora[0].max_records == 5
    with pytest.raises(ValueError, match=r"data.corpora\[0\].pth"):
        from_dict(DataConfig, {"corpora": [{"kind": "json", "pth": "x"}]}, "data")
    with pytest.raises(ValueError, match="overflow"):
        from_dict(DataConfig, {"overflow": "wrap"}, "data")


def _chat(i):
    return Record("", "s", "chat", messages=[{"role": "user", "content": f"question {i}"},
                                             {"role": "assistant", "content": f"answer {i}"}])


def test_split_is_stable_when_the_corpus_grows():
    small = [_chat(i) for i in range(2000)]
    big = [_chat(i) for i in range(6000)]
    for r in small + big:
        r.record_id = content_hash(r)[:20]
    before = {r.record_id: split_of(r.record_id, 0.1) for r in small}
    after = {r.record_id: split_of(r.record_id, 0.1) for r in big}
    assert all(after[k] == v for k, v in before.items())
    share = sum(v == "validation" for v in after.values()) / len(after)
    assert 0.08 < share < 0.12
    assert split_of(big[0].record_id, 0.0) == "train"


def test_select_is_deterministic_and_respects_weight_and_cap():
    records = [_chat(i) for i in range(100)]
    for r in records:
        r.record_id = content_hash(r)[:20]
    half = select(records, 0.5, None, seed=0)
    assert len(half) == 50 and half == select(records, 0.5, None, seed=0)
    assert half != select(records, 0.5, None, seed=1)
    assert len(select(records, 1.0, 7, seed=0)) == 7
    with pytest.raises(ValueError, match="weight"):
        select(records, 1.5, None, 0)


def test_max_turns_keeps_first_answers(tmp_path):
    items = [{"conversations": turns(("human", "a"), ("gpt", "b"), ("human", "c"), ("gpt", "d"))}]
    records, _ = read_corpus(CorpusConfig(kind="json", path=str(sharegpt(tmp_path, items))), max_turns=1)
    assert [m["content"] for m in records[0].messages] == ["a", "b"]


def test_gzip_jsonl(tmp_path):
    path = tmp_path / "c.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write(json.dumps(GOOD) + "\n")
    records, _ = read_corpus(CorpusConfig(kind="jsonl", path=str(path)))
    assert records[0].messages[1]["content"] == "4"
    assert isinstance(CorpusStats("x").to_dict()["skipped"], dict)


def test_bad_chitchat_and_humaneval_records_are_named(tmp_path):
    path = tmp_path / "chit.json"
    path.write_text(json.dumps({"c1": {"messages": [[{"text": "hi"}], [{"sender": "x"}]]}}))
    with pytest.raises(CorpusError, match=r"chit.json: record c1: field 'messages\[1\]'"):
        read_corpus(CorpusConfig(kind="chitchat", path=str(path)))
    path = tmp_path / "he.jsonl"
    path.write_text(json.dumps({"task_id": "t", "prompt": "def f():\n"}) + "\n")
    with pytest.raises(CorpusError, match=r"he.jsonl: line 1: missing field 'canonical_solution'"):
        read_corpus(CorpusConfig(kind="humaneval", path=str(path)))


def test_requests_from_documents_share_their_source_split(tmp_path):
    """HumanEval prompts and ShareGPT answers as chat requests: labelled, length-filtered, split like the source."""
    from eyas.data.corpora import read_corpus

    template = "Complete this Python function.\n\n```python\n{text}```"
    base, _ = read_corpus(CorpusConfig(kind="humaneval"))
    reqs, stats = read_corpus(CorpusConfig(kind="humaneval", request=template))
    assert len(reqs) == len(base) == 164 and all(r.is_chat and len(r.messages) == 1 for r in reqs)
    assert reqs[0].messages[0]["content"] == template.replace("{text}", base[0].prompt.strip())
    assert {r.category for r in reqs} == {"code"}  # auto: labelled by the request's own text
    for src, req in zip(base, reqs):
        assert req.record_id.startswith(src.record_id + "~")
        assert split_of(req.record_id, 0.3) == split_of(src.record_id, 0.3)
    assert len({split_of(r.record_id, 0.3) for r in reqs}) == 2

    path = tmp_path / "chat.json"
    answers = ["short", "a medium answer " * 5, "x" * 500]
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": a}]}
                                for i, a in enumerate(answers)]))
    summ, stats = read_corpus(CorpusConfig(kind="json", path=str(path), request="Summarize this.\n\n{text}",
                                           request_chars=[20, 200]))
    assert [r.messages[0]["content"] for r in summ] == ["Summarize this.\n\n" + answers[1].strip()]
    assert summ[0].category == "summarization" and stats.skipped["request_text_length"] == 2
    other, _ = read_corpus(CorpusConfig(kind="json", path=str(path), request="Explain: {text}", category="chat"))
    assert {r.category for r in other} == {"chat"} and other[0].record_id != summ[0].record_id
