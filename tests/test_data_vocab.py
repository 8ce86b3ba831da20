"""Draft vocabulary: the exact d2t/t2d format, the round trip, counting, sizes, and the stage on real data."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from eyas.data.config import CorpusConfig, DataConfig, VocabConfig
from eyas.data.vocab import (VocabError, build_mapping, draft_to_target, load_vocab, masked_token_counts, ranked_ids,
                             save_vocab, target_to_draft)
from eyas.recipe import Recipe
from eyas.stages import run_one


def test_mapping_is_the_serving_format_and_round_trips(tmp_path):
    kept = np.array([7, 3, 100, 42, 0])
    d2t, t2d = build_mapping(kept, 128)
    assert d2t.dtype == torch.int64 and d2t.shape == (5,) and t2d.dtype == torch.bool and t2d.shape == (128,)
    # Draft ids follow target-id order; d2t holds offsets, target = draft + d2t[draft].
    assert d2t.tolist() == [0 - 0, 3 - 1, 7 - 2, 42 - 3, 100 - 4]
    draft = torch.arange(5)
    target = draft_to_target(d2t, draft)
    assert target.tolist() == [0, 3, 7, 42, 100]
    assert torch.equal(target_to_draft(t2d, target), draft)
    assert target_to_draft(t2d, torch.tensor([1, 99])).tolist() == [-1, -1]
    assert t2d.sum() == 5 and t2d[target].all()

    save_vocab(tmp_path / "vocab.safetensors", d2t, t2d)
    d2t2, t2d2 = load_vocab(tmp_path)
    assert torch.equal(d2t2, d2t) and torch.equal(t2d2, t2d)


@pytest.mark.parametrize("tensors,message", [
    ({"d2t": torch.zeros(3, dtype=torch.long)}, "missing tensor 't2d'"),
    ({"d2t": torch.zeros(3, dtype=torch.int32), "t2d": torch.zeros(8, dtype=torch.bool)}, "'d2t' must be torch.int64"),
    ({"d2t": torch.zeros(3, dtype=torch.long), "t2d": torch.zeros(8, dtype=torch.uint8)}, "'t2d' must be torch.bool"),
    ({"d2t": torch.zeros(3, dtype=torch.long), "t2d": torch.tensor([1, 1, 0, 0], dtype=torch.bool)}, "marks 2"),
    ({"d2t": torch.tensor([0, 0], dtype=torch.long), "t2d": torch.tensor([0, 1, 1, 0], dtype=torch.bool)}, "offsets"),
])
def test_load_vocab_rejects_wrong_formats(tmp_path, tensors, message):
    save_file(tensors, str(tmp_path / "vocab.safetensors"))
    with pytest.raises(VocabError, match=message):
        load_vocab(tmp_path / "vocab.safetensors")


def test_counts_only_masked_tokens_and_rank_ties_by_id():
    from datasets import Dataset

    split = Dataset.from_dict({"input_ids": [[5, 1, 2, 2], [3, 3, 1]], "loss_mask": [[0, 1, 1, 1], [1, 1, 0]],
                               "record_id": ["a", "b"]})
    counts = masked_token_counts(split, 8, "x")
    assert counts.tolist() == [0, 1, 2, 2, 0, 0, 0, 0]
    assert ranked_ids(counts).tolist() == [2, 3, 1]
    bad = Dataset.from_dict({"input_ids": [[1, 9]], "loss_mask": [[1, 1]], "record_id": ["r9"]})
    with pytest.raises(VocabError, match=r"x: record r9: field 'input_ids' holds id 9 outside .*\[0, 8\)"):
        masked_token_counts(bad, 8, "x")
    ragged = Dataset.from_dict({"input_ids": [[1, 2]], "loss_mask": [[1]], "record_id": ["rr"]})
    with pytest.raises(VocabError, match="record rr: field 'loss_mask' has 1 entries for 2"):
        masked_token_counts(ragged, 8, "x")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A small real prepare run (ShareGPT-style file and HumanEval) with the real SmolLM2 tokenizer."""

    root = tmp_path_factory.mktemp("vocabrun")
    items = [{"conversations": [{"from": "human", "value": f"Tell me about topic number {i}."},
                                {"from": "gpt", "value": f"Topic {i} is about {'cats' if i % 2 else 'dogs'} and "
                                                         f"their {i * 7} habits, explained in plain words."}]}
             for i in range(300)]
    (root / "chat.json").write_text(json.dumps(items))
    recipe = Recipe(output_dir=str(root / "run"),
                    data=DataConfig(corpora=[CorpusConfig(kind="json", path=str(root / "chat.json")),
                                             CorpusConfig(kind="humaneval", max_records=40)],
                                    validation_fraction=0.1, max_length=256))
    run_one("prepare", recipe)
    return recipe


