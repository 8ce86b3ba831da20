"""A recipe is one YAML file; this module assembles each stage's own config section from it.

    eyas train recipes/smollm2-135m-cpu.yaml train.lr=3e-4 data.max_length=256
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from eyas.configbase import ConfigError, _closest, from_dict, to_dict
from eyas.data.config import CollectConfig, DataConfig, TargetConfig, VocabConfig
from eyas.eval.config import BenchConfig, EngineConfig, GateConfig
from eyas.heads.config import ExportConfig, HeadConfig
from eyas.train.config import TrainConfig


@dataclass
class Recipe:
    name: str = "recipe"
    description: str = ""
    # Every stage writes under output_dir: data/, vocab/, features/, head/, bench/, export/.
    output_dir: str = field(default="runs/recipe", metadata={"pattern": (r".*\S.*", "a folder path")})
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    collect: CollectConfig = field(default_factory=CollectConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    # Path of the accelerate config that suits this recipe (documentation for `accelerate launch`).
    accelerate_config: str | None = None

    # Keys that recipes used to carry, refused with the reason (see eyas.configbase.from_dict).
    removed_keys = {"seed": "nothing read it: each section has its own seed",
                    "push": "`eyas push` takes its settings as flags: --repo-id, --private"}

    # ---- where each stage writes -------------------------------------------------------------
    @property
    def out(self) -> Path:
        return Path(self.output_dir)

    def stage_dir(self, stage: str) -> Path:
        return self.out / stage

    def to_dict(self) -> dict:
        return to_dict(self)


def recipes_dir() -> Path:
    return Path(str(resources.files("eyas.recipes")))


def list_recipes() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def find_recipe(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.exists():
        return path
    for candidate in (recipes_dir() / f"{name_or_path}.yaml", recipes_dir() / name_or_path):
        if candidate.exists():
            return candidate
    raise ConfigError(
        f"no recipe file or named recipe '{name_or_path}'{_closest(name_or_path, list_recipes())}"
    )


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line for a YAML error: what went wrong and where (PyYAML's own message spans several lines)."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark else problem


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form section.key=value")
    key, raw = text.split("=", 1)
    keys = key.strip().split(".")
    if not all(keys):
        raise ConfigError(f"override '{text}': '{key}' is not a key path such as train.lr")
    try:
        return keys, yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override '{text}': the value is not valid YAML: {_yaml_problem(exc)}") from None


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for text in overrides:
        keys, value = parse_override(text)
        node = raw
        for k in keys[:-1]:
            if node.get(k) is None:  # absent, or an empty section in the file
                node[k] = {}
            node = node[k]
            if not isinstance(node, dict):
                raise ConfigError(f"override '{text}': '{k}' is not a section")
        node[keys[-1]] = value
    return raw


def deep_merge(base: dict, update: dict) -> dict:
    """`update` over `base`, section by section; lists and scalars are replaced whole."""
    out = dict(base)
    for key, value in update.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_recipe_file(name_or_path: str, seen: tuple[str, ...] = ()) -> dict:
    """The raw mapping of a recipe file, with its `base:` recipe (if any) merged underneath."""
    path = find_recipe(name_or_path)
    if str(path.resolve()) in seen:
        raise ConfigError(f"{path}: `base` recipes form a cycle ({' -> '.join(seen)})")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(exc)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a recipe is a mapping of sections, got {type(raw).__name__}")
    raw.setdefault("name", path.stem)
    base = raw.pop("base", None)
    if base:
        raw = deep_merge(read_recipe_file(base, seen + (str(path.resolve()),)), raw)
    return raw


def load_recipe(name_or_path: str | None = None, overrides: list[str] | None = None) -> Recipe:
    raw = read_recipe_file(name_or_path) if name_or_path else {}
    raw = apply_overrides(raw, list(overrides or []))
    return from_dict(Recipe, raw)


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)
