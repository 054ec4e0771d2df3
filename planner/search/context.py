"""What one pipeline search shares (:class:`SearchContext`): its settings
(:mod:`planner.search.settings`), the programs of each micro-batch size
(:mod:`planner.search.microbatch_programs`), its caches and what a forked
child sends back (:mod:`planner.search.search_caches`), the pricing of its
stages (:mod:`planner.search.stage_pricing`), the layer profiles (time/memory
points of each layer kind on each stage mesh), the exact stage solutions, and
the executor that runs its independent work (:mod:`planner.search.phase_runner`).

Units: seconds, bytes. The search itself is :mod:`planner.search.pipeline_search`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from costmodel.schedules import ScheduleBook
from ir.graph import Graph
from ir.subgraph import subgraph
from planner.ilp.intra_op import (IntraOpResult, PreparedIntraOp, prepare_intra_op, restrict,
                                  solve_prepared)
from planner.ilp.solve import InfeasibleError
from planner.ilp.strategies import NodeStrategies, divisible
from planner.search.cp_search import layout_allows
from planner.search.memory_levels import PROFILE_LEVELS, add_levels
from planner.search.microbatch_programs import (MicrobatchProgram, MicrobatchPrograms,
                                                global_batch_of, microbatch_inputs)
from planner.search.phase_runner import Phase, SearchExecutor, default_executor
from planner.search.search_caches import SearchCaches, pricing_scope, profile_key, reference_key
from planner.search.settings import SearchSettings
from planner.search.stage_dp import LayerProfile, StageMeshOption
from planner.search.stage_times import ZERO_TIMES, StageTimes
from planner.search.stage_pricing import StagePricing
from planner.search.stage_reuse import moved_result, total_memory

# global_batch_of, microbatch_inputs and pricing_scope are imported from here by callers
__all__ = ["SearchContext", "global_batch_of", "microbatch_inputs", "pricing_scope"]


# Seconds each layer-profile ILP may take (they price candidates; the winner's
# stages are solved with the caller's full limit).
PROFILE_TIME_LIMIT_S = 10.0


class SearchContext:
    """Everything one search shares: its :attr:`settings`, programs by
    micro-batch size, its :attr:`caches` (layer profiles by (layer kind, stage
    mesh, micro-batch size), strategies, exact stages), the :attr:`pricing`
    of its stages, the schedule orders (:attr:`schedule_book`), and the
    :attr:`executor` of its independent work (by default forked where a
    second CPU is free, :func:`planner.search.phase_runner.default_executor`).
    No state outlives it.

    ``model`` and ``example_inputs``: the program searched (the whole batch;
    ``whole_batch_graph`` its capture, if made); ``min_layers``: the fewest
    pipeline layers its layer detection cuts; ``progress``: called with a
    short line as the search goes. ``programs``: traced programs by
    micro-batch size, a dict shared between contexts (e.g. the layouts of a
    Megatron grid) shares the traces; ``schedule_book``: torch's schedule
    orders (and what is derived from them) of the shapes this search prices,
    a book shared between contexts shares them."""

    def __init__(self, model: torch.nn.Module, example_inputs: Sequence[Any],
                 settings: SearchSettings, *, min_layers: int = 2,
                 progress: Callable[[str], None] | None = None,
                 whole_batch_graph: Graph | None = None, programs: dict | None = None,
                 schedule_book: ScheduleBook | None = None,
                 executor: SearchExecutor | None = None):
        self.settings = settings
        self.progress = progress or (lambda msg: None)
        self._programs = MicrobatchPrograms(model, example_inputs, min_layers, programs,
                                            whole_batch_graph)
        self.global_batch = self._programs.global_batch
        self.executor = default_executor() if executor is None else executor
        self.schedule_book = ScheduleBook() if schedule_book is None else schedule_book
        self.caches = SearchCaches()
        self.pricing = StagePricing(self.settings, self.caches, self.global_batch)
        self.ilp_solves = 0
        self.stages_reused = 0

    def program(self, num_microbatches: int, traced: bool = False) -> MicrobatchProgram:
        """:meth:`planner.search.microbatch_programs.MicrobatchPrograms.get`: the
        program of one micro-batch of ``num_microbatches``, captured where
        ``traced`` (or no rule derives it)."""
        return self._programs.get(num_microbatches, traced, self.progress)

    def has_traced(self, num_microbatches: int) -> bool:
        """Whether the program of ``num_microbatches`` micro-batches was
        captured or written out (not only derived, nor not yet made)."""
        return self._programs.has_traced(num_microbatches)

    def will_capture(self, num_microbatches: int) -> bool:
        """Whether :meth:`program` would capture the program (seconds)."""
        return self._programs.will_capture(num_microbatches)

    def programs(self) -> list[MicrobatchProgram]:
        """The programs made so far (captured, written out or derived)."""
        return self._programs.made()

    def run_phase(self, phase: Phase, programs: Sequence[MicrobatchProgram] | None = None
                  ) -> None:
        """Run ``phase`` with this search's :attr:`executor`, its results filed
        here in task order. ``programs``: those its results may refer to
        (default: every program made so far), which come back from a forked
        child as these same objects, with the cluster, their graphs and nodes."""
        shared: list[object] = [self.settings.cluster]
        for prog in {id(p): p for p in (self.programs() if programs is None else programs)
                     }.values():
            shared += [prog, prog.graph, prog.graph.exported, *prog.graph.nodes]
        self.executor.run(phase, shared, self._in_forked_child)

    def _in_forked_child(self) -> None:
        """Called first in a forked child of :meth:`run_phase`: its progress
        is silenced (its lines would interleave with this process's), and its
        caches note what the process it was forked from holds
        (:meth:`planner.search.search_caches.SearchCaches.forked`)."""
        self.progress = lambda msg: None
        self.caches.forked()

    def prepare_stage(self, prog: MicrobatchProgram, first: int, end: int,
                      mesh: StageMeshOption, copies: float,
                      profile: bool = False) -> PreparedIntraOp:
        """The priced intra-op problem of layers ``first .. end - 1`` on ``mesh``
        (:meth:`planner.search.stage_pricing.StagePricing.prepare`, on the
        captured program: strategies come from its fake tensors)."""
        if not prog.traced:
            prog = self.program(self.global_batch // prog.microbatch_size, traced=True)
        return self.pricing.prepare(self.stage_graph(prog, first, end), prog, mesh, copies,
                                    profile)

    def allows(self, mesh_shape: Sequence[int], num_microbatches: int) -> bool:
        """Whether a stage mesh of ``mesh_shape`` running ``num_microbatches``
        micro-batches can hold this search's layout: always without context
        parallelism; with it, micro-batches of whole sequences on a mesh
        whose axis 0 holds the cp ranks of each
        (:func:`planner.search.cp_search.layout_allows`)."""
        cp = self.settings.context_parallel
        return cp == 1 or ((self.global_batch // cp) % num_microbatches == 0 and layout_allows(
            cp, mesh_shape, self.global_batch // num_microbatches))

    def solve_stage(self, prog: MicrobatchProgram, first: int, end: int, mesh: StageMeshOption,
                    budget: float | None, copies: float,
                    recompute: bool | None = None) -> IntraOpResult:
        """The intra-op solution of layers ``first .. end - 1`` within ``budget``
        bytes; ``recompute`` as :func:`planner.ilp.intra_op.solve_prepared`."""
        self.ilp_solves += 1
        return solve_prepared(self.prepare_stage(prog, first, end, mesh, copies),
                              memory_budget=budget, time_limit_s=self.settings.time_limit_s,
                              recompute=recompute)

    def exact_stage(self, prog: MicrobatchProgram, first: int, end: int,
                    mesh: StageMeshOption, budget: float | None, copies: float) -> IntraOpResult:
        """:meth:`solve_stage`, or a known solution moved here when it is this
        stage's optimum (:mod:`planner.search.stage_reuse`): the fastest plan of the
        same layers (no memory budget) when it fits ``budget`` with ``copies``
        in-flight micro-batches, or the solution of a stage of the same layers
        under the same budget with at most ``copies`` when it fits."""
        layers = self.stage_key(prog, first, end, mesh)
        sub = self.stage_graph(prog, first, end)
        known: list[tuple[float, IntraOpResult]] = []  # (copies ratio, solution)
        if budget is not None and self._fastest_may_fit(prog, first, end, mesh, budget, copies):
            if layers not in self.caches.fastest_stages:
                self.caches.fastest_stages[layers] = (
                    copies, self.solve_stage(prog, first, end, mesh, None, copies))
            fastest_copies, fastest = self.caches.fastest_stages[layers]
            known.append((copies / fastest_copies, fastest))
        solved = self.caches.stage_results.setdefault((budget, *layers), [])
        known += [(copies / c, r) for c, r in solved if c <= copies]
        for ratio, done in known:
            moved = moved_result(done, sub, ratio)
            if moved is not None and (budget is None or total_memory(moved) <= budget):
                self.stages_reused += 1
                return moved
        result = self.solve_stage(prog, first, end, mesh, budget, copies)
        solved.append((copies, result))
        return result

    @staticmethod
    def stage_key(prog: MicrobatchProgram, first: int, end: int, mesh: StageMeshOption) -> tuple:
        """What :meth:`exact_stage` files the solutions of layers ``first ..
        end - 1`` under (besides the budget): micro-batch size, stage mesh and
        layer kinds. Stages of different keys share no solution."""
        return prog.microbatch_size, mesh.key, tuple(prog.signatures[first:end])

    def _fastest_may_fit(self, prog: MicrobatchProgram, first: int, end: int,
                         mesh: StageMeshOption, budget: float, copies: float) -> bool:
        """Whether the layers' fastest profile points fit ``budget`` bytes with
        ``copies`` in-flight micro-batches (True when a layer has no profile):
        where they do not, solving the stage without a budget is not worth it."""
        total = ZERO_TIMES
        for i in range(first, end):
            prof = self.caches.profiles.get(profile_key(prog, i, mesh))
            if prof is None or not prof.points:
                return True
            total = total + prof.points[0]
        return total.memory(copies) <= budget

    def stage_graph(self, prog: MicrobatchProgram, first: int, end: int) -> Graph:
        """The sub-graph of layers ``first .. end - 1``, made once per program."""
        key = (id(prog.graph), first, end)
        made = self.caches.stage_graphs.get(key)
        if made is None or made[0] is not prog.graph:
            ops = [op for l in prog.layers[first:end] for op in l.ops]
            made = self.caches.stage_graphs[key] = (prog.graph, subgraph(
                prog.graph, ops, prog.boundaries[first][0], prog.boundaries[end - 1][1]))
        return made[1]

    def profile(self, prog: MicrobatchProgram, layer: int, mesh: StageMeshOption,
                levels: int = 1) -> LayerProfile:
        """At least ``levels`` time/memory points of one layer (fewer when no
        smaller-memory plan exists), shared by all layers of its kind.

        The ILP runs at the first (micro-batch size, stage mesh) of each layer
        kind and pricing scope
        (:func:`planner.search.search_caches.reference_key`): that profile is a
        reference of the scope, and elsewhere its placements are re-priced with
        the program's shapes; a level the reference lacks is added to the
        reference first. Where no reference's placements divide the shapes
        (e.g. a batch split more ways than the micro-batch has rows), the ILP
        runs again and makes another reference. The winner's stages are solved
        exactly anyway."""
        key = profile_key(prog, layer, mesh)
        prof = self.caches.profiles.get(key)
        if prof is not None and (len(prof.points) >= levels or prof.exhausted):
            return prof
        if prof is None or prof.mesh is None:  # re-price a reference if one carries over
            scope = reference_key(prog, layer, mesh, self.global_batch)
            for ref in self.caches.references.setdefault(scope, []):
                repriced = self._repriced(prog, layer, mesh, ref)
                if repriced is not None and len(ref.points) < levels and not ref.exhausted:
                    self._extend(ref, levels)
                    repriced = self._repriced(prog, layer, mesh, ref)
                if repriced is not None:
                    self.caches.profiles[key] = repriced
                    return repriced
            # the first of its family here, or no reference's placements divide
            # this program's shapes: ILPs of its own, a new reference
            prof = self.caches.profiles[key] = self._own_profile(prog, layer, mesh)
            self.caches.references[scope].append(prof)
        self._extend(prof, levels)
        return prof

    def own_profiles(self, prog: MicrobatchProgram, mesh: StageMeshOption,
                     levels: int = PROFILE_LEVELS) -> list[tuple[int, LayerProfile]]:
        """Profiles from ILPs of their own, with up to ``levels`` memory
        levels, for every layer kind of ``prog`` on ``mesh`` that has a profile:
        the (layer, profile) pairs that are new or have more levels. An own
        profile is extended in place; a re-priced one is replaced by a new
        one, which only :meth:`file_own_profile` files."""
        changed = []
        for layer in dict.fromkeys(prog.signatures.index(s) for s in prog.signatures):
            prof = self.caches.profiles.get(profile_key(prog, layer, mesh))
            if prof is None:
                continue
            before = len(prof.points)
            if prof.mesh is None:
                prof, before = self._own_profile(prog, layer, mesh), -1
            self._extend(prof, levels)
            if len(prof.points) != before:
                changed.append((layer, prof))
        return changed

    def own_profiles_program(self, num_microbatches: int, mesh: StageMeshOption
                             ) -> MicrobatchProgram:
        """The program :meth:`own_profiles` on ``mesh`` should be given, made
        now: the traced one where a layer kind has a re-priced profile there
        (its strategies are enumerated on it), else the one priced so far."""
        prog = self.program(num_microbatches)
        repriced = any(p is not None and p.mesh is None for p in (
            self.caches.profiles.get(profile_key(prog, layer, mesh))
            for layer in range(len(prog.signatures))))
        return self.program(num_microbatches, traced=True) if repriced else prog

    def file_own_profile(self, prog: MicrobatchProgram, layer: int, prof: LayerProfile) -> None:
        """File ``prof``, a profile with ILPs of its own on ``prof.mesh`` (from
        :meth:`own_profiles`, here or in a forked process), as the profile of
        ``layer``'s kind: an extended own profile keeps its place among the
        references of its mesh family, a new one is added after them."""
        key = profile_key(prog, layer, prof.mesh)
        old = self.caches.profiles.get(key)
        self.caches.profiles[key] = prof
        refs = self.caches.references.setdefault(
            reference_key(prog, layer, prof.mesh, self.global_batch), [])
        if old is not None and old.mesh is not None:
            refs[:] = [prof if r is old else r for r in refs]
        else:
            refs.append(prof)

    def _own_profile(self, prog: MicrobatchProgram, layer: int,
                     mesh: StageMeshOption) -> LayerProfile:
        return LayerProfile([], prepared=self.prepare_stage(prog, layer, layer + 1, mesh, 1.0,
                                                            profile=True),
                            mesh=mesh, origin=(prog.microbatch_size, layer))

    def _extend(self, prof: LayerProfile, levels: int) -> None:
        """Add memory levels to a profile with its own ILP until it has ``levels``."""
        if len(prof.points) < levels and not prof.exhausted and prof.prepared is None:
            # made in a forked process, which kept its priced problem
            mb, layer = prof.origin
            prog = self.program(self.global_batch // mb, traced=True)
            prof.prepared = self.prepare_stage(prog, layer, layer + 1, prof.mesh, 1.0,
                                               profile=True)
        add_levels(prof, levels, lambda weight: self._solve_weighted(prof, weight))

    def _solve_weighted(self, prof: LayerProfile, weight: float
                        ) -> tuple[IntraOpResult, StageTimes] | None:
        """:data:`planner.search.memory_levels.WeightedSolve` of ``prof``'s own problem."""
        try:
            self.ilp_solves += 1
            result = solve_prepared(prof.prepared, memory_weight=weight,
                                    time_limit_s=min(self.settings.time_limit_s,
                                                     PROFILE_TIME_LIMIT_S))
        except InfeasibleError:  # nothing found in time
            return None
        return result, self.pricing.times_of(result, prof.mesh, prof.prepared.cost)

    def _repriced(self, prog: MicrobatchProgram, layer: int, mesh: StageMeshOption,
                  ref: LayerProfile) -> LayerProfile | None:
        """The points of the reference profile ``ref`` of this layer's kind,
        re-priced with this program's shapes on ``mesh``; None when a placement
        no longer divides a shape."""
        sub = self.stage_graph(prog, layer, layer + 1)
        # one problem holding every level's strategy of each node, priced once
        strategies = []
        for n in sub.nodes:
            picks: list = []
            for chosen in ref.assignments:
                s = chosen.get(n.name)
                if s is None or not all(
                        divisible(info.shape, p, mesh.shape)
                        for info, p in zip((*n.inputs, *n.outputs), (*s.inputs, *s.outputs))):
                    return None
                if s not in picks:
                    picks.append(s)
            strategies.append(NodeStrategies(n, picks))
        prepared = prepare_intra_op(sub, mesh.cluster(self.settings.cluster), mesh.shape,
                                    dtype=self.settings.dtype, optimizer=self.settings.optimizer,
                                    strategies=strategies, pricer=self.pricing.pricer(mesh),
                                    zero_stage=mesh.zero_stage,
                                    step_share=self.pricing.step_share(prog), units_gathered=False)
        points = []
        for chosen, weight in zip(ref.assignments, ref.weights):
            level = restrict(prepared, [
                [prepared.strategies[group[0]].strategies.index(
                    chosen[prepared.strategies[group[0]].node.name])]
                for group in prepared.built.members])
            # the same price of memory decides checkpointing
            result = solve_prepared(level, memory_weight=weight,
                                    time_limit_s=self.settings.time_limit_s)
            points.append(self.pricing.times_of(result, mesh, level.cost))
        return LayerProfile(points, exhausted=ref.exhausted, weights=list(ref.weights))