def test_run_vocab_writes_mapping_and_coverage(prepared):
    from datasets import load_from_disk

    recipe = prepared
    recipe.vocab = VocabConfig(draft_vocab_size=128, sizes=[32, 64, 128], argmax_positions=16, argmax_batch_size=4)
    out = run_one("vocab", recipe)
    d2t, t2d = load_vocab(out)
    assert d2t.shape == (128,) and t2d.shape == (49152,)  # SmolLM2's config vocab_size
    report = json.loads((out / "coverage.json").read_text())
    assert report["draft_vocab_size"] == 128 and report["target_vocab_size"] == 49152
    rows = {r["size"]: r for r in report["table"]}
    assert rows[32]["train"] < rows[64]["train"] < rows[128]["train"] < 1.0
    assert 0.0 < rows[128]["target_argmax"] <= 1.0 and report["masked_tokens"]["target_argmax"] == 16
    # Coverage recomputed from the saved mapping agrees with the report.
    train = load_from_disk(str(recipe.stage_dir("data")))["train"]
    masked = np.concatenate([np.asarray(i)[np.asarray(m, bool)] for i, m in zip(train["input_ids"],
                                                                                  train["loss_mask"])])
    assert abs(t2d[torch.as_tensor(masked)].float().mean().item() - rows[128]["train"]) < 1e-6
    # The kept tokens are the most frequent ones.
    counts = np.bincount(masked, minlength=49152)
    assert counts[t2d.numpy()].min() >= counts[~t2d.numpy()].max()
    assert "| 128 (chosen) |" in (out / "coverage.md").read_text()
    assert (out / "coverage.png").read_bytes()[:4] == b"\x89PNG"
    done = json.loads((out / "DONE.json").read_text())
    assert run_one("vocab", recipe) == out and json.loads((out / "DONE.json").read_text()) == done  # skipped


def test_coverage_target_and_too_few_distinct_tokens(prepared):
    recipe = prepared
    recipe.vocab = VocabConfig(draft_vocab_size=8192, coverage_target=0.5, sizes=[16, 64, 256], argmax_positions=0)
    report = json.loads((run_one("vocab", recipe) / "coverage.json").read_text())
    reached = [r["size"] for r in report["table"] if r["validation"] >= 0.5]
    assert report["draft_vocab_size"] == min(reached)

    recipe.vocab = VocabConfig(draft_vocab_size=30000, sizes=[64], argmax_positions=0)
    with pytest.raises(VocabError, match="distinct masked tokens, fewer than the draft vocabulary size 30000"):
        run_one("vocab", recipe)
    recipe.vocab = VocabConfig(draft_vocab_size=30000, sizes=[64], argmax_positions=0, shrink_to_distinct=True)
    report = json.loads((run_one("vocab", recipe) / "coverage.json").read_text())
    assert report["draft_vocab_size"] == report["distinct_train_tokens"] < 30000
    assert load_vocab(recipe.stage_dir("vocab"))[0].shape == (report["distinct_train_tokens"],)

    recipe.vocab = VocabConfig(coverage_target=0.999999, sizes=[16], argmax_positions=0)
    with pytest.raises(VocabError, match="coverage_target 0.999999 is not reached"):
        run_one("vocab", recipe)


