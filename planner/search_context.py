"""What one pipeline search shares: the programs of each micro-batch size
(captured, written out or derived), DTensor's strategies per stage mesh, the
layer profiles (time/memory points of each layer kind on each stage mesh) and
the exact stage solutions, and how they travel between its two processes.

Units: seconds, bytes. The search itself is :mod:`planner.pipeline`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.distributed.tensor.placement_types import Replicate

from costmodel.cluster import Cluster
from costmodel.collectives import axis_links
from costmodel.resharding import ReshardPricer
from ir.fast_trace import SynthesizedProgram, rescaled_trace
from ir.graph import PARAM, Graph
from ir.layers import PipelineLayer, pipeline_layers
from ir.rescale import BatchRule, batch_rule
from ir.subgraph import boundary_values, subgraph
from ir.trace import trace
from planner.inter_op import (LayerProfile, StageMeshOption, StageTimes, layer_signature,
                              mesh_family, stage_times)
from planner.intra_op import (IntraOpCost, IntraOpResult, PreparedIntraOp, prepare_intra_op,
                              restrict, solve_prepared)
from planner.ilp import InfeasibleError
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
                                pricer=self.pricer(mesh), zero_stage=mesh.zero_stage,
                                reduce_once=mesh.reduce_once)

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
        bytes; ``recompute`` as :func:`planner.intra_op.solve_prepared`."""
        self.ilp_solves += 1
        return solve_prepared(self.prepare_stage(prog, first, end, mesh, copies),
                              memory_budget=budget, time_limit_s=self.time_limit_s,
                              recompute=recompute)

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
                           mesh.zero_stage, pricer=self.pricer(mesh), cost=cost,
                           reduce_once=mesh.reduce_once)

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
                                    zero_stage=mesh.zero_stage, reduce_once=mesh.reduce_once)
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


def held_by_both(ctx: SearchContext, progs: Sequence[MicrobatchProgram]) -> list[object]:
    """What this process and a forked one both hold and a result may refer
    to (:func:`planner.forked.run_forked`'s ``shared``): the cluster and the
    programs with their graphs and nodes."""
    shared: list[object] = [ctx.cluster]
    for prog in {id(p): p for p in progs}.values():
        shared += [prog, prog.graph, prog.graph.exported, *prog.graph.nodes]
    return shared


class ChildMark:
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
