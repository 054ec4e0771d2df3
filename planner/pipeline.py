"""The two-level search: pipeline configurations over the inter-op DP, solved
exactly per stage by the intra-op ILP, written as one Plan.

Units: seconds, bytes. See :mod:`planner.inter_op` for the pieces.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import pickle
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from costmodel.cluster import Cluster
from costmodel.collectives import axis_links
from costmodel.resharding import ReshardPricer
from torch.distributed.tensor.placement_types import Replicate
from costmodel.schedules import (adopt_orders, canonical_schedule, default_stages_per_rank,
                                 orders_cached, simulate, torch_orders)
from ir.fast_trace import SynthesizedProgram, rescaled_trace
from ir.graph import INPUT, PARAM, Graph
from ir.layers import PipelineLayer, pipeline_layers
from ir.rescale import BatchRule, batch_rule
from ir.subgraph import boundary_values, subgraph
from ir.trace import trace
from planner.inter_op import (SEARCH_SCHEDULES, LayerProfile, PipelineCandidate,
                              PipelineInfeasibleError, SplitResult, StageMeshOption, StageTimes,
                              config_label, in_flight, layer_signature, mesh_family,
                              split_layers, stage_mesh_options, stage_times)
from planner.forked import run_beside, run_forked
from planner.intra_op import (IntraOpCost, IntraOpResult, MemoryInfeasibleError,
                              PreparedIntraOp, prepare_intra_op, restrict, solve_prepared)
from planner.ilp import InfeasibleError
from planner.plan_format import PipelinePlan, Plan, SolverReport, StagePlan
from planner.stage_reuse import moved_result, total_memory
from planner.strategies import NodeStrategies, build_strategies, divisible

# Memory levels of a layer profile are the supported Pareto points of (seconds,
# bytes), found as in the non-inferior set estimation (NISE) method: level 0
# is the fastest plan, the next the least-memory one (memory weighted
# PROFILE_LEAST_MEMORY_WEIGHT x the fastest plan's seconds per byte), and each
# further point comes from the widest gap between two known points, solved with
# memory weighted by the slope between them (it is new if it beats both there).
# A weight, unlike a memory budget row, keeps every ILP as easy as the
# unconstrained one. The search asks for the first two (the least-memory point
# decides whether a configuration fits at all); refine() adds the rest for the
# leading candidates' (mesh, micro-batch size) pairs.
PROFILE_LEVELS = 4
PROFILE_LEAST_MEMORY_WEIGHT = 1e3
# Seconds each layer-profile ILP may take (they price candidates; the winner's
# stages are solved with the caller's full limit).
PROFILE_TIME_LIMIT_S = 10.0


def microbatch_inputs(example_inputs: Sequence[Any], num_microbatches: int) -> tuple:
    """The first micro-batch of ``example_inputs`` (dim 0 split evenly)."""
    out = []
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.ndim > 0:
            out.append(t[: t.shape[0] // num_microbatches])
        else:
            out.append(t)
    return tuple(out)


def global_batch_of(example_inputs: Sequence[Any]) -> int:
    sizes = {int(t.shape[0]) for t in example_inputs if isinstance(t, torch.Tensor) and t.ndim > 0}
    if len(sizes) != 1:
        raise ValueError(f"example inputs must share one batch dimension 0, got sizes {sorted(sizes)}")
    return sizes.pop()


@dataclass
class MicrobatchProgram:
    """The program of one micro-batch and its pipeline layers."""

    microbatch_size: int
    graph: Graph
    layers: list[PipelineLayer]
    boundaries: list[tuple[list[str], list[str]]]  # per layer: (receives, sends)
    signatures: list[str]
    # with a program for strategy queries (True: captured, or written out from
    # two captures' probes by ir.fast_trace.rescaled_trace) or derived by
    # ir.rescale (False: shapes, FLOPs and bytes only)
    traced: bool = True
    # captured by torch.export (not written out or derived)
    captured: bool = True


class SearchContext:
    """Everything one search shares: programs by micro-batch size, layer profiles
    by (layer kind, stage mesh, micro-batch size). No state outlives it."""

    def __init__(self, model: torch.nn.Module, example_inputs: Sequence[Any], cluster: Cluster, *,
                 dtype: str, optimizer: str, budget: float, time_limit_s: float,
                 min_layers: int = 2, progress: Callable[[str], None] | None = None,
                 whole_batch_graph: Graph | None = None,
                 fixed: dict[str, tuple] | None = None, programs: dict | None = None):
        self.model = model
        # placements every stage must use (a manual layout), by parameter FQN / input name
        self.fixed = dict(fixed or {})
        self.example_inputs = tuple(example_inputs)
        self.cluster = cluster
        self.dtype = dtype
        self.optimizer = optimizer
        self.budget = budget
        self.time_limit_s = time_limit_s
        self.min_layers = min_layers
        self.progress = progress or (lambda msg: None)
        self.global_batch = global_batch_of(example_inputs)
        # traced programs by micro-batch size; a dict shared between contexts
        # (e.g. the layouts of a Megatron grid) shares the traces
        self._programs: dict[int, MicrobatchProgram] = {} if programs is None else programs
        # how the program follows the micro-batch size (ir.rescale), once two
        # captures gave it and a third confirmed it; False when they did not agree
        self._batch_rule: BatchRule | None | bool = None
        self._batch_rule_checked = False
        self._profiles: dict[tuple, LayerProfile] = {}
        # DTensor's strategies by node signature, per stage mesh shape
        self._strategy_cache: dict[tuple, dict] = {}
        # DTensor's single-dim strategies expanded, by number of mesh axes and
        # node signature, for every stage mesh shape (planner.strategies)
        self._expansions: dict[tuple, list] = {}
        # how many leading entries of each strategy cache (by mesh shape) and
        # of the expansions the process this one was forked from holds
        # (see forked and scope_state; both only ever grow)
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
        if whole_batch_graph is not None and self.global_batch not in self._programs:
            self._add_program(self.global_batch, whole_batch_graph)

    def _add_program(self, mb: int, graph: Graph, traced: bool = True,
                     captured: bool = True) -> None:
        layers = pipeline_layers(graph, self.min_layers)
        self._programs[mb] = MicrobatchProgram(
            mb, graph, layers, boundary_values(graph, [l.ops for l in layers]),
            [layer_signature(graph, l) for l in layers], traced, captured)

    def program(self, num_microbatches: int, traced: bool = False) -> MicrobatchProgram:
        """The program of one micro-batch when the batch is split ``num_microbatches``
        ways: captured, or (unless ``traced``) derived from earlier captures when
        the program follows the batch size exactly (:mod:`ir.rescale`, checked
        on a third capture first). Derived programs price known placements;
        anything that enumerates strategies asks for a captured one. Micro-batch
        size 1 is always captured: torch specialises size-1 dimensions there
        (another program than the rule gives; once its capture replaced a
        derived one mid-search, and the search's two processes then priced with
        different programs)."""
        mb = self.global_batch // num_microbatches
        prog = self._programs.get(mb)
        if prog is not None and (prog.traced or not traced):
            return prog
        if not traced and self._derivable(mb):
            self._add_program(mb, self._batch_rule.at(mb), traced=False, captured=False)
            return self._programs[mb]
        inputs = microbatch_inputs(self.example_inputs, num_microbatches)
        graph = self._written_out(mb, inputs)
        if graph is not None:
            self._add_program(mb, graph, captured=False)
            return self._programs[mb]
        self.progress(f"tracing micro-batch {mb}")
        earlier = self._programs.get(self.global_batch)
        graph = trace(self.model, inputs,
                      like=earlier.graph if earlier is not None and earlier.traced else None)
        if prog is not None and graph.fingerprint() != prog.graph.fingerprint():
            self._batch_rule = False  # the derived program was not the real one
        self._learn_batch_rule(mb, graph)
        self._add_program(mb, graph)
        return self._programs[mb]

    def _written_out(self, mb: int, inputs: tuple) -> Graph | None:
        """The program at micro-batch size ``mb`` written out from the probes of
        the first two captures (:func:`ir.fast_trace.rescaled_trace`) once the
        batch rule is confirmed on a third, when it is exactly what that rule
        gives; None otherwise (the caller captures). About 0.6 s against 2-3 s
        for a capture (llama3-8b on meta). Never at micro-batch size 1: torch
        specialises size-1 dimensions there and captures another program
        (gpt3-1.3b: 1767 of its nodes differ), which the affine rule cannot
        tell, since the written-out program follows the rule too."""
        if mb < 2 or not (self._batch_rule_checked and self._batch_rule):
            return None
        bases = [p.graph.exported for p in self._programs.values()
                 if p.captured and isinstance(p.graph.exported, SynthesizedProgram)][:2]
        if len(bases) < 2:
            return None
        self.progress(f"writing out micro-batch {mb}")
        graph = rescaled_trace(self.model, inputs, *bases)
        return graph if graph is not None and self._batch_rule.matches(graph, mb) else None

    def has_traced(self, num_microbatches: int) -> bool:
        """Whether the program of ``num_microbatches`` micro-batches was
        captured or written out (not only derived, nor not yet made)."""
        prog = self._programs.get(self.global_batch // num_microbatches)
        return prog is not None and prog.traced

    def will_capture(self, num_microbatches: int) -> bool:
        """Whether :meth:`program` would capture the program (seconds) rather
        than find it or derive it from earlier captures."""
        mb = self.global_batch // num_microbatches
        return mb not in self._programs and not self._derivable(mb)

    def _derivable(self, mb: int) -> bool:
        """Whether the program at micro-batch size ``mb`` may be derived from
        the confirmed batch rule (never at size 1, see :meth:`program`)."""
        return mb > 1 and self._batch_rule_checked and bool(self._batch_rule)

    def programs(self) -> list[MicrobatchProgram]:
        """The programs made so far (captured, written out or derived)."""
        return list(self._programs.values())

    def forked(self) -> None:
        """Called first in a forked process: what the strategy caches and
        expansions hold now, the process it was forked from holds too, so
        :meth:`scope_state` leaves it out (pickling it back cost ~0.5 s
        of a llama3-8b search)."""
        self._sent_strategies = {shape: len(c) for shape, c in self._strategy_cache.items()}
        self._sent_expansions = len(self._expansions)

    def scope_state(self, scopes: set[tuple]) -> dict[str, dict]:
        """The layer profiles and references of the pricing ``scopes``
        (:func:`pricing_scope`), the strategies of their meshes and the
        expansions this process made since :meth:`forked` or the last call,
        for :meth:`adopt_scope_state` in the process it was forked from. The
        profiles lose their priced problems (too big to send; remade if they
        are extended)."""
        profiles = {k: p for k, p in self._profiles.items()
                    if pricing_scope(k[1], k[2]) in scopes}
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

    def adopt_scope_state(self, state: dict[str, dict]) -> None:
        """File what :meth:`scope_state` of another process gave."""
        self._profiles.update(state["profiles"])
        self._reference.update(state["references"])
        for shape, cache in state["strategies"].items():
            self._strategy_cache.setdefault(shape, {}).update(cache)
        for key, rows in state["expansions"].items():
            self._expansions.setdefault(key, rows)

    def _learn_batch_rule(self, mb: int, graph: Graph) -> None:
        """Infer the batch rule from the first two captures, check it on the third."""
        if self._batch_rule is False or self._batch_rule_checked:
            return
        if self._batch_rule is None:
            others = [p for b, p in sorted(self._programs.items()) if p.traced and b != mb]
            if others:
                self._batch_rule = batch_rule(others[0].graph, others[0].microbatch_size,
                                              graph, mb) or False
            return
        self._batch_rule_checked = True
        if not self._batch_rule.matches(graph, mb):
            self._batch_rule = False

    def prepare_stage(self, prog: MicrobatchProgram, first: int, end: int,
                      mesh: StageMeshOption, copies: float) -> PreparedIntraOp:
        """The priced intra-op problem of layers ``first .. end - 1`` on ``mesh``
        (on the captured program: strategies come from its fake tensors)."""
        if not prog.traced:
            prog = self.program(self.global_batch // prog.microbatch_size, traced=True)
        sub = self.stage_graph(prog, first, end)
        strategies = build_strategies(sub, mesh.shape,
                                      self._strategy_cache.setdefault(mesh.shape, {}),
                                      self._expansions)
        if mesh.zero_stage == 3:  # FSDP2 shards parameters that are replicated on axis 0
            strategies = [ns if ns.node.kind != PARAM else NodeStrategies(
                ns.node, [s for s in ns.strategies if isinstance(s.outputs[0][0], Replicate)],
                ns.fallback) for ns in strategies]
        return prepare_intra_op(sub, mesh.cluster(self.cluster), mesh.shape, dtype=self.dtype,
                                optimizer=self.optimizer, fixed=self.fixed or None,
                                activation_copies=copies, strategies=strategies,
                                pricer=self.pricer(mesh), zero_stage=mesh.zero_stage)

    def pricer(self, mesh: StageMeshOption) -> ReshardPricer:
        """The resharding pricer every problem on ``mesh`` shares."""
        key = (mesh.shape, mesh.num_nodes, mesh.devices_per_node)
        if key not in self._pricers:
            self._pricers[key] = ReshardPricer(
                mesh.shape, axis_links(mesh.cluster(self.cluster), mesh.shape))
        return self._pricers[key]

    def solve_stage(self, prog: MicrobatchProgram, first: int, end: int, mesh: StageMeshOption,
                    budget: float | None, copies: float) -> IntraOpResult:
        """The intra-op solution of layers ``first .. end - 1`` within ``budget`` bytes."""
        self.ilp_solves += 1
        return solve_prepared(self.prepare_stage(prog, first, end, mesh, copies),
                              memory_budget=budget, time_limit_s=self.time_limit_s)

    def exact_stage(self, prog: MicrobatchProgram, first: int, end: int,
                    mesh: StageMeshOption, budget: float | None, copies: float) -> IntraOpResult:
        """:meth:`solve_stage`, or a known solution moved here when it is this
        stage's optimum (:mod:`planner.stage_reuse`): the fastest plan of the
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
                           mesh.zero_stage, pricer=self.pricer(mesh), cost=cost)

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
            for ref in self._reference.setdefault(_reference_key(prog, layer, mesh), []):
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
            self._reference[_reference_key(prog, layer, mesh)].append(prof)
        self._extend(prof, levels)
        return prof

    def own_profiles(self, prog: MicrobatchProgram, mesh: StageMeshOption,
                     levels: int = PROFILE_LEVELS) -> list[tuple[int, LayerProfile]]:
        """Profiles from ILPs of their own, with up to ``levels`` memory
        levels, for every layer kind of ``prog`` on ``mesh`` that has a profile:
        the (layer, profile) pairs that are new or have more levels. An own
        profile is extended in place; a re-priced one is replaced by a new
        one, which only :meth:`adopt` files."""
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

    def has_repriced(self, prog: MicrobatchProgram, mesh: StageMeshOption) -> bool:
        """Whether a layer kind of ``prog`` on ``mesh`` has a re-priced profile
        (:meth:`own_profiles` enumerates its strategies on a traced program)."""
        return any(p is not None and p.mesh is None for p in (
            self._profiles.get(_profile_key(prog, layer, mesh))
            for layer in range(len(prog.signatures))))

    def adopt(self, prog: MicrobatchProgram, layer: int, prof: LayerProfile) -> None:
        """File ``prof``, a profile with ILPs of its own on ``prof.mesh`` (from
        :meth:`own_profiles`, here or in a forked process), as the profile of
        ``layer``'s kind: an extended own profile keeps its place among the
        references of its mesh family, a new one is added after them."""
        key = _profile_key(prog, layer, prof.mesh)
        old = self._profiles.get(key)
        self._profiles[key] = prof
        refs = self._reference.setdefault(_reference_key(prog, layer, prof.mesh), [])
        if old is not None and old.mesh is not None:
            refs[:] = [prof if r is old else r for r in refs]
        else:
            refs.append(prof)

    def _own_profile(self, prog: MicrobatchProgram, layer: int,
                     mesh: StageMeshOption) -> LayerProfile:
        return LayerProfile([], prepared=self.prepare_stage(prog, layer, layer + 1, mesh, 1.0),
                            mesh=mesh, origin=(prog.microbatch_size, layer))

    def _extend(self, prof: LayerProfile, levels: int) -> None:
        """Add memory levels to a profile with its own ILP until it has ``levels``."""
        if len(prof.points) < levels and not prof.exhausted and prof.prepared is None:
            # made in a forked process, which kept its priced problem
            mb, layer = prof.origin
            prog = self.program(self.global_batch // mb, traced=True)
            prof.prepared = self.prepare_stage(prog, layer, layer + 1, prof.mesh, 1.0)
        while len(prof.points) < levels and not prof.exhausted:
            if not self._next_level(prof, prof.mesh):
                prof.exhausted = True

    def _next_level(self, prof: LayerProfile, mesh: StageMeshOption) -> bool:
        """Add the profile's next memory level (points stay sorted, fastest
        first); False when there is none: no gap left that a weight splits, or
        the ILP found nothing in time."""
        if not prof.points:
            return self._add_point(prof, mesh, 0.0)
        if len(prof.points) == 1:
            fastest = prof.points[0]
            weight = PROFILE_LEAST_MEMORY_WEIGHT * fastest.total_s / max(fastest.memory(1.0), 1.0)
            return self._add_point(prof, mesh, weight, below=0.999 * fastest.memory(1.0))
        gaps = sorted(zip(prof.points, prof.points[1:]),
                      key=lambda ab: -ab[0].memory(1.0) / max(ab[1].memory(1.0), 1.0))
        for a, b in gaps:  # the widest gap first
            key = (a.memory(1.0), b.memory(1.0))
            if key in prof.closed or b.total_s <= a.total_s:
                continue
            # the weight at which a and b tie; a new point must beat both there
            weight = (b.total_s - a.total_s) / (a.memory(1.0) - b.memory(1.0))
            tie = a.total_s + weight * a.memory(1.0)
            found = self._solve_weighted(prof, mesh, weight)
            if found is None:
                return False
            t = found[1]
            if (t.total_s + weight * t.memory(1.0) < tie * (1 - 1e-6)
                    and b.memory(1.0) < t.memory(1.0) < a.memory(1.0)):
                self._insert(prof, weight, *found)
                return True
            prof.closed.add(key)
        return False

    def _add_point(self, prof: LayerProfile, mesh: StageMeshOption, weight: float,
                   below: float = math.inf) -> bool:
        """Solve with memory weighted by ``weight`` (seconds per byte) and add the
        point if it uses less than ``below`` bytes."""
        found = self._solve_weighted(prof, mesh, weight)
        if found is None or found[1].memory(1.0) >= below:
            return False
        self._insert(prof, weight, *found)
        return True

    def _solve_weighted(self, prof: LayerProfile, mesh: StageMeshOption, weight: float
                        ) -> tuple[IntraOpResult, StageTimes] | None:
        try:
            self.ilp_solves += 1
            result = solve_prepared(prof.prepared, memory_weight=weight,
                                    time_limit_s=min(self.time_limit_s, PROFILE_TIME_LIMIT_S))
        except InfeasibleError:  # nothing found in time
            return None
        return result, self.times_of(result, mesh, prof.prepared.cost)

    @staticmethod
    def _insert(prof: LayerProfile, weight: float, result: IntraOpResult, t: StageTimes) -> None:
        at = sum(p.memory(1.0) > t.memory(1.0) for p in prof.points)
        prof.points.insert(at, t)
        prof.weights.insert(at, weight)
        prof.assignments.insert(at, result.chosen)

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
                                    zero_stage=mesh.zero_stage)
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


