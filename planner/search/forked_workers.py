"""Run independent pieces of a search on two CPU cores by forking.

The search's configurations fall into pricing scopes that share no layer
profile, its schedule shapes are independent of each other, and the
finalists' exact stage solves fall into chains that share no
cached solution (other layer kinds, stage mesh or micro-batch size); most of
their time is the ILP solver, which holds the GIL. :func:`run_forked` runs the tasks in
this process and a forked child, each taking the next task when it is free.
The child inherits the whole search state (copy-on-write), so nothing is sent
to it; its results come back pickled through a file, with the objects both
processes already hold (the traced programs) passed by reference instead of
copied.

Each task's answer depends only on its own inputs, so which process runs it
does not change it: the result list is the same as running the tasks in order.
The search reaches these through :class:`planner.search.phase_runner.ForkedExecutor`.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import pickle
import tempfile
import traceback
from typing import Any, Callable, Iterator, Sequence

import torch

from ir.torch_compat import op_overload_name


class ForkedTaskError(RuntimeError):
    """A task failed in the forked child with an exception that could not be sent back."""


def can_fork() -> bool:
    """Whether tasks can run in a forked child: POSIX fork and two or more CPUs."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return hasattr(os, "fork") and (cpus or 1) >= 2


def run_forked(tasks: Sequence[Callable[[], Any]], shared: Sequence[object] = (),
               in_child: Callable[[], None] | None = None) -> list[Any]:
    """``[task() for task in tasks]``, run by this process and one forked
    child together: each takes the next task not yet taken when it is free
    (so one long task does not leave the other process idle).

    Args:
        tasks: callables without arguments; their results must pickle.
        shared: objects that exist before the fork and may be part of the
            results: they come back as these same objects, not copies.
        in_child: called first in the child (e.g. to silence progress output).

    An exception a task raises is raised here, in task order, after every
    task has run. Runs everything here when there is one task or no fork.
    """
    return _results(_forked_outcomes(tasks, shared, in_child), len(tasks))


def _forked_outcomes(tasks: Sequence[Callable[[], Any]], shared: Sequence[object],
                     in_child: Callable[[], None] | None) -> dict[int, tuple[bool, Any]]:
    """The outcomes of :func:`run_forked`, by task index (nothing raised)."""
    if len(tasks) < 2 or not can_fork():
        return {i: _outcome(task) for i, task in enumerate(tasks)}
    take = _taker(len(tasks))

    def work(in_the_child: bool, child_done: Callable[[], bool]) -> dict[int, tuple[bool, Any]]:
        outcomes = {}
        while (i := take()) is not None:
            outcomes[i] = _outcome(tasks[i])
        return outcomes

    return _with_child(work, shared, in_child)


def run_beside(here: Callable[[], Any], there: Callable[[], Any], shared: Sequence[object] = (),
               in_child: Callable[[], None] | None = None,
               then: Sequence[Callable[[], Any]] = (),
               later: Sequence[Callable[[], Any]] = ()
               ) -> tuple[Any, Any, list[Any], list[Any]]:
    """``(here(), there(), [task() for task in then], [task() for task in
    later])``: ``here`` run by this process and ``there`` by a forked
    child at the same time, after which each process takes the next task of
    ``then`` not yet taken when it is free (as :func:`run_forked` does; so
    the one that finishes first does not wait idle).

    ``later``: tasks that need what ``here`` made, which the child
    (forked before) lacks. This process runs them first, once ``here`` is
    done, while the child works on ``then``; once the child is done, the rest
    are shared with a new child (:func:`run_forked`), which holds it.

    What ``here`` changes stays, what ``there`` changes comes back only as its
    result; results of tasks run by a child come back pickled. ``shared`` and
    ``in_child`` as in :func:`run_forked`; an exception a task raises is
    raised here, in task order, after every task has run. Runs everything
    here, in that order, when there is no fork."""
    if not can_fork():
        return here(), there(), [task() for task in then], [task() for task in later]
    take = _taker(len(then))
    after = 2 + len(then)  # the index of later's first outcome
    ran_after = 0  # how many of later this process ran while the child worked

    def work(in_the_child: bool, child_done: Callable[[], bool]) -> dict[int, tuple[bool, Any]]:
        nonlocal ran_after
        if in_the_child:
            outcomes = {1: _outcome(there)}
        else:
            outcomes = {0: _outcome(here)}
            while ran_after < len(later) and not child_done():
                outcomes[after + ran_after] = _outcome(later[ran_after])
                ran_after += 1
        while (i := take()) is not None:
            outcomes[2 + i] = _outcome(then[i])
        return outcomes

    outcomes = _with_child(work, shared, in_child)
    rest = _forked_outcomes(later[ran_after:], shared, in_child)
    outcomes.update((after + ran_after + i, outcome) for i, outcome in rest.items())
    results = _results(outcomes, after + len(later))
    return results[0], results[1], results[2:after], results[after:]


