"""Tiny real pieces for the train tests: a random-weight Llama target, a draft vocab, batches and a head."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eyas.data.targets import logits_from_final_hidden, target_features
from eyas.heads.eagle3 import Eagle3Config, build_head
from reference_ttt import DenseTeacher

AUX_IDS = [1, 2, 3]


def tiny_target(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def draft_vocab_from(model, ids: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d): the `size` target ids the target predicts most often on `ids`, sorted by id."""
    _, final = target_features(model, ids, AUX_IDS)
    argmax = logits_from_final_hidden(model, final).argmax(-1).flatten()
    counts = torch.bincount(argmax, minlength=model.config.vocab_size)
    keep = counts.argsort(descending=True)[:size].sort().values
    d2t = keep - torch.arange(size)
    t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[keep] = True
    return d2t, t2d


def tiny_head(model, d2t, t2d, seed: int = 1):
    cfg = Eagle3Config.from_target(model.config, draft_vocab_size=len(d2t), aux_layer_ids=AUX_IDS)
    torch.manual_seed(seed)
    head = build_head(cfg)
    head.set_vocab(d2t, t2d)
    return head


def tiny_ids(model, batch: int = 3, seq: int = 16, seed: int = 2) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def tiny_batch(model, d2t, t2d, batch: int = 3, seq: int = 16, pad: int = 3, seed: int = 2):
    """A right-padded batch with a random loss mask, and the dense teacher over the draft vocab."""
    ids = tiny_ids(model, batch, seq, seed)
    g = torch.Generator().manual_seed(seed + 1)
    attention = torch.ones(batch, seq, dtype=torch.bool)
    attention[-1, seq - pad:] = False
    ids[~attention] = 0
    loss_mask = (torch.rand(batch, seq, generator=g) < 0.85).long() * attention.long()
    aux, final = target_features(model, ids, AUX_IDS, attention_mask=attention.long())
    full_logits = logits_from_final_hidden(model, final)
    draft_rows = torch.arange(len(d2t)) + d2t
    out = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attention, "aux": aux,
           "target_in_draft": t2d[full_logits.argmax(-1)]}
    return out, DenseTeacher(full_logits[..., draft_rows])


# ---- a whole tiny pipeline on disk: target dir, prepared data, vocab, recipe --------------------------------

REAL_TARGET = "smollm2-135m-instruct"
TEXT = (
    "Speculative decoding drafts several tokens with a small model and verifies them with the target in one "
    "forward pass. The draft head reads three hidden states of the target and predicts the next tokens. "
    "Training-time test feeds the head its own outputs so that it learns to continue its drafts. "
    "Acceptance length is the number of drafted tokens the target agrees with, plus one. "
)


def write_tiny_pipeline(root, n_train: int = 24, n_val: int = 8, draft_vocab: int = 128, seed: int = 0) -> dict:
    """A tiny random Llama target with the real SmolLM2 tokenizer, prepared data from real text, and a
    frequency-based draft vocab: everything the collect and train stages read. Returns the recipe dict."""
    import datasets
    from pathlib import Path
    from transformers import AutoTokenizer

    from eyas.data.targets import resolve_target
    from eyas.data.vocab import build_mapping, save_vocab
    from stage_outputs import mark_done

    root = Path(root)
    tokenizer = AutoTokenizer.from_pretrained(resolve_target(REAL_TARGET))
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")

    ids = tokenizer(TEXT * 4)["input_ids"]
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n_train + n_val):
        start = int(torch.randint(0, len(ids) - 48, (1,), generator=g))
        length = int(torch.randint(20, 40, (1,), generator=g))
        prompt = int(torch.randint(4, 10, (1,), generator=g))
        rows.append({"input_ids": ids[start:start + length], "loss_mask": [0] * prompt + [1] * (length - prompt),
                     "source": "inline", "record_id": f"r{i}", "category": "chat"})
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:n_train]),
                               "validation": datasets.Dataset.from_list(rows[n_train:])})
    out = root / "run"
    dd.save_to_disk(str(out / "data"))
    mark_done(out / "data")

    counts = torch.bincount(torch.tensor([t for r in rows[:n_train] for t in r["input_ids"]]), minlength=len(tokenizer))
    keep = counts.argsort(descending=True)[:draft_vocab].sort().values
    (out / "vocab").mkdir(parents=True)
    save_vocab(out / "vocab" / "vocab.safetensors", *build_mapping(keep, len(tokenizer)))
    mark_done(out / "vocab")
    return {
        "name": "tiny", "output_dir": str(out),
        "target": {"name_or_path": str(root / "target"), "aux_layer_ids": [0, 1, 2]},
        "vocab": {"draft_vocab_size": draft_vocab},
        "collect": {"mode": "offline", "batch_size": 4},
        "train": {"ttt_steps": 3, "batch_size": 2, "max_steps": 6, "eval_every": 3, "save_every": 3, "log_every": 1,
                  "lr": 3e-3, "warmup_steps": 1, "eval_max_batches": 2},
    }


def write_recipe(path, recipe: dict):
    import yaml
    from pathlib import Path

    Path(path).write_text(yaml.safe_dump(recipe))
    return path


def shared_pipeline(tmp_path_factory) -> dict:
    """The tiny pipeline with its features collected, built once per test session (all train tests reuse it)."""
    import filelock  # ships with huggingface_hub

    from eyas.recipe import Recipe, from_dict
    from eyas.stages import run_one

    root = tmp_path_factory.getbasetemp() / "train-pipeline"
    root.mkdir(exist_ok=True)
    with filelock.FileLock(str(root) + ".lock"):
        recipe_file = root / "recipe.yaml"
        if not recipe_file.exists():
            recipe = write_tiny_pipeline(root)
            reset_accelerate()
            run_one("collect", from_dict(Recipe, recipe))
            write_recipe(recipe_file, recipe)
    import yaml

    return yaml.safe_load(recipe_file.read_text())


def fresh_run(recipe: dict, dest, **train) -> dict:
    """A copy of the pipeline's inputs (data, vocab, features) under `dest`, so each run has its own head/."""
    import copy
    import shutil
    from pathlib import Path

    out = Path(dest) / "run"
    for stage in ("data", "vocab", "features"):
        shutil.copytree(Path(recipe["output_dir"]) / stage, out / stage)
    recipe = copy.deepcopy(recipe)
    recipe["output_dir"] = str(out)
    recipe["train"].update(train)
    return recipe


def reset_accelerate() -> None:
    """accelerate keeps process-wide singletons; in-process runs with other settings need them cleared."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def read_metrics(head_dir, kind: str = "train") -> list[dict]:
    import json
    from pathlib import Path

    lines = (Path(head_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]
