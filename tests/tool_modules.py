"""The scripts in tools/ as importable modules, so tests drive the flow a user runs.

tools/ is not a package: a script is loaded from its file once per process and cached in
``sys.modules``. The training and evaluation flows are library modules
(``opencood.engine.trainer``, ``opencood.engine.evaluator``): tests import those, and watch a run
through its parameters (``trainer.main(argv, hooks)``, opencood.engine.hooks).
"""
from __future__ import annotations

import importlib.util
import logging
import runpy
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import NamedTuple, Sequence

import torch

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


def import_and_load(peer_args: Sequence[str], out: Path):
    """``tools/import_checkpoint.py --from ... <peer_args> --out out``, then what tools/eval.py
    does with the folder: build the model from its config.yaml and load last.pth strictly.
    -> (config, model in eval mode, checkpoint dict)."""
    from opencood.config import load_config
    from opencood.models.build import build_model
    load_tool("import_checkpoint").main([*map(str, peer_args), "--out", str(out)])
    cfg = load_config(out / "config.yaml")
    model = build_model(cfg["model"])
    checkpoint = torch.load(out / "last.pth", weights_only=True)
    model.load_state_dict(checkpoint["model"], strict=True)
    return cfg, model.eval(), checkpoint


class ScriptResult(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def exit_status(code) -> int:
    """The status Python's interpreter exits with for ``SystemExit(code)``; a message (any code
    but None or an int) goes to stderr first, as the interpreter prints it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


# Python's default warning filters (pytest replaces them while a test runs).
STARTUP_WARNING_FILTERS = (("default", DeprecationWarning, "__main__"),
                           ("ignore", DeprecationWarning, ""),
                           ("ignore", PendingDeprecationWarning, ""),
                           ("ignore", ImportWarning, ""), ("ignore", ResourceWarning, ""))


def print_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """What an interpreter prints for a warning (pytest records them instead)."""
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def run_script(script: Path, argv: Sequence, monkeypatch, capsys) -> ScriptResult:
    """``python script argv...`` run in this process as a fresh interpreter runs it, without
    paying another interpreter and torch import: the file as ``__main__`` (runpy) with
    ``sys.argv``; logging as at start-up (no handler on the root or the "opencood" logger, so a
    record logged before the tool sets up its own reaches stderr through Python's last-resort
    handler, or the tool's ``basicConfig`` installs its own); warnings printed to stderr under
    Python's default filters; the exit status of SystemExit.
    Any other exception propagates (where a subprocess would print its traceback).
    ``monkeypatch`` puts the loggers back after the test; the working folder is the caller's."""
    for log in (logging.getLogger(), logging.getLogger("opencood")):
        for attribute, fresh in (("handlers", []), ("level", log.level), ("propagate", True)):
            monkeypatch.setattr(log, attribute, fresh)
    monkeypatch.setattr(logging.getLogger("opencood"), "level", logging.NOTSET)
    monkeypatch.setattr(sys, "argv", [str(script), *map(str, argv)])
    capsys.readouterr()
    threads = torch.get_num_threads()
    with warnings.catch_warnings():          # printed to stderr, filtered as at start-up
        warnings.resetwarnings()
        for action, category, module in STARTUP_WARNING_FILTERS:
            warnings.filterwarnings(action, category=category, module=module)
        warnings.showwarning = print_warning
        try:
            runpy.run_path(str(script), run_name="__main__")
            status = 0
        except SystemExit as exit_:
            status = exit_status(exit_.code)
        finally:
            torch.set_num_threads(threads)       # a tool's --threads stays its own
    captured = capsys.readouterr()
    return ScriptResult(status, captured.out, captured.err)
