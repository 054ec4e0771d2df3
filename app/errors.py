"""How the ``planner`` command ends on an error: a user's error in one line
with exit 2, a bug of ours in one line with its traceback in a file, and a
reader that closed the output pipe (``planner plan ... | head``) quietly."""

from __future__ import annotations

import os
import sys
from typing import Callable

#: Exit status of a user's error (and of a bug of ours, also reported in one line).
EXIT_USAGE = 2

#: Exit status when the reader of standard output closed it: the shell's
#: status of a process ended by SIGPIPE (128 + 13).
EXIT_PIPE_CLOSED = 141


def user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that report a user's mistake (their message is the one line shown)."""
    from costmodel.cluster import ClusterError
    from ir.program_capture import TraceError
    from models.source import ModelSourceError
    from models.zoo import ExampleStepError, UnknownModelError
    from planner.request import PlanningError
    from plan.format import PlanError

    errors: list[type[BaseException]] = [ClusterError, ModelSourceError, TraceError,
                                         UnknownModelError, ExampleStepError, PlanningError,
                                         PlanError]
    try:
        from codegen.capture import PlanMismatchError
        from codegen.parallel_model import BatchShapeError
        from training.checkpoint import CheckpointError
        from training.data import DataError
        errors += [PlanMismatchError, BatchShapeError, DataError, CheckpointError]
    except ImportError:
        pass
    return tuple(errors)


def run_command(command: Callable[[], int]) -> int:
    """``command()``'s exit status, with every error it raises ended as this
    module's docstring says."""
    try:
        status = command()
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return status
    except BrokenPipeError:
        # later writes (and the interpreter's own flush at exit) go nowhere
        # rather than raising again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PIPE_CLOSED
    except user_errors() as err:
        print(f"planner: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as err:  # noqa: BLE001 - a bug of ours: one line, the traceback in a file
        if os.environ.get("PLANNER_TRACEBACK"):
            raise
        print(f"planner: error: {internal_error_line(err)}", file=sys.stderr)
        return EXIT_USAGE


def internal_error_line(err: BaseException) -> str:
    """One line for an error the planner did not expect: what it was, and the
    file its traceback was written to (set PLANNER_TRACEBACK=1 to see it here)."""
    import tempfile
    import traceback

    fd, path = tempfile.mkstemp(prefix="planner-error-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        traceback.print_exception(err, file=f)
    text = str(err).strip().splitlines()
    return (f"internal error {type(err).__name__}: {text[0] if text else ''} (a bug of the "
            f"planner, not of the model: report it with the traceback in {path})")
