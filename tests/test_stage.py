"""The stage contract (data/stage.py): skip when DONE matches; redo on a changed input, upstream or code line."""

import json
import sys

import pytest

from eyas.data.stage import DONE, Stage, code_version, done_hash, input_hash, run_stage
from eyas.stages import STAGES


@pytest.fixture
def stage_module(tmp_path, monkeypatch):
    """A real module on sys.path whose source the test edits, as a developer edits a stage's code."""
    path = tmp_path / "mods" / "fake_stage_code.py"
    path.parent.mkdir()
    path.write_text("FACTOR = 2\n")
    monkeypatch.syspath_prepend(str(path.parent))
    yield path
    sys.modules.pop("fake_stage_code", None)


def counting_stage(calls: list, code=("fake_stage_code",)) -> Stage:
    def run(out):
        calls.append(out)
        (out / "result.txt").write_text(str(len(calls)))
        return {"calls": len(calls)}
    return Stage("fake", folder="fake", sections=("s",), upstream=(), code=code, run=run)


def run_fake(stage, out, sections, upstream=None, extra=None):
    key = input_hash(stage, sections, upstream or {}, extra)
    return run_stage(stage, out, key, lambda: stage.run(out))


def test_skips_when_up_to_date_and_redoes_on_changed_config_inputs_or_code(tmp_path, stage_module):
    calls: list = []
    stage, out = counting_stage(calls), tmp_path / "run" / "fake"
    assert run_fake(stage, out, {"s": {"x": 1}}) == out and len(calls) == 1
    done = json.loads((out / DONE).read_text())
    assert done["stage"] == "fake" and done["calls"] == 1
    run_fake(stage, out, {"s": {"x": 1}})
    assert len(calls) == 1 and json.loads((out / DONE).read_text()) == done  # skipped, DONE untouched
    run_fake(stage, out, {"s": {"x": 2}})  # a config value changed
    assert len(calls) == 2
    run_fake(stage, out, {"s": {"x": 2}}, extra={"corpus": "other bytes"})  # an input file changed
    assert len(calls) == 3
    before = code_version(stage.code)
    stage_module.write_text("FACTOR = 3\n")  # only the stage's code changed
    assert code_version(stage.code) != before
    run_fake(stage, out, {"s": {"x": 2}}, extra={"corpus": "other bytes"})
    assert len(calls) == 4


def test_an_upstream_rerun_redoes_the_stages_after_it(tmp_path, stage_module):
    calls: list = []
    up, out = tmp_path / "up", tmp_path / "down"
    up.mkdir()
    (up / DONE).write_text(json.dumps({"input_hash": "aaaa"}))
    stage = counting_stage(calls)
    run_fake(stage, out, {"s": {}}, {"up": up})
    run_fake(stage, out, {"s": {}}, {"up": up})
    assert len(calls) == 1
    (up / DONE).write_text(json.dumps({"input_hash": "bbbb"}))  # upstream redone with other inputs
    run_fake(stage, out, {"s": {}}, {"up": up})
    assert len(calls) == 2


def test_a_missing_upstream_is_named_and_nothing_runs(tmp_path, stage_module):
    calls: list = []
    with pytest.raises(FileNotFoundError, match=r"up/DONE.json does not exist: stage 'fake' needs up first; "
                                                r"run `eyas up <recipe>`"):
        run_fake(counting_stage(calls), tmp_path / "down", {"s": {}}, {"up": tmp_path / "up"})
    assert not calls


def test_a_failing_stage_leaves_no_done(tmp_path, stage_module):
    out = tmp_path / "fake"
    stage = counting_stage([])
    run_fake(stage, out, {"s": {"x": 1}})
    assert done_hash(out)

    def broken():
        raise ValueError("bad record")
    with pytest.raises(ValueError):
        run_stage(stage, out, input_hash(stage, {"s": {"x": 9}}, {}, None), broken)
    assert done_hash(out) is None  # the old DONE went before the work began: a half-redone folder is never "done"


def test_every_registered_stage_names_code_that_exists():
    for stage in STAGES:
        assert len(code_version(stage.code)) == 16, stage.name


def test_a_second_run_on_a_locked_folder_is_refused_and_names_the_holder(tmp_path, stage_module):
    import subprocess
    import textwrap

    out = tmp_path / "fake"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from eyas.data.stage import folder_lock
        with folder_lock(Path({str(out)!r}), "fake"):
            print("locked", flush=True)
            time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        calls: list = []
        with pytest.raises(RuntimeError, match=rf"{out} is being written by pid {holder.pid} on .* \(stage 'fake'\)"):
            run_fake(counting_stage(calls), out, {"s": {}})
        assert not calls and done_hash(out) is None
    finally:
        holder.kill()
        holder.wait()
    calls = []
    run_fake(counting_stage(calls), out, {"s": {}})  # the holder died: its lock went with it
    assert len(calls) == 1


def test_a_changed_train_setting_redoes_train_but_not_the_data_stages():
    """Each registered stage hashes only its own sections: a new learning rate leaves prepare's key alone."""
    from eyas.data.stage import hash_json
    from eyas.recipe import load_recipe
    from eyas.stages import get_stage

    a = load_recipe("smollm2-135m-cpu")
    b = load_recipe("smollm2-135m-cpu", ["train.lr=1e-3"])

    def sections(recipe, stage):
        return hash_json({s: getattr(recipe, s) for s in get_stage(stage).sections})
    assert sections(a, "prepare") == sections(b, "prepare") and sections(a, "vocab") == sections(b, "vocab")
    assert sections(a, "train") != sections(b, "train")
