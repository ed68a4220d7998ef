"""The shell blocks of README.md and the docs/ pages still run, as a newcomer would type them.

Every ```bash block of the front page and the pages is read and split into commands (``\\``
continuations joined, comments dropped, ``&&`` chains split, shell variables and ``{a,b}`` expanded,
a synopsis's ``[--opt X]`` read as ``--opt X`` and ``a|b`` as each choice). Each command is then:

* checked, whatever its cost: the launcher is one this test knows (python, torchrun, srun, bash,
  pip), torchrun's options parse with torchrun's own parser, the tool exists, its own argparse
  parser accepts every flag and value (parsed in-process and stopped right after parsing: nothing
  runs), every ``hypes_yaml/`` path exists, and a training command's yaml loads with its ``--set``
  overrides (an unknown key is the schema's one-line error);
* run for real when its block is in ``RUN_BLOCKS``: in a scratch folder holding only a link to
  ``hypes_yaml/``, through the tool's ``main(argv)`` (the function the script calls) with exactly
  the block's arguments, in the block's order.

Every block is in ``RUN_BLOCKS`` or ``SKIPPED_BLOCKS`` (with the reason); a new block in neither
fails the test, so it is classified when it is written. ``--help`` of every tool a page names runs
too. Runtime: about 12 s of CPU, most of it the tour's smoke training and the first imports of
torch's compiler and TensorBoard, which the rest of the suite pays anyway.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple
from unittest import mock

import pytest
from torch.distributed.run import get_args_parser as torchrun_parser

from opencood.config import load_config
from opencood.errors import OpencoodError
from process_state import cpu_and_process_state  # noqa: F401  (fixture)
from tool_modules import load_tool

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md"] + sorted(f"docs/{page.name}" for page in (REPO_ROOT / "docs").glob("*.md"))

# (page, the nearest heading above the block, its place among that heading's blocks)
BlockKey = Tuple[str, str, int]

# Blocks run for real: key -> (indexes of the commands run, None: all; why).
RUN_BLOCKS: Dict[BlockKey, Tuple[Optional[Tuple[int, ...]], str]] = {
    ("README.md", "A tour", 0): (
        None, "the newcomer's first session: tiny data (about 2 s), its check, a picture, "
              "the smoke training (2 steps), its evaluation and the record list"),
    ("docs/datasets.md", "V2V4Real (`fusion.dataset: v2v4real`, `hypes_yaml/v2v4real/`)", 0): (
        (0,), "the tiny V2V4Real set is written (about 2 s); its torchrun training (2 "
              "processes) and the evaluation of that run are only checked"),
    ("docs/datasets.md", "DAIR-V2X-C (`fusion.dataset: dairv2x`, `hypes_yaml/dairv2x/`)", 0): (
        (0,), "as V2V4Real: the tiny DAIR-V2X-C set is written, training and evaluation checked"),
    ("docs/heterogeneous.md", "The data: OPV2V-H in the synthetic world", 0): (
        None, "the tiny OPV2V-H set with its assignment files (about 3 s)"),
}

# Blocks only checked: key -> why they are not run here.
SKIPPED_BLOCKS: Dict[BlockKey, str] = {
    ("docs/datasets.md", "V2X-Real (`fusion.dataset: v2xreal`, `hypes_yaml/v2xreal/`)", 0):
        "tests/test_v2xreal.py writes the same format and reads it with the smoke config; "
        "here the commands are checked only",
    ("README.md", "Quick start (two commands, fresh machine, no GPU needed)", 0):
        "minutes of training, then the whole suite; tests/test_ci.py pins both commands and CI "
        "(.ci/run) runs the second in a fresh venv",
    ("docs/checkpoints.md", "Checkpoints and interop: using published checkpoints", 0):
        "needs another codebase's run folder and a real OPV2V copy (PEER_RUN, /data/opv2v); "
        "tests/test_parity_opencood.py and test_e2e_parity.py run import and export",
    ("docs/checkpoints.md", "Checkpoints and interop: using published checkpoints", 1):
        "needs HEAL / V2V4Real / CoAlign run folders; tests/test_import_heal_v2v4real.py runs them",
    ("docs/heterogeneous.md", "HEAL's heterogeneous runs", 0):
        "needs a HEAL heterogeneous run folder; tests/test_import_heal_heter.py imports runs "
        "built from HEAL's own pyramid models through the tool",
    ("docs/heterogeneous.md", "HEAL's heterogeneous runs", 1):
        "needs HEAL's stage-one and aligned run folders; tests/test_import_heal_heter.py merges "
        "folders split from HEAL's pyramid fixture through the tool (--merge)",
    ("docs/heterogeneous.md", "HEAL's table on the synthetic world", 0):
        "the `small` OPV2V-H set (22 minutes) and 45 minutes of training on 2 cores",
    ("docs/heterogeneous.md", "Evaluating as HEAL does", 0):
        "needs a trained heterogeneous run (RUN); tests/test_heter_eval.py and test_heter.py "
        "check the steps, the agents each keeps and the rows' record",
    ("docs/cameras.md", "HEAL's camera runs", 0):
        "needs a HEAL camera run folder; tests/test_import_heal_camera.py imports HEAL's own "
        "model through the tool",
    ("docs/cameras.md", "HEAL's camera runs", 1):
        "needs an imported HEAL camera run; tests/test_import_heal_camera.py round-trips the export "
        "on HEAL's fixture runs",
    ("docs/datasets.md", "The OPV2V layout, and using a real OPV2V copy", 0):
        "needs a real OPV2V copy and 8 processes",
    ("docs/datasets.md", "The synthetic world", 0):
        "the `small` preset takes minutes of CPU (the quick start writes it); the tour writes "
        "`tiny` with the same tool",
    ("docs/evaluation.md", "Evaluation and protocols", 0):
        "a synopsis over a trained run (runs/NAME); the tour evaluates one",
    ("docs/evaluation.md", "Pose correction (CoAlign)", 0):
        "two training runs of many minutes; tests/test_pose_correction.py and test_eval.py "
        "evaluate with a stage-1 run",
    ("docs/results.md", "CPU, `small` synthetic preset, equal optimizer steps", 0):
        "about 90 minutes of training",
    ("docs/results.md", "CPU, `small` preset: the four baselines at 1,120 equal steps", 0):
        "about 2 hours of training",
    ("docs/results.md", "CPU, `small` preset: cameras, ego-only vs cooperation", 0):
        "about 50 minutes of training on the camera preset",
    ("docs/results.md", "Multi-class (synthetic V2X-Real)", 0):
        "about 35 minutes of training; tests/test_results_table.py runs the tool",
    ("docs/results.md", "GPU, `opv2v` preset", 0):
        "needs a GPU, 26 GB of data and hours",
    ("docs/training.md", "Training", 0):
        "real training runs on GPUs, nodes or SLURM; the tour trains the smoke config",
}

# Words a page writes for "your value here", and what argparse is given in their place.
PLACEHOLDER_VALUES = {"N": "1"}
PLACEHOLDER_PATHS = {"X.yaml"}
ENVIRONMENT_COMMANDS = {"pip"}          # setting up the venv: the quick start's, run by CI


# ----------------------------------------------------------------------------------------------
# Reading the pages
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ShellBlock:
    page: str
    heading: str
    ordinal: int
    text: str

    @property
    def key(self) -> BlockKey:
        return (self.page, self.heading, self.ordinal)


def shell_blocks(page: str, text: str) -> List[ShellBlock]:
    """The ```bash blocks of one page, each under the nearest heading outside any fence."""
    blocks, heading, fence, body, seen = [], "", None, [], {}
    for line in text.splitlines():
        if fence is None and line.startswith("```"):
            fence, body = line[3:].strip(), []
        elif fence is not None and line.startswith("```"):
            if fence == "bash":
                ordinal = seen[heading] = seen.get(heading, -1) + 1
                blocks.append(ShellBlock(page, heading, ordinal, "\n".join(body)))
            fence = None
        elif fence is not None:
            body.append(line)
        elif re.match(r"#+ ", line):
            heading = line.lstrip("#").strip()
    return blocks


