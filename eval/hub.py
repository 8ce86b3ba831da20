"""`eyas push`: upload an export to the Hugging Face Hub with a model card, only for a head that passed the gate.

The upload folder (export files, the card as README.md, the bench plots) is staged in a temporary
directory and sent as one commit, so a failure leaves neither local files nor a half-written repo.
The token comes from HF_TOKEN or the user's `hf auth login`; eyas never prints or stores it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from eyas.data.packages import sha256_file
from eyas.eval.gate import GATE_FILE, gate_passed_for
from eyas.eval.modelcard import build_card
from eyas.eval.report import load_report
from eyas.heads.checkpoint import WEIGHTS
from eyas.heads.export import EXPORT_METADATA, validate_export
from eyas.heads.verifier import verifier_warning

PLOTS_DIR = "plots"


class PushError(ValueError):
    """The push cannot go ahead (no token, no network, a bad export); nothing was uploaded."""


def read_export_info(export_dir: Path) -> dict:
    path = export_dir / EXPORT_METADATA
    if not path.exists():
        raise FileNotFoundError(f"{export_dir}: no {EXPORT_METADATA}; push an `eyas export` directory")
    info = json.loads(path.read_text())
    for key in ("format", "source_head_hash", "weights_sha256", "config_sha256", "head_config", "settings"):
        if key not in info:
            raise PushError(f"{path}: field '{key}' is missing; re-run `eyas export`")
    return info


def gate_status(head_hash: str, report_path: Path | None) -> tuple[bool, dict | None, str]:
    """(passed for this exact head, gate.json or None, why not) from the gate beside the bench report."""
    if report_path is None:
        return False, None, "no bench report was recorded at export or given with --report"
    gate_file = report_path.with_name(GATE_FILE)
    gate = json.loads(gate_file.read_text()) if gate_file.exists() else None
    if gate_passed_for(head_hash, report_path):
        return True, gate, ""
    if gate is None:
        return False, None, f"no gate.json beside {report_path} (run `eyas gate {report_path}`)"
    if gate.get("head_sha256") != head_hash:
        return False, gate, (f"{gate_file} is for head {str(gate.get('head_sha256'))[:12]}, this export is of head "
                             f"{head_hash[:12]}")
    if gate.get("passed") is not True:
        return False, gate, f"the gate failed ({gate_file})"
    return False, gate, f"{report_path} changed after it was gated (re-run `eyas gate {report_path}`)"


def public_info(info: dict) -> dict:
    """eyas_export.json as uploaded: local paths cut to their names."""
    out = dict(info)
    for key in ("source_head", "bench_report"):
        if out.get(key):
            out[key] = Path(out[key]).name
    return out


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link when on the same filesystem (weights can be gigabytes), else copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def stage_upload(export_dir: Path, folder: Path, info: dict, card: str, plots: list[Path]) -> list[tuple[str, int]]:
    """Fill `folder` with what goes to the Hub; returns (relative path, bytes) of every file, sorted."""
    for src in sorted(export_dir.iterdir()):
        if src.is_file() and src.name not in ("README.md", EXPORT_METADATA):
            link_or_copy(src, folder / src.name)
    (folder / EXPORT_METADATA).write_text(json.dumps(public_info(info), indent=2))
    if plots:
        (folder / PLOTS_DIR).mkdir()
        for png in plots:
            link_or_copy(png, folder / PLOTS_DIR / png.name)
    (folder / "README.md").write_text(card)
    return sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*") if p.is_file())


def hub_token() -> str:
    from huggingface_hub import get_token

    token = os.environ.get("HF_TOKEN") or get_token()
    if not token:
        raise PushError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (nothing was uploaded)")
    return token


def upload(folder: Path, repo_id: str, token: str, private: bool, message: str) -> str:
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        commit = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                                   commit_message=message)
    except Exception as exc:  # network, auth and Hub errors all end the push the same way
        detail = str(exc).replace(token, "***").splitlines()[0][:300] if str(exc) else ""
        raise PushError(f"could not push to {repo_id}: {type(exc).__name__}: {detail} "
                        "(check the network, the token's write access and the repo id; local files are untouched)"
                        ) from None
    return getattr(commit, "commit_url", None) or f"https://huggingface.co/{repo_id}"


def push(export_dir, repo_id: str, report=None, dry_run: bool = False, force: bool = False,
         private: bool = False) -> int:
    """Upload `export_dir` to `repo_id`; 0 on success (or dry run), 1 when the gate refuses."""
    export_dir = Path(export_dir)
    info = read_export_info(export_dir)
    validate_export(export_dir)  # names a config.json field that no longer matches the head
    for name, key in ((WEIGHTS, "weights_sha256"), ("config.json", "config_sha256")):
        if info[key] != sha256_file(export_dir / name):
            raise PushError(f"{export_dir / name} changed after `eyas export` wrote it; re-export the gated head")
    report_path = Path(report) if report else Path(info["bench_report"]) if info.get("bench_report") else None
    if report_path is not None and not report_path.exists():
        if report:
            raise FileNotFoundError(f"bench report {report_path} does not exist")
        report_path = None  # recorded at export but gone: treated as no report
    report_data = load_report(report_path) if report_path else None
    passed, gate, reason = gate_status(info["source_head_hash"], report_path)
    if not passed and not force:
        print(f"eyas push: refused: {reason}. Publish only gated heads, or pass --force (recorded in the card).")
        return 1
    if warning := verifier_warning(info.get("verifier_check") or {}, info.get("trained_against")):
        print(f"eyas push: warning: {warning}")
    if info.get("verifier") and Path(info["verifier"]).expanduser().exists():
        print(f"eyas push: warning: the export names a local verifier path ({info['verifier']}); "
              "re-export with --verifier <Hub id> so others can load it")
    plots = sorted(report_path.parent.glob("*.png")) if report_path else []
    card_reason = reason.replace(f"{report_path.parent}/", "") if report_path else reason  # no local paths
    card = build_card(info, report_data, gate, passed, forced=not passed, reason=card_reason, repo_id=repo_id,
                      plots=[f"{PLOTS_DIR}/{p.name}" for p in plots])

    with tempfile.TemporaryDirectory(prefix="eyas-push-") as tmp:
        folder = Path(tmp)
        files = stage_upload(export_dir, folder, info, card, plots)
        if dry_run:
            print(f"eyas push --dry-run: would upload {len(files)} files to {repo_id} "
                  f"({'private' if private else 'public'}); nothing was sent")
            for name, size in files:
                print(f"  {name}  ({size:,} bytes)")
            print("\n----- README.md (model card) -----\n" + card)
            return 0
        token = hub_token()
        message = f"eyas: EAGLE-3 head {info['source_head_hash'][:12]} ({info['format']})" + (
            ", pushed with --force without a passing gate" if not passed else "")
        url = upload(folder, repo_id, token, private, message)
    print(f"eyas push: uploaded {len(files)} files to {repo_id}: {url}")
    return 0
