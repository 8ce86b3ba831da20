"""The EAGLE-3 head: names, shapes, rope copied from the target, checkpoint round trip and refusal."""

import json

import pytest
import torch

from conftest import tiny_config
from eyas.heads.checkpoint import HeadMismatchError, load_head, save_head, serving_config
from eyas.heads.eagle3 import Eagle3Config, build_head

EXPECTED_NAMES = {
    "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
}


def make_head(arch="llama", draft_vocab=100):
    tc = tiny_config(arch, vocab_size=512, layers=8)
    cfg = Eagle3Config.from_target(tc, draft_vocab, [2, 4, 5])
    return build_head(cfg), tc


def test_parameter_names_and_shapes_match_the_serving_layout():
    head, tc = make_head()
    state = head.state_dict()
    assert set(state) == EXPECTED_NAMES  # the target embedding is not part of the head
    h, nh, nkv, hd = 64, 4, 2, 16
    assert state["fc.weight"].shape == (h, 3 * h)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (nh * hd, 2 * h)
    assert state["midlayer.self_attn.k_proj.weight"].shape == (nkv * hd, 2 * h)
    assert state["lm_head.weight"].shape == (100, h)
    assert state["d2t"].dtype == torch.int64 and state["d2t"].shape == (100,)
    assert state["t2d"].dtype == torch.bool and state["t2d"].shape == (512,)


def test_target_hidden_size_may_differ_from_the_head():
    tc = tiny_config("llama")
    cfg = Eagle3Config.from_target(tc, 50, [1, 2, 3], hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   num_key_value_heads=1)
    head = build_head(cfg)
    assert head.fc.weight.shape == (32, 3 * 64)
    logits, hidden = head(torch.randn(1, 5, 192), torch.randn(1, 5, 32), torch.arange(5)[None])
    assert logits.shape == (1, 5, 50) and hidden.shape == (1, 5, 32)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_rope_matches_the_targets_rotary_embedding(arch):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head, tc = make_head(arch)
    assert head.config.max_position_embeddings == tc.max_position_embeddings
    pos = torch.arange(0, 400, 7)[None]
    cos, sin = head.rope(pos, torch.float32)
    ref = LlamaRotaryEmbedding(LlamaConfig(**{**head.config.llama_config().to_dict()}))
    rcos, rsin = ref(torch.zeros(1, 1, head.config.head_dim), pos)
    torch.testing.assert_close(cos, rcos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, rsin, rtol=1e-5, atol=1e-5)
    if arch == "llama":  # llama3 scaling really is applied (frequencies differ from plain rope)
        assert head.config.rope_parameters["rope_type"] == "llama3"


def test_serving_config_writes_both_layer_id_conventions():
    head, _ = make_head()
    cfg = serving_config(head.config)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["norm_before_residual"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM: stream entering layer k
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang: output of layer i
    assert cfg["draft_vocab_size"] == 100 and cfg["vocab_size"] == 512
    assert cfg["num_hidden_layers"] == 1


def test_checkpoint_round_trip_is_exact(tmp_path):
    head, _ = make_head()
    d2t = torch.arange(100) * 2  # draft i -> target 3i
    t2d = torch.zeros(512, dtype=torch.bool)
    t2d[torch.arange(100) * 3] = True
    head.set_vocab(d2t, t2d)
    save_head(head, tmp_path / "h", {"tokenizer_hash": "abc"})
    loaded, meta = load_head(tmp_path / "h")
    assert meta["tokenizer_hash"] == "abc"
    for k, v in head.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    assert loaded.draft_to_target(torch.tensor([0, 5, 99])).tolist() == [0, 15, 297]
    # No temporary directories are left behind by the atomic write.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h"]


def test_loading_against_another_vocabulary_is_refused(tmp_path, smollm2):
    _, tok = smollm2
    head, _ = make_head()
    save_head(head, tmp_path / "h", {"tokenizer_hash": "not-this-tokenizer", "target": "x"})
    with pytest.raises(HeadMismatchError, match="tokenizer"):
        load_head(tmp_path / "h", tokenizer=tok)
    with pytest.raises(HeadMismatchError, match="512 tokens.*49152"):
        load_head(tmp_path / "h", target_vocab_size=49152)


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an eyas head"):
        load_head(tmp_path)
    head, _ = make_head()
    save_head(head, tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    del cfg["eyas_head_config"]
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="eyas_head_config"):
        load_head(tmp_path / "h")