def _reference_key(prog: MicrobatchProgram, layer: int, mesh: StageMeshOption) -> tuple:
    """The layer kind (its first layer's index, the same at every micro-batch
    size) and the :func:`pricing_scope` whose references carry over to it."""
    return (prog.signatures.index(prog.signatures[layer]),
            *pricing_scope(mesh.key, prog.microbatch_size))


def pricing_scope(mesh_key: tuple, microbatch_size: int) -> tuple:
    """Where the placements of layer profiles carry over (re-priced) to the
    stage mesh with :attr:`StageMeshOption.key` ``mesh_key`` at this
    micro-batch size: its mesh family (:func:`mesh_family`), and at size 1
    the mesh itself (its shape; None at other sizes): torch specialises
    size-1 dimensions into another program, where placements chosen at other
    sizes or on other meshes re-price far from the ILP's own (alpa-gpt3-15b,
    pp=8 x 4 with 512 micro-batches: 60.0 s re-priced, 30.7 s by its own ILP).
    Configurations of different scopes share no profile, so they may be
    priced in any order, in either process of a search."""
    return (*mesh_family(mesh_key), mesh_key[0] if microbatch_size == 1 else None)


def p2p_seconds(prog: MicrobatchProgram, bounds: list[tuple[int, int]], mesh: StageMeshOption,
                 cluster: Cluster) -> list[float]:
    """Seconds to send one micro-batch's boundary values between consecutive
    stages (each device sends its 1/size share; across nodes when a stage
    fills whole nodes or the next stage is on another node)."""
    link = cluster.inter_node if mesh.size >= cluster.devices_per_node and cluster.num_nodes > 1 \
        else cluster.intra_node
    out = []
    for a, b in bounds[:-1]:
        nbytes = sum(prog.graph[v].outputs[0].nbytes for v in prog.boundaries[b - 1][1]
                     if prog.graph[v].outputs and prog.graph[v].outputs[0].is_float)
        out.append(link.latency + nbytes / mesh.size / link.bandwidth)
    return out


