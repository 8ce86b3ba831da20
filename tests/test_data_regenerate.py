"""Regeneration with a tiny random-weight Llama and the real SmolLM2 tokenizer: batching, resume, output;
the same through the serving engine (vLLM) when it is installed."""

import json
from collections import Counter

import pytest
import torch

from eyas.data import regenerate as regen
from eyas.data.config import TargetConfig
from eyas.data.corpora import Record
from eyas.data.engine import engine_missing
from eyas.data.targets import Target


@pytest.fixture(scope="module")
def tokenizer():
    return Target.resolve(TargetConfig()).tokenizer


@pytest.fixture(scope="module")
def tiny_model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config).eval()


def records(n):
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": "Say something " + "please " * (i % 4) + f"about {i}."},
                {"role": "assistant", "content": "original answer"},
                {"role": "user", "content": "and more?"}, {"role": "assistant", "content": "second answer"}]
        out.append(Record(f"id{i}", "s", "chat", messages=msgs))
    return out + [Record("code0", "s", "code", completion="print('hi')\n")]


def test_left_padded_batch_matches_one_by_one_greedy(tiny_model, tokenizer):
    prompts = [regen.first_turn_prompt(r.messages) for r in records(4)[:4]]
    batched = regen.generate_answers(tiny_model, tokenizer, prompts, max_new_tokens=6)
    single = [regen.generate_answers(tiny_model, tokenizer, [p], max_new_tokens=6)[0] for p in prompts]
    assert batched == single
    assert all(finish in ("eos", "length") for _, finish in batched)
    assert tokenizer.padding_side == "right"  # restored


def test_regenerate_resumes_after_a_kill(tiny_model, tokenizer, tmp_path, monkeypatch):
    cache = tmp_path / "regenerated.jsonl"
    calls = []
    real = regen.generate_answers

    def dies_after_two_batches(model, tok, prompts, *args):
        if len(calls) == 2:
            raise KeyboardInterrupt  # the kill
        calls.append(len(prompts))
        return real(model, tok, prompts, *args)

    def hf_source():  # HF generate, 4 new tokens, batches of 2
        return regen.transformers_answers(tiny_model, tokenizer, 4, batch_size=2)

    monkeypatch.setattr(regen, "generate_answers", dies_after_two_batches)
    with pytest.raises(KeyboardInterrupt):
        regen.regenerate(hf_source(), tokenizer, records(7), cache)
    assert len(cache.read_text().splitlines()) == 4
    with open(cache, "a") as fh:
        fh.write('{"record_id": "id6", "ans')  # a line cut mid-write by the kill

    calls.clear()
    monkeypatch.setattr(regen, "generate_answers", lambda *a: calls.append(len(a[2])) or real(*a))
    out = regen.regenerate(hf_source(), tokenizer, records(7), cache)
    assert calls == [2, 1]  # only the 3 records not done before the kill
    done = regen.read_answers(cache)
    assert sorted(done) == [f"id{i}" for i in range(7)]
    chat = [r for r in out if r.is_chat]
    assert len(chat) == 7 and out[-1].record_id == "code0" and not out[-1].is_chat
    for r in chat:
        # First turn only: the prompt, then the target's answer replacing the original.
        assert [m["role"] for m in r.messages] == ["user", "assistant"]
        assert r.messages[1]["content"] == done[r.record_id] != "original answer"

    calls.clear()
    regen.regenerate(hf_source(), tokenizer, records(7), cache)
    assert calls == []  # all done: nothing generated


def test_max_records_limits_the_chat_records(tiny_model, tokenizer, tmp_path):
    out = regen.regenerate(regen.transformers_answers(tiny_model, tokenizer, 3, batch_size=4), tokenizer, records(5),
                           tmp_path / "r.jsonl", max_records=2)
    assert [r.record_id for r in out] == ["id0", "id1", "code0"]
    lines = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert sorted(item["record_id"] for item in lines) == ["id0", "id1"]