def all_blocks() -> List[ShellBlock]:
    return [block for page in PAGES
            for block in shell_blocks(page, (REPO_ROOT / page).read_text())]


ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)")
BRACES = re.compile(r"\{([^{}\s]*,[^{}\s]*)\}")


def expand_token(token: str, variables: Dict[str, str]) -> List[str]:
    """$VAR / ${VAR} substituted, then the first {a,b,c} expanded (as bash would)."""
    for name, value in variables.items():
        token = token.replace("${" + name + "}", value).replace("$" + name, value)
    match = BRACES.search(token)
    if not match:
        return [token]
    return [token[:match.start()] + choice + token[match.end():]
            for choice in match.group(1).split(",")]


def block_commands(text: str) -> List[List[str]]:
    """A block's commands as argv lists (a synopsis's brackets and choices still in them)."""
    variables: Dict[str, str] = {}
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line, comments=True)
        while tokens:
            part, tokens = (tokens[:tokens.index("&&")], tokens[tokens.index("&&") + 1:]) \
                if "&&" in tokens else (tokens, [])
            if len(part) == 1 and ASSIGNMENT.fullmatch(part[0]):
                name, value = ASSIGNMENT.fullmatch(part[0]).groups()
                variables[name] = value
                continue
            while part and ASSIGNMENT.fullmatch(part[0]):      # PYTHONPATH=. bash ...
                part = part[1:]
            commands.append([word for token in part for word in expand_token(token, variables)])
    return commands


