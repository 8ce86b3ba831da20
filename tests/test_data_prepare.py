"""The prepare stage end to end with the real SmolLM2 tokenizer: files, columns, splits, prompts, DONE."""

import json

import pytest

from eyas.data.config import CorpusConfig, DataConfig
from eyas.stages import run_one
from eyas.data.templates import parent_id
from eyas.recipe import Recipe, load_recipe


def chat_file(path, n, start=0):
    items = [{"id": f"r{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: what is {i} times three?"},
        {"from": "gpt", "value": f"{i} times three is {3 * i}. Multiplying by three adds the number to itself twice."},
        {"from": "human", "value": "Thanks."},
        {"from": "gpt", "value": "You are welcome, happy to help with more arithmetic."}]}
        for i in range(start, n)]
    items.append({"id": "bad-role", "conversations": [{"from": "human", "value": "q"}, {"from": "bing", "value": "a"}]})
    path.write_text(json.dumps(items))
    return path


def recipe_for(tmp_path, corpora, **data):
    return Recipe(output_dir=str(tmp_path / "run"),
                  data=DataConfig(corpora=corpora, **{"validation_fraction": 0.2, "max_length": 256, **data}))


def test_prepare_writes_the_dataset_prompts_stats_and_done(tmp_path):
    from datasets import load_from_disk

    corpora = [CorpusConfig(kind="json", path=str(chat_file(tmp_path / "chat.json", 60))),
               CorpusConfig(kind="stdlib", glob="json/*.py"),
               CorpusConfig(kind="humaneval", max_records=30)]
    recipe = recipe_for(tmp_path, corpora)
    out = run_one("prepare", recipe)
    assert out == recipe.stage_dir("data")
    data = load_from_disk(str(out))
    assert set(data) == {"train", "validation"}
    for split in data.values():
        assert split.column_names == ["input_ids", "loss_mask", "source", "record_id", "category"]
    train, val = data["train"], data["validation"]
    assert set(train["category"]) == {"chat", "code"} and len(val) > 0
    assert all(len(i) == len(m) <= 256 and sum(m) >= 8 for i, m in zip(train["input_ids"], train["loss_mask"]))
    # No record (nor any piece of a document) is in both splits.
    assert not {parent_id(r) for r in train["record_id"]} & {parent_id(r) for r in val["record_id"]}

    stats = json.loads((out / "stats.json").read_text())
    chat = stats["corpora"][0]
    assert chat["read"] == 61 and chat["kept"] == 60 and chat["skipped"] == {"unknown_role": 1}
    humaneval = stats["corpora"][2]
    assert humaneval["kept"] == 30 and humaneval["samples"] == 30 - humaneval["render_skipped"]["too_few_assistant_tokens"]
    assert sum(c["samples"] for c in stats["corpora"]) == len(train) + len(val)
    assert stats["splits"]["train"]["samples"] == len(train)
    assert stats["splits"]["train"]["masked_tokens"] == sum(sum(m) for m in train["loss_mask"])

    prompts = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert {p["record_id"] for p in prompts} <= set(val["record_id"])
    for p in prompts:
        if p["category"] == "chat":
            assert p["messages"][-1]["role"] == "user" and all(m["role"] != "assistant" for m in p["messages"])
        else:
            assert p["prompt"].strip()
    done = json.loads((out / "DONE.json").read_text())
    assert done["samples"] == {"train": len(train), "validation": len(val)}


def test_done_skips_unchanged_inputs_and_redoes_changed_ones(tmp_path):
    path = chat_file(tmp_path / "chat.json", 20)
    recipe = recipe_for(tmp_path, [CorpusConfig(kind="json", path=str(path))])
    out = run_one("prepare", recipe)
    first = json.loads((out / "DONE.json").read_text())
    assert json.loads((run_one("prepare", recipe) / "DONE.json").read_text()) == first  # skipped: same finish time
    chat_file(path, 30)  # the corpus grew
    second = json.loads((run_one("prepare", recipe) / "DONE.json").read_text())
    assert second["input_hash"] != first["input_hash"] and sum(second["samples"].values()) > sum(first["samples"].values())
    recipe.data.max_length = 128  # a setting changed
    assert json.loads((run_one("prepare", recipe) / "DONE.json").read_text())["input_hash"] != second["input_hash"]


def test_records_keep_their_split_when_the_corpus_grows(tmp_path):
    from datasets import load_from_disk

    path = tmp_path / "chat.json"
    recipe = recipe_for(tmp_path, [CorpusConfig(kind="json", path=str(chat_file(path, 40)))])
    before = load_from_disk(str(run_one("prepare", recipe)))
    chat_file(path, 120)
    after = load_from_disk(str(run_one("prepare", recipe)))
    for split in ("train", "validation"):
        assert set(before[split]["record_id"]) <= set(after[split]["record_id"])


