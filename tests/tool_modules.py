"""The scripts in tools/ as importable modules, so tests drive the flow a user runs.

tools/ is not a package: a script is loaded from its file once per process and cached in
``sys.modules``. The training and evaluation flows are library modules
(``opencood.engine.trainer``, ``opencood.engine.evaluator``): tests import those, and watch a run
through its parameters (``trainer.main(argv, hooks)``, opencood.engine.hooks).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS_DIR = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py as the module ``opencood_tools_<name>``."""
    module_name = f"opencood_tools_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, TOOLS_DIR / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]