def synopsis_variants(argv: Sequence[str]) -> List[List[str]]:
    """``[--opt X]`` -> ``--opt X``; a token ``a|b|c`` gives one argv per choice (the other
    such tokens at their first choice); placeholders get values argparse's types take."""
    words = [token.strip("[]") for token in argv]
    words = [PLACEHOLDER_VALUES.get(word, word) for word in words]
    first = [word.split("|")[0] for word in words]
    variants = [first]
    for position, word in enumerate(words):
        for choice in word.split("|")[1:]:
            variants.append(first[:position] + [choice] + first[position + 1:])
    return variants


# ----------------------------------------------------------------------------------------------
# One command: what it launches, and whether its arguments parse
# ----------------------------------------------------------------------------------------------

@dataclass
class Command:
    launcher: str               # python, torchrun, srun, bash, pip
    launcher_args: List[str]    # torchrun's own options
    tool: Optional[str]         # "tools/train.py", or None (pip, python -m ...)
    args: List[str]             # the tool's arguments


def parse_command(argv: List[str]) -> Command:
    """Raises ValueError for a launcher or a form this test does not know."""
    head, rest = argv[0], argv[1:]
    if head in ENVIRONMENT_COMMANDS or (head == "python" and rest[:1] == ["-m"]):
        return Command(head, [], None, rest)
    if head == "python" and rest and rest[0].startswith("tools/"):
        return Command(head, [], rest[0], rest[1:])
    if head == "torchrun":
        script = next((i for i, word in enumerate(rest) if word.endswith(".py")), None)
        if script is not None:
            return Command(head, rest[:script], rest[script], rest[script + 1:])
    if head == "srun" and "python" in rest:
        start = rest.index("python")
        inner = parse_command(rest[start:])
        return Command(head, rest[:start], inner.tool, inner.args)
    if head == "bash" and rest and rest[0].startswith("tools/"):
        return Command(head, [], rest[0], rest[1:])
    raise ValueError(f"a command this test does not know how to check: {shlex.join(argv)}")


class _Parsed(BaseException):
    """Raised by ArgumentParser.parse_args in parse-only mode, holding the namespace."""

    def __init__(self, namespace: argparse.Namespace):
        super().__init__()
        self.namespace = namespace


@contextlib.contextmanager
def parse_only() -> Iterator[None]:
    """Every ArgumentParser.parse_args parses, then stops the tool before it does anything."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        yield


def tool_name(tool: str) -> str:
    return Path(tool).stem


def parse_tool_args(tool: str, args: List[str]) -> Tuple[Optional[argparse.Namespace], str]:
    """(namespace, "") when the tool's parser accepts args, else (None, argparse's message)."""
    stderr = io.StringIO()
    quiet = contextlib.redirect_stdout(io.StringIO())
    with parse_only(), contextlib.redirect_stderr(stderr), quiet:
        try:
            load_tool(tool_name(tool)).main(args)
        except _Parsed as parsed:
            return parsed.namespace, ""
        except SystemExit:
            lines = stderr.getvalue().strip().splitlines()
            return None, lines[-1] if lines else "exited while parsing"
    return None, "main() returned without parsing its arguments"


def path_problems(words: Sequence[str]) -> List[str]:
    """hypes_yaml/ and tools/ paths a command names that do not exist."""
    problems = []
    for word in words:
        value = word.split("=", 1)[1] if word.startswith("--") and "=" in word else word
        if value.startswith(("hypes_yaml/", "tools/")) and not (REPO_ROOT / value).exists():
            problems.append(f"no such file: {value}")
    return problems


def config_problems(namespace: argparse.Namespace) -> List[str]:
    """A training command's yaml with its --set overrides loads against the schema."""
    yaml_path = getattr(namespace, "hypes_yaml", None)
    if not yaml_path or Path(yaml_path).name in PLACEHOLDER_PATHS:
        return []
    try:
        load_config(REPO_ROOT / yaml_path, list(getattr(namespace, "overrides", []) or []))
    except (OpencoodError, FileNotFoundError) as error:
        return [f"{yaml_path}: {error}"]
    return []


