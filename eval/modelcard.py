"""The Hub model card of an exported head: metadata, measured acceptance and speedup, the gate, plots, serving.

The figures come from a bench report as eval/report.py `load_report` returns it (checked against its schema).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from eyas.data.targets import DEFAULT_TARGETS
from eyas.heads.serving import serving_markdown
from eyas.heads.verifier import local_target_dir, weights_lines


def base_model_id(info: dict) -> str | None:
    """The target's Hub id when known: a named default's source model, or a verifier that looks like a Hub id."""
    target = info.get("target")
    if target in DEFAULT_TARGETS and DEFAULT_TARGETS[target].hub_id:
        return DEFAULT_TARGETS[target].hub_id
    for name in (info.get("verifier"), target):
        if name and "/" in name and not name.startswith((".", "/", "~")) and not Path(name).exists():
            return name
    return None


def target_license(info: dict) -> str | None:
    """The target's license: recorded at export, else the `license:` of the local target's own model card."""
    if info.get("target_license"):
        return info["target_license"]
    folder = local_target_dir(info.get("target")) or local_target_dir(info.get("verifier"))
    readme = folder / "README.md" if folder else None
    if readme and readme.exists():
        text = readme.read_text(errors="replace")
        if text.startswith("---"):
            meta = yaml.safe_load(text.split("---", 2)[1]) or {}
            if isinstance(meta, dict) and meta.get("license"):
                return str(meta["license"])
    return None


def card_metadata(info: dict) -> dict:
    meta = {}
    if base := base_model_id(info):
        meta["base_model"] = base
    meta["library_name"] = "speculators" if info["format"] == "speculators" else "vllm"
    meta["pipeline_tag"] = "text-generation"
    meta["tags"] = ["eagle3", "speculative-decoding", "draft-model", "eyas", info["format"]]
    if lic := target_license(info):
        meta["license"] = lic
    return meta


def fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


FIGURES = [("alpha", "alpha (chain)"), ("tau", "tau"), ("speedup", "speedup"),
           ("spec_tokens_per_s", "spec tok/s"), ("baseline_tokens_per_s", "plain tok/s"),
           ("itl_p99_regression", "p99 ITL regression"), ("lossless", "lossless")]


def measurements_section(report: dict | None) -> list[str]:
    """The figures of a bench report (None: unmeasured, said so)."""
    if not report:
        return ["## Measured", "", "No bench report was given: acceptance and speedup are unmeasured.", ""]
    env, decoder = report["environment"], report["decoder"]
    lines = ["## Measured", "",
             f"`eyas bench` on {report['prompts']} held-out prompts, {env['device']} "
             f"({env.get('cuda_device') or 'no GPU'}, {env['dtype']}), decoder {decoder['mode']} "
             f"(K={decoder['num_speculative_tokens']}, depth {decoder['depth']}, topk {decoder['topk']}, "
             f"budget {decoder['budget']}). alpha is measured in chain mode at K={report['alpha_chain_length']}; "
             "tau = 1 + accepted / drafts, pooled; speedup = speculative / plain tokens per second, same process.", ""]
    if env["device"] == "cpu":
        lines += ["Timings were taken on a CPU and are indicative only; measure on your serving hardware.", ""]
    if report["target"]["matches_head"] is False:
        lines += ["**Measured on other target weights than the head was trained against** (`eyas bench` was "
                  "allowed to): these figures are not the head's on its own target.", ""]
    if report["noise"]["trustworthy"] is False:
        lines += ["**The timings are untrustworthy:**", ""] + [f"- {w}" for w in report["noise"]["warnings"]] + [""]
    header = "| scope | " + " | ".join(title for _, title in FIGURES) + " |"
    lines += [header, "|" + "---|" * (len(FIGURES) + 1)]
    rows = [("all prompts", report)] + sorted(report["by_category"].items())
    for scope, figures in rows:
        lines.append(f"| {scope} | " + " | ".join(fmt(figures[key]) for key, _ in FIGURES) + " |")
    per_position = report["alpha_per_position"]
    if per_position:
        lines += ["", "Acceptance per draft position: " + ", ".join(fmt(a, 2) for a in per_position)]
    return lines + [""]


def gate_section(gate: dict | None, passed: bool, forced: bool, reason: str) -> list[str]:
    lines = ["## Release gate", ""]
    if gate:
        thresholds = gate.get("thresholds") or {}
        shown = ", ".join(f"{k} {v}" for k, v in thresholds.items() if v not in (None, {}, []))
        lines += [f"Verdict: **{'PASS' if passed else 'FAIL'}** (thresholds: {shown or 'none set'}).", ""]
        checks = gate.get("checks") or []
        if checks:
            lines += ["| check | scope | value | threshold | result |", "|---|---|---|---|---|"]
            lines += [f"| {c.get('name')} | {c.get('scope')} | {fmt(c.get('value'))} | {c.get('threshold')} | "
                      f"{'PASS' if c.get('passed') else 'FAIL'} |" for c in checks]
            lines.append("")
    else:
        lines += ["Verdict: **none** (no gate.json for this head).", ""]
    if forced:
        lines += [f"**Published with `--force`** although the gate did not pass for this head: {reason}.", ""]
    return lines


def build_card(info: dict, report: dict | None, gate: dict | None, gate_passed: bool, forced: bool, reason: str,
               repo_id: str, plots: list[str]) -> str:
    """README.md for the Hub: YAML metadata, then the figures, gate, plots, serving commands and provenance."""
    c = info["head_config"]
    target = base_model_id(info) or info.get("verifier") or info.get("target") or "TARGET"
    lines = ["---", yaml.safe_dump(card_metadata(info), sort_keys=False).strip(), "---", "",
             f"# EAGLE-3 draft head for {target}", "",
             f"A one-layer EAGLE-3 draft head ({info['format']} layout, {info['dtype']} weights) for speculative "
             f"decoding of `{target}` in vLLM and SGLang. Draft vocabulary {c['draft_vocab_size']} of "
             f"{c['vocab_size']} target tokens; target features from layers {c['aux_layer_ids']} "
             "(the residual stream entering each layer).", ""]
    if weights := weights_lines(info):  # which weights the head learnt; whether the verifier is those
        lines += ["## Target weights", ""] + weights
    lines += measurements_section(report)
    lines += gate_section(gate, gate_passed, forced, reason)
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots] + [""]
    lines += ["## Serving", "", serving_markdown(info["format"], target, repo_id, info["settings"])]
    provenance = {k: info.get(k) for k in ("source_head_hash", "target", "target_hash", "tokenizer_hash")}
    provenance["bench_report_head_sha256"] = report["head"]["sha256"] if report else None
    lines += ["## Provenance", "", "```json", json.dumps(provenance, indent=2), "```", "",
              "Made with eyas from a head trained on the target's own hidden states."]
    return "\n".join(lines) + "\n"
