"""``planner train`` jobs as the benchmarks start them (:mod:`benchmarks.train_checks`,
:mod:`benchmarks.train_memory`): on :data:`RANKS` CPU ranks of this machine
(:data:`CLUSTER`; torchrun, gloo), trained on byte tokens of this
repository's docs (:func:`doc_tokens`), each job's result JSON read back with
:func:`read_result`.

A script run as ``python benchmarks/NAME.py`` puts the repository root on
``sys.path`` before importing this module.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from benchmarks.common import text_token_file

__all__ = ["CLUSTER", "DOC_SOURCES", "RANKS", "doc_tokens", "planner_argv", "read_result"]

#: the cluster every job is planned for and runs on: 4 CPU ranks of this machine
CLUSTER = "local-cpu:4"
RANKS = 4
#: the text the jobs train on (paths from the repository root)
DOC_SOURCES = ("README.md", "docs/design.md")


def doc_tokens(workdir: str, min_bytes: int, below: int = 256) -> tuple[str, dict[str, Any]]:
    """:data:`DOC_SOURCES` repeated to at least ``min_bytes`` bytes, bytes not
    below ``below`` left out, as a uint16 byte-token file in ``workdir``
    (:func:`benchmarks.common.text_token_file`: its path and record)."""
    return text_token_file(workdir, DOC_SOURCES, min_bytes=min_bytes, below=below)


def planner_argv(args: list[str]) -> list[str]:
    """The command line of ``planner ARGS`` (``python -m app.cli``, this interpreter)."""
    return [sys.executable, "-m", "app.cli", *args]


def read_result(path: str) -> dict[str, Any] | None:
    """The result JSON a job wrote to ``path`` (``--result-json``); None where it wrote none."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
