"""Sampled speculative decoding draws from the target's own distribution.

A tiny target with an 8-token vocabulary lets us enumerate the exact distribution of the generated
tokens 2 and 3 (token 1 comes from the prefill alone; 2 and 3 go through drafting and rejection
sampling). Thousands of samples must sit within the sampling noise of that distribution, measured by
total variation against a null threshold simulated from the exact distribution itself; with the
rejection correction removed the same test must fail, so it has the power to see a biased sampler.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_target
from eyas.eval import sampling
from eyas.eval import sampling_check as check
from eyas.eval.sampling_check import null_tv_threshold, tv
from eyas.eval.config import DecoderConfig
from eyas.eval.decoder import PlainDecoder, SpeculativeDecoder
from test_decoder_lossless import new_head, tokenizer  # noqa: F401 (fixtures)

VOCAB = 8
SAMPLES = 600  # the missing correction shows as TV ~0.2 against a noise threshold ~0.12


@pytest.fixture(scope="module")
def setup():
    model = tiny_target("llama", VOCAB, layers=2, seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a target distribution with structure, not near-uniform
    head = new_head(model, seed=3, aux_layer_ids=[0, 1, 1])
    with torch.no_grad():
        head.lm_head.weight.mul_(30.0)  # a confident draft that disagrees with the target
    prompt = torch.tensor([[3, 5, 1, 6]])
    return model, head, prompt


def exact_tokens_2_3(model, prompt, cfg: DecoderConfig) -> np.ndarray:
    return check.exact_tokens_2_3(model, prompt, cfg, VOCAB)


def sampled_tokens_2_3(decoder, prompt, n: int) -> np.ndarray:
    decoder.eos_ids = set()  # every draw has three tokens
    return check.sampled_tokens_2_3(decoder, prompt, n, VOCAB)


CONFIGS = {
    "chain": DecoderConfig(mode="chain", num_speculative_tokens=2, temperature=1.0, max_new_tokens=3, seed=1),
    "tree": DecoderConfig(mode="tree", depth=2, topk=2, budget=4, temperature=0.8, top_k=6, top_p=0.95,
                          max_new_tokens=3, seed=2),
}


@pytest.mark.parametrize("name", ["chain", pytest.param("tree", marks=pytest.mark.slow)])
def test_sampled_distribution_matches_target(setup, tokenizer, name, monkeypatch):  # noqa: F811
    model, head, prompt = setup
    cfg = CONFIGS[name]
    exact = exact_tokens_2_3(model, prompt, cfg)
    threshold = null_tv_threshold(exact, SAMPLES)
    decoder = SpeculativeDecoder(model, head, tokenizer, cfg)
    got = sampled_tokens_2_3(decoder, prompt, SAMPLES)
    assert tv(got, exact) < threshold, f"{name}: TV {tv(got, exact):.3f} above noise threshold {threshold:.3f}"

    # Power: the same test rejects a sampler that resamples from p instead of the residual max(p-q, 0).
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    biased = sampled_tokens_2_3(SpeculativeDecoder(model, head, tokenizer, cfg), prompt, SAMPLES)
    assert tv(biased, exact) > threshold, f"{name}: the test cannot see a missing rejection correction"


@pytest.mark.slow
def test_plain_sampling_matches_target(setup, tokenizer):  # noqa: F811
    """The baseline samples the same distribution (so speculative vs plain compares like with like)."""
    model, _, prompt = setup
    cfg = CONFIGS["tree"]
    exact = exact_tokens_2_3(model, prompt, cfg)
    got = sampled_tokens_2_3(PlainDecoder(model, tokenizer, cfg), prompt, SAMPLES)
    assert tv(got, exact) < null_tv_threshold(exact, SAMPLES)


def test_warp_probs_filters_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    torch.testing.assert_close(sampling.warp_probs(logits, 1.0, top_k=2), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # top_p 0.8: 0.5 + 0.3 reaches it, so 0.15 and 0.05 go.
    torch.testing.assert_close(sampling.warp_probs(logits, 1.0, top_p=0.8), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(sampling.warp_probs(logits, 1.0, top_p=0.81),
                               torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


@pytest.mark.parametrize("sampled_proposals", [False, True])
def test_verify_node_outputs_the_target_distribution(sampled_proposals, monkeypatch):
    """One tree node, exact arithmetic: siblings proposed from a q unlike p still yield exactly p."""
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15, 0.0])
    q = torch.tensor([0.5, 0.05, 0.3, 0.05, 0.05, 0.05])
    g = torch.Generator().manual_seed(0)
    n = 20000

    def run() -> np.ndarray:
        counts = np.zeros(len(p))
        for _ in range(n):
            if sampled_proposals:  # a chain step: one draw from q
                candidates, proposals = [int(torch.multinomial(q, 1, generator=g))], [q]
            else:  # tree children: the draft's top-3, one-hot proposals, tested without replacement
                candidates, proposals = [0, 2, 1], [None, None, None]
            counts[sampling.verify_node(p, candidates, proposals, g)[1]] += 1
        return counts / n

    exact = p.double().numpy()
    threshold = null_tv_threshold(exact, n)
    assert tv(run(), exact) < threshold
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    assert tv(run(), exact) > threshold
