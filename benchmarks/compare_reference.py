"""eyas' trainer against the reference EAGLE-3 trainer (SafeAILab/EAGLE, eagle/traineagle3) on identical features
and batches: the same stored features, the same micro-batches in the same order, the same optimizer, schedule and
clipping; what differs is the code that turns a batch into a loss (and, in one run, the initialisation).

    git clone https://github.com/SafeAILab/EAGLE /tmp/EAGLE        # bring your own copy: it is not part of eyas
    eyas run recipes/smollm2-135m-cpu.yaml --stages prepare,vocab,collect
    python benchmarks/compare_reference.py --reference /tmp/EAGLE/eagle/traineagle3 [--steps 300] [overrides]

Runs, each from the recipe's train settings (lr, warm-up + cosine, betas, clip, TTT steps):
    eyas             eyas' TTT loss (train/loss.py) from eyas' initial head
    reference        the reference's Model.forward (its midlayer, its TTT loop and loss) from the same initial
                     weights: only the loss code differs
    reference-init   the reference from its own initialisation (nn.Linear defaults, lm_head random)
The reference gets what its own data step would compute from the target: the three aux features concatenated
and the target's full-vocabulary logits (recomputed from the stored final hidden, exact for last_hidden stores),
both shifted as its `dataprepare` shifts them, and the reference's loss is its weighted sum over TTT steps
(0.8 ** k, as in its main.py). Its rotary base is hard-coded to 10000; it is set to the target's rope theta so
the trained weights mean the same to the serving engines. Every run is validated by one function (eyas' TTT
counters on the validation split: top-1 per TTT step and tau_sim) after its weights are loaded into an eyas head,
and its best head decodes the held-out prompts (acceptance at K, as bench_methods.py measures it).

Writes <out>/compare.json, compare.md and compare.png (validation accuracy of TTT step 0 and loss against steps).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))


def load_reference(path: Path, head_config, rope_theta: float):
    """The reference's cnets module, imported from `path`, with its target loading stubbed out (features come
    from the store) and its rotary base set to `rope_theta`."""
    sys.path.insert(0, str(path))
    import cnets  # noqa: E402  (the reference's own module)
    from configs import EConfig

    class NoTarget(nn.Module):
        @classmethod
        def from_pretrained(cls, *args, **kwargs):
            return cls()

    cnets.LlamaForCausalLM = NoTarget
    init = cnets.LlamaRotaryEmbedding.__init__
    init.__defaults__ = (init.__defaults__[0], rope_theta, *init.__defaults__[2:])
    c = head_config
    config = EConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                     num_hidden_layers=1, rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
                     hidden_act="silu", draft_vocab_size=c.draft_vocab_size, pad_token_id=0, rope_scaling=None,
                     pretraining_tp=1)
    config.rope_scaling = None  # transformers 5 fills in rope parameters; the reference reads None as plain rope
    return cnets, config


def reference_model(cnets, config, ttt_steps: int, embed_weight, d2t, t2d):
    model = cnets.Model(config, None, types.SimpleNamespace(gradient_checkpointing=False), load_emb=False, path="-")
    model.embed_tokens.weight.data.copy_(embed_weight)
    model.register_buffer("d2t", d2t.clone())
    model.register_buffer("t2d", t2d.clone())
    model.length = ttt_steps
    return model


TRAINED = ("fc", "midlayer", "norm", "lm_head")


def trained_parameters(module: nn.Module) -> nn.ModuleDict:
    return nn.ModuleDict({name: getattr(module, name) for name in TRAINED})


def eyas_weights(module: nn.Module) -> dict:
    """The trained tensors under the names eyas (and the engines) use; the reference uses the same names."""
    return {k: v for k, v in module.state_dict().items() if k.split(".")[0] in TRAINED and "rotary_emb" not in k}


class Run:
    """One trainer: its module, its loss on a batch, its optimizer."""

    def __init__(self, name: str, module: nn.Module, loss_fn, cfg, total_steps: int):
        from eyas.train.loop import make_optimizer

        self.name, self.module, self.loss_fn = name, module, loss_fn
        self.params = trained_parameters(module)
        self.optimizer, self.scheduler = make_optimizer(self.params, cfg, total_steps)
        self.clip = cfg.grad_clip
        self.log: list[dict] = []
        self.best = None
        self.seconds = 0.0

    def step(self, micro_batches) -> float:
        start = time.perf_counter()
        self.module.train()
        total = 0.0
        for batch, teacher in micro_batches:
            loss = self.loss_fn(self.module, batch, teacher) / len(micro_batches)
            loss.backward()
            total += loss.item()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        self.seconds += time.perf_counter() - start
        return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", required=True, help="folder of the reference trainer (holding cnets.py)")
    ap.add_argument("--recipe", default="smollm2-135m-cpu")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the recipe's epochs)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=15, help="held-out prompts decoded per run (0: none)")
    ap.add_argument("--prompts-file", default=None)
    ap.add_argument("--runs", default="eyas,reference,reference-init")
    ap.add_argument("--out", default="runs/compare-reference")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    reference_dir = Path(args.reference).expanduser()
    if not (reference_dir / "cnets.py").is_file():
        ap.error(f"--reference {reference_dir}: no cnets.py there (give the eagle/traineagle3 folder of a checkout)")

    from eyas.data.targets import Target
    from eyas.heads.checkpoint import save_head
    from eyas.heads.eagle3 import Eagle3Head
    from eyas.recipe import load_recipe
    from eyas.train.data import TrainPaths
    from eyas.train.loop import setup
    from eyas.train.loss import summarise, ttt_loss
    from bench_methods import acceptance

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    recipe = load_recipe(args.recipe, args.overrides + ["train.resume=never", "train.mixed_precision=fp32"])
    target = Target.resolve(recipe.target)
    cfg = recipe.train
    # eyas' own set-up gives the features, the plan of batches, the embedding and the initial head.
    state = setup(cfg, recipe.head, recipe.collect, target,
                  TrainPaths(recipe.stage_dir("data"), recipe.stage_dir("vocab"), recipe.stage_dir("features"),
                             out / "eyas-setup"))
    features, plan, embed_weight = state.features, state.plan, state.embed_weight
    eyas_head = state.model.head if hasattr(state.model, "head") else state.model.module.head
    initial = {k: v.detach().clone() for k, v in eyas_head.state_dict().items()}
    total_steps = args.steps or state.total_steps
    k = cfg.ttt_steps
    full_lm_head = target.load_model().get_output_embeddings().weight.detach().float()
    cnets, ref_config = load_reference(reference_dir, eyas_head.config,
                                       float(eyas_head.config.rope_parameters.get("rope_theta", 10000.0)))

    def eyas_loss(head, batch, teacher):
        return ttt_loss(head, embed_weight, dict(batch, aux=batch["aux"].float()), teacher, k,
                        cfg.step_weight_decay, cfg.loss).loss

    def reference_loss(model, batch, teacher):
        if "teacher_hidden" not in batch:
            raise SystemExit("compare_reference needs a feature store collected with collect.teacher=last_hidden")
        shift = cnets.padding  # the reference's own shift (left by one, zero at the end)
        logits = batch["teacher_hidden"].float() @ full_lm_head.T
        ids, mask = batch["input_ids"], batch["loss_mask"]
        model.dataprepare = lambda input_ids, attention_mask, loss_mask: (
            batch["aux"].float(), shift(logits, left=False), mask[..., None], shift(ids, left=False))
        plosses, _, _ = model(input_ids=ids, attention_mask=batch["attention_mask"], loss_mask=mask)
        return sum(cfg.step_weight_decay ** i * p for i, p in enumerate(plosses))

    def new_reference(same_init: bool):
        torch.manual_seed(cfg.seed)
        model = reference_model(cnets, ref_config, k, embed_weight, eyas_head.d2t, eyas_head.t2d)
        if same_init:
            missing, unexpected = model.load_state_dict(
                {n: v for n, v in initial.items() if n not in ("d2t", "t2d")}, strict=False)
            assert not unexpected and all(n.split(".")[0] not in TRAINED or "rotary" in n for n in missing), missing
        return model

    def as_eyas_head(module) -> Eagle3Head:
        head = Eagle3Head(eyas_head.config)
        head.load_state_dict({**eyas_weights(module), "d2t": eyas_head.d2t, "t2d": eyas_head.t2d}, strict=True)
        return head

    @torch.no_grad()
    def validate(module) -> dict:
        head = as_eyas_head(module).eval()
        n = len(features.datasets["validation"])
        total = None
        for start in range(0, n - cfg.batch_size + 1, cfg.batch_size):
            batch, teacher = features.batch("validation", list(range(start, start + cfg.batch_size)))
            counters = ttt_loss(head, embed_weight, dict(batch, aux=batch["aux"].float()), teacher, k).counters()
            total = counters if total is None else total + counters
        return summarise(total, k)

    fresh = Eagle3Head(eyas_head.config)
    fresh.load_state_dict(initial)
    builders = {"eyas": lambda: (fresh, eyas_loss), "reference": lambda: (new_reference(True), reference_loss),
                "reference-init": lambda: (new_reference(False), reference_loss)}
    runs = [Run(name, *builders[name](), cfg, total_steps) for name in args.runs.split(",")]
    from tqdm import tqdm

    for step in tqdm(range(total_steps), desc="compare", unit="step"):
        micro = [features.batch("train", rows) for rows in plan.micro_batches(step)]
        for run in runs:
            loss = run.step(micro)
            run.log.append({"step": step + 1, "loss": loss})
            if (step + 1) % args.eval_every == 0 or step + 1 == total_steps:
                val = validate(run.module)
                run.log[-1]["val"] = val
                if run.best is None or val["tau_sim"] > run.best[1]["tau_sim"]:
                    run.best = (step + 1, val)
                    save_head(as_eyas_head(run.module), out / run.name / "best",
                              {**state.meta, "training": {"step": step + 1, "val": val, "trainer": run.name}})
                # The log so far, so that an interrupted comparison keeps its curves.
                (out / "compare.partial.json").write_text(json.dumps(
                    {"steps_done": step + 1, "steps": total_steps, "ttt_steps": k,
                     "runs": [{"run": r.name, "log": r.log} for r in runs]}))

    rows = []
    for run in runs:
        figures = {"run": run.name, "train_s": round(run.seconds, 1), "best_step": run.best[0],
                   "val_acc": run.best[1]["step_acc"], "val_tau_sim": run.best[1]["tau_sim"], "log": run.log}
        if args.prompts:
            figures["acceptance"] = acceptance(args.recipe, args.overrides, out / run.name / "best", args.prompts,
                                               args.prompts_file)
        rows.append(figures)
    (out / "compare.json").write_text(json.dumps({"steps": total_steps, "ttt_steps": k, "runs": rows}, indent=1))
    (out / "compare.partial.json").unlink(missing_ok=True)
    (out / "compare.md").write_text(markdown(rows, total_steps, k))
    plot(rows, out / "compare.png")
    print(markdown(rows, total_steps, k))
    return 0


def markdown(rows: list[dict], steps: int, k: int) -> str:
    lines = [f"{steps} optimizer steps, TTT {k}, identical batches.", "",
             "| run | train s | best step | val acc per TTT step | val tau_sim | acceptance (K) | per position |",
             "|---|---:|---:|---|---:|---:|---|"]
    for r in rows:
        a = r.get("acceptance") or {}
        lines.append(f"| {r['run']} | {r['train_s']} | {r['best_step']} | "
                     f"{' / '.join(f'{x:.3f}' for x in r['val_acc'])} | {r['val_tau_sim']:.3f} | "
                     f"{a.get('alpha', float('nan')):.3f} ({a.get('k', '-')}) | "
                     f"{' / '.join(f'{x:.3f}' for x in a.get('per_position', []))} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for r in rows:
        evals = [e for e in r["log"] if "val" in e]
        left.plot([e["step"] for e in evals], [e["val"]["step_acc"][0] for e in evals], marker="o", label=r["run"])
        window = 10
        losses = [e["loss"] for e in r["log"]]
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                  for i in range(len(losses))]
        right.plot(range(1, len(losses) + 1), smooth, label=r["run"])
    left.set_xlabel("optimizer step")
    left.set_ylabel("validation top-1, TTT step 0")
    right.set_xlabel("optimizer step")
    right.set_ylabel("training loss (each trainer's own; 10-step mean)")
    right.set_yscale("log")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
