"""How a search runs its independent pieces of work: in this process, one
after another (:class:`SerialExecutor`), or in this process and a forked
child together on two CPU cores (:class:`ForkedExecutor`, on
:mod:`planner.search.forked_workers`). The search describes each step of such work as a
:class:`Phase` of :class:`PhaseTask` objects and hands it to the executor of
its :class:`planner.search.context.SearchContext`, which is chosen once,
when the context is made (:func:`default_executor`); nothing else in the
search knows which one runs it.

Each task's answer depends only on its own inputs, so both executors give
the same results, and every result is filed in this process, in task order,
after the whole phase has run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from planner.search.forked_workers import can_fork, run_beside, run_forked


class PhaseTask:
    """One independent piece of a :class:`Phase`. :meth:`run` runs in
    whichever process takes the task; its result is filed in this process by
    :meth:`file`, or, where a forked child ran it, first packed there by
    :meth:`sent_back` (what travels back pickled) and filed here by
    :meth:`file_sent`."""

    def run(self) -> Any:
        """The task's work; the result of :meth:`sent_back` must pickle."""
        raise NotImplementedError

    def file(self, result: Any) -> None:
        """Keep what :meth:`run` gave in this process."""
        raise NotImplementedError

    def sent_back(self, result: Any) -> Any:
        """In a forked child: what it sends back of :meth:`run`'s ``result``
        (with what this process lacks of the child's state; by default the
        result itself)."""
        return result

    def file_sent(self, sent: Any) -> None:
        """Keep what a forked child's :meth:`sent_back` gave (by default as
        :meth:`file` keeps a result)."""
        self.file(sent)


@dataclass
class Phase:
    """One step of a search's independent work.

    ``make`` (programs the tasks need, e.g. captured) runs in this process
    first, while a forked child runs ``there``; then both processes take
    ``tasks``, each the next one not yet taken when it is free; ``after``
    are tasks that need what ``make`` made, which the child (forked before
    it) lacks."""

    tasks: Sequence[PhaseTask] = ()
    make: Callable[[], None] | None = None
    there: PhaseTask | None = None
    after: Sequence[PhaseTask] = ()

    def all_tasks(self) -> list[PhaseTask]:
        """Every task, in the order their results are filed."""
        return [*([self.there] if self.there is not None else []), *self.tasks, *self.after]


class SearchExecutor:
    """Runs the phases of one search (:meth:`run`)."""

    def run(self, phase: Phase, shared: Sequence[object],
            in_child: Callable[[], None]) -> None:
        """Run ``phase`` and file each task's result here, in task order.

        Args:
            shared: objects this process and a forked child both hold that a
                result may refer to (sent back by reference, not copied).
            in_child: called first in a forked child (the search silences
                its progress there and notes what its caches hold).
        """
        raise NotImplementedError


class SerialExecutor(SearchExecutor):
    """Everything in this process, in order: ``make``, ``there``, ``tasks``,
    ``after`` (what a forked phase gives, without a second process)."""

    def run(self, phase: Phase, shared: Sequence[object] = (),
            in_child: Callable[[], None] | None = None) -> None:
        if phase.make is not None:
            phase.make()
        tasks = phase.all_tasks()
        for task, result in zip(tasks, [task.run() for task in tasks]):
            task.file(result)


class ForkedExecutor(SearchExecutor):
    """This process and a forked child together (:mod:`planner.search.forked_workers`):
    the child inherits the search's state, and what it made comes back
    through :meth:`PhaseTask.sent_back`. Runs everything here where a task
    alone is left or no fork is possible (:func:`planner.search.forked_workers.can_fork`)."""

    def run(self, phase: Phase, shared: Sequence[object],
            in_child: Callable[[], None]) -> None:
        forked = False  # set in the child only

        def enter_child() -> None:
            nonlocal forked
            forked = True
            in_child()

        def call(task: PhaseTask) -> Callable[[], tuple[bool, Any]]:
            def run() -> tuple[bool, Any]:
                result = task.run()
                return (True, task.sent_back(result)) if forked else (False, result)
            return run

        if phase.make is None and phase.there is None and not phase.after:
            done = run_forked([call(task) for task in phase.tasks], shared, enter_child)
        else:
            there = call(phase.there) if phase.there is not None else _nothing
            _, first, then, later = run_beside(
                phase.make or _nothing, there, shared, enter_child,
                then=[call(task) for task in phase.tasks],
                later=[call(task) for task in phase.after])
            done = ([first] if phase.there is not None else []) + then + later
        for task, (sent, result) in zip(phase.all_tasks(), done):
            if sent:
                task.file_sent(result)
            else:
                task.file(result)


def _nothing() -> None:
    return None


def default_executor() -> SearchExecutor:
    """The executor a search uses unless told otherwise: forked where this
    machine can fork onto a second CPU, else serial."""
    return ForkedExecutor() if can_fork() else SerialExecutor()
