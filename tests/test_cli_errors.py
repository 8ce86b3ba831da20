"""Bad paths and full or read-only disks end in one line naming the path and the fix, not a traceback."""

import errno
import json

import pytest

from eyas.cli import main


def chat_recipe(tmp_path, corpus_path=None):
    corpus = corpus_path or tmp_path / "chat.json"
    if corpus_path is None:
        corpus.write_text(json.dumps([{"conversations": [
            {"from": "human", "value": f"Question {i}?"},
            {"from": "gpt", "value": f"Answer number {i}, long enough to be trained on."}]} for i in range(40)]))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'run'}\ndata:\n  corpora:\n    - kind: json\n      path: {corpus}\n"
                      f"  validation_fraction: 0.2\n")
    return recipe


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("code, fix", [(errno.EROFS, "the file system is read-only: point output_dir"),
                                       (errno.ENOSPC, "free some space"),
                                       (errno.EACCES, "no permission")])
def test_os_errors_while_writing_a_stage_are_one_line_with_the_path(tmp_path, capsys, monkeypatch, code, fix):
    import os

    def refuse(splits, out):
        raise OSError(code, os.strerror(code), str(out / "train"))
    monkeypatch.setattr("eyas.data.prepare.save_dataset", refuse)
    err = one_line_error(capsys, ["prepare", str(chat_recipe(tmp_path))])
    assert err.startswith(f"eyas prepare: error: {os.strerror(code)} ({tmp_path / 'run' / 'data' / 'train'}); {fix}")
    assert not (tmp_path / "run" / "data" / "DONE.json").exists()


def test_a_folder_given_as_a_sharegpt_file_is_one_line(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'run'}\ndata:\n  corpora:\n    - kind: sharegpt\n      path: {tmp_path}\n")
    err = one_line_error(capsys, ["prepare", str(recipe)])
    assert f"corpus 'sharegpt': {tmp_path} is a folder, and this kind reads one file" in err


def test_a_stage_before_its_upstream_names_the_missing_stage(tmp_path, capsys):
    err = one_line_error(capsys, ["vocab", str(chat_recipe(tmp_path))])
    assert "run/data/DONE.json does not exist: stage 'vocab' needs prepare first; run `eyas prepare <recipe>`" in err


def test_a_bug_keeps_its_traceback_and_its_own_exit_code(tmp_path, capsys, monkeypatch):
    # 3, not 1: a script must tell a crash from a failed release gate (1) and a bad input (2).
    def crash(splits, out):
        raise RuntimeError("an unexpected state")
    monkeypatch.setattr("eyas.data.prepare.save_dataset", crash)
    assert main(["prepare", str(chat_recipe(tmp_path))]) == 3
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "RuntimeError: an unexpected state" in err
    assert err.strip().splitlines()[-1].startswith("eyas prepare: internal error (a bug in eyas)")
    assert not (tmp_path / "run" / "data" / "DONE.json").exists()


def test_run_refuses_a_head_init_the_target_cannot_give_before_any_stage(tmp_path, capsys):
    # Checked on the target's config before prepare: otherwise the error comes after prepare and collect.
    err = one_line_error(capsys, ["run", str(chat_recipe(tmp_path)), "head.init_from_target_layer=99"])
    assert "head.init_from_target_layer: 99 is not a layer of the target (0..29)" in err
    assert not (tmp_path / "run" / "data").exists()


def test_overrides_after_an_option_are_applied_and_stray_words_refused(tmp_path, capsys):
    recipe = chat_recipe(tmp_path)
    assert main(["run", str(recipe), "--stages", "prepare", f"output_dir={tmp_path / 'elsewhere'}"]) == 0
    assert (tmp_path / "elsewhere" / "data" / "DONE.json").exists() and not (tmp_path / "run").exists()
    for stray in (["--bogus"], ["notanoverride"]):
        with pytest.raises(SystemExit) as exit_:
            main(["run", str(recipe), "--stages", "prepare"] + stray)
        assert exit_.value.code == 2 and f"unrecognized arguments: {stray[0]}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["monitor", "http://127.0.0.1:1", "train.lr=1"])  # a command without a recipe
    assert "unrecognized arguments: train.lr=1" in capsys.readouterr().err
