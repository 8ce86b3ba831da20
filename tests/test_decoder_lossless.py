"""Greedy speculative decoding is token-for-token the target's greedy decoding (fp32), in both modes,
on tiny random Llama/Qwen2/Gemma3 targets and on the real SmolLM2 target, with heads fitted just enough
that drafts are accepted (so the KV gather/crop paths really run)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_target
from eyas.data.config import TargetConfig
from eyas.data.targets import Target, aux_layer_ids_for, target_features
from eyas.eval.config import DecoderConfig
from eyas.eval.autotune import autotune
from eyas.eval.decoder import PlainDecoder, SpeculativeDecoder
from eyas.eval.target_runner import TargetRunner
from eyas.heads.eagle3 import Eagle3Config, build_head, embed

VOCAB = 256
AUX = [1, 3, 4]


@pytest.fixture(scope="session")
def tokenizer():
    return Target.resolve(TargetConfig()).tokenizer


def new_head(model, draft_ids: torch.Tensor | None = None, seed: int = 0, aux_layer_ids=AUX):
    """A random head; `draft_ids` (sorted target ids) trims its vocabulary through d2t/t2d."""
    vocab = model.config.vocab_size
    draft_ids = torch.arange(vocab) if draft_ids is None else draft_ids
    torch.manual_seed(seed)
    head = build_head(Eagle3Config.from_target(model.config, draft_vocab_size=len(draft_ids),
                                               aux_layer_ids=aux_layer_ids))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    head.set_vocab(draft_ids - torch.arange(len(draft_ids)), t2d)
    return head


def greedy_sequences(model, tokenizer, prompts, new_tokens) -> list[torch.Tensor]:
    plain = PlainDecoder(model, tokenizer, DecoderConfig(max_new_tokens=new_tokens))
    plain.eos_ids = set()  # full length: more text to fit on
    return [torch.cat([p[0], torch.tensor(plain.generate(p).tokens)])[None] for p in prompts]


def fit_head(model, head, seqs: list[torch.Tensor], steps: int = 120, lr: float = 1e-2) -> float:
    """Overfit the head's first step on the target's own greedy text: enough for drafts to be accepted."""
    t2d_index = torch.cumsum(head.t2d.long(), 0) - 1  # target id -> draft id
    batches = []
    for seq in seqs:
        aux, _ = target_features(model, seq, list(head.config.aux_layer_ids))
        labels = torch.where(head.t2d[seq[:, 2:]], t2d_index[seq[:, 2:]], -100)
        batches.append((aux[:, :-2], embed(model.get_input_embeddings().weight, seq[:, 1:-1]), labels,
                        torch.arange(seq.shape[1] - 2)[None]))
    head.train().requires_grad_(True)
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    for _ in range(steps):
        loss = sum(F.cross_entropy(head(aux, emb, pos)[0][0], labels[0], ignore_index=-100)
                   for aux, emb, labels, pos in batches) / len(batches)
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval().requires_grad_(False)
    return loss.item()


def random_prompts(n, length=8, seed=1, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, length), generator=g) for _ in range(n)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def fitted(request, tokenizer):
    """(target, fitted head, prompts it was fitted on) for one architecture."""
    model = tiny_target(request.param, VOCAB)
    prompts = random_prompts(3)
    head = new_head(model)
    fit_head(model, head, greedy_sequences(model, tokenizer, prompts, 32), steps=50, lr=3e-2)
    return request.param, model, head, prompts


@pytest.mark.parametrize("shape", [dict(mode="chain", num_speculative_tokens=3),
                                   dict(mode="tree", depth=4, topk=3, budget=10),
                                   # the cheapest shapes CPU autotune tries: one draft token, or two candidates
                                   dict(mode="chain", num_speculative_tokens=1),
                                   dict(mode="tree", depth=1, topk=2, budget=2)])
def test_greedy_is_target_greedy_on_tiny_targets(fitted, tokenizer, shape):
    arch, model, head, fitted_prompts = fitted
    cfg = DecoderConfig(max_new_tokens=32, **shape)
    plain, spec = PlainDecoder(model, tokenizer, cfg), SpeculativeDecoder(model, head, tokenizer, cfg)
    depth = shape.get("depth", shape.get("num_speculative_tokens"))
    accepted, accepted_deep = 0, 0
    for ids in fitted_prompts + random_prompts(2, length=5, seed=7):
        want = plain.generate(ids)
        got = spec.generate(ids)
        assert got.tokens == want.tokens, f"{arch} {shape}: speculative output differs from plain greedy"
        assert got.finish_reason == want.finish_reason
        # Every step yields its accepted drafts plus one target token; the first token comes from prefill.
        assert len(got.tokens) <= 1 + got.accepted_tokens + (got.target_forwards - 1)
        assert got.accepted_tokens == sum(got.accepted_per_position)
        assert all(a <= r for a, r in zip(got.accepted_per_position, got.reached_per_position))
        assert len(got.accepted_per_position) == depth
        accepted += got.accepted_tokens
        accepted_deep += sum(got.accepted_per_position[1:])
    assert accepted > 0, f"{arch} {shape}: no draft accepted; the test proves nothing"
    # The gather of accepted tree rows into the cache ran, beyond depth 1.
    assert depth == 1 or accepted_deep > 0, f"{arch} {shape}: no draft accepted beyond depth 1; the test proves nothing"
    hf = model.generate(ids, do_sample=False, max_new_tokens=32, eos_token_id=sorted(plain.eos_ids), pad_token_id=0)
    assert want.tokens == hf[0, ids.shape[1]:].tolist(), f"{arch}: plain decoder differs from HF generate"


def test_head_cache_holds_target_features_of_accepted_tokens(fitted, tokenizer):
    """After decoding, the head k/v of every accepted position equals a fresh pass over target features."""
    _, model, head, prompts = fitted
    spec = SpeculativeDecoder(model, head, tokenizer, DecoderConfig(mode="tree", depth=4, topk=3, budget=10,
                                                                  max_new_tokens=24))
    attributes = {name: id(value) for name, value in vars(spec).items()}
    call = spec.decode(prompts[0])
    got = call.stats
    assert got.accepted_tokens > 0
    seq = torch.cat([prompts[0][0], torch.tensor(got.tokens)])[None]
    n = call.head_k.shape[2]
    aux, _ = target_features(model, seq[:, :n], AUX)
    _, k, v, _ = head.qkv(head.fuse(aux), embed(model.get_input_embeddings().weight, seq[:, 1:n + 1]),
                          torch.arange(n)[None])
    torch.testing.assert_close(call.head_k, k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(call.head_v, v, atol=1e-4, rtol=1e-4)
    # The call's caches live in its own state: the decoder object is left exactly as it was.
    assert {name: id(value) for name, value in vars(spec).items()} == attributes
    assert call.seq[:seq.shape[1]].tolist() == seq[0].tolist()
    assert call.target.length == call.seq.shape[0] - 1  # every token but the newest went through the target


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_kept_tree_rows_match_a_sequential_cache(arch):
    """Verifying a tree and keeping one branch leaves the cache a plain forward of that branch would."""
    model = tiny_target(arch, VOCAB)
    prefix = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(3))
    # Root r, then nodes a (child of r), b (child of r), c (child of b), d (child of c): keep r, b, c, d.
    tokens = torch.tensor([[11, 12, 13, 14, 15]])
    positions = torch.tensor([[20, 21, 21, 22, 23]])
    allowed = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0], [1, 0, 1, 1, 1]],
                           dtype=torch.bool)
    tree = TargetRunner(model, AUX)
    tree.forward(prefix, torch.arange(20)[None])
    tree_logits, tree_aux = tree.forward(tokens, positions, allowed)
    tree.keep(20, torch.tensor([0, 2, 3, 4]))
    seq = TargetRunner(model, AUX)
    seq.forward(prefix, torch.arange(20)[None])
    seq_logits, seq_aux = seq.forward(tokens[:, [0, 2, 3, 4]], torch.arange(20, 24)[None])
    torch.testing.assert_close(tree_logits[[0, 2, 3, 4]], seq_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tree_aux[:, [0, 2, 3, 4]], seq_aux, atol=1e-5, rtol=1e-5)
    assert tree.length == seq.length == 24
    for a, b in zip(tree.cache.layers, seq.cache.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)
    # ...and the next step after the kept branch still matches.
    nxt = torch.tensor([[16]])
    torch.testing.assert_close(tree.forward(nxt, torch.tensor([[24]]))[0], seq.forward(nxt, torch.tensor([[24]]))[0],
                               atol=1e-5, rtol=1e-5)


def test_low_confidence_skips_drafting_and_stays_lossless(tokenizer):
    model = tiny_target("llama", VOCAB)
    head = new_head(model)  # untrained: its top probability is far below 0.5
    cfg = DecoderConfig(mode="tree", depth=4, topk=3, budget=10, max_new_tokens=12, min_draft_prob=0.5)
    ids = random_prompts(1)[0]
    got = SpeculativeDecoder(model, head, tokenizer, cfg).generate(ids)
    assert got.drafts == 0 and got.draft_tokens == 0 and got.target_forwards == 12
    assert got.tokens == PlainDecoder(model, tokenizer, cfg).generate(ids).tokens


@pytest.fixture(scope="module")
def smollm2_fitted(smollm2):
    """The real target with a small-vocabulary head fitted on two of its own greedy answers."""
    model, tok = smollm2
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)["input_ids"]
               for q in ("List the days of the week.", "Count from one to twenty in words.")]
    seqs = greedy_sequences(model, tok, prompts, 40)
    head = new_head(model, torch.unique(torch.cat(seqs, 1)), aux_layer_ids=aux_layer_ids_for(model))  # a trimmed vocabulary: d2t is exercised too
    fit_head(model, head, seqs, steps=60, lr=3e-3)
    return model, tok, head, prompts


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_is_target_greedy_on_smollm2(smollm2_fitted, mode):
    model, tok, head, prompts = smollm2_fitted
    cfg = DecoderConfig(mode=mode, num_speculative_tokens=3, depth=4, topk=3, budget=8, max_new_tokens=32)
    plain, spec = PlainDecoder(model, tok, cfg), SpeculativeDecoder(model, head, tok, cfg)
    fresh = tok("The capital of France is", return_tensors="pt").input_ids
    accepted = 0
    for ids in (prompts[1], fresh):
        want, got = plain.generate(ids), spec.generate(ids)
        assert got.tokens == want.tokens
        assert got.text == want.text
        accepted += got.accepted_tokens
    assert accepted > 5, "the fitted head should get drafts accepted on the text it was fitted on"
    if mode == "tree":
        hf = model.generate(fresh, do_sample=False, max_new_tokens=32, eos_token_id=sorted(plain.eos_ids))
        assert want.tokens == hf[0, fresh.shape[1]:].tolist()


# ---- stop rules: the speculative decoder truncates its accepted tokens exactly where plain decoding stops --

TREE = dict(mode="tree", depth=4, topk=3, budget=10)


def test_eos_and_length_cut_accepted_tokens(fitted, tokenizer):
    _, model, head, prompts = fitted
    ids = prompts[0]
    cfg = DecoderConfig(max_new_tokens=24, **TREE)
    spec = SpeculativeDecoder(model, head, tokenizer, cfg)
    spec.eos_ids = set()
    full = spec.generate(ids)
    assert full.accepted_tokens > 0 and full.finish_reason == "length" and len(full.tokens) == 24
    for limit in (1, 2, 5, 7):
        short = SpeculativeDecoder(model, head, tokenizer, dataclasses.replace(cfg, max_new_tokens=limit))
        short.eos_ids = set()
        got = short.generate(ids)
        assert got.tokens == full.tokens[:limit] and got.finish_reason == "length"
    eos = full.tokens[9]
    want_len = full.tokens.index(eos) + 1
    for decoder in (PlainDecoder(model, tokenizer, cfg), SpeculativeDecoder(model, head, tokenizer, cfg)):
        decoder.eos_ids = {eos}
        got = decoder.generate(ids)
        assert got.tokens == full.tokens[:want_len] and got.finish_reason == "eos"


def test_eos_ids_come_from_generation_config(tokenizer):
    model = tiny_target("llama", VOCAB)
    model.generation_config.eos_token_id = [7, 9]
    assert {7, 9, tokenizer.eos_token_id} <= PlainDecoder(model, tokenizer, DecoderConfig()).eos_ids


def test_stop_string_on_smollm2(smollm2_fitted):
    model, tok, head, prompts = smollm2_fitted
    cfg = DecoderConfig(max_new_tokens=40, stop=["Wednesday"], **TREE)
    want = PlainDecoder(model, tok, cfg).generate(prompts[0])
    got = SpeculativeDecoder(model, head, tok, cfg).generate(prompts[0])
    assert want.finish_reason == got.finish_reason == "stop"
    assert got.tokens == want.tokens and "Wednesday" in got.text
    assert "Wednesday" not in tok.decode(got.tokens[:-1])


def test_autotune_returns_the_fastest_measured_shape(fitted, tokenizer):
    arch, model, head, prompts = fitted
    if arch != "llama":
        pytest.skip("one architecture is enough for the search itself")
    shapes = [dict(mode="chain", num_speculative_tokens=2), dict(mode="tree", depth=3, topk=2, budget=4)]
    best, table = autotune(model, head, tokenizer, prompts[:1], DecoderConfig(max_new_tokens=50), shapes=shapes,
                           max_new_tokens=12)
    assert [row["shape"] for row in table] == [{"mode": "plain"}] + shapes
    fastest = max(table[1:], key=lambda row: row["tokens_per_s"])
    assert fastest["chosen"] and sum(row["chosen"] for row in table) == 1
    assert {k: getattr(best, k) for k in fastest["shape"]} == fastest["shape"]
    assert best.max_new_tokens == 50  # the search's shorter runs do not leak into the returned config
    assert all(row["tokens"] == 12 or row["tokens"] < 12 for row in table)


@pytest.mark.parametrize("bad, field", [(dict(mode="beam"), "decoder.mode"), (dict(budget=0), "decoder.budget"),
                                        (dict(top_p=0.0), "top_p")])
def test_bad_decoder_config_names_the_field(tokenizer, bad, field):
    with pytest.raises(ValueError, match=field):
        PlainDecoder(tiny_target("llama", VOCAB, layers=2), tokenizer, DecoderConfig(**bad))