@pytest.mark.parametrize("max_prompt_tokens", [None, "shortest"])
def test_prepare_with_regeneration_uses_the_targets_answers(tiny_model, tokenizer, tmp_path, max_prompt_tokens):
    """The prepare stage end to end on a tiny random target saved as a local model directory; with
    regenerate_max_prompt_tokens only the prompts that short are answered (and kept)."""
    from datasets import load_from_disk

    from eyas.data.config import CorpusConfig, DataConfig
    from eyas.stages import run_one
    from eyas.recipe import Recipe

    target = tmp_path / "tiny-target"
    tiny_model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    items = [{"conversations": [{"from": "human", "value": f"Question {i}?" + " Really?" * i},
                                {"from": "gpt", "value": "An original answer that is long enough."},
                                {"from": "human", "value": "More?"}, {"from": "gpt", "value": "Later turn."}]}
             for i in range(5)]
    (tmp_path / "chat.json").write_text(json.dumps(items))
    recipe = Recipe(output_dir=str(tmp_path / "run"))
    recipe.target.name_or_path = str(target)
    recipe.data = DataConfig(corpora=[CorpusConfig(kind="json", path=str(tmp_path / "chat.json"))], regenerate=True,
                             regenerate_max_new_tokens=10, regenerate_batch_size=2, validation_fraction=0.5,
                             min_assistant_tokens=1)
    expected = 5
    if max_prompt_tokens == "shortest":
        shortest = regen.prompt_lengths(tokenizer, [Record("q", "s", "chat", messages=[
            {"role": "user", "content": "Question 0?"}, {"role": "assistant", "content": "a"}])])[0]
        recipe.data.regenerate_max_prompt_tokens = shortest + 2  # "Question 0?" and "Question 1? Really?"
        expected = 2
    out = run_one("prepare", recipe)
    [log] = out.glob("regenerated-*.jsonl")
    answers = regen.read_answers(log)
    assert len(answers) == expected
    data = load_from_disk(str(out))
    assert len(data["train"]) + len(data["validation"]) == expected
    rows = [row for split in data.values() for row in split]
    for ids, mask, rid in ((r["input_ids"], r["loss_mask"], r["record_id"]) for r in rows):
        text = tokenizer.decode(ids)
        assert "original answer" not in text and "Later turn" not in text
        masked = tokenizer.decode([t for t, m in zip(ids, mask) if m])
        assert masked.startswith(answers[rid][:5])


def test_regeneration_log_depends_on_the_generation_settings(tmp_path):
    from eyas.data.config import DataConfig
    from eyas.data.prepare import regeneration_log

    target = Target.resolve(TargetConfig())
    data = DataConfig()
    first = regeneration_log(data, target, tmp_path)
    assert regeneration_log(data, target, tmp_path) == first
    data.regenerate_max_new_tokens = 32
    assert regeneration_log(data, target, tmp_path) != first
    data.regenerate_max_new_tokens = DataConfig().regenerate_max_new_tokens
    target.cfg.dtype = "bfloat16"  # another target setting: other answers
    assert regeneration_log(data, target, tmp_path) != first


def test_prompts_too_long_for_max_length_are_not_regenerated(tiny_model, tokenizer, tmp_path):
    lengths = regen.prompt_lengths(tokenizer, records(4)[:4])
    limit = sorted(lengths)[1]  # two prompts fit
    out = regen.regenerate(regen.transformers_answers(tiny_model, tokenizer, 2, batch_size=4), tokenizer, records(4),
                           tmp_path / "r.jsonl", max_prompt_tokens=limit)
    kept = [r.record_id for r in out if r.is_chat]
    assert kept == [f"id{i}" for i, n in enumerate(lengths) if n <= limit] and len(kept) == 2


