"""Load a trained head's speculators export with the real `speculators` package and compare logits.

    python benchmarks/check_speculators_export.py runs/smollm2-135m-cpu/head/best [--prompts runs/.../data/prompts.jsonl]

Exports in fp32 with the local target directory as verifier (speculators reads its embedding, lm_head
and norm offline), runs one draft step of both implementations on held-out prompts, and prints the
largest logit difference and the agreement of their proposals in target ids.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch


def main() -> None:
    from speculators.models.eagle3 import Eagle3DraftModel

    from eyas.data.config import TargetConfig
    from eyas.data.targets import load_target, resolve_target, target_features
    from eyas.heads.checkpoint import load_head, read_metadata
    from eyas.heads.eagle3 import embed
    from eyas.heads.export import export_head

    parser = argparse.ArgumentParser()
    parser.add_argument("head")
    parser.add_argument("--prompts", default=None)
    parser.add_argument("--num", type=int, default=4)
    args = parser.parse_args()
    meta = read_metadata(args.head)
    target_name = meta.get("target", "smollm2-135m-instruct")
    target, tokenizer = load_target(TargetConfig(name_or_path=target_name, dtype="float32", device="cpu"))
    head, _ = load_head(args.head, tokenizer=tokenizer, target_vocab_size=target.config.vocab_size)
    layer_ids = list(head.config.aux_layer_ids)
    prompts_file = Path(args.prompts or Path(args.head).parents[1] / "data" / "prompts.jsonl")
    prompts = [json.loads(line) for line in prompts_file.read_text().splitlines()[: args.num]]
    with tempfile.TemporaryDirectory() as tmp:
        out = export_head(args.head, "speculators", Path(tmp) / "spec", dtype="float32",
                          verifier=resolve_target(target_name))
        draft = Eagle3DraftModel.from_pretrained(str(out)).eval()
        worst, agree, total = 0.0, 0, 0
        for item in prompts:
            text = (tokenizer.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=False)
                    if "messages" in item else item["prompt"])
            ids = tokenizer(text, return_tensors="pt")["input_ids"][:, -256:]
            aux, _ = target_features(target, ids, layer_ids)
            # Position t: features of token t, embedding of token t+1 (speculators' shift_batch).
            aux, input_ids, positions = aux[:, :-1], ids[:, 1:], torch.arange(1, ids.shape[1])[None]
            caught = []
            hook = draft.lm_head.register_forward_hook(lambda m, a, o: caught.append(o))
            with torch.no_grad():
                draft(hidden_states=aux, input_ids=input_ids, document_ids=torch.zeros_like(input_ids),
                      position_ids=positions, ttt_steps=1)
                mine, _ = head(aux, embed(target.get_input_embeddings().weight, input_ids), positions)
            hook.remove()
            theirs = caught[0]
            worst = max(worst, (theirs - mine).abs().max().item())
            t_ids = theirs.argmax(-1) + draft.d2t[theirs.argmax(-1)]
            agree += (t_ids == head.draft_to_target(mine.argmax(-1))).sum().item()
            total += t_ids.numel()
    print(f"speculators {out.name} export of {args.head}: {len(prompts)} prompts, {total} positions, "
          f"max |logit diff| {worst:.2e}, proposals identical at {agree}/{total} positions")


if __name__ == "__main__":
    main()
