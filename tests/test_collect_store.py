"""Offline feature store: format round trip, checksums, resume after a kill, disk refusal, bad input."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import save_file

from eyas.data import collect
from eyas.data.config import CollectConfig, TargetConfig
from eyas.data.features import (FeatureDataset, FeatureStoreError, OnlineFeatures, Teacher, bytes_per_token, collate,
                                dequantize_fp8, quantize_fp8)
from eyas.data.targets import load_target, target_features
from eyas.data.vocab import VocabError, build_mapping, load_vocab, save_vocab
from eyas.recipe import Recipe
from eyas.stages import run_one
from stage_outputs import mark_done

VOCAB = 384


def build_tiny_target(folder: Path) -> Path:
    """A random-weight Llama (8 layers, H=32) with a word-level tokenizer, saved like a real HF model dir."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(folder)
    words = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(folder)
    return folder


def token_rows(n: int, seed: int, min_len: int = 4, max_len: int = 40) -> datasets.Dataset:
    g = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "loss_mask": [], "source": [], "record_id": [], "category": []}
    for i in range(n):
        length = int(torch.randint(min_len, max_len, (1,), generator=g))
        rows["input_ids"].append(torch.randint(0, VOCAB, (length,), generator=g).tolist())
        rows["loss_mask"].append([0] * (length // 2) + [1] * (length - length // 2))
        rows["source"].append("synthetic")
        rows["record_id"].append(f"s{seed}-{i}")
        rows["category"].append("chat")
    return datasets.Dataset.from_dict(rows)


def write_prepared(folder: Path, splits: datasets.DatasetDict) -> None:
    """A prepared dataset as the prepare stage leaves it (DONE included)."""
    shutil.rmtree(folder, ignore_errors=True)
    splits.save_to_disk(str(folder))
    mark_done(folder)


def write_vocab(folder: Path, target_ids: torch.Tensor, vocab_size: int = VOCAB) -> None:
    """A draft vocab as the vocab stage leaves it (DONE included)."""
    folder.mkdir(parents=True, exist_ok=True)
    save_vocab(folder / "vocab.safetensors", *build_mapping(target_ids, vocab_size))
    mark_done(folder)


def run_collect(recipe: Recipe) -> Path:
    """The collect stage as `eyas collect` runs it (skipped when DONE.json matches); returns features/."""
    return run_one("collect", recipe)


def make_recipe(root: Path, target_dir: Path, n_train: int = 14, n_val: int = 5, **collect_kw) -> Recipe:
    """A run dir with a prepared dataset and a draft vocab (every third target id) in the stage formats."""
    kw = {"batch_size": 4, "shard_tokens": 80, **collect_kw}
    recipe = Recipe(output_dir=str(root), target=TargetConfig(name_or_path=str(target_dir)),
                    collect=CollectConfig(**kw))
    write_prepared(recipe.stage_dir("data"), datasets.DatasetDict(train=token_rows(n_train, 1),
                                                                   validation=token_rows(n_val, 2)))
    write_vocab(recipe.stage_dir("vocab"), torch.arange(0, VOCAB, 3))
    return recipe


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


def shard_files(features: Path) -> list[str]:
    return sorted(str(p.relative_to(features)) for p in features.rglob("*.safetensors") if p.name != "teacher.safetensors")


# ---- round trip -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("teacher,feature_dtype", [("last_hidden", "bfloat16"), ("topk", "float8_e4m3")])
def test_round_trip_matches_the_target_run_alone(tmp_path, tiny_target, teacher, feature_dtype):
    recipe = make_recipe(tmp_path, tiny_target, teacher=teacher, feature_dtype=feature_dtype, topk=5)
    features = run_collect(recipe)
    model, _ = load_target(recipe.target)
    d2t, t2d = load_vocab(recipe.stage_dir("vocab"))
    draft_ids = torch.arange(d2t.numel()) + d2t
    prepared = datasets.load_from_disk(str(recipe.stage_dir("data")))
    index = json.loads((features / "index.json").read_text())
    assert index["teacher"] == teacher and index["hidden_size"] == 32 and index["aux_layer_ids"] == [2, 4, 5]
    assert (features / "DONE.json").exists()
    assert len(index["splits"]["train"]["shards"]) > 2  # small shard_tokens: several shards

    for split in ("train", "validation"):
        ds = FeatureDataset(features, split, verify=True)
        assert len(ds) == len(prepared[split]) == index["splits"][split]["num_samples"]
        for i in range(len(ds)):
            item, row = ds[i], prepared[split][i]
            assert int(item["sample_index"]) == i
            assert item["input_ids"].tolist() == row["input_ids"]
            assert item["loss_mask"].tolist() == row["loss_mask"]
            # Reference: the sample alone (no padding, no batch) through the target in fp32.
            aux, final = target_features(model, torch.tensor([row["input_ids"]]), [2, 4, 5])
            aux, final = aux[0], final[0]
            full_logits = final @ model.lm_head.weight.T
            assert torch.equal(item["target_in_draft"], t2d[full_logits.argmax(-1)])
            assert item["aux"].dtype == torch.bfloat16 and item["aux"].shape == aux.shape
            # Worst rounding relative to the group max: bf16 half an ulp (2^-9 of |x|); fp8 e4m3 with the max scaled
            # into [224, 448] rounds by at most half its top step (16), i.e. 16/224 = 1/14 of the max.
            rel = 2 ** -8 if feature_dtype == "bfloat16" else 1 / 14
            scale = aux.view(len(aux), 3, -1).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(aux.shape)
            assert ((item["aux"].float() - aux).abs() <= rel * scale + 1e-6).all()
            draft_logits = full_logits[:, draft_ids]
            if teacher == "last_hidden":
                dense = Teacher.load(features).draft_logits({"teacher_hidden": item["teacher_hidden"][None]})[0]
                assert torch.allclose(dense, draft_logits, atol=0.02 * draft_logits.abs().max())
            else:
                ref_values, ref_ids = draft_logits.topk(5, dim=-1)
                assert torch.equal(item["teacher_topk_ids"], ref_ids)
                assert torch.allclose(item["teacher_topk_logits"].float(), ref_values, rtol=2 ** -10, atol=1e-4)


def test_collate_pads_and_teacher_densifies_topk(tmp_path, tiny_target):
    recipe = make_recipe(tmp_path, tiny_target, n_train=6, n_val=2, teacher="topk", topk=4)
    ds = FeatureDataset(run_collect(recipe), "train")
    samples = [ds[0], ds[3], ds[5]]
    batch = collate(samples, pad_to_multiple=8)
    lengths = [len(s["input_ids"]) for s in samples]
    assert batch["input_ids"].shape[1] % 8 == 0 and batch["input_ids"].shape[1] >= max(lengths)
    assert batch["attention_mask"].sum(1).tolist() == lengths
    assert batch["aux"].shape == (3, batch["input_ids"].shape[1], 96)
    assert batch["input_ids"].dtype == batch["loss_mask"].dtype == batch["teacher_topk_ids"].dtype == torch.long
    pad = ~batch["attention_mask"]
    assert not batch["loss_mask"][pad].any() and not batch["target_in_draft"][pad].any()
    assert (batch["aux"][pad] == 0).all()
    dense = Teacher.load(recipe.stage_dir("features")).draft_logits(batch)
    assert dense.shape == (3, batch["input_ids"].shape[1], VOCAB // 3)
    probs = dense[0, 0].softmax(-1)
    ids = batch["teacher_topk_ids"][0, 0]
    assert torch.allclose(probs[ids].sum(), torch.tensor(1.0))  # renormalised over the k kept ids
    assert torch.allclose(probs[ids], batch["teacher_topk_logits"][0, 0].float().softmax(-1))


def test_fp8_quantisation_is_exact_to_dequantise_and_bounded():
    torch.manual_seed(0)
    x = torch.randn(50, 3 * 64) * torch.tensor([0.01, 1.0, 300.0]).repeat_interleave(64)
    x[7, :64] = 0.0  # an all-zero group must not divide by zero
    q, exp = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and exp.dtype == torch.int8 and exp.shape == (50, 3)
    back = dequantize_fp8(q, exp, torch.float32)
    assert torch.equal(dequantize_fp8(q, exp, torch.bfloat16).float(), back)  # power-of-two scale: exact in bf16
    groups, back_groups = x.view(50, 3, 64), back.view(50, 3, 64)
    amax = groups.abs().amax(-1, keepdim=True)
    assert ((back_groups - groups).abs() <= amax / 14 + 1e-30).all()  # half the top fp8 step (16) over 224
    assert ((back_groups - groups).abs() <= groups.abs() / 16 + amax * 2 ** -10).all()  # 3 mantissa bits
    assert (back[7, :64] == 0).all()
    group_max = q.float().view(50, 3, 64).abs().amax(-1)[amax[..., 0] > 0]
    assert ((group_max >= 224) & (group_max <= 448)).all()  # the scale uses the fp8 range


# ---- integrity ---------------------------------------------------------------------------------------------

def test_checksum_catches_a_corrupt_shard_and_names_it(tmp_path, tiny_target):
    features = run_collect(make_recipe(tmp_path, tiny_target, n_train=8, n_val=2))
    index = json.loads((features / "index.json").read_text())
    victim = features / index["splits"]["train"]["shards"][1]["file"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped in the tensor data
    stat = victim.stat()
    victim.write_bytes(bytes(data))
    # Rewritten in place: its modification time differs from the one recorded, so every read checksums it.
    with pytest.raises(FeatureStoreError, match=f"shard {victim}.*corrupt"):
        FeatureDataset(features, "train")
    # Only a shard that looks untouched (same size and write time) skips the checksum on an ordinary read.
    os.utime(victim, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    FeatureDataset(features, "train")
    with pytest.raises(FeatureStoreError, match=f"shard {victim}.*corrupt"):
        FeatureDataset(features, "train", verify=True)
    victim.write_bytes(bytes(data[:-10]))
    with pytest.raises(FeatureStoreError, match=f"shard {victim} has {len(data) - 10} bytes"):
        FeatureDataset(features, "train")


def shard_content(index: dict) -> dict:
    """The splits of an index.json without the shards' write times (a shard written again gets a new one)."""
    return {split: {**entry, "shards": [{k: v for k, v in shard.items() if k != "mtime_ns"} for shard in entry["shards"]]}
            for split, entry in index["splits"].items()}


def test_resume_after_a_kill_writes_each_shard_once(tmp_path, tiny_target, monkeypatch):
    reference = run_collect(make_recipe(tmp_path / "uninterrupted", tiny_target))
    recipe = make_recipe(tmp_path / "killed", tiny_target)
    real_write = collect.write_shard
    written: list[str] = []

    def dying_write(path, tensors):
        if len(written) == 3:
            raise KeyboardInterrupt("simulated kill")
        written.append(str(path))
        return real_write(path, tensors)

    monkeypatch.setattr(collect, "write_shard", dying_write)
    with pytest.raises(KeyboardInterrupt):
        run_collect(recipe)
    features = recipe.stage_dir("features")
    assert not (features / "DONE.json").exists() and not (features / "index.json").exists()
    assert len(shard_files(features)) == 3

    def counting_write(path, tensors):
        written.append(str(path))
        return real_write(path, tensors)

    monkeypatch.setattr(collect, "write_shard", counting_write)
    run_collect(recipe)
    assert len(written) == len(set(written)), "a shard was written twice"
    assert shard_files(features) == shard_files(reference)
    assert len(written) == len(shard_files(reference))
    got = json.loads((features / "index.json").read_text())
    want = json.loads((reference / "index.json").read_text())
    assert shard_content(got) == shard_content(want)  # same files, same bytes (sha256), same sample and token counts
    assert not list(features.rglob(".*.tmp-*"))
    # A third run is a no-op: DONE.json matches.
    written.clear()
    run_collect(recipe)
    assert written == []


def test_resume_recollects_a_shard_whose_checksum_fails(tmp_path, tiny_target, monkeypatch):
    recipe = make_recipe(tmp_path, tiny_target, n_train=8, n_val=2)
    features = run_collect(recipe)
    before = json.loads((features / "index.json").read_text())
    (features / "DONE.json").unlink()
    victim = features / before["splits"]["train"]["shards"][0]["file"]
    victim.write_bytes(b"garbage")
    written = []
    real_write = collect.write_shard
    monkeypatch.setattr(collect, "write_shard", lambda p, t: (written.append(p), real_write(p, t))[1])
    run_collect(recipe)
    assert written == [victim]
    assert shard_content(json.loads((features / "index.json").read_text())) == shard_content(before)


def test_refuses_when_the_disk_cannot_hold_the_store(tmp_path, tiny_target, monkeypatch, capsys):
    recipe = make_recipe(tmp_path, tiny_target, n_train=8, n_val=2)
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=10_000))
    with pytest.raises(FeatureStoreError, match="not enough disk.*only 0.00 GiB free"):
        run_collect(recipe)
    printed = capsys.readouterr().out
    per_token = bytes_per_token(32, recipe.collect, VOCAB // 3)
    assert f"{per_token} bytes/token" in printed
    assert per_token == 6 + 3 * 32 * 2 + 32 * 2
    assert shard_files(recipe.stage_dir("features")) == []


def test_bad_records_and_vocab_are_named(tmp_path, tiny_target):
    recipe = make_recipe(tmp_path, tiny_target, n_train=4, n_val=2)
    rows = token_rows(4, 1).to_dict()
    rows["loss_mask"][2] = rows["loss_mask"][2][:-1]
    write_prepared(recipe.stage_dir("data"),
                   datasets.DatasetDict(train=datasets.Dataset.from_dict(rows), validation=token_rows(2, 2)))
    with pytest.raises(FeatureStoreError, match=r"data \(train split\): record s1-2 \(row 2\): field 'loss_mask'"):
        run_collect(recipe)
    rows = token_rows(4, 1).to_dict()
    rows["input_ids"][1][0] = VOCAB + 5
    write_prepared(recipe.stage_dir("data"),
                   datasets.DatasetDict(train=datasets.Dataset.from_dict(rows), validation=token_rows(2, 2)))
    with pytest.raises(FeatureStoreError, match=f"record s1-1 \\(row 1\\): field 'input_ids' holds id {VOCAB + 5}"):
        run_collect(recipe)
    write_vocab(recipe.stage_dir("vocab"), torch.arange(0, 100, 3), vocab_size=100)
    with pytest.raises(FeatureStoreError, match="100 target tokens, the target's lm_head has 384"):
        OnlineFeatures(load_target(recipe.target)[0], load_vocab(recipe.stage_dir("vocab")), recipe.collect)
    bad = recipe.stage_dir("vocab") / "vocab.safetensors"
    save_file({"d2t": torch.zeros(3, dtype=torch.long), "t2d": torch.zeros(10, dtype=torch.bool)}, str(bad))
    mark_done(recipe.stage_dir("vocab"))
    with pytest.raises(VocabError, match=f"{bad}: t2d marks 0 target ids but d2t has 3"):
        run_collect(recipe)


def test_topk_store_starts_lm_head_from_the_targets_files(tmp_path, tiny_target):
    """A top-k store keeps no lm_head rows; the trainer reads them from the target's safetensors instead."""
    from eyas.data.features import Teacher
    from eyas.data.targets import Target
    from eyas.heads.eagle3 import Eagle3Config, build_head
    from eyas.train.head_init import init_lm_head_from_target

    recipe = make_recipe(tmp_path, tiny_target, teacher="topk", topk=4)
    features = run_collect(recipe)
    teacher = Teacher.load(features)
    assert teacher.rows is None
    target = Target.resolve(recipe.target)
    d2t, t2d = load_vocab(recipe.stage_dir("vocab"))
    head = build_head(Eagle3Config.from_target(target.config, d2t.numel(), target.aux_layer_ids))
    head.set_vocab(d2t, t2d)
    init_lm_head_from_target(head, teacher, target)
    model, _ = load_target(recipe.target)
    want = model.get_output_embeddings().weight[torch.arange(d2t.numel()) + d2t]
    assert torch.equal(head.lm_head.weight, want.float())


def test_decoder_layer_from_a_target_layer_is_that_layer_on_the_aux_stream(tiny_target):
    """head.init_from_target_layer: fc passes the highest aux layer through and the decoder layer, with a zero
    embedding, computes what the target's layer computes on that stream (weights from the files alone)."""
    from eyas.data.targets import Target
    from eyas.heads.eagle3 import Eagle3Config, build_head
    from eyas.train.head_init import init_from_target_layer

    cfg = TargetConfig(name_or_path=str(tiny_target), dtype="float32", device="cpu")
    target = Target.resolve(cfg)
    head = build_head(Eagle3Config.from_target(target.config, 16, target.aux_layer_ids))
    init_from_target_layer(head, target, 5)
    model, _ = load_target(cfg)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        streams = model(ids, output_hidden_states=True).hidden_states  # [i]: the stream entering layer i
        aux = torch.cat([streams[i] for i in target.aux_layer_ids], dim=-1)
        highest = streams[max(target.aux_layer_ids)]
        assert torch.equal(head.fuse(aux), highest)
        positions = torch.arange(9)[None]
        q, k, v, residual = head.qkv(streams[5], torch.zeros(1, 9, 32), positions)
        causal = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
        out = head.finish(head.attend(q, k, v, causal), residual)
    torch.testing.assert_close(out, streams[6], rtol=1e-4, atol=1e-5)
    assert torch.equal(head.norm.weight, model.model.norm.weight)
    q_proj = model.model.layers[5].self_attn.q_proj.weight
    assert torch.equal(head.midlayer.self_attn.q_proj.weight, torch.cat([q_proj, q_proj], dim=1))


def test_decoder_layer_init_refuses_a_missing_layer_and_foreign_layers(tmp_path, tiny_target):
    from conftest import tiny_target as random_target
    from eyas.data.targets import Target
    from eyas.heads.eagle3 import Eagle3Config, build_head
    from eyas.train.head_init import TrainingError, init_from_target_layer

    target = Target.resolve(TargetConfig(name_or_path=str(tiny_target)))
    head = build_head(Eagle3Config.from_target(target.config, 16, target.aux_layer_ids))
    with pytest.raises(TrainingError, match=r"head.init_from_target_layer: 8 is not a layer of the target \(0..7\)"):
        init_from_target_layer(head, target, 8)
    random_target("qwen3").save_pretrained(tmp_path / "qwen3")
    qwen = Target.resolve(TargetConfig(name_or_path=str(tmp_path / "qwen3")))
    head = build_head(Eagle3Config.from_target(qwen.config, 16, qwen.aux_layer_ids))
    with pytest.raises(TrainingError, match="a qwen3 target's layers are not the head's"):
        init_from_target_layer(head, qwen, 1)
    from transformers import LlamaConfig, LlamaForCausalLM  # a Llama with biases: their values would stay random

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
                     ).save_pretrained(tmp_path / "biased")
    biased = Target.resolve(TargetConfig(name_or_path=str(tmp_path / "biased")))
    head = build_head(Eagle3Config.from_target(biased.config, 16, biased.aux_layer_ids))
    with pytest.raises(TrainingError, match="a llama target's layers are not the head's .* without biases"):
        init_from_target_layer(head, biased, 1)
