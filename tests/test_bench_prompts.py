"""Prompts files: what is accepted, how bad lines are reported, which prompts are measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eyas.eval.bench import BenchPrompt, PromptFileError, encode_prompt, read_prompts, select_prompts

GOOD = [
    {"messages": [{"role": "user", "content": "Name three rivers."}], "category": "chat"},
    {"prompt": "def add(a, b):\n", "category": "code"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_reads_chat_and_completion_prompts_with_line_numbers_and_default_category(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [json.dumps(GOOD[0]), "", json.dumps(GOOD[1]), json.dumps(GOOD[2])])
    prompts = read_prompts(path)
    assert [p.line for p in prompts] == [1, 3, 4]
    assert [p.category for p in prompts] == ["chat", "code", "uncategorized"]
    assert prompts[0].messages == GOOD[0]["messages"] and prompts[0].prompt is None
    assert prompts[1].prompt == "def add(a, b):\n" and prompts[1].messages is None


@pytest.mark.parametrize("line, field", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"category": "chat"}), "'prompt' (string) or 'messages'"),
    (json.dumps({"prompt": "a", "messages": []}), "exactly one of"),
    (json.dumps({"prompt": 3}), "field 'prompt'"),
    (json.dumps({"prompt": "   "}), "field 'prompt'"),
    (json.dumps({"messages": "hello"}), "field 'messages'"),
    (json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 5}]}),
     "field 'messages[1].content'"),
    (json.dumps({"messages": [{"content": "a"}]}), "field 'messages[0].role'"),
    (json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}),
     "field 'messages[1].role' is 'assistant'"),
    (json.dumps({"prompt": "a", "category": 7}), "field 'category'"),
])
def test_bad_line_error_names_file_line_and_field(tmp_path, line, field):
    path = write_lines(tmp_path / "prompts.jsonl", [json.dumps(GOOD[0]), line])
    with pytest.raises(PromptFileError) as err:
        read_prompts(path)
    assert f"{path}:2:" in str(err.value)
    assert field in str(err.value)


def test_missing_and_empty_files_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="eyas prepare"):
        read_prompts(tmp_path / "absent.jsonl")
    with pytest.raises(PromptFileError, match="no prompts"):
        read_prompts(write_lines(tmp_path / "empty.jsonl", ["", "  "]))


def test_selection_covers_every_category_in_file_order():
    prompts = [BenchPrompt(line=i, category="chat" if i <= 6 else "code", prompt="x") for i in range(1, 10)]
    chosen = select_prompts(prompts, 4)
    assert [p.line for p in chosen] == [1, 2, 7, 8]
    assert len(select_prompts(prompts, 100)) == 9


@pytest.fixture(scope="module")
def smollm_tokenizer():
    from eyas.data.config import TargetConfig
    from eyas.data.targets import Target

    return Target.resolve(TargetConfig()).tokenizer


def test_chat_prompts_end_with_the_assistant_generation_prompt(smollm_tokenizer):
    ids = encode_prompt(smollm_tokenizer, BenchPrompt(line=1, category="chat", messages=GOOD[0]["messages"]))
    assert ids.shape[0] == 1 and ids.dtype.is_floating_point is False
    text = smollm_tokenizer.decode(ids[0])
    assert "Name three rivers." in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = encode_prompt(smollm_tokenizer, BenchPrompt(line=2, category="code", prompt="def add(a, b):\n"))
    assert smollm_tokenizer.decode(plain[0]) == "def add(a, b):\n"
