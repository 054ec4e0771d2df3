"""What one search keeps of its work (:class:`SearchCaches`), how each cache
is keyed (:func:`profile_key`, :func:`reference_key`, :func:`pricing_scope`),
and the fork sync: what a forked child of the search sends back
(:meth:`SearchCaches.scope`) and its parent keeps (:meth:`SearchCaches.merge`).

Nothing here prices or solves; :class:`planner.search.context.SearchContext`
fills the caches.
"""

from __future__ import annotations

import itertools
from typing import Any

from costmodel.resharding import ReshardPricer
from ir.graph import Graph
from planner.ilp.intra_op import IntraOpResult
from planner.search.microbatch_programs import MicrobatchProgram
from planner.search.stage_dp import LayerProfile, StageMeshOption, mesh_family

__all__ = ["SearchCaches", "pricing_scope", "profile_key", "reference_key"]


class SearchCaches:
    """The caches of one search; none outlives it.

    Attributes:
        profiles: layer profiles by :func:`profile_key`.
        references: by :func:`reference_key`, the profiles with ILPs of their
            own, whose placements the scope re-prices.
        strategies: DTensor's strategies by node signature, per stage mesh shape.
        expansions: DTensor's single-dim strategies expanded, by number of mesh
            axes and node signature, for every stage mesh shape
            (:mod:`planner.ilp.strategies`).
        pricers: memoised resharding prices per stage mesh (shape, nodes,
            devices per node).
        stage_graphs: stage sub-graphs by (id of the program's graph, first
            layer, end): (that graph, kept so that the id stays its own; the
            sub-graph).
        stage_results: exact stage solutions by (memory budget, micro-batch
            size, stage mesh, layer kinds): the (in-flight copies, solution) pairs.
        fastest_stages: by the same key less the budget, the fastest plan.
    """

    def __init__(self) -> None:
        self.profiles: dict[tuple, LayerProfile] = {}
        self.references: dict[tuple, list[LayerProfile]] = {}
        self.strategies: dict[tuple, dict] = {}
        self.expansions: dict[tuple, list] = {}
        self.pricers: dict[tuple, ReshardPricer] = {}
        self.stage_graphs: dict[tuple, tuple[Graph, Graph]] = {}
        self.stage_results: dict[tuple, list[tuple[float, IntraOpResult]]] = {}
        self.fastest_stages: dict[tuple, tuple[float, IntraOpResult]] = {}
        # how many leading entries of each strategy cache (by mesh shape) and
        # of the expansions the process this one was forked from holds
        # (see forked and scope; both only ever grow)
        self._sent_strategies: dict[tuple, int] = {}
        self._sent_expansions = 0

    def forked(self) -> None:
        """Called first in a forked child: what the strategy caches and
        expansions hold now, the process it was forked from holds too, so
        :meth:`scope` leaves it out (pickling it back cost ~0.5 s of a
        llama3-8b search)."""
        self._sent_strategies = {shape: len(c) for shape, c in self.strategies.items()}
        self._sent_expansions = len(self.expansions)

    def scope(self, scopes: set[tuple], global_batch: int) -> dict[str, dict]:
        """The layer profiles and references of the pricing ``scopes``
        (:func:`pricing_scope`), the strategies of their meshes and the
        expansions this process made since it was forked (:meth:`forked`)
        or the last call, for :meth:`merge` in the process it was forked
        from. The profiles lose their priced problems (too big to send;
        remade if they are extended)."""
        profiles = {k: p for k, p in self.profiles.items()
                    if pricing_scope(k[1], k[2], global_batch) in scopes}
        references = {k: refs for k, refs in self.references.items()  # see reference_key
                      if k[1:] in scopes}
        for prof in [*profiles.values(), *(p for refs in references.values() for p in refs)]:
            prof.prepared = None
        shapes = {mesh_key[0] for _, mesh_key, _ in profiles}
        strategies = {}
        for shape in shapes & self.strategies.keys():
            cache = self.strategies[shape]
            strategies[shape] = dict(itertools.islice(
                cache.items(), self._sent_strategies.get(shape, 0), None))
            self._sent_strategies[shape] = len(cache)
        expansions = dict(itertools.islice(self.expansions.items(), self._sent_expansions, None))
        self._sent_expansions = len(self.expansions)
        return {"profiles": profiles, "references": references,
                "strategies": strategies, "expansions": expansions}

    def merge(self, caches: dict[str, Any]) -> None:
        """Keep what :meth:`scope` of a forked child gave."""
        self.profiles.update(caches["profiles"])
        self.references.update(caches["references"])
        for shape, cache in caches["strategies"].items():
            self.strategies.setdefault(shape, {}).update(cache)
        for key, rows in caches["expansions"].items():
            self.expansions.setdefault(key, rows)


def profile_key(prog: MicrobatchProgram, layer: int, mesh: StageMeshOption) -> tuple:
    """What a layer's profile is filed under: its kind, the stage mesh (shape
    and ZeRO stage) and the micro-batch size."""
    return prog.signatures[layer], mesh.key, prog.microbatch_size


def reference_key(prog: MicrobatchProgram, layer: int, mesh: StageMeshOption,
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