# The schedule name of a one-stage candidate (no pipeline).
NO_PIPELINE = "none"


def stage_in_flight(schedule: str, pp: int, m: int, v: int) -> list[float]:
    """In-flight micro-batches of each stage (1 for a single stage)."""
    return [1.0] if schedule == NO_PIPELINE else in_flight(schedule, pp, m, v)


def simulate_step(schedule: str, pp: int, m: int, v: int, times: list[StageTimes],
              p2p: list[float]) -> tuple[float, float]:
    """(step seconds including the slowest gradient sync, bubble seconds)."""
    if schedule == NO_PIPELINE:
        return times[0].microbatch_s + times[0].grad_sync_s, 0.0
    r = simulate(schedule, pp, m, [t.forward_s for t in times],
                 [t.backward_input_s for t in times], [t.backward_weight_s for t in times],
                 p2p if p2p else 0.0, stages_per_rank=v, timeline=False)
    sync = max(t.grad_sync_s for t in times)
    return r.step_time + sync, r.step_time - max(r.busy)


def _microbatch_options(global_batch: int, pp: int, v: int, schedule: str,
                        limit: int) -> list[int]:
    """Micro-batch counts tried, fewest first: the batch split into
    micro-batches of 1, 4, 16, ... sequences, at most ``limit`` of them,
    where the count is a multiple of pp (DualPipeV: 2pp), as torch's
    schedules accept. Micro-batches of one sequence (Megatron's usual
    size) keep the bubble and the in-flight activations smallest: with
    counts pp, 2pp and 4pp instead, gpt3-175b on 1024 A100s chose 516.10
    s/step where pp=16 with 1536 micro-batches gives 277.74, and llama3-8b
    on 64 H100s 71.10 where pp=2 with 256 gives 58.25."""
    first = pp * (2 if canonical_schedule(schedule) == "dualpipev" else 1)
    counts = []
    size = 1  # sequences per micro-batch
    while global_batch // size >= first and len(counts) < limit:
        if global_batch % size == 0 and (global_batch // size) % first == 0:
            counts.append(global_batch // size)
        size *= 4
    return sorted(counts)


def _accumulation_options(global_batch: int, limit: int) -> list[int]:
    """Micro-batch counts tried for one stage with gradient accumulation: 2,
    8, 32, ... (a quarter of the micro-batch each time) dividing the batch,
    at most ``limit`` of them."""
    out = []
    m = 2
    while m <= global_batch and len(out) < limit:
        if global_batch % m == 0:
            out.append(m)
        m *= 4
    return out


# ZeRO stages the search tries for pipeline stages: none, and FSDP2 (ZeRO-3)
# over stage mesh axis 0.
SEARCH_ZERO_STAGES = (0, 3)


@dataclass
class SearchOptions:
    """What the pipeline search may choose from (None = everything valid)."""

    pp: Sequence[int] | None = None
    schedules: Sequence[str] | None = None
    num_microbatches: Sequence[int] | None = None
    stage_mesh: Sequence[int] | None = None
    # ZeRO stages of pipeline stages (SEARCH_ZERO_STAGES when None)
    zero_stages: Sequence[int] | None = None
    microbatch_options: int = 3
    finalists: int = 3
    # ZeRO-3 variants (zero_variants) solved exactly besides the finalists
    zero_finalists: int = 2

    @property
    def zero_choices(self) -> list[int]:
        """The ZeRO stages allowed: ``zero_stages``, or all the search knows."""
        return list(SEARCH_ZERO_STAGES if self.zero_stages is None else self.zero_stages)


def configurations(ctx: SearchContext, opts: SearchOptions
                   ) -> list[tuple[int, int, StageMeshOption, str, int]]:
    """Every (pp, stages per rank, stage mesh, schedule, micro-batches) the
    search prices, in a fixed order: pp = 1 is the single stage of the whole
    batch, then the pipelines, then one stage accumulating the gradients of
    several micro-batches (:func:`accumulates`; last, so that the profiles
    they make change no other price). The stage meshes are without ZeRO
    where ``opts`` allows it (:func:`zero_variants` adds ZeRO-3 for the
    leading candidates), else with the ZeRO stage it names (on meshes whose
    axis 0 has more than one rank). Pipelines of more stages than the
    program has layers are left out before any program is made for them
    (llama3-8b's 32 layers: 29 configurations, which under earlier
    micro-batch options alone asked for a capture at size 1, 2.7 s)."""
    n = ctx.cluster.num_devices
    schedules = [canonical_schedule(s) for s in (opts.schedules or SEARCH_SCHEDULES)]
    pps = list(opts.pp) if opts.pp else [p for p in range(1, n + 1) if n % p == 0]
    zeros = opts.zero_choices
    zero = 0 if 0 in zeros else zeros[0]
    num_layers = len(ctx.program(1).layers)
    out, accumulating = [], []
    for pp in pps:
        meshes = stage_mesh_options(ctx.cluster, pp)
        if opts.stage_mesh is not None:  # any logical view of the sub-mesh
            want = tuple(opts.stage_mesh)
            meshes = [StageMeshOption(want, mo.num_nodes, mo.devices_per_node)
                      for mo in meshes[:1] if mo.size == math.prod(want)]
        for mesh in meshes:
            if pp == 1:  # one stage: the whole batch at once, no schedule (no ZeRO)
                out.append((1, 1, mesh, NO_PIPELINE, 1))
            if zero and mesh.shape[0] == 1:
                continue
            mesh = dataclasses.replace(mesh, zero_stage=zero)
            if pp == 1:  # or micro-batches with their gradients accumulated (1F1B of one stage)
                ms = list(opts.num_microbatches) if opts.num_microbatches else \
                    _accumulation_options(ctx.global_batch, opts.microbatch_options)
                if "1f1b" in schedules:
                    accumulating.extend((1, 1, mesh, "1f1b", m) for m in ms if m > 1)
                continue
            for schedule in schedules:
                v = default_stages_per_rank(schedule)
                if pp * v > num_layers:
                    continue
                ms = list(opts.num_microbatches) if opts.num_microbatches else \
                    _microbatch_options(ctx.global_batch, pp, v, schedule, opts.microbatch_options)
                out.extend((pp, v, mesh, schedule, m) for m in ms)
    return out + accumulating


def accumulates(cand: PipelineCandidate) -> bool:
    """Whether ``cand`` is one stage accumulating the gradients of its micro-batches."""
    return cand.pp == 1 and cand.schedule != NO_PIPELINE


def search(ctx: SearchContext, opts: SearchOptions) -> list[PipelineCandidate]:
    """Every priced configuration (from layer profiles and the stage DP), best first."""
    configs = configurations(ctx, opts)
    candidates = [c for c in _price_all(ctx, configs, lambda k, config: (
        f"[{k + 1}/{len(configs)}] {config_label(*config)}")) if c is not None]
    candidates.sort(key=lambda c: c.step_time_s)
    return candidates


Config = tuple[int, int, StageMeshOption, str, int]  # (pp, v, stage mesh, schedule, m)


class _ChildMark:
    """The ``in_child`` hook of :mod:`planner.forked` for a search's phases:
    called first in the forked child, it silences ``ctx``'s progress there
    (the child's lines would interleave with this process's), marks
    :attr:`in_child`, so that a task knows its results travel back pickled,
    and tells ``ctx`` what its parent holds (:meth:`SearchContext.forked`)."""

    def __init__(self, ctx: SearchContext):
        self.ctx = ctx
        self.in_child = False

    def __call__(self) -> None:
        self.in_child = True
        self.ctx.progress = lambda msg: None
        self.ctx.forked()


def _price_all(ctx: SearchContext, configs: Sequence[Config],
               label: Callable[[int, Config], str], traced: bool = False
               ) -> list[PipelineCandidate | None]:
    """``[_price(ctx, *config) for config in configs]``, on two CPU cores
    (:mod:`planner.forked`), one task per pricing scope.

    A configuration's price depends on the profiles of its pricing scope
    only (:func:`pricing_scope`: references are made and re-priced within a
    mesh family, and at micro-batch size 1 within a stage mesh), so pricing
    each scope's configurations in their order, in either process, gives the
    same prices as pricing all in order. The programs are made here first,
    in that order (which decides what is captured and what derived), size 1
    last, so that both processes hold them before they price; while this
    process captures, the forked child prices what needs no program still
    to come: the leading configurations (they come first in every scope's
    order) and, beside the capture of size 1, the scopes of other sizes.
    A task run by the child sends back its
    scopes' profiles, without their priced problems (remade if they are
    extended, :meth:`SearchContext._extend`), and its strategy caches.

    ``traced``: the configurations are of mesh families without references
    (ZeRO-3 variants), so their scopes make them, with ILPs of their own on
    captured or written-out programs (:meth:`SearchContext.program`). Those
    only derived so far are written out here while the child prices the
    scopes that have theirs; then both price the rest."""

    def scope_of(config: Config) -> tuple:
        mesh, m = config[2], config[4]
        return pricing_scope(mesh.key, ctx.global_batch // m)

    ms = list(dict.fromkeys(m for *_, m in configs if ctx.global_batch % m == 0))
    ready = 0  # the leading configurations whose programs exist
    while ready < len(configs) and not ctx.will_capture(configs[ready][4]):
        ready += 1
    child = _ChildMark(ctx)

    def task(ks: list[int]) -> Callable[[], tuple]:
        def run() -> tuple:
            solves = ctx.ilp_solves
            out = []
            for k in ks:
                ctx.progress(label(k, configs[k]))
                out.append(_price(ctx, *configs[k]))
            if not child.in_child:  # its profiles and ILP count are here already
                return out, None, 0
            return (out, ctx.scope_state({scope_of(configs[k]) for k in ks}),
                    ctx.ilp_solves - solves)
        return run

    priced: list[PipelineCandidate | None] = [None] * len(configs)

    def file(ks: list[int], done: tuple) -> None:
        out, state, solves = done
        if state is not None:  # priced by the child
            ctx.adopt_scope_state(state)
            ctx.ilp_solves += solves
        for k, cand in zip(ks, out):
            priced[k] = cand

    Job = tuple[Callable[[], Any], Callable[[Any], None]]  # a task, and what files its result

    def make(counts: list[int], traced: bool = False) -> None:
        for m in counts:
            ctx.program(m, traced=traced)

    def settle(jobs: list[Job], results: list[Any]) -> None:
        for (_, on_done), result in zip(jobs, results):
            on_done(result)

    def beside(counts: list[int], there: list[int], jobs: list[Job],
               after: Sequence[Job] = (), traced: bool = False) -> None:
        """Make the programs of micro-batch ``counts`` (``traced``: captured
        or written out) here while the forked child prices the
        configurations ``there``; then both take ``jobs``, and this process
        (and, once the child is done with those, a new one) the jobs
        ``after``, which need those programs."""
        _, done, results, results_after = run_beside(
            lambda: make(counts, traced), task(there), _held_by_both(ctx, ctx.programs()), child,
            then=[job for job, _ in jobs], after_here=[job for job, _ in after])
        file(there, done)
        settle(jobs, results)
        settle(after, results_after)

    def forked(jobs: list[Job]) -> None:
        settle(jobs, run_forked([job for job, _ in jobs], _held_by_both(ctx, ctx.programs()),
                                child))

    # torch's schedule orders, made once on both cores before the scopes are
    # priced (each asks for many of them; each process made them all for
    # itself: gpt3-175b on 1024 GPUs, 96 shapes, ~16 s in each)
    shapes = _missing_schedule_shapes(configs)
    orders: list[Job] = [(_orders_task(shape), lambda blob, shape=shape: _file_order(shape, blob))
                         for shape in shapes]
    # micro-batches of one sequence: another program, captured last (see
    # SearchContext.program); the scopes that need it, priced last
    one = [m for m in ms if ctx.global_batch // m == 1]
    others = [m for m in ms if m not in one]
    capture_others = any(ctx.will_capture(m) for m in others)
    capture_one = any(ctx.will_capture(m) for m in one)
    first = list(range(ready)) if capture_others or capture_one else []
    scopes: dict[tuple, list[int]] = {}
    for k in range(len(first), len(configs)):
        scopes.setdefault(scope_of(configs[k]), []).append(k)
    # the largest scopes first, so that the last task to start is short; those
    # at micro-batch size 1 apart (their program may be captured after the others)
    # (a scope names its stage mesh, last, only at size 1: see pricing_scope)
    ordered = sorted(scopes.items(), key=lambda item: len(item[1]), reverse=True)

    def job(ks: list[int]) -> Job:
        return task(ks), lambda done: file(ks, done)

    early = [ks for scope, ks in ordered if scope[-1] is None]
    late = [ks for scope, ks in ordered if scope[-1] is not None]
    # the child works while this process captures: on the leading
    # configurations whose programs exist (``first``) and the schedule orders
    # beside the first captures; on the scopes not at size 1 beside the
    # capture of size 1 (once ``first`` is filed: a scope's configurations
    # are priced in their order), while this process, done capturing, prices
    # the scopes at size 1
    if capture_others:
        beside(others, first, orders)
        if capture_one:
            beside(one, [], [job(ks) for ks in early], [job(ks) for ks in late])
            early = late = []
        else:
            make(one)
    else:
        make(others)
        if capture_one:
            beside(one, first, orders)
        else:
            forked(orders)
    rest = early + late
    # (traced) made here first: each program only derived so far that a
    # scope may price on (where no reference divides its shapes, another
    # size of its scope makes one too)
    unwritten = [m for m in ms if traced and not ctx.has_traced(m)]
    waiting = [ks for ks in rest if any(configs[k][4] in unwritten for k in ks)]
    if waiting:
        beside(unwritten, [], [job(ks) for ks in rest if ks not in waiting],
               [job(ks) for ks in waiting], traced=True)
    else:
        forked([job(ks) for ks in rest])
    return priced


def _missing_schedule_shapes(configs: Sequence[Config]) -> list[tuple[str, int, int, int]]:
    """The schedule shapes ``(schedule, pp, m, v)`` of ``configs`` whose
    torch orders (:func:`costmodel.schedules.torch_orders`) this process
    lacks, the longest first."""
    return sorted({(s, pp, m, v) for pp, v, _, s, m in configs
                   if s != NO_PIPELINE and not orders_cached(s, pp, m, v)},
                  key=lambda shape: (-shape[1] * shape[2] * shape[3], shape))


def _orders_task(shape: tuple[str, int, int, int]) -> Callable[[], bytes | None]:
    """A task giving torch's orders of ``shape`` pickled (:func:`_file_order`
    reads them), or None where torch rejects it (the pricing reads that as no
    candidate). Pickled here by the C pickler in one piece: the forked
    child's results go through :mod:`planner.forked`'s pickler, which asks
    which object it is for each of the ~600k tuples and ints of a large
    shape (gpt3-175b: 2.2 s for all shapes, against 0.1 s)."""
    def run() -> bytes | None:
        try:
            return pickle.dumps(torch_orders(*shape), protocol=pickle.HIGHEST_PROTOCOL)
        except ValueError:
            return None
    return run


def _file_order(shape: tuple[str, int, int, int], blob: bytes | None) -> None:
    """File in this process the orders :func:`_orders_task` made for ``shape``."""
    if blob is not None:
        adopt_orders(*shape, pickle.loads(blob))


# The leading candidates whose ZeRO-3 variants zero_variants() prices.
ZERO_CANDIDATES = 6


def zero_variants(ctx: SearchContext, groups: Sequence[list[PipelineCandidate]],
                  opts: SearchOptions) -> list[list[PipelineCandidate]]:
    """For each group of ranked candidates, the ZeRO-3 variants of its
    leading :data:`ZERO_CANDIDATES` pipelines (those without ZeRO whose stage
    mesh has more than one rank on axis 0), priced, best first; none unless
    ``opts`` allows both ZeRO stages. The groups are priced together, in
    one forked phase (in their order within each pricing scope, as if one
    after the other).

    ZeRO-3 keeps the parameters replicated on axis 0, shards their states
    there and synchronises gradients once per step instead of in every
    micro-batch (:class:`planner.intra_op.IntraOpCost`). Its layer
    profiles are ILPs of their own (a mesh family of its own). Only the
    leading configurations are tried: the ILP without ZeRO may already shard
    parameter states on any axis, so ZeRO-3 mostly changes how fast a
    configuration is, not whether it fits."""
    zeros = opts.zero_choices
    if not (0 in zeros and 3 in zeros):
        return [[] for _ in groups]
    per_group = [[(c.pp, c.stages_per_rank, dataclasses.replace(c.mesh, zero_stage=3),
                   c.schedule, c.num_microbatches) for c in ranked[:ZERO_CANDIDATES]
                  if c.schedule != NO_PIPELINE and not c.mesh.zero_stage and c.mesh.shape[0] > 1]
                 for ranked in groups]
    configs = [config for group in per_group for config in group]
    priced = _price_all(ctx, configs, lambda k, config: (
        f"ZeRO-3 variant {k + 1}/{len(configs)}: {config_label(*config)}"), traced=True)
    out, start = [], 0
    for group in per_group:
        variants = [c for c in priced[start:start + len(group)] if c is not None]
        variants.sort(key=lambda c: c.step_time_s)
        out.append(variants)
        start += len(group)
    return out


# The leading candidates whose (stage mesh, micro-batches) get ILP profiles of
# their own before the finalists are chosen, and at most how many such pairs.
REFINE_CANDIDATES = 6
REFINE_PAIRS = 3


def refine(ctx: SearchContext, ranked: list[PipelineCandidate]) -> list[PipelineCandidate]:
    """Re-price the leading candidates with ILP profiles of their own (mesh,
    micro-batch size) and all :data:`PROFILE_LEVELS` memory levels, then rank again.

    Re-priced profiles carry placements the ILP chose at another micro-batch
    size or mesh of the family; they are feasible but can be far from the
    ILP's answer at this size (alpa-gpt3-15b on 32 V100: pp=4 x 8 interleaved
    1F1B was priced 35.9 s re-priced and 32.4 s by its own profile, which
    decided whether it reached the finalists)."""
    top = [c for c in ranked[:REFINE_CANDIDATES] if c.schedule != NO_PIPELINE]
    pairs: dict[tuple, StageMeshOption] = {}
    for c in top:
        pairs.setdefault((c.mesh.key, c.num_microbatches), c.mesh)
    pairs = dict(list(pairs.items())[:REFINE_PAIRS])
    changed = _own_profiles_forked(ctx, pairs)
    if not changed:
        return ranked
    again = []
    for c in ranked:
        if (c.mesh.key, c.num_microbatches) in changed:
            c = _price(ctx, c.pp, c.stages_per_rank, c.mesh, c.schedule, c.num_microbatches)
        if c is not None:
            again.append(c)
    again.sort(key=lambda c: c.step_time_s)
    return again


def _held_by_both(ctx: SearchContext, progs: Sequence[MicrobatchProgram]) -> list[object]:
    """What this process and a forked one both hold and a result may refer
    to (:func:`planner.forked.run_forked`'s ``shared``): the cluster and the
    programs with their graphs and nodes."""
    shared: list[object] = [ctx.cluster]
    for prog in {id(p): p for p in progs}.values():
        shared += [prog, prog.graph, prog.graph.exported, *prog.graph.nodes]
    return shared


def _own_profiles_forked(ctx: SearchContext, pairs: dict[tuple, StageMeshOption]
                         ) -> list[tuple]:
    """:meth:`SearchContext.own_profiles` of every (stage mesh, micro-batches)
    pair, on two CPU cores (:mod:`planner.forked`); the pairs whose profiles
    changed.

    The pairs share no profile (each is filed under its own mesh and
    micro-batch size), so each gives the same profiles whichever process
    makes them. The programs whose strategies are enumerated are made here
    first, so that both processes hold them. A forked process's profiles come
    back without their priced problem, which is made again only if they are
    extended later (:meth:`SearchContext._extend`)."""
    progs = {}
    for (shape, m), mesh in pairs.items():
        prog = ctx.program(m)
        progs[shape, m] = ctx.program(m, traced=True) if ctx.has_repriced(prog, mesh) else prog
    child = _ChildMark(ctx)

    def task(prog: MicrobatchProgram, mesh: StageMeshOption) -> Callable[[], tuple]:
        def run() -> tuple:
            solves = ctx.ilp_solves
            changed = ctx.own_profiles(prog, mesh)
            if child.in_child:  # sent back by pickling: without the priced problems
                changed = [(layer, dataclasses.replace(p, prepared=None)) for layer, p in changed]
            return changed, ctx.ilp_solves - solves
        return run

    shared = _held_by_both(ctx, list(progs.values()))
    solves = ctx.ilp_solves
    done = run_forked([task(progs[key], mesh) for key, mesh in pairs.items()], shared, child)
    ctx.ilp_solves = solves + sum(d[1] for d in done)  # a child's never reach ctx by themselves
    for key, (changed, _) in zip(pairs, done):
        for layer, prof in changed:
            ctx.adopt(progs[key], layer, prof)
    return [key for key, (changed, _) in zip(pairs, done) if changed]


def _price(ctx: SearchContext, pp: int, v: int, mesh: StageMeshOption, schedule: str,
           m: int) -> PipelineCandidate | None:
    if ctx.global_batch % m:
        return None
    prog = ctx.program(m)
    S = pp * v
    if S > len(prog.layers):
        return None
    try:
        copies = stage_in_flight(schedule, pp, m, v)
    except ValueError:  # torch rejects this (schedule, pp, m) combination
        return None
    split = None
    for levels in (1, 2):  # the least-memory points only when the fastest do not fit
        profiles = [ctx.profile(prog, i, mesh, levels) for i in range(len(prog.layers))]
        if any(not p.points for p in profiles):
            return None
        # every point found so far is used; with the least-memory ones among
        # them, no point added later (they use more memory) could make it fit
        known = max(len(p.points) for p in profiles)
        split = split_layers(lambda i, lv: profiles[i].point(lv), len(prog.layers), S, m, copies,
                             ctx.budget / v, known)
        if split is not None:
            break
    if split is None:
        return None
    p2p = p2p_seconds(prog, split.bounds, mesh, ctx.cluster)
    step, bubble = simulate_step(schedule, pp, m, v, split.times, p2p)
    return PipelineCandidate(pp, v, mesh, schedule, m, split, step, bubble, sum(p2p))


@dataclass
class ExactPipeline:
    """A candidate with every stage solved exactly on its own sub-graph."""

    candidate: PipelineCandidate
    program: MicrobatchProgram
    bounds: list[tuple[int, int]]
    results: list[IntraOpResult]
    times: list[StageTimes]
    copies: list[float]
    step_time_s: float
    bubble_s: float
    p2p: list[float]


def solve_exact(ctx: SearchContext, cand: PipelineCandidate,
                bounds: list[tuple[int, int]] | None = None) -> ExactPipeline:
    """Solve each stage of ``cand`` (or of the given layer ``bounds``) with the
    intra-op ILP under its share of memory and in-flight activations."""
    prog, bounds, copies = _stages(ctx, cand, bounds)
    results = [None] * len(bounds)
    for s in _solve_order(copies):
        results[s] = _exact_stage(ctx, prog, cand, bounds[s], copies[s], s)
    return _exact_pipeline(ctx, cand, prog, bounds, copies, results)


def _stages(ctx: SearchContext, cand: PipelineCandidate,
            bounds: list[tuple[int, int]] | None = None
            ) -> tuple[MicrobatchProgram, list[tuple[int, int]], list[float]]:
    """The captured program, the layer bounds and the in-flight micro-batches
    of each stage of ``cand``."""
    prog = ctx.program(cand.num_microbatches, traced=True)
    copies = stage_in_flight(cand.schedule, cand.pp, cand.num_microbatches, cand.stages_per_rank)
    return prog, list(bounds or cand.split.bounds), copies


def _solve_order(copies: list[float]) -> list[int]:
    """Stages with fewer in-flight micro-batches first: their solutions may
    carry over to stages of the same layers that hold more."""
    return sorted(range(len(copies)), key=lambda s: copies[s])


def _exact_stage(ctx: SearchContext, prog: MicrobatchProgram, cand: PipelineCandidate,
                 bounds: tuple[int, int], copies: float, s: int) -> IntraOpResult:
    a, b = bounds
    ctx.progress(f"stage {s}: layers {a}..{b - 1}")
    return ctx.exact_stage(prog, a, b, cand.mesh, ctx.budget / cand.stages_per_rank, copies)


def _exact_pipeline(ctx: SearchContext, cand: PipelineCandidate, prog: MicrobatchProgram,
                    bounds: list[tuple[int, int]], copies: list[float],
                    results: list[IntraOpResult],
                    times: list[StageTimes] | None = None) -> ExactPipeline:
    """The step time of ``cand`` with its stages' exact solutions ``results``
    (whose :meth:`SearchContext.times_of` are ``times`` where given)."""
    if times is None:
        times = [ctx.times_of(r, cand.mesh) for r in results]
    p2p = p2p_seconds(prog, bounds, cand.mesh, ctx.cluster)
    step, bubble = simulate_step(cand.schedule, cand.pp, cand.num_microbatches,
                                 cand.stages_per_rank, times, p2p)
    return ExactPipeline(cand, prog, bounds, results, times, copies, step, bubble, p2p)


def solve_finalists(ctx: SearchContext, finalists: Sequence[PipelineCandidate]
                    ) -> list[ExactPipeline | None]:
    """:func:`solve_exact` of every finalist (None where a stage has no plan
    within limits), on two CPU cores.

    A stage's exact solve reads and writes only the solutions filed under
    its :meth:`SearchContext.stage_key` (its layer kinds on its stage mesh
    at its micro-batch size). The stages of all finalists are
    therefore cut into chains by that key, each chain in the order
    :func:`solve_exact` of the finalists one after another would reach them;
    chains share nothing, so each gives the same answers whichever process
    runs it (:mod:`planner.forked`). The programs are captured first, here,
    so that both processes hold them and results refer to them instead of
    copying them."""
    ctx.progress(f"exact stage solves of {len(finalists)} finalists")
    staged = [_stages(ctx, cand) for cand in finalists]
    chains: dict[tuple, list[tuple[int, int]]] = {}
    for i, (cand, (prog, bounds, copies)) in enumerate(zip(finalists, staged)):
        for s in _solve_order(copies):
            chains.setdefault(ctx.stage_key(prog, *bounds[s], cand.mesh), []).append((i, s))
    shared = _held_by_both(ctx, [prog for prog, _, _ in staged])

    def chain_task(items: list[tuple[int, int]]) -> Callable[[], tuple]:
        def run() -> tuple:
            solves, reused = ctx.ilp_solves, ctx.stages_reused
            failed: set[int] = set()  # finalists with a stage that has no plan
            out: list[tuple[IntraOpResult, StageTimes] | None] = []  # solutions, their times
            for i, s in items:
                prog, bounds, copies = staged[i]
                solved = None
                if i not in failed:
                    try:
                        result = _exact_stage(ctx, prog, finalists[i], bounds[s], copies[s], s)
                        solved = result, ctx.times_of(result, finalists[i].mesh)
                    except (MemoryInfeasibleError, InfeasibleError):  # no plan within limits
                        failed.add(i)
                out.append(solved)
            return out, ctx.ilp_solves - solves, ctx.stages_reused - reused
        return run

    solves, reused = ctx.ilp_solves, ctx.stages_reused
    # the longest chains first, so that the last chain to start is short
    order = sorted(chains.values(), key=len, reverse=True)
    done = run_forked([chain_task(items) for items in order], shared, _ChildMark(ctx))
    # the counts of both processes (a child's never reach ctx by themselves)
    ctx.ilp_solves = solves + sum(d[1] for d in done)
    ctx.stages_reused = reused + sum(d[2] for d in done)
    solved: list[list[tuple[IntraOpResult, StageTimes] | None]] = [
        [None] * len(b) for _, b, _ in staged]
    for items, (out, _, _) in zip(order, done):
        for (i, s), stage in zip(items, out):
            solved[i][s] = stage
    return [None if any(r is None for r in rs) else
            _exact_pipeline(ctx, cand, prog, bounds, copies, [r for r, _ in rs],
                            [t for _, t in rs])
            for cand, (prog, bounds, copies), rs in zip(finalists, staged, solved)]


# Finalists predicted slower than the fastest prediction by more than this
# factor are solved exactly only when none of the others has a plan. Over the
# 86 finalists of the 12 plan_quality cases (all solved), none of the 26 so
# far behind won (the nearest ended 14.4 % behind the winner), and the
# predictions of pipelines and whole-batch single stages were within 3.3 % of
# their exact solves; gpt3-175b's interleaved finalists, 29 % behind, took a
# third of its exact solve time (with pp, 4pp and 16pp micro-batches, before
# micro-batches of 1, 4 and 16 sequences). One stage accumulating micro-batches is
# always solved: its predictions were up to 85 % above its exact solve.
FINALIST_MARGIN = 1.15


def split_far_finalists(finalists: Sequence[PipelineCandidate],
                        margin: float = FINALIST_MARGIN
                        ) -> tuple[list[PipelineCandidate], list[PipelineCandidate]]:
    """``(close, far)``: the finalists that accumulate micro-batches on one
    stage (:func:`accumulates`) or are predicted within ``margin`` times the
    fastest prediction, and the rest (both in their order)."""
    fastest = min((c.step_time_s for c in finalists), default=math.inf)

    def close(c: PipelineCandidate) -> bool:
        return accumulates(c) or c.step_time_s <= margin * fastest

    return [c for c in finalists if close(c)], [c for c in finalists if not close(c)]


def stage_to_rank(schedule: str, pp: int, v: int) -> dict[int, int]:
    """Pipeline rank of every stage, as torch's schedule places it (read from
    its order at the fewest micro-batches it accepts; no simulation)."""
    m = 2 * pp if canonical_schedule(schedule) == "dualpipev" else pp
    return dict(torch_orders(schedule, pp, m, v)[1])


def assemble(exact: ExactPipeline, ctx: SearchContext,
             base_plan: Callable[[IntraOpResult, Cluster], Plan]) -> Plan:
    """One Plan from the exactly solved stages (placements merged by node name)."""
    cand = exact.candidate
    prog = exact.program
    mesh_shape = list(cand.mesh.shape)
    world = cand.pp * cand.mesh.size
    s2r = stage_to_rank(cand.schedule, cand.pp, cand.stages_per_rank)
    stage_cluster = cand.mesh.cluster(ctx.cluster)
    parts = [base_plan(r, stage_cluster) for r in exact.results]
    stages: list[StagePlan] = []
    for s, (r, part) in enumerate(zip(exact.results, parts)):
        a, b = exact.bounds[s]
        recv, send = prog.boundaries[a][0], prog.boundaries[b - 1][1]
        next_inputs = parts[s + 1] if s + 1 < len(parts) else None
        inputs = {name: _strs(r.chosen[name].outputs[0]) for name in recv}
        if next_inputs is None:
            outputs = {name: _strs(r.chosen[name].outputs[0]) for name in send}
        else:
            nr = exact.results[s + 1]
            outputs = {name: _strs(nr.chosen[name].outputs[0]) for name in send}
        rank = s2r[s]
        ranks = list(range(rank * cand.mesh.size, (rank + 1) * cand.mesh.size))
        t = exact.times[s]
        stages.append(StagePlan(
            index=s, pp_rank=rank, layers=[l.name for l in prog.layers[a:b]],
            nodes=[op for l in prog.layers[a:b] for op in l.ops], ranks=ranks,
            inputs=inputs, outputs=outputs, checkpoint=list(r.checkpointed),
            zero_stage=cand.mesh.zero_stage, zero_axis=0 if cand.mesh.zero_stage else None,
            predicted={"forward_s": t.forward_s, "backward_input_s": t.backward_input_s,
                       "backward_weight_s": t.backward_weight_s, "grad_sync_s": t.grad_sync_s,
                       "in_flight_microbatches": exact.copies[s],
                       "memory_bytes_per_device": part.predicted["memory_bytes_per_device"]}))
    first = parts[0]
    plan = Plan(
        model={**first.model, "fingerprint": prog.graph.fingerprint()}, cluster=ctx.cluster.to_dict(),
        mesh={"shape": [cand.pp] + mesh_shape,
              "axis_names": ["pp"] + [f"mesh{i}" for i in range(len(mesh_shape))]},
        parameters={k: v for p in parts for k, v in p.parameters.items()},
        inputs={k: v for k, v in first.inputs.items() if prog.graph[k].kind == INPUT},
        nodes={k: v for p in parts for k, v in p.nodes.items()},
        reshards=[r for p in parts for r in p.reshards],
        predicted=_predicted(exact, parts, ctx),
        solver=_solver_report(parts),
        training={**first.training, "microbatch_size": ctx.global_batch // cand.num_microbatches,
                  "global_batch": ctx.global_batch},
        checkpoint=[c for p in parts for c in p.checkpoint],
        pipeline=PipelinePlan(schedule=cand.schedule, num_microbatches=cand.num_microbatches,
                              stages_per_rank=cand.stages_per_rank,
                              stage_mesh={"shape": mesh_shape,
                                          "axis_names": [f"mesh{i}" for i in range(len(mesh_shape))]},
                              stages=stages))
    assert plan.world_size == world
    return plan


def _strs(placements) -> list[str]:
    from costmodel.resharding import placement_str
    return [placement_str(p) for p in placements]


def _predicted(exact: ExactPipeline, parts: list[Plan], ctx: SearchContext) -> dict[str, Any]:
    m = exact.candidate.num_microbatches
    v = exact.candidate.stages_per_rank
    pp = exact.candidate.pp
    # memory per device: the stages of the fullest rank
    s2r = stage_to_rank(exact.candidate.schedule, pp, v)
    per_rank: dict[int, dict[str, int]] = {}
    for s, p in enumerate(parts):
        acc = per_rank.setdefault(s2r[s], {})
        for k, val in p.predicted["memory_bytes_per_device"].items():
            acc[k] = acc.get(k, 0) + int(val)
    memory = max(per_rank.values(), key=lambda d: d.get("total", 0))
    busiest = max(range(pp), key=lambda r: sum(
        exact.times[s].microbatch_s for s in range(len(parts)) if s2r[s] == r))
    mine = [s for s in range(len(parts)) if s2r[s] == busiest]
    return {
        "step_time_s": exact.step_time_s,
        "compute_s": m * sum(parts[s].predicted["compute_s"] for s in mine),
        "communication_s": m * sum(parts[s].predicted["communication_s"] for s in mine),
        "resharding_s": m * sum(parts[s].predicted["resharding_s"] for s in mine),
        "bubble_s": exact.bubble_s,
        "p2p_s": sum(exact.p2p),
        "grad_sync_s": max(t.grad_sync_s for t in exact.times),
        "memory_bytes_per_device": memory,
    }


def _solver_report(parts: list[Plan]) -> SolverReport:
    reports = [p.solver for p in parts]
    statuses = sorted({r.status for r in reports})
    return SolverReport(
        solver=reports[0].solver, status="/".join(statuses),
        objective_s=sum(r.objective_s for r in reports), bound_s=sum(r.bound_s for r in reports),
        gap=max(r.gap for r in reports), time_limit_s=reports[0].time_limit_s,
        num_variables=sum(r.num_variables for r in reports),
        num_constraints=sum(r.num_constraints for r in reports))
