"""Where in a rank's work an error arose, for its one-line report.

:func:`during` marks an exception raised inside with the phase it arose in
(building the plan's model, the forward of step 2, ...);
:func:`backward_tracer` names the autograd node a failing backward entered last;
:func:`error_line` is the rank's one line (``in PHASE: Type: message``) that the
launcher finds in the ranks' output.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

__all__ = ["backward_tracer", "during", "error_line"]


@contextlib.contextmanager
def during(what: str) -> Iterator[None]:
    """An exception raised inside says that it arose during ``what`` (the
    innermost phase wins), for this rank's one-line error (:func:`error_line`)."""
    try:
        yield
    except Exception as err:
        if not hasattr(err, "rank_phase"):
            try:
                err.rank_phase = what
            except AttributeError:  # an exception type without a __dict__
                pass
        raise


def backward_tracer(loss: Any) -> Callable[[], str | None]:
    """Pre-hooks on every autograd node of ``loss``'s graph; the returned call
    names the node the backward pass entered last (on a failure: the failing
    op's gradient, ``ViewBackward0``), or None."""
    last: list[str] = []
    fn = getattr(loss, "grad_fn", None)
    seen: set[int] = set()
    stack = [fn] if fn is not None else []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))

        def enter(grad_outputs: Any, name: str = node.name()) -> None:
            last[:] = [name]

        node.register_prehook(enter)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return lambda: last[0] if last else None


def error_line(err: BaseException) -> str:
    """This rank's one-line error: where it failed (:func:`during`), the
    exception's type and the first line of its message."""
    text = str(err).strip().splitlines()
    phase = getattr(err, "rank_phase", None)
    return (f"{f'in {phase}: ' if phase else ''}{type(err).__name__}: "
            f"{text[0] if text else ''}")
