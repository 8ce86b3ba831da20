"""Head size and draft cost at several draft-vocabulary sizes, beside one target decode step.

    python benchmarks/bench_vocab_sizes.py gemma3-270m [--sizes 4096,16384,65536,262144]

A draft step is one head forward for one new token (with a 256-token head KV prefix), lm_head included:
the part of the draft that grows with the vocabulary. Figures are ratios measured side by side in one run.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoConfig, DynamicCache

from eyas.data.config import TargetConfig
from eyas.data.targets import default_aux_layer_ids, load_target, resolve_target, text_config
from eyas.heads.eagle3 import Eagle3Config, build_head


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target", default="gemma3-270m", nargs="?")
    parser.add_argument("--sizes", default="4096,8192,16384,32768,65536,262144")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    tc = text_config(AutoConfig.from_pretrained(resolve_target(args.target)))
    model, _ = load_target(TargetConfig(name_or_path=args.target, dtype="float32", device="cpu"))
    prefix = torch.randint(0, tc.vocab_size, (1, 256))
    cache = DynamicCache()
    model(prefix, past_key_values=cache, use_cache=True)
    step = torch.randint(0, tc.vocab_size, (1, 1))

    def target_step():
        model(step, past_key_values=cache, use_cache=True)
        cache.crop(256)

    target_ms = median_time(target_step, args.reps) * 1e3
    target_params = sum(p.numel() for p in model.parameters())
    print(f"target {args.target}: {target_params / 1e6:.0f}M parameters, vocab {tc.vocab_size}, "
          f"decode step {target_ms:.1f} ms")
    print(f"{'draft vocab':>12}{'head params':>14}{'lm_head share':>15}{'draft step ms':>15}{'x target step':>15}")
    for size in [int(s) for s in args.sizes.split(",")]:
        cfg = Eagle3Config.from_target(tc, size, default_aux_layer_ids(tc.num_hidden_layers))
        head = build_head(cfg).eval()
        params = sum(p.numel() for p in head.parameters())
        k_prev = torch.randn(1, cfg.num_key_value_heads, 256, cfg.head_dim)
        hidden = torch.randn(1, 1, cfg.hidden_size)
        embeds = torch.randn(1, 1, cfg.hidden_size)
        pos = torch.tensor([[256]])

        def draft_step():
            q, k, v, residual = head.qkv(hidden, embeds, pos)
            keys, values = torch.cat([k_prev, k], 2), torch.cat([k_prev, v], 2)
            out = head.finish(head.attend(q, keys, values, None), residual)
            head.logits(out).float().log_softmax(-1).topk(4)

        ms = median_time(draft_step, args.reps) * 1e3
        print(f"{size:>12}{params / 1e6:>13.1f}M{head.lm_head.weight.numel() / params:>15.0%}"
              f"{ms:>15.2f}{ms / target_ms:>15.3f}")


if __name__ == "__main__":
    main()
