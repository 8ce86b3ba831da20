"""Atomic writes: a failing writer leaves the previous file or folder untouched and no temporary behind."""

import pytest

from eyas.data.atomic import atomic_dir_write, atomic_write, atomic_write_json, atomic_write_text


def test_failed_file_write_keeps_the_old_file(tmp_path):
    path = atomic_write_text(tmp_path / "a.txt", "old")

    def broken(tmp):
        tmp.write_text("half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        atomic_write(path, broken)
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
    atomic_write_json(path, {"b": 1, "a": 2})
    assert path.read_text() == '{\n  "a": 2,\n  "b": 1\n}\n'


def test_failed_dir_write_keeps_the_old_folder(tmp_path):
    atomic_dir_write(tmp_path / "head", lambda d: (d / "w").write_text("v1"))

    def broken(d):
        (d / "w").write_text("v2-partial")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        atomic_dir_write(tmp_path / "head", broken)
    assert (tmp_path / "head" / "w").read_text() == "v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]
    atomic_dir_write(tmp_path / "head", lambda d: (d / "w").write_text("v2"))
    assert (tmp_path / "head" / "w").read_text() == "v2"
