"""The recipe schema, checked at load: choices, ranges, mappings, overrides and removed keys, each refused in one
line naming the key path, before any stage (or model) runs."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml

from eyas.cli import main
from eyas.configbase import RULES, ConfigError, from_dict, to_dict
from eyas.data.config import CorpusConfig, DataConfig
from eyas.heads.config import ExportConfig
from eyas.recipe import Recipe, dump_recipe, list_recipes, load_recipe

BASE = "smollm2-135m-cpu"


def refused(overrides: list[str], recipe: str | None = BASE) -> str:
    with pytest.raises(ConfigError) as info:
        load_recipe(recipe, overrides)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def recipe_file(tmp_path, text: str) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return str(path)


# ---- choices ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ("collect.mode=onlin", "collect.mode: 'onlin' is not one of offline, online (did you mean 'online'?)"),
    ("collect.teacher=top_k", "collect.teacher: 'top_k' is not one of last_hidden, topk (did you mean 'topk'?)"),
    ("collect.topk_dtype=float8", "collect.topk_dtype: 'float8' is not one of float16, fp16, bfloat16, bf16 "
                                   "(did you mean 'float16'?)"),
    ("collect.feature_dtype=int8", "collect.feature_dtype: 'int8' is not one of bfloat16, bf16, float8_e4m3, "
                                   "float8_e4m3fn, fp8"),
    ("bench.decoder.mode=beam", "bench.decoder.mode: 'beam' is not one of chain, tree"),
    ("bench.linear_kernels=fast", "bench.linear_kernels: 'fast' is not one of auto, off"),
    ("train.resume=always", "train.resume: 'always' is not one of auto, never"),
    ("train.mixed_precision=fp8", "train.mixed_precision: 'fp8' is not one of auto, fp32, no, bf16, fp16"),
    ("train.trackers=[tensorboard, wandbb]", "train.trackers[1]: 'wandbb' is not one of wandb, tensorboard, trackio, "
                                             "none (did you mean 'wandb'?)"),
    ("export.formats=[sglang, onnx]", "export.formats[1]: 'onnx' is not one of sglang, vllm, speculators"),
    ("export.dtype=int8", "export.dtype: 'int8' is not one of bfloat16, float16, float32"),
    ("target.dtype=double", "target.dtype: 'double' is not one of auto, float32, fp32, bfloat16, bf16, float16, fp16"),
    ("target.device_map=everywhere", "target.device_map: 'everywhere' is not one of auto, balanced, balanced_low_0, "
                                     "sequential"),
    ("data.overflow=wrap", "data.overflow: 'wrap' is not one of truncate, drop"),
    ("target.device=gpu", "target.device: 'gpu' is not auto, cpu, cuda or cuda:N"),
])
def test_invalid_choice_names_the_valid_ones(override, message):
    assert refused([override]) == message


def test_device_takes_an_index():
    assert load_recipe(BASE, ["target.device=cuda:1"]).target.device == "cuda:1"
    assert refused(["target.device=cuda:x"]) == "target.device: 'cuda:x' is not auto, cpu, cuda or cuda:N"


# ---- ranges ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ("train.batch_size=0", "train.batch_size: must be >= 1, got 0"),
    ("train.grad_accum=0", "train.grad_accum: must be >= 1, got 0"),
    ("train.eval_every=0", "train.eval_every: must be >= 1, got 0"),
    ("train.ttt_steps=0", "train.ttt_steps: must be >= 1, got 0"),
    ("train.epochs=-1", "train.epochs: must be > 0, got -1.0"),
    ("train.epochs=0", "train.epochs: must be > 0, got 0.0"),
    ("train.lr=0", "train.lr: must be > 0, got 0.0"),
    ("train.warmup_steps=-1", "train.warmup_steps: must be >= 0, got -1"),
    ("train.max_steps=0", "train.max_steps: must be >= 1, got 0"),
    ("train.betas=[0.9, 1.0]", "train.betas[1]: must be >= 0 and < 1, got 1.0"),
    ("train.betas=[0.9]", "train.betas: expected 2 items, got 1"),
    ("data.validation_fraction=1", "data.validation_fraction: must be >= 0 and < 1, got 1.0"),
    ("data.max_length=1", "data.max_length: must be >= 2, got 1"),
    ("data.max_length=8", "data.min_assistant_tokens: must be below max_length (8), got 8"),
    ("data.corpora=[{kind: sharegpt, weight: 0}]", "data.corpora[0].weight: must be > 0 and <= 1, got 0.0"),
    ("data.corpora=[]", "data.corpora: expected at least 1 item(s), got 0"),
    ("vocab.sizes=[1024, 0]", "vocab.sizes[1]: must be >= 1, got 0"),
    ("collect.batch_size=0", "collect.batch_size: must be >= 1, got 0"),
    ("bench.decoder.top_p=0", "bench.decoder.top_p: must be > 0 and <= 1, got 0.0"),
    ("bench.decoder.top_p=1.5", "bench.decoder.top_p: must be > 0 and <= 1, got 1.5"),
    ("bench.decoder.temperature=-0.1", "bench.decoder.temperature: must be >= 0, got -0.1"),
    ("bench.decoder.num_speculative_tokens=0", "bench.decoder.num_speculative_tokens: must be >= 1, got 0"),
    ("bench.decoder.depth=0", "bench.decoder.depth: must be >= 1, got 0"),
    ("bench.decoder.topk=0", "bench.decoder.topk: must be >= 1, got 0"),
    ("bench.decoder.budget=0", "bench.decoder.budget: must be >= 1, got 0"),
    ("bench.decoder.min_draft_prob=1", "bench.decoder.min_draft_prob: must be >= 0 and < 1, got 1.0"),
    ("gate.min_alpha=1.5", "gate.min_alpha: must be >= 0 and <= 1, got 1.5"),
    ("gate.weights={chat: 0.7, code: -1}", "gate.weights.code: must be >= 0, got -1.0"),
    ("export.num_speculative_tokens=0", "export.num_speculative_tokens: must be >= 1, got 0"),
    ("train.lr=.nan", "train.lr: expected a finite number, got nan"),
])
def test_out_of_range_values_are_refused_with_the_key_path(override, message):
    assert refused([override]) == message


def test_range_boundaries_are_accepted():
    r = load_recipe(BASE, ["data.validation_fraction=0", "bench.decoder.top_p=1", "gate.min_alpha=0",
                           "train.warmup_steps=0", "bench.decoder.temperature=0", "gate.min_alpha=null",
                           "train.lr=3e-4"])  # YAML 1.1 reads 3e-4 as a string; it is still a number here
    assert (r.data.validation_fraction, r.bench.decoder.top_p, r.gate.min_alpha, r.train.lr) == (0.0, 1.0, None, 3e-4)


def test_cross_field_rules():
    assert load_recipe(BASE, ["head.num_attention_heads=6"]).head.num_attention_heads == 6  # kv heads: the target's
    assert refused(["head.num_attention_heads=6", "head.num_key_value_heads=4"]) == \
        "head.num_key_value_heads: must divide num_attention_heads (6), got 4"


# ---- sections and list items that are not mappings --------------------------------------------------------------

def test_scalar_section_in_a_file_and_on_the_command_line(tmp_path):
    assert refused([], recipe_file(tmp_path, "train: 5\n")) == "train: expected a mapping of keys, got 5"
    assert refused(["train=5"]) == "train: expected a mapping of keys, got 5"
    assert refused(["bench.decoder=3"]) == "bench.decoder: expected a mapping of keys, got 3"
    assert refused(["data.corpora=[sharegpt]"]) == "data.corpora[0]: expected a mapping of keys, got 'sharegpt'"
    assert refused(["train.lr=1"], recipe_file(tmp_path, "train: 5\n")) == "override 'train.lr=1': 'train' is not a section"


def test_an_empty_section_keeps_the_defaults(tmp_path):
    path = recipe_file(tmp_path, "train:\nbench:\n")
    assert load_recipe(path).train == Recipe().train
    assert load_recipe(path, ["train.lr=0.5"]).train.lr == 0.5


def test_malformed_override_value_is_one_line_naming_it():
    message = refused(["train.betas=[0.9, 0.95"])
    assert message.startswith("override 'train.betas=[0.9, 0.95': the value is not valid YAML: ")
    assert refused(["train.=3"]) == "override 'train.=3': 'train.' is not a key path such as train.lr"


def test_malformed_recipe_file_is_one_line(tmp_path):
    path = recipe_file(tmp_path, "train:\n  lr: [1\n")
    assert refused([], path).startswith(f"{path}: not valid YAML: ")


# ---- on/off ----------------------------------------------------------------------------------------------------

def test_off_and_no_unquoted_mean_the_word(tmp_path):
    path = recipe_file(tmp_path, f"base: {BASE}\nbench:\n  linear_kernels: off\ntrain:\n  mixed_precision: no\n")
    r = load_recipe(path)
    assert (r.bench.linear_kernels, r.train.mixed_precision) == ("off", "no")
    r = load_recipe(BASE, ["bench.linear_kernels=off", "train.mixed_precision=no"])
    assert (r.bench.linear_kernels, r.train.mixed_precision) == ("off", "no")
    assert load_recipe(BASE, ["bench.linear_kernels='off'"]).bench.linear_kernels == "off"
    # `on` is no choice of linear_kernels, and `false` is no word of resume: refused, saying what YAML read.
    assert refused(["bench.linear_kernels=on"]) == ("bench.linear_kernels: true is not one of auto, off "
                                                    "(YAML reads unquoted on/off/yes/no as true/false)")
    assert refused(["train.resume=false"]).startswith("train.resume: false is not one of auto, never")
    # The shipped recipes that pin the stock matmul write the documented unquoted form.
    assert load_recipe("smollm2-135m-code").bench.linear_kernels == "off"


# ---- nested corpus items ---------------------------------------------------------------------------------------

def test_nested_corpus_item_unknown_kind_and_key(tmp_path):
    path = recipe_file(tmp_path, "data:\n  corpora:\n    - kind: sharegptt\n")
    assert refused([], path) == ("data.corpora[0].kind: 'sharegptt' is not one of sharegpt, chitchat, json, jsonl, "
                                 "hf, humaneval, stdlib, text, code (did you mean 'sharegpt'?)")
    path = recipe_file(tmp_path, "data:\n  corpora:\n    - kind: stdlib\n    - kind: json\n      pth: x.json\n")
    assert refused([], path) == "unknown key 'data.corpora[1].pth' (did you mean 'path'?)"
    cfg = from_dict(DataConfig, {"corpora": [{"kind": "stdlib", "max_records": 5}]}, "data")
    assert cfg.corpora == [CorpusConfig(kind="stdlib", max_records=5)]


# ---- removed keys and defaults ---------------------------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ("seed=1", "seed: no longer a setting (nothing read it: each section has its own seed); delete it"),
    ("push.repo_id=org/name", "push: no longer a setting (`eyas push` takes its settings as flags: --repo-id, "
                              "--private); delete it"),
    ("train.num_workers=2", "train.num_workers: no longer a setting (it was never read); delete it"),
])
def test_removed_keys_say_why(override, message):
    assert refused([override]) == message


def test_export_formats_default_is_a_list():
    assert ExportConfig().formats == ["sglang", "speculators"]
    assert load_recipe(None).export.formats == ["sglang", "speculators"]


def _config_classes(cls=Recipe, seen=None):
    seen = seen if seen is not None else []
    if cls not in seen:
        seen.append(cls)
        for hint in typing.get_type_hints(cls).values():
            for t in (hint, *typing.get_args(hint)):
                if dataclasses.is_dataclass(t):
                    _config_classes(t, seen)
    return seen


def test_defaults_fit_the_schema_and_every_rule_is_known():
    assert from_dict(Recipe, to_dict(Recipe())) == Recipe()
    classes = _config_classes()
    assert CorpusConfig in classes and len(classes) >= 11
    for cls in classes:
        for f in dataclasses.fields(cls):
            assert set(f.metadata) <= set(RULES), f"{cls.__name__}.{f.name}: {dict(f.metadata)}"


def test_every_shipped_recipe_round_trips_through_show():
    for name in list_recipes():
        recipe = load_recipe(name)
        assert from_dict(Recipe, yaml.safe_load(dump_recipe(recipe))) == recipe, name


# ---- the command line: one line, exit 2, nothing loaded --------------------------------------------------------

@pytest.fixture
def no_model_loads(monkeypatch):
    from eyas.data import targets

    def forbidden(*args, **kwargs):
        raise AssertionError("a target was resolved or loaded before the recipe was checked")

    monkeypatch.setattr(targets.Target, "resolve", classmethod(forbidden))
    monkeypatch.setattr(targets.Target, "load_model", forbidden)
    monkeypatch.setattr(targets, "load_target", forbidden)


@pytest.mark.parametrize("argv, message", [
    (["recipe", "show", BASE, "train.batch_size=0"], "eyas recipe: error: train.batch_size: must be >= 1, got 0"),
    (["recipe", "show", BASE, "bench.decoder.mode=beam"],
     "eyas recipe: error: bench.decoder.mode: 'beam' is not one of chain, tree"),
    (["recipe", "show", BASE, "train.betas=[0.9, 0.95"],
     "eyas recipe: error: override 'train.betas=[0.9, 0.95': the value is not valid YAML: "),
    (["run", BASE, "bench.decoder.mode=beam"], "eyas run: error: bench.decoder.mode: 'beam' is not one of chain, tree"),
    (["train", BASE, "train=5"], "eyas train: error: train: expected a mapping of keys, got 5"),
])
def test_cli_prints_one_line_and_exits_2_before_any_model_loads(argv, message, capsys, tmp_path, no_model_loads):
    assert main(argv + [f"output_dir={tmp_path / 'run'}"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(message), err
    assert not (tmp_path / "run").exists()


def test_cli_recipe_show_accepts_documented_off(capsys):
    assert main(["recipe", "show", BASE, "bench.linear_kernels=off"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["bench"]["linear_kernels"] == "off"
