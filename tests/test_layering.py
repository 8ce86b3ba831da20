"""The structure holds: imports point one way (data <- heads <- train <- eval <- eyas), modules stay small."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["data", "heads", "train", "eval", "eyas"]  # each may import only itself and those before it


def eyas_imports(path: Path) -> list[tuple[int, str]]:
    """(line, top folder) of every `eyas.<folder>` import in a file, at any depth (lazy imports count)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "eyas":
                found.append((node.lineno, parts[1] if len(parts) > 1 and parts[1] in ORDER[:4] else "eyas"))
    return found


def test_each_folder_imports_only_the_folders_before_it():
    wrong = []
    for folder in ORDER[:4]:
        allowed = set(ORDER[:ORDER.index(folder) + 1])
        for path in sorted((ROOT / folder).glob("*.py")):
            wrong += [f"{path.relative_to(ROOT)}:{line} imports eyas.{to}" for line, to in eyas_imports(path)
                      if to not in allowed and not (to == "eyas" and path.name == "__init__.py")]
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_a_wrong_arrow(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from eyas.eval.report import load_report\n    import eyas.recipe\n")
    assert eyas_imports(bad) == [(2, "eval"), (2, "eval"), (3, "eyas")]


def test_no_package_module_is_much_over_450_lines():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for folder in ORDER for p in sorted((ROOT / folder).glob("*.py"))
            if (n := len(p.read_text().splitlines())) > 460]
    assert not long, "split these by job: " + ", ".join(long)
