"""Hand-made stage folders (a prepared dataset, a draft vocab) that count as finished stages for the runner."""

from __future__ import annotations

from pathlib import Path

from eyas.data.packages import sha256_file
from eyas.data.stage import DONE, hash_json, write_done


def mark_done(folder: Path) -> None:
    """Write DONE.json into `folder` with a hash of its files' content, so new content is a new input."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != DONE)
    write_done(folder, hash_json([(str(p.relative_to(folder)), sha256_file(p)) for p in files]))