def _taker(count: int) -> Callable[[], int | None]:
    """A function giving the next of ``count`` task indices not yet taken by
    this process or a child forked after it was made (None when none is
    left): the counter lives in shared memory, which the child inherits."""
    next_task = multiprocessing.Value("i", 0)

    def take() -> int | None:
        with next_task.get_lock():
            i = next_task.value
            next_task.value += 1
        return i if i < count else None

    return take


def _with_child(work: Callable[[bool, Callable[[], bool]], dict[int, tuple[bool, Any]]],
                shared: Sequence[object], in_child: Callable[[], None] | None
                ) -> dict[int, tuple[bool, Any]]:
    """``work(True, ...)`` in a forked child and ``work(False, child_done)``
    here at the same time: their outcomes by task index, the child's sent
    back pickled (an exception that does not pickle as a
    :class:`ForkedTaskError`). ``child_done()`` tells whether the child has
    run all it will (it may still be sending its outcomes)."""
    with tempfile.TemporaryDirectory(prefix="planner-fork-") as tmp, _frozen_heap():
        path = os.path.join(tmp, "results.pickle")
        finished = multiprocessing.Value("b", 0, lock=False)  # set by the child
        pid = os.fork()
        if pid == 0:  # the child: run tasks, write their outcomes, leave at once
            code = 0
            try:
                if in_child is not None:
                    in_child()
                outcomes = work(True, lambda: False)
                finished.value = 1
                outcomes = {i: _sendable(o) for i, o in outcomes.items()}
                with open(path, "wb") as fh:
                    _SharedPickler(fh, shared).dump(outcomes)
            except BaseException:  # noqa: BLE001 - reported through the exit code
                traceback.print_exc()
                code = 1
            os._exit(code)  # no atexit handlers or finalizers of the parent's state
        outcomes = work(False, lambda: bool(finished.value))
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0 or not os.path.exists(path):
            raise ForkedTaskError("the forked search process failed (its traceback is above); "
                                  "run the search again, or report it with that traceback")
        with open(path, "rb") as fh:
            outcomes.update(_SharedUnpickler(fh, shared).load())
    return outcomes


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """Every object alive now out of the cyclic garbage collector's sight
    (``gc.freeze``) while the forked child runs, as Python's documentation
    advises before a fork: the collector of either process then never walks
    the search's long-lived programs, profiles and schedule orders (each full
    collection took ~0.2 s in a llama3-8b search, 16 of them 3.3 s of this
    process's 20.6 s; unpickling the child's 1 MB of results, 0.43 s against
    0.02 s) nor, in the child, writes to their pages (copying them). They
    are handed back afterwards, unless something else had frozen objects
    before (``gc.unfreeze`` would release those too). ``planner.plan`` pauses
    the collector for the whole search besides; this serves the forked phases
    called on their own."""
    ours = gc.get_freeze_count() == 0
    gc.freeze()
    try:
        yield
    finally:
        if ours:
            gc.unfreeze()


def _results(outcomes: dict[int, tuple[bool, Any]], count: int) -> list[Any]:
    """The results of tasks ``0 .. count - 1``; the first exception, if any, raised."""
    results = []
    for i in range(count):
        ok, value = outcomes[i]
        if not ok:
            raise value
        results.append(value)
    return results


def _outcome(task: Callable[[], Any]) -> tuple[bool, Any]:
    """(True, result) or (False, the exception it raised)."""
    try:
        return True, task()
    except Exception as exc:  # noqa: BLE001 - handed to the caller by run_forked
        return False, exc


def _sendable(outcome: tuple[bool, Any]) -> tuple[bool, Any]:
    """The outcome, with an exception that does not pickle replaced by a
    :class:`ForkedTaskError` carrying its type and message."""
    ok, value = outcome
    if ok:
        return outcome
    try:
        pickle.loads(pickle.dumps(value))
    except Exception:  # noqa: BLE001 - any failure to round-trip
        return False, ForkedTaskError(f"{type(value).__name__}: {value}")
    return outcome


class _SharedPickler(pickle.Pickler):
    """Writes the objects of ``shared`` as their index in it, and torch ops
    (which do not pickle) by name."""

    def __init__(self, fh, shared: Sequence[object]):
        super().__init__(fh, protocol=pickle.HIGHEST_PROTOCOL)
        self._index = {id(obj): i for i, obj in enumerate(shared)}

    def persistent_id(self, obj: object) -> int | None:
        return self._index.get(id(obj))

    def reducer_override(self, obj: object) -> Any:
        name = op_overload_name(obj)
        return NotImplemented if name is None else (_torch_op, name)


def _torch_op(name: str, overload: str) -> Any:
    """The torch op ``namespace::name.overload`` (what :class:`_SharedPickler` wrote)."""
    namespace, op = name.split("::")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")


class _SharedUnpickler(pickle.Unpickler):
    """Reads an index written by :class:`_SharedPickler` as that object of ``shared``."""

    def __init__(self, fh, shared: Sequence[object]):
        super().__init__(fh)
        self._shared = shared

    def persistent_load(self, pid: int) -> object:
        return self._shared[pid]
