"""README.md is a user's guide whose commands work (issue 28).

Every line starting with ``planner `` in README.md's shell blocks (```bash,
```sh or plain ```) is run as the ``planner`` command runs it
(``app.cli.main``), in README order, in one temporary folder, so that a
command finds what an earlier one wrote (``planner show plan.json`` reads the
plan ``planner plan ... -o plan.json`` made). They run in this test's process:
a fresh interpreter per command would import torch and the planner again each
time, most of a short command's seconds, and ``planner run``'s ranks start
from this process's forkserver, whose imports the other tests' launches have
paid. Each command must exit 0 and leave the files it says it wrote;
``planner run --check`` must pass. (``tests/test_cli.py`` runs ``python -m
app.cli`` itself, as a user's shell does.)

Inputs the README has the user make themselves are made here:

* ``my_model.py``: the README's ```python block that starts with
  ``# my_model.py`` is written out as it stands, so that example is run too;
* ``train.bin``: the README's own bytes as a token file (``planner train --data``);
* ``corpus.txt``: the README's own text (``planner data``);
* ``h100.json``: on a GPU machine ``planner profile --ranks 1 -o h100.json``
  writes it (skipped here: no GPU); the test writes the ``dgx-h100`` preset cut
  to one GPU instead, as ``benchmarks/plan_identity.py`` does.

The commands in :data:`SKIPPED` are not run (each says why); their flags are
still checked against the ``planner`` parser.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import shlex
import time
from pathlib import Path

import numpy as np
import pytest

from app.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
#: A user's guide, not the design: the design is docs/design.md. (200 until
#: ``planner train`` and its loop of the README's own came in.)
MAX_LINES = 250
SHELL_FENCES = {"", "bash", "sh", "shell"}

#: README commands not run here, with the reason.
SKIPPED = {
    "planner profile --ranks 1 -o h100.json": "needs a GPU",
    "planner run gpt2.json --check": "needs a GPU (the plan is for an H100)",
    "planner run plan.json --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500":
        "needs two nodes",
    "planner profile --ranks 4 -o local-cpu.json":
        "measures this machine for about a minute at full load (tests/test_profile.py "
        "runs `planner profile --quick`)",
}


def _blocks(text: str) -> list[tuple[str, list[str]]]:
    """README's fenced code blocks as (language, lines)."""
    blocks: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    lang = ""
    for line in text.splitlines():
        fence = re.match(r"^\s*```\s*([\w+-]*)\s*$", line)
        if fence and current is None:
            lang, current = fence.group(1).lower(), []
        elif fence:
            blocks.append((lang, current))
            current = None
        elif current is not None:
            current.append(line)
    assert current is None, "README.md has an unclosed ``` block"
    return blocks


def readme_commands() -> list[list[str]]:
    """The ``planner`` commands of README.md's shell blocks, as argument lists
    (``planner`` included, trailing ``# comments`` dropped), in README order."""
    commands = []
    for lang, lines in _blocks(README.read_text()):
        if lang not in SHELL_FENCES:
            continue
        for line in lines:
            line = line.strip()
            if line.startswith("planner "):
                assert not line.endswith("\\"), f"continued command line in README: {line}"
                commands.append(shlex.split(line, comments=True))
    return commands


def _key(command: list[str]) -> str:
    return " ".join(command)


def _readme_file(name: str) -> str:
    """The README's ```python block whose first line is ``# NAME``."""
    for lang, lines in _blocks(README.read_text()):
        if lang == "python" and lines and lines[0].strip() == f"# {name}":
            return "\n".join(lines) + "\n"
    raise AssertionError(f"README.md has no ```python block starting with '# {name}'")


def _outputs(command: list[str]) -> list[str]:
    """The files a command writes, by its subcommand and flags (defaults included)."""
    args = build_parser().parse_args(command[1:])
    if args.command in ("plan", "data"):
        return [args.output]
    if args.command == "compare":
        return [args.output + ".json", args.output + ".png"]
    if args.command == "profile":
        stem, _ = os.path.splitext(args.output)
        return [args.output, stem + ".profile.json"]
    if args.command == "show" and getattr(args, "plot", None):
        return [os.path.join(args.plot, "memory.png")]
    if args.command == "train":
        return [p for p in (args.checkpoint_dir, args.result_json, args.export, args.log) if p]
    return []


