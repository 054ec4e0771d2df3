"""The pipeline search's pricing cut into phases of independent tasks
(:mod:`planner.search.phase_runner`), which its context's executor runs on one
or two CPU cores (:meth:`planner.search.context.SearchContext.run_phase`):
the configurations of each pricing scope, torch's schedule orders, and the
own profiles of the leading (stage mesh, micro-batches) pairs.

Units: seconds, bytes. What is priced is :mod:`planner.search.pipeline_search`'s.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any, Callable, Sequence

from costmodel.schedules import ScheduleBook, torch_orders
from planner.search.stage_dp import NO_PIPELINE, LayerProfile, PipelineCandidate, StageMeshOption
from planner.search.microbatch_programs import MicrobatchProgram
from planner.search.context import SearchContext, pricing_scope
from planner.search.phase_runner import Phase, PhaseTask

Config = tuple[int, int, StageMeshOption, str, int]  # (pp, v, stage mesh, schedule, m)
# one configuration priced (None: it does not fit, or torch rejects its schedule)
PriceConfig = Callable[..., PipelineCandidate | None]


def price_all(ctx: SearchContext, configs: Sequence[Config], price: PriceConfig,
              label: Callable[[int, Config], str], traced: bool = False
              ) -> list[PipelineCandidate | None]:
    """``[price(ctx, *config) for config in configs]``, one task per pricing
    scope, each told to ``ctx.progress`` as ``label(index, config)``.

    A configuration's price depends on the profiles of its pricing scope
    only (:func:`pricing_scope`: references are made and re-priced within a
    mesh family, and at micro-batch size 1 within a stage mesh), so pricing
    each scope's configurations in their order, in either process, gives the
    same prices as pricing all in order. The programs are made here first
    (:func:`_price_while_making`), and a task run by a forked child sends
    back its scopes' profiles, without their priced problems (remade if they
    are extended, :meth:`SearchContext._extend`), and its strategy caches.

    ``traced``: the configurations are of mesh families without references
    (ZeRO-3 variants), so their scopes make them, with ILPs of their own on
    captured or written-out programs (:meth:`SearchContext.program`)."""
    pricing = _Pricing(ctx, configs, price, label)
    _price_rest(pricing, _price_while_making(pricing), traced)
    return pricing.priced


class _Pricing:
    """The configurations one :func:`price_all` prices and their prices as filed so far."""

    def __init__(self, ctx: SearchContext, configs: Sequence[Config], price: PriceConfig,
                 label: Callable[[int, Config], str]):
        self.ctx = ctx
        self.configs = configs
        self._price = price
        self._label = label
        self.priced: list[PipelineCandidate | None] = [None] * len(configs)

    def price(self, k: int) -> PipelineCandidate | None:
        """Configuration ``k`` priced, in whichever process runs this."""
        self.ctx.progress(self._label(k, self.configs[k]))
        return self._price(self.ctx, *self.configs[k])

    def scope(self, k: int) -> tuple:
        """The :func:`pricing_scope` of configuration ``k``."""
        mesh, m = self.configs[k][2], self.configs[k][4]
        return pricing_scope(mesh.key, self.ctx.global_batch // m, self.ctx.global_batch)

    def microbatch_counts(self) -> list[int]:
        """The micro-batch counts that divide the batch, in configuration order."""
        return list(dict.fromkeys(m for *_, m in self.configs if self.ctx.global_batch % m == 0))

    def scope_tasks(self, start: int) -> tuple[list[_PriceScope], list[_PriceScope]]:
        """A task per pricing scope of the configurations from ``start`` on,
        the largest scopes first (so that the last task to start is short):
        those at micro-batch sizes other than 1, and those at size 1 (their
        program may be captured after the others; a scope names its stage
        mesh, last, only at size 1: see :func:`pricing_scope`)."""
        scopes: dict[tuple, list[int]] = {}
        for k in range(start, len(self.configs)):
            scopes.setdefault(self.scope(k), []).append(k)
        ordered = sorted(scopes.items(), key=lambda item: len(item[1]), reverse=True)
        return ([_PriceScope(self, ks) for scope, ks in ordered if scope[-1] is None],
                [_PriceScope(self, ks) for scope, ks in ordered if scope[-1] is not None])


class _PriceScope(PhaseTask):
    """Configurations ``ks`` of a :class:`_Pricing` priced in their order (a
    pricing scope, or the leading configurations). A forked child sends back
    the profiles of their scopes
    (:meth:`planner.search.search_caches.SearchCaches.scope`) and how many
    ILPs it solved."""

    def __init__(self, pricing: _Pricing, ks: Sequence[int]):
        self.pricing = pricing
        self.ks = list(ks)

    def run(self) -> tuple[list[PipelineCandidate | None], int]:
        """The prices, and the ILPs solved for them."""
        ctx = self.pricing.ctx
        solves = ctx.ilp_solves
        return [self.pricing.price(k) for k in self.ks], ctx.ilp_solves - solves

    def sent_back(self, result: tuple[list[PipelineCandidate | None], int]) -> tuple:
        scopes = {self.pricing.scope(k) for k in self.ks}
        ctx = self.pricing.ctx
        return (*result, ctx.caches.scope(scopes, ctx.global_batch))

    def file(self, result: tuple) -> None:
        for k, cand in zip(self.ks, result[0]):
            self.pricing.priced[k] = cand

    def file_sent(self, sent: tuple) -> None:
        _, solves, caches = sent
        self.pricing.ctx.caches.merge(caches)
        self.pricing.ctx.ilp_solves += solves
        self.file(sent)


def _making(ctx: SearchContext, counts: Sequence[int], traced: bool = False
            ) -> Callable[[], None]:
    """What makes the programs of micro-batch ``counts`` here, in order
    (``traced``: captured or written out, not derived)."""
    def make() -> None:
        for m in counts:
            ctx.program(m, traced=traced)
    return make


def _price_while_making(pricing: _Pricing) -> list[_PriceScope]:
    """Make the programs of every micro-batch count here, in configuration
    order (which decides what is captured and what derived), size 1 last,
    so that both processes hold them before they price; the scope tasks left
    to price are returned.

    While this process captures, the forked child prices what needs no
    program still to come: during the first captures, the leading
    configurations whose programs exist (they come first in every scope's
    order) and torch's schedule orders (each scope asks for many of them;
    each process made them all for itself: gpt3-175b on 1024 GPUs, 96
    shapes, ~16 s in each); during a second capture, of size 1, the scopes
    of other sizes (the leading configurations are filed by then), while
    this process, done capturing, prices the scopes at size 1. Where nothing
    is captured the schedule orders are made on both cores first."""
    ctx, configs = pricing.ctx, pricing.configs
    ready = 0  # the leading configurations whose programs exist
    while ready < len(configs) and not ctx.will_capture(configs[ready][4]):
        ready += 1
    counts = pricing.microbatch_counts()
    one = [m for m in counts if ctx.global_batch // m == 1]  # captured last (see program)
    groups = [[m for m in counts if m not in one], one]
    captures = [any(ctx.will_capture(m) for m in group) for group in groups]
    leading = list(range(ready)) if any(captures) else []
    early, late = pricing.scope_tasks(len(leading))
    book = ctx.schedule_book
    orders = [_ScheduleOrders(shape, book) for shape in missing_schedule_shapes(configs, book)]
    # the child's work during each capture, in turn
    while_capturing = [Phase(orders, there=_PriceScope(pricing, leading) if leading else None),
                       Phase(early, after=late)]
    for group, captured in zip(groups, captures):
        make = _making(ctx, group)
        if captured:
            ctx.run_phase(dataclasses.replace(while_capturing.pop(0), make=make))
        else:
            make()
    if len(while_capturing) == 2:  # nothing captured
        ctx.run_phase(while_capturing.pop(0))
    return [task for phase in while_capturing for task in (*phase.tasks, *phase.after)]


def _price_rest(pricing: _Pricing, scopes: list[_PriceScope], traced: bool) -> None:
    """Price the ``scopes`` left; with ``traced``, each program only derived
    so far that a scope may price on (where no reference divides its shapes,
    another size of its scope makes one too) is written out here first,
    while the forked child prices the scopes that need none."""
    ctx = pricing.ctx
    unwritten = [m for m in pricing.microbatch_counts() if traced and not ctx.has_traced(m)]
    waiting = [task for task in scopes
               if any(pricing.configs[k][4] in unwritten for k in task.ks)]
    if waiting:
        ctx.run_phase(Phase([task for task in scopes if task not in waiting],
                            make=_making(ctx, unwritten, traced=True), after=waiting))
    else:
        ctx.run_phase(Phase(scopes))


def missing_schedule_shapes(configs: Sequence[Config], book: ScheduleBook
                            ) -> list[tuple[str, int, int, int]]:
    """The schedule shapes ``(schedule, pp, m, v)`` of ``configs`` whose
    torch orders (:func:`costmodel.schedules.torch_orders`) ``book`` lacks,
    the longest first."""
    return sorted({(s, pp, m, v) for pp, v, _, s, m in configs
                   if s != NO_PIPELINE and not book.holds(s, pp, m, v)},
                  key=lambda shape: (-shape[1] * shape[2] * shape[3], shape))


class _ScheduleOrders(PhaseTask):
    """Torch's orders of one schedule ``shape``, kept in ``book`` of the
    process that makes them, or None where torch rejects the shape (the
    pricing reads that as no candidate). A forked child sends them pickled
    by the C pickler in one piece: :mod:`planner.search.forked_workers`'s pickler asks which
    object it is for each of the ~600k tuples and ints of a large shape
    (gpt3-175b: 2.2 s for all shapes, against 0.1 s)."""

    def __init__(self, shape: tuple[str, int, int, int], book: ScheduleBook):
        self.shape = shape
        self.book = book

    def run(self) -> Any:
        """:func:`costmodel.schedules.torch_orders` of the shape, or None."""
        try:
            return torch_orders(*self.shape, book=self.book)
        except ValueError:
            return None

    def file(self, result: Any) -> None:
        """Nothing: made here, they are in the book already."""

    def sent_back(self, result: Any) -> bytes | None:
        return None if result is None else pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)

    def file_sent(self, sent: bytes | None) -> None:
        if sent is not None:
            self.book.adopt(*self.shape, pickle.loads(sent))


def own_profiles_of(ctx: SearchContext, pairs: dict[tuple, StageMeshOption]) -> list[tuple]:
    """:meth:`SearchContext.own_profiles` of every (stage mesh key,
    micro-batches) pair in ``pairs``, one task each; the pairs whose
    profiles changed.

    The pairs share no profile (each is filed under its own mesh and
    micro-batch size), so each gives the same profiles whichever process
    makes them. The programs whose strategies are enumerated are made here
    first, so that both processes hold them."""
    tasks = [_OwnProfiles(ctx, ctx.own_profiles_program(m, mesh), mesh)
             for (_, m), mesh in pairs.items()]
    ctx.run_phase(Phase(tasks), [task.prog for task in tasks])
    return [key for key, task in zip(pairs, tasks) if task.changed]


class _OwnProfiles(PhaseTask):
    """:meth:`SearchContext.own_profiles` of ``prog`` on ``mesh``; once
    filed, :attr:`changed` tells whether a profile changed. A forked child
    sends the profiles back without their priced problems (made again only
    if they are extended later, :meth:`SearchContext._extend`) and how many
    ILPs it solved."""

    def __init__(self, ctx: SearchContext, prog: MicrobatchProgram, mesh: StageMeshOption):
        self.ctx = ctx
        self.prog = prog
        self.mesh = mesh
        self.changed = False

    def run(self) -> tuple[list[tuple[int, LayerProfile]], int]:
        """The (layer, profile) pairs that changed, and the ILPs solved."""
        solves = self.ctx.ilp_solves
        changed = self.ctx.own_profiles(self.prog, self.mesh)
        return changed, self.ctx.ilp_solves - solves

    def sent_back(self, result: tuple[list[tuple[int, LayerProfile]], int]) -> tuple:
        changed, solves = result
        return [(layer, dataclasses.replace(p, prepared=None)) for layer, p in changed], solves

    def file(self, result: tuple[list[tuple[int, LayerProfile]], int]) -> None:
        for layer, prof in result[0]:
            self.ctx.file_own_profile(self.prog, layer, prof)
        self.changed = bool(result[0])

    def file_sent(self, sent: tuple[list[tuple[int, LayerProfile]], int]) -> None:
        self.ctx.ilp_solves += sent[1]
        self.file(sent)