@pytest.mark.skipif(engine_missing() is not None, reason="vLLM is not installed (EYAS_ENGINE=none)")
def test_prepare_regenerates_through_the_engine_like_hf_generate(tokenizer, tmp_path):
    """data.regenerate_engine=vllm: the prepare stage starts vLLM on the tiny target, answers every prompt
    through it (same greedy answers as HF generate, the same log format), stops it, and a rerun with the log
    complete starts no server at all."""
    from eyas.data.config import CorpusConfig, DataConfig
    from eyas.recipe import Recipe
    from eyas.stages import run_one

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # head_dim 64: vLLM's CPU attention has no kernel for the smaller ones
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    tiny_model = LlamaForCausalLM(config).eval()
    target = tmp_path / "tiny-target"
    tiny_model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    items = [{"conversations": [{"from": "human", "value": f"Question {i}?" + " Really?" * i},
                                {"from": "gpt", "value": "An original answer that is long enough."}]}
             for i in range(6)]
    (tmp_path / "chat.json").write_text(json.dumps(items))
    recipe = Recipe(output_dir=str(tmp_path / "run"))
    recipe.target.name_or_path = str(target)
    recipe.data = DataConfig(corpora=[CorpusConfig(kind="json", path=str(tmp_path / "chat.json"))], regenerate=True,
                             regenerate_engine="vllm", regenerate_concurrency=4, regenerate_max_new_tokens=8,
                             validation_fraction=0.5, min_assistant_tokens=1)
    out = run_one("prepare", recipe)
    [log] = out.glob("regenerated-*.jsonl")
    answers = regen.read_answers(log)
    assert len(answers) == 6 and (out / "vllm-regenerate.log").is_file()

    prompts = [[{"role": "user", "content": it["conversations"][0]["value"]}] for it in items]
    expected = [a for a, _ in regen.generate_answers(tiny_model, tokenizer, prompts, max_new_tokens=8)]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(row["finish"] in ("eos", "length") for row in rows)
    # float32 on both sides; another kernel may flip a rare near tie, so most (not all) answers must agree
    same = sum((Counter(answers.values()) & Counter(expected)).values())
    assert same >= 5, (sorted(answers.values()), sorted(expected))

    (out / "DONE.json").unlink()  # force prepare to run again: every answer is in the log
    (out / "vllm-regenerate.log").unlink()
    run_one("prepare", recipe)
    assert not (out / "vllm-regenerate.log").exists()  # no server started


@pytest.mark.skipif(engine_missing() is not None, reason="vLLM is not installed (EYAS_ENGINE=none)")
def test_an_engine_that_fails_mid_run_gives_one_line_with_its_reason(tiny_model, tokenizer, tmp_path):
    """The tiny head_dim-8 target starts in vLLM but its CPU attention refuses the first step: the error's
    first line names the engine's own reason and the log; the server is stopped; the log file is kept."""
    from eyas.data.engine import EngineError, VllmServer

    target = tmp_path / "tiny-target"
    tiny_model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    servers = []

    def start_server():
        servers.append(VllmServer(target, tmp_path, max_model_len=128, log_name="vllm-regenerate.log"))
        return servers[-1]

    source = regen.engine_answers(start_server, tokenizer, max_new_tokens=4, concurrency=2)
    with pytest.raises(EngineError) as err:
        regen.regenerate(source, tokenizer, records(3), tmp_path / "r.jsonl")
    first = str(err.value).splitlines()[0]
    assert "a regeneration request failed" in first and "head_dim=8" in first and "vllm-regenerate.log" in first
    assert servers[0].proc is None  # stopped
    assert not (tmp_path / "r.jsonl").exists() or regen.read_answers(tmp_path / "r.jsonl") == {}


def categorised(counts: dict[str, int]) -> list[Record]:
    out = []
    for cat, n in counts.items():
        out += [Record(f"{cat}{i}", "s", cat, messages=[{"role": "user", "content": f"{cat} {i}"}]) for i in range(n)]
    return out


def test_take_mix_keeps_shares_and_passes_a_short_category_on():
    recs = categorised({"chat": 50, "code": 50, "reasoning": 3, "other": 9})
    mix = {"chat": 0.5, "code": 0.3, "reasoning": 0.2}
    got = Counter(r.category for r in regen.take_mix(recs, 20, mix))
    # reasoning has 3 of its 4: the missing one goes to chat and code in proportion; "other" is not in the mix.
    assert got == {"chat": 11, "code": 6, "reasoning": 3}
    assert [r.record_id for r in regen.take_mix(recs, 20, mix) if r.category == "chat"] == [f"chat{i}" for i in range(11)]
    assert Counter(r.category for r in regen.take_mix(recs, 10, {"chat": 1, "code": 1})) == {"chat": 5, "code": 5}
    assert len(regen.take_mix(recs, 1000, mix)) == 103  # fewer than asked: every record of the mix
    assert regen.take_mix(recs, 4, None) == recs[:4] and regen.take_mix(recs, None, None) == recs


