"""Bytes per token of each feature-store layout on the real target, and what each costs in accuracy.

    python benchmarks/bench_storage.py                       # SmolLM2-135M-Instruct, 8 held-out ShareGPT samples
    python benchmarks/bench_storage.py --samples 32 --out -  # more tokens (slower), table only

Layouts: the common one (four hidden states in bf16: three aux + last, 8*H bytes a token) against eyas'
(aux bf16 | fp8 e4m3 with a power-of-two scale per token and layer; teacher last_hidden bf16 | top-k fp16 logits
+ int16 draft ids).  Accuracy, against the fp32 target on held-out samples (every real position):
  teacher:  top-1 agreement and KL(q || p) of the stored teacher q with the fp32 target's distribution p over the
            draft vocab (renormalised, the training target), and p's mass outside the stored top-k;
  aux:      each stored aux feature is put back into the target in place of the fp32 stream entering its layer,
            the rest of the target runs on; top-1 agreement and KL with the fp32 target's full-vocab prediction
            (how much of what the target knows at that depth survives the storage rounding; worst of the 3).
Bytes/token are measured on disk (the collect stage run on the same samples) and checked against the formula.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np
import torch

from eyas.data.atomic import atomic_write_text
from eyas.data.collect import collect
from eyas.data.config import CollectConfig, CorpusConfig, TargetConfig
from eyas.data.corpora import CorpusStats, Record, _chat_items, content_hash, corpus_path, normalise_turns
from eyas.data.features import FeatureDataset, bytes_per_token, collate, dequantize_fp8, quantize_fp8
from eyas.data.targets import (Target, aux_layer_ids_for, decoder_layers, load_target, logits_from_final_hidden,
                               target_features)
from eyas.data.templates import render_records
from eyas.data.vocab import build_mapping, draft_to_target, ranked_ids, save_vocab

LAYOUTS = [  # name, aux storage, teacher, top-k
    ("common: 4 hidden bf16", "bfloat16", "last_hidden", None),
    ("eyas bf16 aux + last_hidden", "bfloat16", "last_hidden", None),
    ("eyas fp8 aux + last_hidden", "float8_e4m3", "last_hidden", None),
    ("eyas bf16 aux + top-64", "bfloat16", "topk", 64),
    ("eyas fp8 aux + top-64", "float8_e4m3", "topk", 64),
    ("eyas fp8 aux + top-32", "float8_e4m3", "topk", 32),
]


def sharegpt_samples(tokenizer, n_records: int, max_length: int) -> list:
    """The first n usable ShareGPT conversations (first assistant turn), rendered and masked as `prepare` does."""
    cfg = CorpusConfig(kind="sharegpt")
    path, stats = corpus_path(cfg), CorpusStats(source="sharegpt")
    records = []
    for where, pairs in itertools.islice(_chat_items(cfg, path, stats), n_records * 2):
        messages = normalise_turns(pairs, where, stats, max_turns=1)
        if messages is not None:
            record = Record("", str(path), "chat", messages=messages)
            record.record_id = content_hash(record)[:20]
            records.append(record)
        if len(records) == n_records:
            break
    return render_records(tokenizer, records, max_length, min_assistant_tokens=8)


def draft_vocab(samples, vocab_size: int, draft_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in samples:
        ids, mask = np.asarray(s.input_ids), np.asarray(s.loss_mask, dtype=bool)
        counts += np.bincount(ids[mask], minlength=vocab_size)
    return build_mapping(ranked_ids(counts)[:draft_size], vocab_size)


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row from log-probs (terms with p = 0 contribute 0)."""
    p = p_log.exp()
    return torch.where(p > 0, p * (p_log - q_log), torch.zeros_like(p)).sum(-1)


def stored_stream(hidden: torch.Tensor, feature_dtype: str) -> torch.Tensor:
    if feature_dtype == "float8_e4m3":
        q, exp = quantize_fp8(hidden, groups=1)
        return dequantize_fp8(q, exp).to(hidden.dtype)
    return hidden.to(torch.bfloat16).to(hidden.dtype)


@torch.no_grad()
def logits_with_stored_stream(model, batch, layer: int, feature_dtype: str) -> torch.Tensor:
    """Full-vocab logits when the stream entering `layer` is replaced by its stored (rounded) version."""
    def hook(module, args, kwargs):
        if args:
            return (stored_stream(args[0], feature_dtype), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": stored_stream(kwargs["hidden_states"], feature_dtype)}

    handle = decoder_layers(model)[layer].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long()).logits.float()
    finally:
        handle.remove()


