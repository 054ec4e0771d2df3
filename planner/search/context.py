"""What one pipeline search shares: the programs of each micro-batch size
(:mod:`planner.search.microbatch_programs`), DTensor's strategies per stage mesh, the
layer profiles (time/memory points of each layer kind on each stage mesh),
the exact stage solutions, and the executor that runs its independent work
(:mod:`planner.search.phase_runner`), with what a forked child sends back.

Units: seconds, bytes. The search itself is :mod:`planner.search.pipeline_search`.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import torch
from torch.distributed.tensor.placement_types import Replicate

from costmodel.cluster import Cluster
from costmodel.collectives import axis_links
from costmodel.resharding import ReshardPricer
from costmodel.schedules import ScheduleBook
from costmodel.memory import training_state_bytes
from costmodel.strategy_cost import FSDP_STAGES, IntraOpCost, zero3_param_sets
from ir.graph import PARAM, Graph
from ir.subgraph import subgraph
from planner.search.cp_search import layout_allows, pinned_strategies
from planner.search.stage_dp import (LayerProfile, StageMeshOption, StageTimes, mesh_family, stage_times,
                              step_collectives)
from planner.ilp.intra_op import (IntraOpResult, PreparedIntraOp, prepare_intra_op, restrict,
                              solve_prepared)
from planner.ilp.solve import InfeasibleError
from planner.search.microbatch_programs import (MicrobatchProgram, MicrobatchPrograms,
                                         global_batch_of, microbatch_inputs)
from planner.search.memory_levels import PROFILE_LEVELS, add_levels
from planner.search.phase_runner import Phase, SearchExecutor, default_executor
from planner.search.stage_reuse import moved_result, total_memory
from planner.ilp.strategies import NodeStrategies, build_strategies, divisible

# global_batch_of and microbatch_inputs are imported from here by callers
__all__ = ["SearchContext", "global_batch_of", "microbatch_inputs", "pricing_scope"]


# Seconds each layer-profile ILP may take (they price candidates; the winner's
# stages are solved with the caller's full limit).
PROFILE_TIME_LIMIT_S = 10.0


class SearchContext:
    """Everything one search shares: programs by micro-batch size, layer profiles
    by (layer kind, stage mesh, micro-batch size), the schedule orders
    (:attr:`schedule_book`), and the :attr:`executor` of its independent work
    (``executor``; by default forked where a second CPU is free,
    :func:`planner.search.phase_runner.default_executor`). No state outlives it."""

    def __init__(self, model: torch.nn.Module, example_inputs: Sequence[Any], cluster: Cluster, *,
                 dtype: str, optimizer: str, budget: float, time_limit_s: float,
                 min_layers: int = 2, progress: Callable[[str], None] | None = None,
                 whole_batch_graph: Graph | None = None,
                 fixed: dict[str, tuple] | None = None, programs: dict | None = None,
                 schedule_book: ScheduleBook | None = None,
                 executor: SearchExecutor | None = None, context_parallel: int = 1):
        # placements every stage must use (a manual layout), by parameter FQN / input name
        self.fixed = dict(fixed or {})
        # cp of the program searched (one cp rank's: planner.search.cp_search);
        # > 1 pins the batch rows to stage mesh axis 0 (layout_allows, pinned_strategies)
        self.context_parallel = int(context_parallel)
        self.cluster = cluster
        self.dtype = dtype
        self.optimizer = optimizer
        self.budget = budget
        self.time_limit_s = time_limit_s
        self.progress = progress or (lambda msg: None)
        # traced programs by micro-batch size; a dict shared between contexts
        # (e.g. the layouts of a Megatron grid) shares the traces
        self._programs = MicrobatchPrograms(model, example_inputs, min_layers, programs,
                                            whole_batch_graph)
        self.global_batch = self._programs.global_batch
        self.executor = default_executor() if executor is None else executor
        # torch's schedule orders (and what is derived from them) of the shapes
        # this search prices; a book shared between contexts shares them
        self.schedule_book = ScheduleBook() if schedule_book is None else schedule_book
        self._profiles: dict[tuple, LayerProfile] = {}
        # DTensor's strategies by node signature, per stage mesh shape
        self._strategy_cache: dict[tuple, dict] = {}
        # DTensor's single-dim strategies expanded, by number of mesh axes and
        # node signature, for every stage mesh shape (planner.ilp.strategies)
        self._expansions: dict[tuple, list] = {}
        # how many leading entries of each strategy cache (by mesh shape) and
        # of the expansions the process this one was forked from holds
        # (see _in_forked_child and scope_caches; both only ever grow)
        self._sent_strategies: dict[tuple, int] = {}
        self._sent_expansions = 0
        # memoised resharding prices per stage mesh (shape, nodes, devices per node)
        self._pricers: dict[tuple, ReshardPricer] = {}
        # stage sub-graphs by (id of the program's graph, first layer, end):
        # (that graph, kept so that the id stays its own; the sub-graph)
        self._stage_graphs: dict[tuple, tuple[Graph, Graph]] = {}
        # (layer kind, pricing scope) -> the profiles with ILPs of their own,
        # whose placements the scope re-prices (see _reference_key)
        self._reference: dict[tuple, list[LayerProfile]] = {}
        # exact stage solutions for exact_stage: by (memory budget, micro-batch
        # size, stage mesh, layer kinds) the (in-flight copies, solution) pairs,
        # and by the same key less the budget the fastest plan
        self._stage_results: dict[tuple, list[tuple[float, IntraOpResult]]] = {}
        self._fastest_stages: dict[tuple, tuple[float, IntraOpResult]] = {}
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
        shared: list[object] = [self.cluster]
        for prog in {id(p): p for p in (self.programs() if programs is None else programs)
                     }.values():
            shared += [prog, prog.graph, prog.graph.exported, *prog.graph.nodes]
        self.executor.run(phase, shared, self._in_forked_child)

    def _in_forked_child(self) -> None:
        """Called first in a forked child of :meth:`run_phase`: its progress
        is silenced (its lines would interleave with this process's), and
        what the strategy caches and expansions hold now, the process it was
        forked from holds too, so :meth:`scope_caches` leaves it out
        (pickling it back cost ~0.5 s of a llama3-8b search)."""
        self.progress = lambda msg: None
        self._sent_strategies = {shape: len(c) for shape, c in self._strategy_cache.items()}
        self._sent_expansions = len(self._expansions)

    def scope_caches(self, scopes: set[tuple]) -> dict[str, dict]:
        """The layer profiles and references of the pricing ``scopes``
        (:func:`pricing_scope`), the strategies of their meshes and the
        expansions this process made since it was forked (:meth:`run_phase`)
        or the last call, for :meth:`merge_scope_caches` in the process it
        was forked from. The profiles lose their priced problems (too big to
        send; remade if they are extended)."""
        profiles = {k: p for k, p in self._profiles.items()
                    if pricing_scope(k[1], k[2], self.global_batch) in scopes}
        references = {k: refs for k, refs in self._reference.items()  # see _reference_key
                      if k[1:] in scopes}
        for prof in [*profiles.values(), *(p for refs in references.values() for p in refs)]:
            prof.prepared = None
        shapes = {mesh_key[0] for _, mesh_key, _ in profiles}
        strategies = {}
        for shape in shapes & self._strategy_cache.keys():
            cache = self._strategy_cache[shape]
            strategies[shape] = dict(itertools.islice(
                cache.items(), self._sent_strategies.get(shape, 0), None))
            self._sent_strategies[shape] = len(cache)
        expansions = dict(itertools.islice(self._expansions.items(), self._sent_expansions, None))
        self._sent_expansions = len(self._expansions)
        return {"profiles": profiles, "references": references,
                "strategies": strategies, "expansions": expansions}

    def merge_scope_caches(self, caches: dict[str, dict]) -> None:
        """Keep what :meth:`scope_caches` of a forked child gave."""
        self._profiles.update(caches["profiles"])
        self._reference.update(caches["references"])
        for shape, cache in caches["strategies"].items():
            self._strategy_cache.setdefault(shape, {}).update(cache)
        for key, rows in caches["expansions"].items():
            self._expansions.setdefault(key, rows)

    def prepare_stage(self, prog: MicrobatchProgram, first: int, end: int,
                      mesh: StageMeshOption, copies: float,
                      profile: bool = False) -> PreparedIntraOp:
        """The priced intra-op problem of layers ``first .. end - 1`` on ``mesh``
        (on the captured program: strategies come from its fake tensors);
        ``profile``: of one layer's profile, whose ZeRO-3 units count as shards
        (the stage DP keeps :meth:`zero3_headroom` for those gathered)."""
        if not prog.traced:
            prog = self.program(self.global_batch // prog.microbatch_size, traced=True)
        sub = self.stage_graph(prog, first, end)
        strategies = build_strategies(sub, mesh.shape,
                                      self._strategy_cache.setdefault(mesh.shape, {}),
                                      self._expansions)
        if mesh.zero_stage in FSDP_STAGES:  # FSDP2 shards parameters replicated on axis 0
            strategies = [ns if ns.node.kind != PARAM else NodeStrategies(
                ns.node, [s for s in ns.strategies if isinstance(s.outputs[0][0], Replicate)],
                ns.fallback) for ns in strategies]
        if self.context_parallel > 1:
            strategies = pinned_strategies(strategies, prog.microbatch_size)
        return prepare_intra_op(sub, mesh.cluster(self.cluster), mesh.shape, dtype=self.dtype,
                                optimizer=self.optimizer, fixed=self.fixed or None,
                                activation_copies=copies, strategies=strategies,
                                pricer=self.pricer(mesh), zero_stage=mesh.zero_stage,
                                reduce_once=mesh.reduce_once,
                                step_share=self.step_share(prog), units_gathered=not profile)

    def allows(self, mesh_shape: Sequence[int], num_microbatches: int) -> bool:
        """Whether a stage mesh of ``mesh_shape`` running ``num_microbatches``
        micro-batches can hold this search's layout: always without context
        parallelism; with it, micro-batches of whole sequences on a mesh
        whose axis 0 holds the cp ranks of each
        (:func:`planner.search.cp_search.layout_allows`)."""
        cp = self.context_parallel
        return cp == 1 or ((self.global_batch // cp) % num_microbatches == 0 and layout_allows(
            cp, mesh_shape, self.global_batch // num_microbatches))

    def zero3_headroom(self, prog: MicrobatchProgram, mesh: StageMeshOption) -> float:
        """Bytes per device a ZeRO-3 stage on ``mesh`` holds beyond its layers'
        profiles (which count its units as shards): the whole parameters and
        gradients FSDP2 holds gathered at once
        (:func:`costmodel.strategy_cost.zero3_param_sets` of the whole
        program, unsharded on the other mesh axes: an upper bound). 0 for
        other stages."""
        if mesh.zero_stage != 3 or mesh.shape[0] == 1:
            return 0.0
        numel = sum(prog.graph[p].output.numel for p in zero3_param_sets(prog.graph)[1])
        state = {gathered: training_state_bytes(numel, precision=self.dtype,
                                                optimizer=self.optimizer, zero_stage=3,
                                                dp_size=int(mesh.shape[0]), gathered=gathered)
                 for gathered in (True, False)}
        return float(state[True]["total"] - state[False]["total"])

    def step_share(self, prog: MicrobatchProgram) -> float:
        """The weight of once-per-step seconds against one micro-batch's in the
        ILPs of ``prog``'s stages (:class:`IntraOpCost`): one over the
        micro-batches of a step."""
        return prog.microbatch_size / self.global_batch

    def pricer(self, mesh: StageMeshOption) -> ReshardPricer:
        """The resharding pricer every problem on ``mesh`` shares."""
        key = (mesh.shape, mesh.num_nodes, mesh.devices_per_node)
        if key not in self._pricers:
            self._pricers[key] = ReshardPricer(
                mesh.shape, axis_links(mesh.cluster(self.cluster), mesh.shape))
        return self._pricers[key]

    def solve_stage(self, prog: MicrobatchProgram, first: int, end: int, mesh: StageMeshOption,
                    budget: float | None, copies: float,
                    recompute: bool | None = None) -> IntraOpResult:
        """The intra-op solution of layers ``first .. end - 1`` within ``budget``
        bytes; ``recompute`` as :func:`planner.ilp.intra_op.solve_prepared`."""
        self.ilp_solves += 1
        return solve_prepared(self.prepare_stage(prog, first, end, mesh, copies),
                              memory_budget=budget, time_limit_s=self.time_limit_s,
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
            if layers not in self._fastest_stages:
                self._fastest_stages[layers] = (
                    copies, self.solve_stage(prog, first, end, mesh, None, copies))
            fastest_copies, fastest = self._fastest_stages[layers]
            known.append((copies / fastest_copies, fastest))
        solved = self._stage_results.setdefault((budget, *layers), [])
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
        total = 0.0
        for i in range(first, end):
            prof = self._profiles.get(_profile_key(prog, i, mesh))
            if prof is None or not prof.points:
                return True
            total += prof.points[0].memory(copies)
        return total <= budget

    def times_of(self, result: IntraOpResult, mesh: StageMeshOption,
                 cost: IntraOpCost | None = None) -> StageTimes:
        """:func:`stage_times` of a stage on ``mesh`` (with its ZeRO stage);
        ``cost``: the one ``result`` was solved with, to share."""
        return stage_times(result, mesh.cluster(self.cluster), self.dtype, self.optimizer,
                           cost=cost or self._stage_cost(result, mesh))

    def step_collectives_of(self, result: IntraOpResult, mesh: StageMeshOption) -> float:
        """:func:`planner.search.stage_dp.step_collectives` of a stage solved on ``mesh``."""
        return step_collectives(result, self._stage_cost(result, mesh))

    def _stage_cost(self, result: IntraOpResult, mesh: StageMeshOption) -> IntraOpCost:
        """An :class:`IntraOpCost` pricing ``result``'s graph as its stage on
        ``mesh`` is priced (its ZeRO stage, gradient reduction and pricer)."""
        return IntraOpCost(result.graph, mesh.cluster(self.cluster), result.mesh_shape,
                           self.dtype, self.optimizer, zero_stage=mesh.zero_stage,
                           pricer=self.pricer(mesh), reduce_once=mesh.reduce_once)

    def stage_graph(self, prog: MicrobatchProgram, first: int, end: int) -> Graph:
        """The sub-graph of layers ``first .. end - 1``, made once per program."""
        key = (id(prog.graph), first, end)
        made = self._stage_graphs.get(key)
        if made is None or made[0] is not prog.graph:
            ops = [op for l in prog.layers[first:end] for op in l.ops]
            made = self._stage_graphs[key] = (prog.graph, subgraph(
                prog.graph, ops, prog.boundaries[first][0], prog.boundaries[end - 1][1]))
        return made[1]

    def profile(self, prog: MicrobatchProgram, layer: int, mesh: StageMeshOption,
                levels: int = 1) -> LayerProfile:
        """At least ``levels`` time/memory points of one layer (fewer when no
        smaller-memory plan exists), shared by all layers of its kind.

        The ILP runs at the first (micro-batch size, stage mesh) of each layer
        kind and pricing scope (:func:`_reference_key`): that profile is a
        reference of the scope, and elsewhere its placements are re-priced with
        the program's shapes; a level the reference lacks is added to the
        reference first. Where no reference's placements divide the shapes
        (e.g. a batch split more ways than the micro-batch has rows), the ILP
        runs again and makes another reference. The winner's stages are solved
        exactly anyway."""
        key = _profile_key(prog, layer, mesh)
        prof = self._profiles.get(key)
        if prof is not None and (len(prof.points) >= levels or prof.exhausted):
            return prof
        if prof is None or prof.mesh is None:  # re-price a reference if one carries over
            scope = _reference_key(prog, layer, mesh, self.global_batch)
            for ref in self._reference.setdefault(scope, []):
                repriced = self._repriced(prog, layer, mesh, ref)
                if repriced is not None and len(ref.points) < levels and not ref.exhausted:
                    self._extend(ref, levels)
                    repriced = self._repriced(prog, layer, mesh, ref)
                if repriced is not None:
                    self._profiles[key] = repriced
                    return repriced
            # the first of its family here, or no reference's placements divide
            # this program's shapes: ILPs of its own, a new reference
            prof = self._profiles[key] = self._own_profile(prog, layer, mesh)
            self._reference[scope].append(prof)
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
            prof = self._profiles.get(_profile_key(prog, layer, mesh))
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
            self._profiles.get(_profile_key(prog, layer, mesh))
            for layer in range(len(prog.signatures))))
        return self.program(num_microbatches, traced=True) if repriced else prog

    def file_own_profile(self, prog: MicrobatchProgram, layer: int, prof: LayerProfile) -> None:
        """File ``prof``, a profile with ILPs of its own on ``prof.mesh`` (from
        :meth:`own_profiles`, here or in a forked process), as the profile of
        ``layer``'s kind: an extended own profile keeps its place among the
        references of its mesh family, a new one is added after them."""
        key = _profile_key(prog, layer, prof.mesh)
        old = self._profiles.get(key)
        self._profiles[key] = prof
        refs = self._reference.setdefault(
            _reference_key(prog, layer, prof.mesh, self.global_batch), [])
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
                                    time_limit_s=min(self.time_limit_s, PROFILE_TIME_LIMIT_S))
        except InfeasibleError:  # nothing found in time
            return None
        return result, self.times_of(result, prof.mesh, prof.prepared.cost)

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
        prepared = prepare_intra_op(sub, mesh.cluster(self.cluster), mesh.shape,
                                    dtype=self.dtype, optimizer=self.optimizer,
                                    strategies=strategies, pricer=self.pricer(mesh),
                                    zero_stage=mesh.zero_stage, reduce_once=mesh.reduce_once,
                                    step_share=self.step_share(prog), units_gathered=False)
        points = []
        for chosen, weight in zip(ref.assignments, ref.weights):
            level = restrict(prepared, [
                [prepared.strategies[group[0]].strategies.index(
                    chosen[prepared.strategies[group[0]].node.name])]
                for group in prepared.built.members])
            # the same price of memory decides checkpointing
            result = solve_prepared(level, memory_weight=weight, time_limit_s=self.time_limit_s)
            points.append(self.times_of(result, mesh, level.cost))
        return LayerProfile(points, exhausted=ref.exhausted, weights=list(ref.weights))


def _profile_key(prog: MicrobatchProgram, layer: int, mesh: StageMeshOption) -> tuple:
    """What a layer's profile is filed under: its kind, the stage mesh (shape
    and ZeRO stage) and the micro-batch size."""
    return prog.signatures[layer], mesh.key, prog.microbatch_size


def _reference_key(prog: MicrobatchProgram, layer: int, mesh: StageMeshOption,
                   global_batch: int) -> tuple:
    """The layer kind (its first layer's index, the same at every micro-batch
    size) and the :func:`pricing_scope` whose references carry over to it."""
    return (prog.signatures.index(prog.signatures[layer]),
            *pricing_scope(mesh.key, prog.microbatch_size, global_batch))


def pricing_scope(mesh_key: tuple, microbatch_size: int, global_batch: int) -> tuple:
    """Where the placements of layer profiles carry over (re-priced) to the
    stage mesh with :attr:`StageMeshOption.key` ``mesh_key`` at this
    micro-batch size: its mesh family (:func:`mesh_family`); whether the
    micro-batch is the whole batch; and at size 1 the mesh itself (its
    shape, last; None at other sizes).

    * Size 1: torch specialises size-1 dimensions into another program,
      where placements chosen at other sizes or on other meshes re-price far
      from the ILP's own (alpa-gpt3-15b, pp=8 x 4 with 512 micro-batches:
      60.0 s re-priced, 30.7 s by its own ILP).
    * The whole batch is one stage on every device: its mesh's first axis is
      larger than any pipeline stage's, and placements that size forced
      re-price far from a smaller mesh's own. moe-8x on 16 GPUs: 8 experts
      do not split over 16 data-parallel ranks, and those placements priced
      a block on an 8-rank stage at 27.7 ms, where its own ILP shards the
      experts over the 8 ranks (pp=2: 1.6 s a step re-priced, 1.10 s own).

    Configurations of different scopes share no profile, so they may be
    priced in any order, in either process of a search."""
    return (*mesh_family(mesh_key), microbatch_size == global_batch,
            mesh_key[0] if microbatch_size == 1 else None)