def test_requests_without_an_answer_are_answered_whole(tiny_model, tokenizer, tmp_path):
    reqs = categorised({"summarization": 2})
    assert regen.first_turn_prompt(reqs[0].messages) == reqs[0].messages
    out = regen.regenerate(regen.transformers_answers(tiny_model, tokenizer, 3, batch_size=4), tokenizer, reqs,
                           tmp_path / "r.jsonl")
    assert [m["role"] for m in out[0].messages] == ["user", "assistant"] and out[0].messages[0] == reqs[0].messages[0]


def test_prepare_mixes_regenerated_and_original_answers_and_holds_out_unanswered_prompts(tiny_model, tokenizer,
                                                                                         tmp_path):
    """One corpus answered by the target (a budget of 4 of its 12 records), one keeping its own answers; the
    held-out prompts come from every validation record, answered or not; reference counts cover the train split."""
    from datasets import load_from_disk
    from safetensors.torch import load_file

    from eyas.data.config import CorpusConfig, DataConfig
    from eyas.data.corpora import read_corpus, split_of
    from eyas.data.prepare import REFERENCE_COUNTS
    from eyas.recipe import Recipe
    from eyas.stages import run_one

    target = tmp_path / "tiny-target"
    tiny_model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    for name in ("a", "b"):
        items = [{"conversations": [{"from": "human", "value": f"Corpus {name} question {i}?"},
                                    {"from": "gpt", "value": f"Original answer {name}{i} about zebras and quartz."}]}
                 for i in range(12)]
        (tmp_path / f"{name}.json").write_text(json.dumps(items))
    recipe = Recipe(output_dir=str(tmp_path / "run"))
    recipe.target.name_or_path = str(target)
    recipe.data = DataConfig(corpora=[CorpusConfig(kind="json", path=str(tmp_path / "a.json")),
                                      CorpusConfig(kind="json", path=str(tmp_path / "b.json"), regenerate=False)],
                             regenerate=True, regenerate_max_records=4, regenerate_max_new_tokens=6,
                             regenerate_batch_size=4, validation_fraction=0.3, min_assistant_tokens=1)
    out = run_one("prepare", recipe)
    data = load_from_disk(str(out))
    rows = [row for split in data.values() for row in split]
    texts = [tokenizer.decode(r["input_ids"]) for r in rows]
    assert sum("Original answer a" in t for t in texts) == 0 and sum("Corpus a" in t for t in texts) == 4
    assert sum("Original answer b" in t for t in texts) == 12  # the second corpus keeps its own answers

    prompts = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    questions = {p["messages"][0]["content"] for p in prompts}
    assert all(split_of(p["record_id"], 0.3) == "validation" for p in prompts)
    # Validation records of corpus a that the target did not answer are held-out prompts too.
    val_a = [i for i in range(12) if any(p["messages"][0]["content"] == f"Corpus a question {i}?" for p in prompts)]
    answered_val = [r for r in data["validation"] if "Corpus a" in tokenizer.decode(r["input_ids"])]
    assert len(val_a) > len(answered_val) and len(questions) == len(prompts)

    counts = load_file(str(out / REFERENCE_COUNTS))["counts"]
    expected = torch.zeros(tiny_model.config.vocab_size, dtype=torch.long)
    for corpus in recipe.data.corpora:
        for r in read_corpus(corpus)[0]:
            if split_of(r.record_id, 0.3) == "train":  # originals of both corpora, validation left out
                ids = tokenizer(r.messages[1]["content"], add_special_tokens=False)["input_ids"]
                expected += torch.bincount(torch.tensor(ids), minlength=len(expected))
    assert torch.equal(counts, expected) and 0 < counts.sum() < 24 * 12

    # Both regenerated: a budget smaller than the first corpus answers each in turn.
    recipe.data.corpora[1].regenerate = None
    recipe.data.regenerate_max_records = 6
    out = run_one("prepare", recipe)
    texts = [tokenizer.decode(r["input_ids"]) for split in load_from_disk(str(out)).values() for r in split]
    assert sum("Corpus a" in t for t in texts) == sum("Corpus b" in t for t in texts) == 3
    assert not any("Original answer" in t for t in texts)


