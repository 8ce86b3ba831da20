"""The Hub model card of an exported head: metadata, measured acceptance and speedup, the gate, plots, serving."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from eyas.heads.export import KNOWN_TARGETS, local_target_dir, serving_markdown


def base_model_id(info: dict) -> str | None:
    """The target's Hub id when known: a named default's source model, or a verifier that looks like a Hub id."""
    target = info.get("target")
    if target in KNOWN_TARGETS:
        return KNOWN_TARGETS[target]["hub_id"]
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


def measurements_section(report: dict) -> list[str]:
    if not report:
        return ["## Measured", "", "No bench report was given: acceptance and speedup are unmeasured.", ""]
    env = report.get("environment") or {}
    decoder = report.get("decoder") or report.get("settings") or {}
    lines = ["## Measured", "",
             f"`eyas bench` on {fmt(report.get('prompts'))} held-out prompts, {env.get('device', '?')} "
             f"({env.get('cuda_device') or 'no GPU'}, {env.get('dtype', '?')}), decoder {decoder.get('mode', '?')} "
             f"(K={decoder.get('num_speculative_tokens', '?')}, depth {decoder.get('depth', '?')}, "
             f"topk {decoder.get('topk', '?')}, budget {decoder.get('budget', '?')}). alpha is measured in chain mode "
             f"at K={report.get('alpha_chain_length', decoder.get('num_speculative_tokens', '?'))}; "
             "tau = 1 + accepted / drafts, pooled; speedup = speculative / plain tokens per second, same process.", ""]
    if env.get("device") == "cpu":
        lines += ["Timings were taken on a CPU and are indicative only; measure on your serving hardware.", ""]
    header = "| scope | " + " | ".join(title for _, title in FIGURES) + " |"
    lines += [header, "|" + "---|" * (len(FIGURES) + 1)]
    rows = [("all prompts", report)] + sorted((report.get("by_category") or {}).items())
    for scope, figures in rows:
        lines.append(f"| {scope} | " + " | ".join(fmt(figures.get(key)) for key, _ in FIGURES) + " |")
    per_position = report.get("alpha_per_position")
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


def build_card(info: dict, report: dict, gate: dict | None, gate_passed: bool, forced: bool, reason: str,
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
    if note := KNOWN_TARGETS.get(info.get("target"), {}).get("note"):
        lines += [note, ""]
    lines += measurements_section(report)
    lines += gate_section(gate, gate_passed, forced, reason)
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots] + [""]
    lines += ["## Serving", "", serving_markdown(info["format"], target, repo_id, info["settings"])]
    provenance = {k: info.get(k) for k in ("source_head_hash", "target", "target_hash", "tokenizer_hash")}
    provenance["bench_report_head_sha256"] = (report.get("head") or {}).get("sha256")
    lines += ["## Provenance", "", "```json", json.dumps(provenance, indent=2), "```", "",
              "Made with eyas from a head trained on the target's own hidden states."]
    return "\n".join(lines) + "\n"