@torch.no_grad()
def measure_accuracy(model, samples, d2t, t2d, layer_ids, batch_size: int) -> dict:
    draft_ids = draft_to_target(d2t, torch.arange(d2t.numel()))
    lm_rows = model.get_output_embeddings().weight[draft_ids].float()
    acc: dict[str, list] = {}

    def add(key, values):
        acc.setdefault(key, []).append(values.float())

    for start in range(0, len(samples), batch_size):
        rows = [{"input_ids": s.input_ids, "loss_mask": s.loss_mask} for s in samples[start:start + batch_size]]
        batch = collate(rows)
        real = batch["attention_mask"]
        _, final = target_features(model, batch["input_ids"], layer_ids, attention_mask=real.long())
        full = logits_from_final_hidden(model, final).float()  # fp32 reference
        p_full = full.log_softmax(-1)[real]
        p_draft = full[..., draft_ids].log_softmax(-1)[real]
        ref_top1 = p_draft.argmax(-1)
        # teacher: last_hidden stored in bf16, logits recomputed over the draft vocab
        q = (final.to(torch.bfloat16).float() @ lm_rows.T).log_softmax(-1)[real]
        add("last_hidden/top1", q.argmax(-1) == ref_top1)
        add("last_hidden/kl", kl(q, p_draft))
        for k in sorted({k for *_, k in LAYOUTS if k}):
            values, ids = full[..., draft_ids][real].topk(k, dim=-1)
            q_k = values.half().float().log_softmax(-1)  # fp16 on disk, renormalised over the k ids
            add(f"top{k}/top1", ids.gather(-1, q_k.argmax(-1, keepdim=True))[:, 0] == ref_top1)
            add(f"top{k}/kl", kl(q_k, p_draft.gather(-1, ids)))
            add(f"top{k}/tail", 1 - p_draft.gather(-1, ids).exp().sum(-1))
        # aux: each stored feature put back into the target
        for feature_dtype in ("bfloat16", "float8_e4m3"):
            for j, layer in enumerate(layer_ids):
                injected = logits_with_stored_stream(model, batch, layer, feature_dtype).log_softmax(-1)[real]
                add(f"aux-{feature_dtype}-{j}/top1", injected.argmax(-1) == p_full.argmax(-1))
                add(f"aux-{feature_dtype}-{j}/kl", kl(p_full, injected))
    return {key: torch.cat(v).mean().item() for key, v in acc.items()}


def measure_bytes(target_cfg: TargetConfig, samples, d2t, t2d, workdir: Path) -> dict:
    """Bytes per token on disk from real collect-stage runs of each layout (header and offsets included)."""
    rows = {"input_ids": [s.input_ids for s in samples], "loss_mask": [s.loss_mask for s in samples],
            "source": [s.source for s in samples], "record_id": [s.record_id for s in samples],
            "category": [s.category for s in samples]}
    target = Target.resolve(target_cfg)
    ds = datasets.Dataset.from_dict(rows)
    data_dir, vocab_dir = workdir / "data", workdir / "vocab"
    datasets.DatasetDict(train=ds, validation=ds.select(range(1))).save_to_disk(str(data_dir))
    vocab_dir.mkdir(parents=True)
    save_vocab(vocab_dir / "vocab.safetensors", d2t, t2d)
    out = {}
    for name, feature_dtype, teacher, k in LAYOUTS[1:]:
        cfg = CollectConfig(feature_dtype=feature_dtype, teacher=teacher, topk=k or 64, batch_size=8,
                            shard_tokens=1 << 20)
        features = workdir / name.replace(" ", "_").replace(":", "")
        start = time.time()
        collect(cfg, target, data_dir, vocab_dir, features)
        index = json.loads((features / "index.json").read_text())["splits"]["train"]
        on_disk = sum((features / s["file"]).stat().st_size for s in index["shards"])
        FeatureDataset(features, "train", verify=True)  # what was written reads back
        out[name] = {"measured": on_disk / index["num_tokens"], "seconds": time.time() - start,
                     "tokens": index["num_tokens"]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--samples", type=int, default=8, help="held-out samples to measure accuracy on")
    ap.add_argument("--disk-samples", type=int, default=3, help="samples collected per layout for bytes on disk")
    ap.add_argument("--vocab-records", type=int, default=1500, help="ShareGPT records that pick the draft vocab")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy 2-core box)")
    ap.add_argument("--out", default="docs/results-storage.md", help="markdown file, or - for none")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    target_cfg = TargetConfig(name_or_path=args.target, dtype="float32", device="cpu")
    model, tok = load_target(target_cfg)
    hidden = model.config.hidden_size
    layer_ids = aux_layer_ids_for(model, target_cfg)
    samples = sharegpt_samples(tok, args.vocab_records + args.samples, args.max_length)
    held_out, vocab_part = samples[:args.samples], samples[args.samples:]
    d2t, t2d = draft_vocab(vocab_part, model.config.vocab_size, args.draft_vocab)
    tokens = sum(len(s.input_ids) for s in held_out)
    print(f"target {args.target}: H={hidden}, aux layers {layer_ids}; draft vocab {d2t.numel()} from "
          f"{len(vocab_part)} ShareGPT samples; measuring on {len(held_out)} held-out samples, {tokens} tokens",
          flush=True)

    start = time.time()
    acc = measure_accuracy(model, held_out, d2t, t2d, layer_ids, args.batch_size)
    acc_seconds = time.time() - start
    with tempfile.TemporaryDirectory() as tmp:  # bytes/token hardly depend on the text: a few samples do
        disk = measure_bytes(target_cfg, held_out[:args.disk_samples], d2t, t2d, Path(tmp))

    def aux_worst(dtype):
        return (min(acc[f"aux-{dtype}-{j}/top1"] for j in range(3)), max(acc[f"aux-{dtype}-{j}/kl"] for j in range(3)))

    rows = []
    for name, feature_dtype, teacher, k in LAYOUTS:
        cfg = CollectConfig(feature_dtype=feature_dtype, teacher=teacher, topk=k or 64)
        formula = 8 * hidden + 4 + 1 if name.startswith("common") else bytes_per_token(hidden, cfg, d2t.numel())
        key = "last_hidden" if teacher == "last_hidden" else f"top{k}"
        aux_top1, aux_kl = aux_worst(feature_dtype)
        rows.append({
            "layout": name, "formula": formula, "measured": disk.get(name, {}).get("measured"),
            "xH": formula / hidden, "teacher_top1": acc[f"{key}/top1"], "teacher_kl": acc[f"{key}/kl"],
            "tail": acc.get(f"{key}/tail", 0.0), "aux_top1": aux_top1, "aux_kl": aux_kl,
            "exact": "exact up to bf16 h" if teacher == "last_hidden" else f"approx. (top-{k} only)",
        })
    table = render_table(rows)
    print(table)
    base = rows[1]
    for r in rows[2:]:
        print(f"  {r['layout']}: teacher top-1 {100 * (r['teacher_top1'] - base['teacher_top1']):+.2f} pts, "
              f"aux top-1 {100 * (r['aux_top1'] - base['aux_top1']):+.2f} pts vs the bf16 store")
    if args.out != "-":
        write_markdown(Path(args.out), table, rows, args, hidden, layer_ids, d2t.numel(), len(held_out), tokens,
                       acc_seconds, disk)
        print(f"wrote {args.out}")
    return 0


