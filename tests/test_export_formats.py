"""Export to sglang/vllm/speculators: names, configs, the loader-side validator, snippets, round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from eyas.eval.report import ReportError, serving_settings
from eyas.heads.checkpoint import WEIGHTS, head_content_hash, save_head
from eyas.heads.eagle3 import Eagle3Config, build_head
from eyas.heads.export import (
    EXPORT_METADATA,
    FORMATS,
    ExportValidationError,
    decoding_settings,
    export_head,
    load_exported,
    validate_export,
)
from test_gate_checks import crafted_report, write_report


def tiny_target(folder: Path, seed: int = 0, config: LlamaConfig | None = None) -> tuple[LlamaForCausalLM, Path]:
    """A random 6-layer Llama (300 tokens) saved like a real target (config + safetensors)."""
    torch.manual_seed(seed)
    cfg = config or LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      num_hidden_layers=6, vocab_size=300, max_position_embeddings=4096, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    return model, folder


def tiny_head_dir(folder: Path, target: LlamaForCausalLM, target_dir: Path, draft_vocab: int = 100,
                  seed: int = 1) -> Path:
    """A random head on `target` with a trimmed vocabulary, saved as a native head."""
    torch.manual_seed(seed)
    c = Eagle3Config.from_target(target.config, draft_vocab_size=draft_vocab, aux_layer_ids=[2, 3, 4])
    head = build_head(c)
    with torch.no_grad():  # non-trivial norms, so a swapped norm tensor changes the logits
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randperm(c.vocab_size)[:draft_vocab].sort().values
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    head.set_vocab(ids - torch.arange(draft_vocab), t2d)
    return save_head(head, folder, {"target": str(target_dir)})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    target, target_dir = tiny_target(root / "target")
    head_dir = tiny_head_dir(root / "head", target, target_dir)
    return root, target, target_dir, head_dir


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_gives_identical_tensors(setup, fmt, dtype):
    root, _, _, head_dir = setup
    out = export_head(head_dir, fmt, root / f"rt-{fmt}-{dtype}", dtype=dtype)
    native = load_file(str(head_dir / WEIGHTS))
    written = load_file(str(out / WEIGHTS))
    assert written["d2t"].dtype == torch.int64 and written["t2d"].dtype == torch.bool
    want = getattr(torch, dtype)
    assert all(t.dtype == want for k, t in written.items() if k not in ("d2t", "t2d"))
    back, info = load_exported(out, dtype=want)
    assert info["source_head_hash"] == head_content_hash(head_dir)
    got = back.state_dict()
    assert set(got) == set(native)
    for name, tensor in native.items():
        expect = tensor.to(want) if tensor.is_floating_point() else tensor
        assert torch.equal(got[name], expect), name


def test_sglang_vllm_config_has_both_layer_conventions_and_target_rope(setup):
    root, target, _, head_dir = setup
    out = export_head(head_dir, "sglang", root / "sg")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["norm_before_residual"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]  # vLLM: stream entering layer k
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # SGLang: output of layer k-1
    assert cfg["max_position_embeddings"] == 4096
    assert cfg["rope_theta"] == 50000.0
    assert cfg["draft_vocab_size"] == 100 and cfg["vocab_size"] == 300
    assert cfg["torch_dtype"] == "bfloat16"
    assert "eyas_head_config" not in cfg  # eyas-only keys stay in eyas_export.json
    names = set(load_file(str(out / WEIGHTS)))
    assert "midlayer.self_attn.q_proj.weight" in names and not any(n.startswith("layers.") for n in names)
    assert "embed_tokens.weight" not in names


def test_speculators_config_and_names(setup):
    root, _, target_dir, head_dir = setup
    report = write_report(root / "chain-bench", crafted_report(alpha_chain_length=3))
    out = export_head(head_dir, "speculators", root / "spec", settings=serving_settings(report))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["norm_before_residual"] is False
    assert cfg["target_hidden_size"] == 64 and cfg["draft_vocab_size"] == 100
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == 300
    spec = cfg["speculators_config"]
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 3}]
    assert spec["default_proposal_method"] == "greedy"
    assert spec["verifier"] == {"name_or_path": str(target_dir), "architectures": ["LlamaForCausalLM"]}
    names = set(load_file(str(out / WEIGHTS)))
    assert "layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer.") for n in names)
    assert "embed_tokens.weight" in names  # the target's, so `speculators` needs no fallback


def rewrite_weights(folder: Path, edit) -> None:
    tensors = load_file(str(folder / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(folder / WEIGHTS))


def test_validator_catches_renamed_tensor(setup):
    root, _, _, head_dir = setup
    out = export_head(head_dir, "sglang", root / "renamed")
    assert validate_export(out) == "sglang"
    rewrite_weights(out, lambda t: t.__setitem__("midlayer.mlp.upproj.weight", t.pop("midlayer.mlp.up_proj.weight")))
    with pytest.raises(ExportValidationError) as err:
        validate_export(out)
    assert "midlayer.mlp.upproj.weight" in str(err.value) and "midlayer.mlp.up_proj.weight" in str(err.value)


def test_validator_refuses_layers0_names_in_sglang_dir(setup):
    """SGLang would silently skip layers.0.* and serve a random midlayer."""
    root, _, _, head_dir = setup
    out = export_head(head_dir, "sglang", root / "l0")
    rewrite_weights(out, lambda t: t.update({k.replace("midlayer.", "layers.0."): t.pop(k)
                                             for k in [k for k in t if k.startswith("midlayer.")]}))
    with pytest.raises(ExportValidationError, match="unknown tensors.*layers.0.self_attn.q_proj.weight"):
        validate_export(out)


def test_validator_catches_wrong_shape(setup):
    root, _, _, head_dir = setup
    out = export_head(head_dir, "speculators", root / "shape", dtype="float32")
    rewrite_weights(out, lambda t: t.__setitem__("fc.weight", t["fc.weight"][:, :128].contiguous()))
    with pytest.raises(ExportValidationError, match=r"'fc.weight': shape \(64, 128\).*\(64, 192\)"):
        validate_export(out)


def test_validator_catches_non_finite_weights(setup):
    root, _, _, head_dir = setup
    out = export_head(head_dir, "sglang", root / "nan")
    rewrite_weights(out, lambda t: t["norm.weight"].__setitem__(3, float("nan")))
    with pytest.raises(ExportValidationError, match="'norm.weight': has NaN"):
        validate_export(out)


def test_validator_catches_inconsistent_vocab_mapping(setup):
    root, _, _, head_dir = setup
    out = export_head(head_dir, "vllm", root / "vocab")
    rewrite_weights(out, lambda t: t.__setitem__("t2d", torch.zeros_like(t["t2d"])))
    with pytest.raises(ExportValidationError, match="d2t and t2d disagree"):
        validate_export(out)


def test_failed_export_leaves_existing_output_untouched(setup, tmp_path):
    root, target, target_dir, _ = setup
    bad_head = tiny_head_dir(tmp_path / "bad", target, target_dir)
    rewrite_weights(bad_head, lambda t: t.__setitem__("d2t", t["d2t"] + 10_000))  # maps outside the vocabulary
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(ExportValidationError, match="outside the target vocabulary"):
        export_head(bad_head, "sglang", out)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_snippets_use_bench_settings(setup):
    root, _, _, head_dir = setup
    report = write_report(root / "tree-bench", crafted_report(
        alpha_chain_length=3, decoder={"mode": "tree", "num_speculative_tokens": 4, "depth": 5, "topk": 4, "budget": 16}))
    out = export_head(head_dir, "sglang", root / "snip", settings=serving_settings(report), verifier="org/target")
    serving = (out / "SERVING.md").read_text()
    assert (f"python -m sglang.launch_server --model org/target --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path <path to this folder> --speculative-num-steps 5 --speculative-eagle-topk 4 "
            f"--speculative-num-draft-tokens 17") in serving
    vllm = json.dumps({"method": "eagle3", "model": "<path to this folder>", "num_speculative_tokens": 3})
    assert f"vllm serve org/target --speculative-config '{vllm}'" in serving
    assert serving.split("\n\n", 1)[1] in (out / "README.md").read_text()
    info = json.loads((out / EXPORT_METADATA).read_text())
    assert info["bench_report"] == str(report.resolve())
    assert info["settings"]["from_report"] is True and "report" not in info["settings"]
    assert "the best settings of the bench report" in serving


def test_serving_settings_come_from_the_report_or_chain_defaults(tmp_path):
    defaults = {"mode": "chain", "num_speculative_tokens": 4, "from_report": False, "report": None, "depth": 4,
                "topk": 1, "num_draft_tokens": 5}
    assert serving_settings(tmp_path / "absent.json", None) == defaults == decoding_settings()
    assert serving_settings(None, num_speculative_tokens=2)["num_draft_tokens"] == 3
    chain = write_report(tmp_path / "chain", crafted_report(alpha_chain_length=3))
    got = serving_settings(chain, None)
    # K is the chain length alpha was measured at (the one meant for serving), not the decoder's own K.
    assert got == dict(defaults, num_speculative_tokens=3, depth=3, num_draft_tokens=4, from_report=True,
                       report=str(chain.resolve()))
    assert serving_settings(chain, num_speculative_tokens=2)["num_draft_tokens"] == 3  # the override wins
    tree = write_report(tmp_path / "tree", crafted_report(
        decoder={"mode": "tree", "num_speculative_tokens": 4, "depth": 2, "topk": 2, "budget": 16}))
    assert serving_settings(tree)["num_draft_tokens"] == 5  # SGLang caps draft tokens at depth * topk + 1
    stale = crafted_report()
    del stale["decoder"]["budget"]
    with pytest.raises(ReportError, match="field 'decoder.budget' is missing"):
        serving_settings(write_report(tmp_path / "stale", stale))


def test_third_party_export_loads_without_eyas_metadata(setup):
    root, _, _, head_dir = setup
    for fmt in ("sglang", "speculators"):
        out = export_head(head_dir, fmt, root / f"bare-{fmt}", dtype="float32")
        (out / EXPORT_METADATA).unlink()
        head, info = load_exported(out)
        assert info == {}
        native = load_file(str(head_dir / WEIGHTS))
        assert all(torch.equal(head.state_dict()[k], v) for k, v in native.items())
        assert head.config.aux_layer_ids == [2, 3, 4] and head.config.rope_parameters["rope_theta"] == 50000.0


def test_cli_export_writes_each_format(setup):
    from eyas.cli import main

    root, _, _, head_dir = setup
    out = root / "cli"
    assert main(["export", str(head_dir), "--format", "sglang", "--format", "speculators", "--out", str(out)]) == 0
    assert validate_export(out / "sglang") == "sglang"
    assert validate_export(out / "speculators") == "speculators"
    assert main(["export", str(root / "missing"), "--format", "vllm", "--out", str(root / "x")]) == 2
    report = write_report(root / "cli-bench", crafted_report(alpha_chain_length=3))
    assert main(["export", str(head_dir), "--format", "speculators", "--out", str(root / "cli-k"),
                 "--report", str(report), "--num-speculative-tokens", "2"]) == 0
    spec = json.loads((root / "cli-k" / "config.json").read_text())["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 2


def test_verifier_is_a_hub_id_or_path_never_an_eyas_short_name():
    from eyas.heads.export import resolve_verifier

    assert resolve_verifier(None, {"target": "smollm2-135m-instruct"}) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_verifier("smollm2-135m-instruct", {}) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_verifier("org/model", {"target": "smollm2-135m-instruct"}) == "org/model"
    assert resolve_verifier(None, {"target": "/data/my-target"}) == "/data/my-target"


def test_engine_limits_are_refused_before_writing(setup, tmp_path):
    root, target, target_dir, _ = setup
    narrow = Eagle3Config.from_target(target.config, draft_vocab_size=300, aux_layer_ids=[2, 3, 4], hidden_size=32,
                                      num_attention_heads=2, num_key_value_heads=2)
    head = build_head(narrow)
    head.set_vocab(torch.zeros(300, dtype=torch.long), torch.ones(300, dtype=torch.bool))
    narrow_dir = save_head(head, tmp_path / "narrow", {"target": str(target_dir)})
    with pytest.raises(ExportValidationError, match="draft hidden size \\(32\\) to equal the target's \\(64\\)"):
        export_head(narrow_dir, "speculators", tmp_path / "spec")
    assert not (tmp_path / "spec").exists()
    out = export_head(narrow_dir, "vllm", tmp_path / "vllm")  # vLLM/SGLang take target_hidden_size for fc
    assert json.loads((out / "config.json").read_text())["target_hidden_size"] == 64

    biased = Eagle3Config.from_target(target.config, draft_vocab_size=300, aux_layer_ids=[2, 3, 4])
    biased.attention_bias = True
    head = build_head(biased)
    head.set_vocab(torch.zeros(300, dtype=torch.long), torch.ones(300, dtype=torch.bool))
    biased_dir = save_head(head, tmp_path / "biased", {"target": str(target_dir)})
    with pytest.raises(ExportValidationError, match="SGLang's EAGLE-3 loader has no attention/MLP bias"):
        export_head(biased_dir, "sglang", tmp_path / "sg")
    vllm_dir = export_head(biased_dir, "vllm", tmp_path / "vb")
    assert "midlayer.self_attn.q_proj.bias" in load_file(str(vllm_dir / WEIGHTS))
    # Full vocabulary: speculators allocates no d2t/t2d, so none are written; loading back gives the identity.
    spec = export_head(biased_dir, "speculators", tmp_path / "full-vocab", dtype="float32")
    assert {"d2t", "t2d"}.isdisjoint(load_file(str(spec / WEIGHTS)))
    back, _ = load_exported(spec)
    assert torch.equal(back.draft_target_ids(), torch.arange(300)) and bool(back.t2d.all())