def _inputs(command: list[str]) -> set[str]:
    """The names a command may read: its arguments after the subcommand (the plan
    file, a cluster JSON), and the file of a ``file.py:factory`` model."""
    names = set()
    for token in command[2:]:
        names.add(token)
        names.add(token.split(":")[0])  # my_model.py:make
    return names


def _prepare_inputs(folder: Path) -> None:
    """Write what the README has the user write, or what a skipped command writes."""
    from costmodel.presets import preset

    (folder / "my_model.py").write_text(_readme_file("my_model.py"))
    # train.bin: the README as byte tokens, below gpt-tiny's vocabulary of 128
    text = bytes(b for b in README.read_bytes() if b < 128)
    (folder / "train.bin").write_bytes(np.frombuffer(text, dtype=np.uint8).astype("<u2").tobytes())
    (folder / "corpus.txt").write_bytes(README.read_bytes())
    one_gpu = dataclasses.replace(preset("dgx-h100", 1), name="h100", devices_per_node=1)
    (folder / "h100.json").write_text(one_gpu.to_json())


@dataclasses.dataclass
class _Run:
    command: list[str]
    deps: list[int]
    seconds: float = 0.0
    returncode: int | None = None
    output: str = ""
    note: str = ""


@contextlib.contextmanager
def _working_directory(folder: Path):
    saved = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(saved)


def _run_here(run: _Run, folder: Path) -> None:
    """Run ``run.command`` as ``planner`` would (``app.cli.main``) in this
    process, in ``folder``, with what it prints in ``run.output``."""
    printed = io.StringIO()
    started = time.perf_counter()
    with _working_directory(folder), contextlib.redirect_stdout(printed), \
            contextlib.redirect_stderr(printed):
        try:
            run.returncode = main(run.command[1:])
        except SystemExit as stop:  # argparse's own exits
            run.returncode = stop.code if isinstance(stop.code, int) else 2
    run.seconds = time.perf_counter() - started
    run.output = printed.getvalue()


def _run_all(commands: list[list[str]], folder: Path) -> list[_Run]:
    """Run ``commands`` in ``folder``, in README order; a command whose input
    an earlier command failed to write is not run."""
    runs = []
    for i, command in enumerate(commands):
        reads = _inputs(command)
        deps = [j for j in range(i) if reads & set(_outputs(commands[j]))]
        run = _Run(command, deps)
        failed = [d for d in deps if runs[d].returncode != 0]
        if failed:
            run.returncode = -1
            run.note = f"not run: `{_key(runs[failed[0]].command)}` failed"
        else:
            _run_here(run, folder)
        runs.append(run)
    return runs


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines; move detail to docs/design.md"


def test_readme_commands_use_real_flags(capsys):
    commands = readme_commands()
    assert len(commands) >= 8, "README.md shows fewer planner commands than expected"
    for command in commands:
        try:
            build_parser().parse_args(command[1:])
        except SystemExit:
            pytest.fail(f"README command does not parse: {_key(command)}\n"
                        f"{capsys.readouterr().err}")


def test_skipped_commands_are_in_the_readme():
    shown = {_key(c) for c in readme_commands()}
    stale = [c for c in SKIPPED if c not in shown]
    assert not stale, f"SKIPPED names commands README.md no longer shows: {stale}"


@pytest.mark.multiprocess
def test_readme_commands_run(tmp_path):
    _prepare_inputs(tmp_path)
    commands = [c for c in readme_commands() if _key(c) not in SKIPPED]
    assert any(c[1] == "run" for c in commands), "no `planner run` of the README is run"
    runs = _run_all(commands, tmp_path)
    for run in runs:  # shown with -s, or when the test fails
        print(f"{run.seconds:5.1f} s  exit {run.returncode}  {_key(run.command)}")
    problems = []
    for run in runs:
        what = f"`{_key(run.command)}` ({run.seconds:.1f} s)"
        if run.returncode != 0:
            problems.append(f"{what}: exit status {run.returncode} {run.note}\n"
                            f"{run.output[-3000:]}")
            continue
        said = re.findall(r"^(?:wrote|replaced) (\S+)", run.output, flags=re.M)
        missing = [p for p in [*_outputs(run.command), *said] if not (tmp_path / p).exists()]
        if missing:
            problems.append(f"{what}: did not write {missing}\n{run.output[-2000:]}")
        if "--check" in run.command and "check PASSED" not in run.output:
            problems.append(f"{what}: no 'check PASSED'\n{run.output[-2000:]}")
    assert not problems, "\n\n".join(problems)