def command_problems(argv: List[str]) -> List[str]:
    """Everything wrong with one command of a page, each as one line."""
    try:
        command = parse_command(argv)
    except ValueError as error:
        return [str(error)]
    if command.tool is None:
        return []
    problems = path_problems([command.tool] + command.args)
    if problems:
        return problems
    if command.launcher == "torchrun":
        try:
            with contextlib.redirect_stderr(io.StringIO()) as stderr:
                torchrun_parser().parse_args(command.launcher_args + [command.tool])
        except SystemExit:
            problems.append(f"torchrun: {stderr.getvalue().strip().splitlines()[-1]}")
    if command.tool.endswith(".sh"):
        syntax = subprocess.run(["bash", "-n", str(REPO_ROOT / command.tool)],
                                capture_output=True, text=True)
        if syntax.returncode:
            problems.append(f"{command.tool}: {syntax.stderr.strip()}")
        return problems
    for variant in synopsis_variants(command.args):
        namespace, message = parse_tool_args(command.tool, variant)
        if namespace is None:
            problems.append(f"{command.tool} {shlex.join(variant)}: {message}")
        else:
            problems += config_problems(namespace)
    return problems


def block_problems(block: ShellBlock) -> List[str]:
    return [f"{block.page} [{block.heading}] `{shlex.join(argv)}`: {problem}"
            for argv in block_commands(block.text) for problem in command_problems(argv)]


# ----------------------------------------------------------------------------------------------
# The checker itself fails where it should (a checker that cannot fail checks nothing)
# ----------------------------------------------------------------------------------------------

def test_block_reading_joins_continuations_expands_and_splits_chains():
    text = ("S=hypes_yaml/synthetic\n"
            "PYTHONPATH=. bash tools/gpu_checks.sh   # comment\n"
            "python tools/results_table.py --steps 3 \\\n  --configs $S/point_pillar_{a,b}.yaml\n"
            "pip install -e . && python -m pytest -q\n")
    assert block_commands(text) == [
        ["bash", "tools/gpu_checks.sh"],
        ["python", "tools/results_table.py", "--steps", "3", "--configs",
         "hypes_yaml/synthetic/point_pillar_a.yaml", "hypes_yaml/synthetic/point_pillar_b.yaml"],
        ["pip", "install", "-e", "."], ["python", "-m", "pytest", "-q"]]
    synopsis = ["--m", "runs/NAME", "[--fusion_method", "no|late]", "[--steps", "N]"]
    assert synopsis_variants(synopsis) == [
        ["--m", "runs/NAME", "--fusion_method", "no", "--steps", "1"],
        ["--m", "runs/NAME", "--fusion_method", "late", "--steps", "1"]]


def test_headings_inside_code_fences_are_not_headings():
    text = "# Page\n## Part\n```python\n# not a heading\n```\n```bash\necho\n```\n"
    assert [block.key for block in shell_blocks("p.md", text)] == [("p.md", "Part", 0)]


@pytest.mark.parametrize("argv, expected", [
    ("python tools/eval.py --model_dir runs/x --no_such_flag",
     "unrecognized arguments: --no_such_flag"),
    ("python tools/eval.py --model_dir runs/x --protocol nonesuch", "invalid choice: 'nonesuch'"),
    ("python tools/no_such_tool.py --help", "no such file: tools/no_such_tool.py"),
    ("python tools/train.py --hypes_yaml hypes_yaml/synthetic/smoke.yaml "
     "--set train_params.epoch=1", "train_params.epoch"),
    ("python tools/train.py --hypes_yaml hypes_yaml/synthetic/nonesuch.yaml", "no such file"),
    ("torchrun --nproc-per-nodes=2 tools/train.py --hypes_yaml X.yaml", "torchrun: "),
    ("python tools/generate_synthetic.py --out d --presets tiny",
     "unrecognized arguments: --presets"),
    ("make all", "a command this test does not know"),
])
def test_a_stale_command_is_reported(argv, expected):
    problems = command_problems(shlex.split(argv))
    assert len(problems) == 1 and expected in problems[0], problems