def short_items(n):
    return [{"conversations": [{"from": "human", "value": f"short {i}?"},
                               {"from": "gpt", "value": f"A short answer number {i}, long enough to train."}]}
            for i in range(n)]


def test_overflow_drop_and_duplicates_are_counted(tmp_path):
    long = {"conversations": [{"from": "human", "value": "long?"}, {"from": "gpt", "value": "word " * 400}]}
    items = short_items(20)
    path = tmp_path / "c.json"
    path.write_text(json.dumps([long] + items + items[:1]))
    recipe = recipe_for(tmp_path, [CorpusConfig(kind="json", path=str(path))], overflow="drop",
                        validation_fraction=0.3)
    stats = json.loads((run_one("prepare", recipe) / "stats.json").read_text())
    assert stats["render_skipped"] == {"too_long": 1} and stats["corpora"][0]["skipped"] == {"duplicate": 1}
    assert stats["corpora"][0]["render_skipped"] == {"too_long": 1} and stats["corpora"][0]["samples"] == 20
    assert stats["splits"]["train"]["samples"] + stats["splits"]["validation"]["samples"] == 20


@pytest.mark.parametrize("case", ["empty_jsonl", "binary_folder", "all_unusable", "no_validation"])
def test_prepare_refuses_data_that_leaves_nothing_to_train_or_validate_on(tmp_path, case):
    if case == "empty_jsonl":
        (tmp_path / "c.jsonl").write_text("")
        corpus, match = CorpusConfig(kind="jsonl", path=str(tmp_path / "c.jsonl")), r"c.jsonl: no usable records: read 0"
    elif case == "binary_folder":
        (tmp_path / "docs").mkdir()
        for i in range(3):
            (tmp_path / "docs" / f"f{i}.bin").write_bytes(bytes(range(128, 256)) * 4)
        corpus, match = CorpusConfig(kind="text", path=str(tmp_path / "docs")), r"docs: no usable records: read 3, .*not_utf8 3"
    elif case == "all_unusable":  # every answer too short to train on
        (tmp_path / "c.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": f"q{i}"},
                                                                        {"from": "gpt", "value": "ok"}]}
                                                     for i in range(5)]))
        corpus, match = CorpusConfig(kind="json", path=str(tmp_path / "c.json")), r"c.json: no usable records: read 5, kept 5, samples 0 \(too_few_assistant_tokens 5\)"
    else:
        (tmp_path / "c.json").write_text(json.dumps(short_items(10)))
        corpus, match = CorpusConfig(kind="json", path=str(tmp_path / "c.json")), r"the validation split is empty \(10 samples, validation_fraction 0.0\)"
    recipe = recipe_for(tmp_path, [corpus], validation_fraction=0.0 if case == "no_validation" else 0.2)
    with pytest.raises(ValueError, match=match):
        run_one("prepare", recipe)
    assert not (recipe.stage_dir("data") / "DONE.json").exists()


def test_corpus_files_that_cannot_be_read_are_named(tmp_path):
    (tmp_path / "latin1.jsonl").write_bytes(b'{"messages": []}\n{"messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    recipe = recipe_for(tmp_path, [CorpusConfig(kind="jsonl", path=str(tmp_path / "latin1.jsonl"))])
    with pytest.raises(ValueError, match=r"latin1.jsonl: line 2: not UTF-8 \(byte 0xe9"):
        run_one("prepare", recipe)
    recipe = recipe_for(tmp_path, [CorpusConfig(kind="sharegpt", path=str(tmp_path))])
    with pytest.raises(ValueError, match=r"corpus 'sharegpt': .* is a folder, and this kind reads one file"):
        run_one("prepare", recipe)


def test_real_sharegpt_sample_from_a_recipe_file(tmp_path):
    from datasets import load_from_disk

    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(f"output_dir: {tmp_path / 'run'}\ndata:\n  corpora:\n    - kind: sharegpt\n"
                           f"      max_records: 120\n  max_length: 256\n  validation_fraction: 0.1\n")
    out = run_one("prepare", load_recipe(str(recipe_file)))
    stats = json.loads((out / "stats.json").read_text())
    assert stats["corpora"][0]["read"] == 17671 and stats["corpora"][0]["kept"] == 120
    assert stats["corpora"][0]["skipped"]["truncated_record"] == 1
    data = load_from_disk(str(out))
    assert 100 <= len(data["train"]) + len(data["validation"]) <= 120
    assert stats["splits"]["train"]["masked_tokens"] > 0.5 * stats["splits"]["train"]["tokens"]


def test_bad_corpus_fails_before_writing_done(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "text": "q"}]}]))
    recipe = recipe_for(tmp_path, [CorpusConfig(kind="json", path=str(path))])
    with pytest.raises(ValueError, match=r"bad.json: record 0: field 'conversations\[0\]': missing field 'value'"):
        run_one("prepare", recipe)
    assert not (recipe.stage_dir("data") / "DONE.json").exists()