def render_table(rows) -> str:
    lines = ["| layout | bytes/token (formula) | measured on disk | x H | teacher | teacher top-1 agree | "
             "teacher KL(q‖p) | p mass outside top-k | aux top-1 agree (worst layer) | aux KL (worst layer) |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        measured = f"{r['measured']:.1f}" if r["measured"] else "-"
        lines.append(f"| {r['layout']} | {r['formula']} | {measured} | {r['xH']:.2f} | {r['exact']} | "
                     f"{100 * r['teacher_top1']:.2f}% | {r['teacher_kl']:.2e} | {100 * r['tail']:.2f}% | "
                     f"{100 * r['aux_top1']:.2f}% | {r['aux_kl']:.2e} |")
    return "\n".join(lines)


def write_markdown(path: Path, table, rows, args, hidden, layer_ids, draft_size, n, tokens, seconds, disk) -> None:
    cmd = "python benchmarks/bench_storage.py " + " ".join(sys.argv[1:])
    speed = ", ".join(f"{name}: {d['tokens'] / d['seconds']:.0f} tok/s" for name, d in disk.items())
    text = f"""Command: `{cmd.strip()}` (CPU, torch threads={args.threads}; the machine was shared with other jobs).

Target {args.target} (H={hidden}, aux layers {layer_ids}, fp32), draft vocab {draft_size} (most frequent masked
tokens of other ShareGPT samples), {n} held-out ShareGPT samples (first assistant turn, <= {args.max_length}
tokens), {tokens} tokens.  The "common" layout stores four hidden states in bf16 (8*H bytes a token, ids extra);
its accuracy is the bf16 store's (same rounding).

{table}

- **teacher top-1 agree / KL(q‖p)**: the stored teacher q against the fp32 target's distribution p over the
  draft vocab (renormalised: what the loss trains towards), every real position. `last_hidden` keeps the whole
  distribution, exact up to the bf16 rounding of the final hidden; top-k drops p's tail (the column after) and
  renormalises over the k kept ids.
- **aux top-1 agree / KL**: each stored aux feature replaces the fp32 stream entering its layer and the target runs
  on; agreement of the resulting full-vocab argmax with the fp32 target's, worst of the three layers. It measures
  how much of the target's information at that depth survives the storage rounding (a proxy; the draft head's
  own acceptance needs a trained head, see the trainer's results).
- The budget was <= 5*H = {5 * hidden} bytes a token with accuracy within 1% of the bf16 store.
- Collection speed in these runs (noisy, shared 2-core CPU): {speed}.
"""
    update_section(path, text)


BEGIN, END = "<!-- bench_storage:begin -->", "<!-- bench_storage:end -->"


def update_section(path: Path, text: str) -> None:
    """Replace the benchmark's own section of the results file (the hand-written rest is kept), atomically."""
    old = path.read_text() if path.exists() else "# Feature store: bytes per token and accuracy\n\n"
    block = f"{BEGIN}\n{text}{END}"
    if BEGIN in old and END in old:
        new = old[:old.index(BEGIN)] + block + old[old.index(END) + len(END):]
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    atomic_write_text(path, new)


if __name__ == "__main__":
    raise SystemExit(main())
