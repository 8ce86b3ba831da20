"""Tokens/s of plain vs chain vs tree decoding on a real target with a given head.

    python benchmarks/bench_decoder.py --head runs/x/head/best [--target smollm2-135m-instruct]
        [--prompts 8] [--max-new-tokens 128] [--autotune] [--dtype auto] [--device auto]

Without --head an untrained head is built and saved (a speed sanity check of the decoder's own cost;
its drafts are almost never accepted). Prompts: --prompts-file (bench JSONL format) or built-in chat
questions, through the target's chat template. Greedy decoding; the speculative outputs are checked against the
plain ones. On a shared machine timings are noisy: repeat and compare ratios, not absolute figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile

import torch

from eyas.data.config import TargetConfig
from eyas.data.targets import aux_layer_ids_for, load_target
from eyas.eval.config import DecoderConfig
from eyas.eval.autotune import autotune
from eyas.eval.decoder import PlainDecoder, SpeculativeDecoder
from eyas.heads.checkpoint import load_head, save_head
from eyas.heads.eagle3 import Eagle3Config, build_head

QUESTIONS = [
    "Explain how a hash map works, with a short Python example.",
    "Write a haiku about autumn rain.",
    "What are three good habits for writing maintainable code?",
    "Summarise the causes of the French Revolution in five sentences.",
    "Give me a recipe for a simple tomato soup.",
    "How do I reverse a linked list in C? Show the code.",
    "What is the difference between TCP and UDP?",
    "Write a short, friendly email declining a meeting invitation.",
]


def load_prompts(tokenizer, path: str | None, count: int, device) -> list[torch.Tensor]:
    """A prompts JSONL (the bench format: `messages` or `prompt` per line), or built-in chat questions."""
    from eyas.eval.bench import BenchPrompt, encode_prompt, read_prompts

    prompts = read_prompts(path)[:count] if path else [
        BenchPrompt(line=i + 1, category="chat", messages=[{"role": "user", "content": q}]) for i, q in enumerate(QUESTIONS[:count])]
    return [encode_prompt(tokenizer, p, device) for p in prompts]


def untrained_head_dir(model) -> str:
    config = Eagle3Config.from_target(model.config, draft_vocab_size=model.config.vocab_size,
                                      aux_layer_ids=aux_layer_ids_for(model))
    head = build_head(config)
    head.set_vocab(torch.zeros(config.draft_vocab_size, dtype=torch.long),
                   torch.ones(config.vocab_size, dtype=torch.bool))
    return str(save_head(head, tempfile.mkdtemp(prefix="eyas-untrained-head-") + "/head"))


def run(decoder, prompts) -> dict:
    decoder.generate(prompts[0])  # warm-up
    runs = [decoder.generate(ids) for ids in prompts]
    tokens, seconds = sum(len(r.tokens) for r in runs), sum(r.total_s for r in runs)
    target, draft = sum(r.time_target_s for r in runs), sum(r.time_draft_s for r in runs)
    drafts = sum(r.drafts for r in runs)
    return {"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
            "tau": 1 + sum(r.accepted_tokens for r in runs) / drafts if drafts else 1.0,
            "share_target": target / seconds, "share_draft": draft / seconds,
            "share_other": 1 - (target + draft) / seconds, "outputs": [r.tokens for r in runs]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", help="native head dir (default: an untrained head)")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=6, help="how many prompts")
    ap.add_argument("--prompts-file", help="JSONL of prompts (default: built-in chat questions)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--chain-k", type=int, default=4)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--min-draft-prob", type=float, default=0.0, help="skip/stop drafting below this confidence")
    ap.add_argument("--autotune", action="store_true", help="also search the draft shape on 2 prompts")
    args = ap.parse_args(argv)

    model, tok = load_target(TargetConfig(name_or_path=args.target, dtype=args.dtype, device=args.device))
    dtype = next(model.parameters()).dtype
    head, _ = load_head(args.head or untrained_head_dir(model), device=model.device, dtype=dtype, tokenizer=tok,
                        target_vocab_size=model.config.vocab_size)
    prompts = load_prompts(tok, args.prompts_file, args.prompts, model.device)
    base = DecoderConfig(max_new_tokens=args.max_new_tokens, min_draft_prob=args.min_draft_prob)
    configs = {"chain": dataclasses.replace(base, mode="chain", num_speculative_tokens=args.chain_k),
               "tree": dataclasses.replace(base, mode="tree", depth=args.depth, topk=args.topk, budget=args.budget)}
    if args.autotune:
        tuned, table = autotune(model, head, tok, prompts[:2], base, max_new_tokens=min(64, args.max_new_tokens))
        for row in table:
            print(f"autotune {json.dumps(row['shape']):60s} {row['tokens_per_s']:8.1f} tok/s "
                  f"x{row['speedup']:.2f} tau {row['tokens_per_step']:.2f}{'  <- chosen' if row['chosen'] else ''}")
        configs["autotuned"] = tuned

    print(f"target {args.target} on {model.device} ({dtype}), head {args.head or 'untrained'}, "
          f"{len(prompts)} prompts x {args.max_new_tokens} new tokens, greedy. Timings on a shared machine are noisy.")
    plain = run(PlainDecoder(model, tok, base), prompts)
    print(f"{'plain':10s} {plain['tokens_per_s']:8.1f} tok/s")
    for name, cfg in configs.items():
        r = run(SpeculativeDecoder(model, head, tok, cfg), prompts)
        same = sum(a == b for a, b in zip(r["outputs"], plain["outputs"]))
        print(f"{name:10s} {r['tokens_per_s']:8.1f} tok/s  x{r['tokens_per_s'] / plain['tokens_per_s']:.2f}  "
              f"tau {r['tau']:.2f}  time: target {r['share_target']:.0%} draft {r['share_draft']:.0%} "
              f"other {r['share_other']:.0%}  identical outputs {same}/{len(prompts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