def test_run_vocab_needs_prepared_data(tmp_path):
    with pytest.raises(FileNotFoundError, match="run `eyas prepare"):
        run_one("vocab", Recipe(output_dir=str(tmp_path)))


def test_run_vocab_names_a_missing_column(tmp_path):
    from datasets import Dataset, DatasetDict

    recipe = Recipe(output_dir=str(tmp_path))
    data_dir = recipe.stage_dir("data")
    split = Dataset.from_dict({"input_ids": [[1, 2]], "record_id": ["a"]})
    DatasetDict({"train": split, "validation": split}).save_to_disk(str(data_dir))
    (data_dir / "DONE.json").write_text('{"input_hash": "x"}')
    with pytest.raises(VocabError, match="data/train: missing column 'loss_mask'"):
        run_one("vocab", recipe)


def test_fill_from_corpora_adds_the_corpus_tokens_after_the_trained_ones(prepared):
    from datasets import load_from_disk

    from eyas.data.prepare import REFERENCE_COUNTS
    from eyas.data.vocab import fill_ranking

    assert fill_ranking(np.array([5, 2]), np.array([0, 3, 9, 1, 0, 7])).tolist() == [5, 2, 1, 3]
    recipe = prepared
    data_dir = recipe.stage_dir("data")
    from safetensors.torch import load_file

    written = load_file(str(data_dir / REFERENCE_COUNTS))["counts"]
    assert written.shape == (49152,) and written.sum() > 0  # prepare wrote the corpora's counts
    train = load_from_disk(str(data_dir))["train"]
    seen = np.unique(np.concatenate([np.asarray(i)[np.asarray(m, bool)] for i, m in zip(train["input_ids"],
                                                                                          train["loss_mask"])]))
    unseen = np.setdiff1d(np.arange(49152), seen)[[10, 20, 30]]
    reference = torch.zeros(49152, dtype=torch.long)
    reference[torch.as_tensor(unseen)] = torch.tensor([5, 9, 1])
    reference[int(seen[0])] = 1000  # a token the answers use keeps its place among those
    save_file({"counts": reference}, str(data_dir / REFERENCE_COUNTS))
    try:
        recipe.vocab = VocabConfig(draft_vocab_size=len(seen) + 2, sizes=[64], argmax_positions=0,
                                   fill_from_corpora=True)
        out = run_one("vocab", recipe)
        _, t2d = load_vocab(out)
        assert t2d[torch.as_tensor(seen)].all() and t2d[int(unseen[1])] and t2d[int(unseen[0])]
        assert not t2d[int(unseen[2])] and int(t2d.sum()) == len(seen) + 2
        report = json.loads((out / "coverage.json").read_text())
        assert report["filled_from_corpora"] == 2 and report["distinct_train_tokens"] == len(seen)
        recipe.vocab = VocabConfig(draft_vocab_size=len(seen) + 9, sizes=[64], argmax_positions=0,
                                   fill_from_corpora=True)
        with pytest.raises(VocabError, match=f"original text hold {len(seen) + 3} distinct tokens, fewer than"):
            run_one("vocab", recipe)
    finally:
        save_file({"counts": written}, str(data_dir / REFERENCE_COUNTS))


def test_fill_from_corpora_needs_the_counts_prepare_writes(tmp_path):
    from eyas.data.vocab import read_reference_counts

    with pytest.raises(VocabError, match=r"reference_counts.safetensors does not exist .*rerun `eyas prepare`"):
        read_reference_counts(tmp_path, 8)
    save_file({"counts": torch.zeros(5, dtype=torch.long)}, str(tmp_path / "reference_counts.safetensors"))
    with pytest.raises(VocabError, match=r"tensor 'counts' must be 1-d with 8 entries .* got \(5,\)"):
        read_reference_counts(tmp_path, 8)