def test_a_good_command_parses_without_running():
    namespace, message = parse_tool_args("tools/train.py",
                                         ["--hypes_yaml", "X.yaml", "--set", "a=1"])
    assert message == "" and namespace.hypes_yaml == "X.yaml" and namespace.overrides == ["a=1"]
    torchrun_eval = "torchrun --nproc_per_node=4 tools/eval.py --model_dir r"
    assert command_problems(shlex.split(torchrun_eval)) == []


# ----------------------------------------------------------------------------------------------
# The pages
# ----------------------------------------------------------------------------------------------

def test_every_block_is_classified_as_run_or_skipped():
    keys = [block.key for block in all_blocks()]
    unclassified = [key for key in keys if key not in RUN_BLOCKS and key not in SKIPPED_BLOCKS]
    assert not unclassified, ("add these blocks to RUN_BLOCKS or SKIPPED_BLOCKS (with the reason) "
                              f"in {Path(__file__).name}: {unclassified}")
    stale = [key for key in (*RUN_BLOCKS, *SKIPPED_BLOCKS) if key not in keys]
    assert not stale, f"listed blocks no page has any more: {stale}"
    assert not set(RUN_BLOCKS) & set(SKIPPED_BLOCKS)


def test_every_command_of_every_page_names_real_tools_flags_and_configs():
    problems = [problem for block in all_blocks() for problem in block_problems(block)]
    assert not problems, "\n".join(problems)


def test_help_of_every_tool_a_page_names(capsys):
    named = {word for block in all_blocks() for argv in block_commands(block.text)
             for word in argv if re.fullmatch(r"tools/\w+\.py", word)}
    assert {"tools/train.py", "tools/eval.py", "tools/generate_synthetic.py"} <= named
    for tool in sorted(named):
        with pytest.raises(SystemExit) as exited:
            load_tool(tool_name(tool)).main(["--help"])
        out = capsys.readouterr().out
        assert exited.value.code == 0 and out.startswith("usage:"), (tool, out[:200])


def run_tool(argv: List[str]) -> None:
    """One page command run in-process through the tool's main(argv), as its script would."""
    command = parse_command(argv)
    assert command.launcher == "python" and command.tool, f"only python tools run here: {argv}"
    try:
        result = load_tool(tool_name(command.tool)).main(command.args)
    except SystemExit as exited:
        result = exited.code
    assert result in (None, 0) or not isinstance(result, (int, str)), \
        f"`{shlex.join(argv)}` ended with {result!r}"


@pytest.mark.usefixtures("cpu_and_process_state")
def test_the_cheap_blocks_run_as_written(tmp_path, monkeypatch):
    (tmp_path / "hypes_yaml").symlink_to(REPO_ROOT / "hypes_yaml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OPENCOOD_CACHE", str(tmp_path / "cache"))     # not the user's cache
    blocks = {block.key: block for block in all_blocks()}
    for key, (indexes, _why) in RUN_BLOCKS.items():
        commands = block_commands(blocks[key].text)
        for index in (range(len(commands)) if indexes is None else indexes):
            run_tool(commands[index])
    # What the tour's commands leave behind, read back.
    assert (tmp_path / "sample.png").stat().st_size > 0
    assert list((tmp_path / "runs" / "smoke" / "evals").glob("test_*.yaml"))
    for name in ("synthetic_tiny", "synthetic_tiny_v2v4real", "synthetic_tiny_dairv2x"):
        assert (tmp_path / "data" / name / "generation.yaml").exists(), name


# ----------------------------------------------------------------------------------------------
# The front page and the links between the pages
# ----------------------------------------------------------------------------------------------

README_MAX_LINES = 250          # issue 35: a front page; the rest lives in docs/


def heading_anchors(text: str) -> set:
    """GitHub's anchors of a page's headings (fenced lines are no headings)."""
    anchors, in_fence = set(), False
    for line in text.splitlines():
        in_fence ^= line.startswith("```")
        if not in_fence and re.match(r"#+ ", line):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_the_readme_stays_a_front_page_linking_every_page():
    readme = (REPO_ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    linked = set(re.findall(r"\]\((docs/[\w.]+\.md)", readme))
    assert linked == {page for page in PAGES if page.startswith("docs/")}


def test_every_relative_link_and_picture_of_the_pages_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", (REPO_ROOT / page).read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            file_part, _, anchor = target.partition("#")
            path = (REPO_ROOT / page).parent / file_part if file_part else REPO_ROOT / page
            if not path.exists():
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and anchor not in heading_anchors(path.read_text()):
                broken.append(f"{page}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
