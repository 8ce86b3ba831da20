"""GPU check, section 1: speculative decoding is lossless on the device.

Greedy: on tiny random Llama / Qwen3 / Gemma3 targets, chain and tree decoding must give exactly the
plain decoder's tokens in fp32; in bf16 the two may part where near-ties of the logits round differently
(the verify forward batches more rows), so the share of tokens before the first divergence is reported.
Each head is fitted briefly on the target's own greedy text so that drafts are accepted, deep ones too:
otherwise the accepted-path cache gathers would never run and "identical" would prove little.

Sampling: the distribution of generated tokens 2 and 3 (both pass through drafting and rejection sampling)
from an 8-token target, enumerated exactly, against samples of the speculative decoder; total variation
must stay under a noise threshold simulated from the exact distribution, and the same test must reject a
sampler with the rejection correction removed (its power).
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from gpu_check_common import Ctx, StubTokenizer, new_head, random_prompts, random_target, tiny_config

ARCHS = ("llama", "qwen3", "gemma3")
VOCAB = 256
AUX = [1, 3, 4]
GREEDY_SHAPES = {"chain": dict(mode="chain", num_speculative_tokens=3),
                 "tree": dict(mode="tree", depth=4, topk=3, budget=10)}


def token_agreement(reference: list[int], other: list[int]) -> float:
    """Share of the reference tokens reproduced before the first divergence (1.0 = identical)."""
    same = 0
    for a, b in zip(reference, other):
        if a != b:
            break
        same += 1
    return same / max(len(reference), len(other), 1)


def compare(plain, spec, prompts) -> dict:
    """Plain vs speculative decoding on each prompt: identical outputs, agreement, acceptance."""
    identical, agreement, accepted, deep, drafted, forwards, tokens = 0, [], 0, 0, 0, 0, 0
    for ids in prompts:
        want, got = plain.generate(ids), spec.generate(ids)
        identical += int(got.tokens == want.tokens)
        agreement.append(token_agreement(want.tokens, got.tokens))
        accepted += got.accepted_tokens
        deep += sum(got.accepted_per_position[1:])
        drafted += got.draft_tokens
        forwards += got.target_forwards
        tokens += len(got.tokens)
    return {"prompts": len(prompts), "identical": identical, "all_identical": identical == len(prompts),
            "token_agreement": float(np.mean(agreement)), "accepted_tokens": accepted,
            "accepted_beyond_depth_1": deep, "draft_tokens": drafted, "target_forwards": forwards,
            "tokens": tokens}


def fit_head(model, head, seqs: list[torch.Tensor], steps: int, lr: float = 3e-2) -> float:
    """Overfit the head's first step on the target's own greedy text: enough for drafts to be accepted."""
    from eyas.data.targets import target_features
    from eyas.heads.eagle3 import embed

    batches = []
    for seq in seqs:
        aux, _ = target_features(model, seq, list(head.config.aux_layer_ids))
        positions = torch.arange(seq.shape[1] - 2, device=seq.device)[None]
        batches.append((aux[:, :-2], embed(model.get_input_embeddings().weight, seq[:, 1:-1]), seq[0, 2:], positions))
    head.train().requires_grad_(True)
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    for _ in range(steps):
        loss = sum(F.cross_entropy(head(aux, emb, pos)[0][0], labels) for aux, emb, labels, pos in batches) / len(batches)
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval().requires_grad_(False)
    return float(loss.detach())


def greedy_case(ctx: Ctx, arch: str) -> tuple[dict, list[str]]:
    """fp32 identity and bf16 agreement of chain and tree decoding on one architecture.

    --cpu mode: fewer and shorter generations, and bf16 (emulated there, so slow) in chain mode only."""
    from eyas.eval.config import DecoderConfig
    from eyas.eval.decoder import PlainDecoder, SpeculativeDecoder

    new_tokens = 16 if ctx.cpu else 32
    model = random_target(tiny_config(arch, VOCAB), ctx.device)
    tok = StubTokenizer()
    fitted = [p.to(ctx.device) for p in random_prompts(2 if ctx.cpu else 3, 8, VOCAB)]
    plain = PlainDecoder(model, tok, DecoderConfig(max_new_tokens=new_tokens))
    seqs = [torch.cat([p[0], torch.tensor(plain.generate(p).tokens, device=ctx.device)])[None] for p in fitted]
    head = new_head(model.config, AUX, device=ctx.device)
    loss = fit_head(model, head, seqs, steps=40 if ctx.cpu else 60)
    prompts = fitted + ([] if ctx.cpu else [p.to(ctx.device) for p in random_prompts(2, 5, VOCAB, seed=7)])

    out, failures = {"head_fit_loss": loss}, []
    for precision in ("fp32", "bf16"):
        if precision == "bf16":
            model, head = model.to(torch.bfloat16), head.to(torch.bfloat16)
        for mode, shape in GREEDY_SHAPES.items():
            if precision == "bf16" and ctx.cpu and mode == "tree":
                continue
            cfg = DecoderConfig(max_new_tokens=new_tokens, **shape)
            row = compare(PlainDecoder(model, tok, cfg), SpeculativeDecoder(model, head, tok, cfg), prompts)
            out[f"{precision}_{mode}"] = row
            if precision == "fp32" and not row["all_identical"]:
                failures.append(f"{arch} {mode} fp32: speculative output differs from plain greedy "
                                f"({row['identical']}/{row['prompts']} prompts identical)")
            if precision == "fp32" and row["accepted_beyond_depth_1"] == 0:
                failures.append(f"{arch} {mode} fp32: no draft accepted beyond depth 1, the check proves little")
    return out, failures


# ---- rejection sampling ---------------------------------------------------------------------------------------

SAMPLE_VOCAB = 8
SAMPLING_CONFIGS = {
    "chain": dict(mode="chain", num_speculative_tokens=2, temperature=1.0, max_new_tokens=3, seed=1),
    "tree": dict(mode="tree", depth=2, topk=2, budget=4, temperature=0.8, top_k=6, top_p=0.95, max_new_tokens=3,
                 seed=2),
}


def sampling_setup(device: torch.device):
    """The target (no EOS in its config: three tokens every draw), a confident disagreeing head, a prompt."""
    model = random_target(tiny_config("llama", SAMPLE_VOCAB, layers=2), device, seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a target distribution with structure, not near-uniform
    head = new_head(model.config, [0, 1, 1], seed=3, device=device)
    with torch.no_grad():
        head.lm_head.weight.mul_(30.0)  # a confident draft that disagrees with the target
    return model, head, torch.tensor([[3, 5, 1, 6]], device=device)


@contextlib.contextmanager
def without_rejection_correction():
    """Resample from p instead of the residual max(p - q, 0): a biased sampler the test must catch."""
    from eyas.eval import sampling

    original = sampling.residual
    sampling.residual = lambda p, q: p
    try:
        yield
    finally:
        sampling.residual = original


def sampling_case(ctx: Ctx, name: str, samples: int, power: bool) -> tuple[dict, list[str]]:
    from eyas.eval.config import DecoderConfig
    from eyas.eval.decoder import SpeculativeDecoder
    from eyas.eval.sampling_check import exact_tokens_2_3, null_tv_threshold, sampled_tokens_2_3, tv

    model, head, prompt = sampling_setup(ctx.device)
    cfg = DecoderConfig(**SAMPLING_CONFIGS[name])
    exact = exact_tokens_2_3(model, prompt, cfg, SAMPLE_VOCAB)
    threshold = null_tv_threshold(exact, samples)
    got = tv(sampled_tokens_2_3(SpeculativeDecoder(model, head, StubTokenizer(), cfg), prompt, samples,
                                SAMPLE_VOCAB), exact)
    row = {"samples": samples, "tv": got, "tv_threshold_p999": threshold, "matches_target": got < threshold}
    failures = [] if got < threshold else [f"sampling {name}: TV {got:.3f} above the noise threshold {threshold:.3f}"]
    if power:
        with without_rejection_correction():
            decoder = SpeculativeDecoder(model, head, StubTokenizer(), dataclasses.replace(cfg))
            biased = tv(sampled_tokens_2_3(decoder, prompt, samples, SAMPLE_VOCAB), exact)
        row.update(tv_without_correction=biased, power_ok=biased > threshold)
        if biased <= threshold:
            failures.append(f"sampling {name}: a sampler without the rejection correction passes too "
                            f"(TV {biased:.3f} <= {threshold:.3f}): the test has no power")
    return row, failures


def run(ctx: Ctx) -> dict:
    results, failures = {"greedy": {}, "sampling": {}}, []
    for arch in ARCHS:
        row, bad = greedy_case(ctx, arch)
        results["greedy"][arch] = row
        failures += bad
    # 600 draws: a missing correction shows as TV ~0.2 against a noise threshold ~0.12. The --cpu mode runs
    # the chain alone with 300 draws and no power run (tests/test_decoder_sampling.py covers that on the CPU).
    for name in ("chain",) if ctx.cpu else tuple(SAMPLING_CONFIGS):
        row, bad = sampling_case(ctx, name, samples=300 if ctx.cpu else 600, power=not ctx.cpu)
        results["sampling"][name] = row
        failures += bad
    results["failures"] = failures
    return results


def markdown(results: dict) -> list[str]:
    lines = ["| target | mode | fp32 identical | fp32 accepted (beyond depth 1) | bf16 identical | bf16 token agreement |",
             "|---|---|---|---|---|---|"]
    for arch, row in results.get("greedy", {}).items():
        for mode in GREEDY_SHAPES:
            a, b = row.get(f"fp32_{mode}"), row.get(f"bf16_{mode}")
            if a is None:
                continue
            bf16 = f"{b['identical']}/{b['prompts']} | {b['token_agreement']:.3f}" if b else "- | -"
            lines.append(f"| {arch} | {mode} | {a['identical']}/{a['prompts']} | "
                         f"{a['accepted_tokens']} ({a['accepted_beyond_depth_1']}) | {bf16} |")
    lines += ["", "| sampling | draws | TV | noise threshold (p99.9) | TV without correction |", "|---|---|---|---|---|"]
    for name, row in results.get("sampling", {}).items():
        biased = row.get("tv_without_correction")
        lines.append(f"| {name} | {row['samples']} | {row['tv']:.3f} | {row['tv_threshold_p999']:.3f} | "
                     f"{'-' if biased is None else f'{biased:.3f}'} |")
    return lines
