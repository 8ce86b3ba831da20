"""head/training.png: validation top-1 accuracy per TTT step, and tau_sim, over training."""

from __future__ import annotations

import json
from pathlib import Path

from eyas.data.atomic import atomic_write


def plot_training(metrics_path: str | Path, out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    val = [r for r in records if r.get("kind") == "val"]
    train = [r for r in records if r.get("kind") == "train"]
    fig, (ax_acc, ax_tau, ax_loss) = plt.subplots(1, 3, figsize=(15, 4))
    steps = [r["step"] for r in val]
    for k in range(len(val[0]["step_acc"]) if val else 0):
        ax_acc.plot(steps, [r["step_acc"][k] for r in val], marker=".", label=f"step {k}")
    ax_acc.set(title="validation top-1 accuracy per TTT step", xlabel="optimizer step", ylabel="accuracy")
    if val:
        ax_acc.legend(fontsize=7)
    ax_tau.plot(steps, [r["tau_sim"] for r in val], marker="o")
    ax_tau.set(title="validation tau_sim (simulated acceptance length)", xlabel="optimizer step", ylabel="tau_sim")
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train])
    ax_loss.set(title="training loss (weighted TTT sum)", xlabel="optimizer step", ylabel="loss")
    fig.tight_layout()
    atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
    plt.close(fig)
    return Path(out)