def test_a_repeated_first_request_is_answered_once_and_never_both_trained_on_and_held_out(tiny_model, tokenizer,
                                                                                         tmp_path):
    """Six distinct conversations that open with the same request ("continue"), in both splits: regeneration
    keeps only the first request, so they would be one sample six times and a held-out prompt seen in training.
    Prepare answers the request once (the rest counted as repeated_request) and holds out no request that a
    training sample starts with."""
    from datasets import load_from_disk

    from eyas.data.config import CorpusConfig, DataConfig
    from eyas.data.corpora import read_corpus, split_of
    from eyas.recipe import Recipe
    from eyas.stages import run_one

    target = tmp_path / "tiny-target"
    tiny_model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    items = [{"conversations": [{"from": "human", "value": f"Question {i} about owls?"},
                                {"from": "gpt", "value": f"Original answer {i}."}]} for i in range(10)]
    items += [{"conversations": [{"from": "human", "value": "continue" + " " * (i % 2)},
                                 {"from": "gpt", "value": f"Part {i} of a story about lighthouses."}]} for i in range(6)]
    (tmp_path / "chat.json").write_text(json.dumps(items))
    corpus = CorpusConfig(kind="json", path=str(tmp_path / "chat.json"))
    repeated = [r for r in read_corpus(corpus)[0] if r.messages[0]["content"].strip() == "continue"]
    assert len(repeated) == 6 and {split_of(r.record_id, 0.5) for r in repeated} == {"train", "validation"}

    recipe = Recipe(output_dir=str(tmp_path / "run"))
    recipe.target.name_or_path = str(target)
    recipe.data = DataConfig(corpora=[corpus], regenerate=True, regenerate_max_new_tokens=6, regenerate_batch_size=4,
                             validation_fraction=0.5, min_assistant_tokens=1)
    out = run_one("prepare", recipe)
    splits = load_from_disk(str(out))
    starts = {name: [tokenizer.decode(r["input_ids"]).split("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
                     for r in split] for name, split in splits.items()}
    assert sum(s.strip() == "continue" for split in starts.values() for s in split) == 1
    assert len(regen.read_answers(next(out.glob("regenerated-*.jsonl")))) == 11  # 10 questions + "continue" once
    stats = json.loads((out / "stats.json").read_text())["corpora"][0]
    assert stats["skipped"]["repeated_request"] == 5

    held = [p["messages"][0]["content"].strip() for p in
            map(json.loads, (out / "prompts.jsonl").read_text().splitlines())]
    trained = {s.strip() for s in starts["train"]}
    assert held and not trained & set(held) and len(held) == len(set(held))
    # "continue" is held out exactly when its one sample is a validation sample
    assert ("continue" in held) == ("continue" in {s.strip() for s in starts["validation"]})

    # Original answers (no regeneration): all six conversations are samples, and "continue" is not held out
    # because training conversations open with it.
    recipe.data.regenerate = False
    out = run_one("prepare", recipe)
    texts = [tokenizer.decode(r["input_ids"]) for split in load_from_disk(str(out)).values() for r in split]
    assert sum("story about lighthouses" in t for t in texts) == 6
    held = [p["messages"][0]["content"].strip() for p in
            map(json.loads, (out / "prompts.jsonl").read_text().splitlines())]
    owls_held_out = {r.messages[0]["content"] for r in read_corpus(corpus)[0]
                     if "owls" in r.messages[0]["content"] and split_of(r.record_id, 0.5) == "validation"}
    assert "continue" not in held and set(held) == owls_held_out
