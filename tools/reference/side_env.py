"""What the tools/reference scripts share to run the authors' code in a side environment (its
own venv and checkout, outside this one; see each script's docstring for the command).

Scripts import this file as a sibling: ``sys.path.insert(0, <this folder>)`` then
``from side_env import ...`` (the folder is not a package). Depends on the standard library
only, so it loads in any side environment.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path


def load_by_path(name: str, path: Path) -> types.ModuleType:
    """The Python file ``path`` as the module ``name`` (registered in ``sys.modules``, so its
    dataclasses and pickled classes resolve): a sibling script, tests/parity_weights.py or one
    of the authors' files without importing its package."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def stub_module(name: str, **attributes) -> None:
    """An empty module ``name`` (holding ``attributes``) for an import the authors' code makes
    but never uses on the path a script runs."""
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module


def reference_root() -> Path:
    """The authors' checkout: the first ``sys.path`` (PYTHONPATH) entry holding an ``opencood``
    package."""
    for entry in sys.path:
        if entry and (Path(entry) / "opencood" / "__init__.py").is_file():
            return Path(entry)
    raise SystemExit("no reference checkout (a folder with opencood/, e.g. HEAL's) on "
                     "PYTHONPATH")


def two_step_main(argv, script: str, generate, run) -> int:
    """The command line of a two-step fixture script: ``--generate DATA_DIR`` (our side:
    ``generate(Path)``) or ``DATA_DIR OUT`` (the authors' side: ``run(Path, Path)``)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "--generate":
        generate(Path(args[1]))
        return 0
    if len(args) != 2:
        print(f"usage: {script} [--generate] DATA_DIR OUT", file=sys.stderr)
        return 2
    run(Path(args[0]), Path(args[1]))
    return 0
