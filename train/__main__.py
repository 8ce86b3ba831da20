"""`python -m eyas.train RECIPE [section.key=value ...]`, so that `accelerate launch -m eyas.train RECIPE` works."""

from __future__ import annotations

import sys

from eyas.configbase import ConfigError
from eyas.recipe import load_recipe
from eyas.train.loop import TrainingError, run_train


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if args else 2
    try:
        print(run_train(load_recipe(args[0], args[1:])))
    except (ConfigError, TrainingError, FileNotFoundError, ValueError) as exc:
        print(f"eyas.train: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
