"""Online mode gives the batches that the offline store gives, on tiny and on the real target."""

from __future__ import annotations

import datasets
import pytest
import torch

from eyas.data.config import CollectConfig, TargetConfig
from eyas.data.features import FeatureDataset, OnlineFeatures, Teacher, collate
from eyas.data.targets import load_target
from eyas.data.vocab import load_vocab
from eyas.recipe import Recipe

from test_collect_store import build_tiny_target, make_recipe, run_collect, write_prepared, write_vocab


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


def assert_same_batch(offline: dict, online: dict, aux_rel: float = 2 ** -7) -> None:
    """Bitwise for ids, masks, flags and top-k ids; features within one rounding step of their storage dtype
    (offline ran each sample in another padded batch, so fp32 sums may round differently before the cast)."""
    assert set(offline) - {"sample_index"} == set(online) - {"sample_index", "record_id"}
    for name, want in offline.items():
        if name == "sample_index":
            continue
        got = online[name].cpu()
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if want.dtype in (torch.long, torch.bool):
            assert torch.equal(got, want), name
        else:
            ulp = aux_rel if name == "aux" else {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[want.dtype]
            tol = ulp * want.float().abs() + 1e-6
            assert ((got.float() - want.float()).abs() <= tol).all(), name


@pytest.mark.parametrize("teacher,feature_dtype", [("last_hidden", "bfloat16"), ("topk", "float8_e4m3")])
def test_online_batches_equal_offline_batches(tmp_path, tiny_target, teacher, feature_dtype):
    recipe = make_recipe(tmp_path, tiny_target, teacher=teacher, feature_dtype=feature_dtype, topk=6)
    features = run_collect(recipe)
    store = FeatureDataset(features, "train")
    prepared = datasets.load_from_disk(str(recipe.stage_dir("data")))["train"]
    model, _ = load_target(recipe.target)
    online = OnlineFeatures(model, load_vocab(recipe.stage_dir("vocab")), recipe.collect)
    # Rows that were collected in different (length-sorted) batches, regrouped.
    for rows in ([0, 5, 9], [13], [2, 3, 4, 7, 11]):
        offline = collate([store[r] for r in rows])
        on = online(collate([prepared[r] for r in rows]))
        # An fp8 value that lands on the other side of a rounding boundary moves by one fp8 step (1/8).
        assert_same_batch(offline, on, aux_rel=2 ** -3 if feature_dtype == "float8_e4m3" else 2 ** -7)
        offline_teacher = Teacher.load(features)
        assert torch.equal(offline_teacher.draft_logits(offline), online.teacher().draft_logits(on)) \
            if teacher == "topk" else torch.allclose(offline_teacher.draft_logits(offline),
                                                     online.teacher().draft_logits(on), rtol=0.02, atol=1e-3)


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "user", "content": "Write a Python function that adds two numbers."},
     {"role": "assistant", "content": "def add(a, b):\n    return a + b"}],
    [{"role": "user", "content": "Name three colours."},
     {"role": "assistant", "content": "Red, green and blue."}],
]


def test_real_target_online_equals_offline_and_teacher_matches_lm_head(tmp_path):
    """SmolLM2-135M-Instruct: the stored teacher reproduces the model's own logits over the draft vocab."""
    target_cfg = TargetConfig()
    model, tok = load_target(target_cfg)
    rows = {"input_ids": [], "loss_mask": [], "source": [], "record_id": [], "category": []}
    for i, chat in enumerate(CHATS):
        prompt = tok.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template(chat, tokenize=False)
        ids = tok(full, add_special_tokens=False)["input_ids"]
        n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
        rows["input_ids"].append(ids)
        rows["loss_mask"].append([0] * n_prompt + [1] * (len(ids) - n_prompt))
        rows.update({k: rows[k] + [v] for k, v in (("source", "test"), ("record_id", f"chat{i}"), ("category", "chat"))})
    recipe = Recipe(output_dir=str(tmp_path), target=target_cfg, collect=CollectConfig(batch_size=2))
    ds = datasets.Dataset.from_dict(rows)
    write_prepared(recipe.stage_dir("data"), datasets.DatasetDict(train=ds, validation=ds.select([0])))
    used = sorted({t for ids in rows["input_ids"] for t in ids})
    # Draft vocab: the tokens of the data plus the first 2000 ids (sorted, as the vocab stage does).
    write_vocab(recipe.stage_dir("vocab"), torch.tensor(sorted(set(used) | set(range(2000)))),
                vocab_size=model.config.vocab_size)
    features = run_collect(recipe)
    store = FeatureDataset(features, "train", verify=True)
    offline = collate([store[i] for i in range(len(store))])
    online = OnlineFeatures(model, load_vocab(recipe.stage_dir("vocab")), recipe.collect)
    assert_same_batch(offline, online(collate([ds[i] for i in range(len(ds))])))

    d2t, t2d = load_vocab(recipe.stage_dir("vocab"))
    draft_ids = torch.arange(d2t.numel()) + d2t
    with torch.no_grad():
        full = model(input_ids=offline["input_ids"], attention_mask=offline["attention_mask"].long()).logits
    real = offline["attention_mask"]
    assert torch.equal(offline["target_in_draft"][real], t2d[full.argmax(-1)][real])
    dense = Teacher.load(features).draft_logits(offline)[real]
    want = full[..., draft_ids][real]
    # bf16 hidden: logits differ by a small fraction of their scale; the argmax agrees nearly everywhere.
    assert (dense - want).abs().max() < 0.05 * want.abs().max()
    assert (dense.argmax(-1) == want.argmax(-1)).float().mean() > 0.97


def test_bf16_collection_runs_the_target_under_autocast_close_to_fp32():
    """collect.mixed_precision=bf16: the real target's features come from bf16 matmuls (so they differ from the
    fp32 ones) and stay within bf16's rounding of them; the teacher's argmax mostly agrees."""
    from eyas.data.targets import bf16_autocast, cpu_bf16_is_fast

    cpu = torch.device("cpu")
    assert bf16_autocast("bf16", cpu) and not bf16_autocast("fp32", cpu)
    assert bf16_autocast("auto", cpu) == cpu_bf16_is_fast()
    model, tok = load_target(TargetConfig())
    texts = [tok.apply_chat_template(chat, tokenize=False) for chat in CHATS]
    ids = [torch.tensor(tok(text, add_special_tokens=False)["input_ids"]) for text in texts]
    batch = collate([{"input_ids": x, "loss_mask": torch.ones_like(x)} for x in ids])
    vocab = (torch.zeros(2000, dtype=torch.long), torch.arange(model.config.vocab_size) < 2000)
    fp32 = OnlineFeatures(model, vocab, CollectConfig(mixed_precision="fp32"))(batch)
    bf16 = OnlineFeatures(model, vocab, CollectConfig(mixed_precision="bf16"))(batch)
    real = batch["attention_mask"].bool()
    a, b = fp32["aux"][real].float(), bf16["aux"][real].float()
    assert not torch.equal(a, b)
    assert ((a - b).norm(dim=-1) / a.norm(dim=-1)).max() < 0.1
    teacher = OnlineFeatures(model, vocab, CollectConfig()).teacher()
    agree = (teacher.draft_logits(fp32).argmax(-1) == teacher.draft_logits(bf16).argmax(-1))[real].float().mean()
    assert agree > 0.9
