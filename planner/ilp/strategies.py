"""Per-op sharding strategies, read from DTensor's own registered op strategies.

This is the one module that uses DTensor's private sharding-propagation API
(``DTensor._op_dispatcher.sharding_propagator``, reached through
:mod:`ir.torch_compat`). Strategies are evaluated on a
fake process group of the mesh's world size, so every strategy the ILP can pick
is one DTensor executes. A strategy fixes the placement of each tensor input (in
argument order) and each output of one op.

Only the placements the planner prices are kept: ``Replicate()``, ``Shard(d)``
with ``d`` divisible by the devices sharding it, and ``Partial("sum")``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ir.graph import Graph, Node, OP
from ir.strategy import NodeStrategies, Placements, Strategy, is_shard
from ir.torch_compat import (SDPA, dtensor_schema_types, fake_store_type, is_assertion_op,
                             mesh_without_groups, op_schema_info, op_strategy_functions,
                             sharding_propagator,
                             single_dim_expansion, without_dtensor_redistribute_costs)

DTensorSpec, TensorMeta, OpSchema, OpSpec, OpStrategy, TupleStrategy = dtensor_schema_types()

class ReplicateFallbackWarning(UserWarning):
    """An op had no DTensor strategy; the planner runs it replicated."""


@contextlib.contextmanager
def fake_mesh(mesh_shape: Sequence[int]) -> Iterator[DeviceMesh]:
    """A DeviceMesh of ``mesh_shape`` on a fake process group (no processes).

    The fake group lives only inside the ``with`` block.
    """
    if dist.is_initialized():
        raise RuntimeError("planning needs a process without an initialised process group; "
                           "run the planner outside torchrun")
    FakeStore = fake_store_type()

    world = 1
    for d in mesh_shape:
        world *= int(d)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield mesh_without_groups(torch.arange(world).reshape(tuple(mesh_shape)))
    finally:
        dist.destroy_process_group()


def _is_kept(p: Placement) -> bool:
    if isinstance(p, (Replicate, Shard)):
        return type(p) in (Replicate, Shard)
    return isinstance(p, Partial) and p.reduce_op == "sum"


def divisible(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int]) -> bool:
    split = [1] * len(shape)
    for p, n in zip(placements, mesh_shape):
        if is_shard(p):
            if p.dim >= len(shape) or p.dim < -len(shape):
                return False
            split[p.dim] *= n
    return all(s % k == 0 for s, k in zip(shape, split))


def enumerate_placements(shape: Sequence[int], mesh_shape: Sequence[int]) -> list[Placements]:
    """Every Replicate/Shard combination for a tensor of ``shape`` (evenly divisible)."""
    options: list[Placement] = [Replicate()] + [Shard(d) for d in range(len(shape))]
    out = []
    for combo in itertools.product(options, repeat=len(mesh_shape)):
        if divisible(shape, combo, mesh_shape):
            out.append(tuple(combo))
    return out


def _spec(mesh: DeviceMesh, placements: Placements, val: torch.Tensor) -> DTensorSpec:
    meta = TensorMeta(val.shape, val.stride(), val.dtype)
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta)


def _out_meta(val):
    if isinstance(val, torch.Tensor):
        return TensorMeta(val.shape, val.stride(), val.dtype)
    if isinstance(val, (list, tuple)):
        return tuple(_out_meta(v) if isinstance(v, torch.Tensor) else None for v in val)
    return None


def _spec_list(output_specs) -> list[DTensorSpec | None]:
    if isinstance(output_specs, DTensorSpec):
        return [output_specs]
    return list(output_specs)


# One of DTensor's strategies as placements: per tensor input (None: as the
# first output), per output (None where the op returns no tensor).
_Row = tuple[tuple[Placements, ...] | None, tuple[Placements | None, ...]]


def _rows(result: OpStrategy) -> list[_Row]:
    """The placements of DTensor's strategies ``result``, in its order."""
    rows = []
    for spec in result.strategies:
        outs = tuple(None if o is None else o.placements for o in _spec_list(spec.output_specs))
        ins = None if spec.input_specs is None else tuple(s.placements for s in spec.input_specs)
        rows.append((ins, outs))
    return rows


class StrategyBuilder:
    """Enumerates strategies for every node of a Graph on one mesh shape."""

    def __init__(self, graph: Graph, mesh: DeviceMesh | Callable[[], DeviceMesh],
                 cache: dict[tuple, list[Strategy] | Exception] | None = None,
                 expansions: dict[tuple, list[_Row] | Exception] | None = None,
                 mesh_shape: Sequence[int] | None = None):
        """``mesh``: the mesh, or (with its ``mesh_shape``) a function making
        it, called only if DTensor is asked (see :func:`build_strategies`)."""
        self.graph = graph
        self._mesh = mesh if isinstance(mesh, DeviceMesh) else None
        self._make_mesh = mesh
        self.mesh_shape = tuple(mesh.shape if mesh_shape is None else mesh_shape)
        self.prop = sharding_propagator()
        self.fx_nodes = {n.name: n for n in graph.exported.graph.nodes}
        # node name -> candidate placements of each output (distinct, ordered)
        self._out_candidates: dict[str, list[list[Placements]]] = {}
        # the same, by strategy list (repeated blocks share DTensor's cached
        # list): id -> (the list, kept so that the id stays its own; candidates)
        self._candidates_of_list: dict[int, tuple[list[Strategy], list[list[Placements]]]] = {}
        # structural signature of a node -> its strategies (or why it has none);
        # a caller may share one between graphs planned on the same mesh shape
        self._cache: dict[tuple, list[Strategy] | Exception] = {} if cache is None else cache
        # (mesh axes, signature) -> DTensor's expansion of a single-dim strategy
        # (see _expanded); a caller may share one between every mesh shape
        self._expansions: dict[tuple, list[_Row] | Exception] = \
            {} if expansions is None else expansions
        self._unit_mesh: DeviceMesh | None = None

    @property
    def mesh(self) -> DeviceMesh:
        """The mesh DTensor is asked on (made at the first ask)."""
        if self._mesh is None:
            self._mesh = self._make_mesh()
        return self._mesh

    # -- candidates flowing along edges -------------------------------------------------
    def _record(self, ns: NodeStrategies) -> None:
        made = self._candidates_of_list.get(id(ns.strategies))
        if made is None or made[0] is not ns.strategies:
            n_out = max((len(s.outputs) for s in ns.strategies), default=0)
            cands: list[dict[Placements, None]] = [{} for _ in range(n_out)]
            for s in ns.strategies:
                for i, o in enumerate(s.outputs):
                    if o is not None:
                        cands[i].setdefault(o, None)
            made = self._candidates_of_list[id(ns.strategies)] = (
                ns.strategies, [list(c) for c in cands])
        self._out_candidates[ns.node.name] = made[1]

    def candidates_of(self, name: str, index: int = 0) -> list[Placements]:
        return self._out_candidates[name][index]

    # -- per node ------------------------------------------------------------------------
    def build(self) -> list[NodeStrategies]:
        out = []
        with _without_dtensor_costs():
            for node in self.graph.nodes:
                ns = self.node_strategies(node)
                self._record(ns)
                out.append(ns)
        return out

    def node_strategies(self, node: Node) -> NodeStrategies:
        if node.kind != OP:
            shape = node.output.shape
            return NodeStrategies(node, [Strategy((), (p,)) for p in
                                         enumerate_placements(shape, self.mesh_shape)])
        if node.target == "getitem":
            src = node.args[0]
            return NodeStrategies(node, [Strategy((p,), (p,)) for p in
                                         self.candidates_of(src, node.arg_index)])
        if not node.args:  # factory op (arange, full, ...): computed locally everywhere
            return NodeStrategies(node, [self._replicated(node)])
        if not node.outputs and is_assertion_op(self.fx_nodes[node.name].target):
            # an assertion on its input's metadata: no data moves, so it takes its
            # input as it comes (the executor checks it on any placement)
            if len(node.args) == 1:
                return NodeStrategies(node, [Strategy((p,), ()) for p in
                                             self.candidates_of(node.args[0], 0)])
            return NodeStrategies(node, [self._replicated(node)])
        try:
            strategies = self._from_dtensor(node)
            reason = None if strategies else "no strategy with even sharding"
        except _NoStrategy as err:
            strategies, reason = [], str(err)
        if not strategies:
            warnings.warn(f"{node.target} ({node.name}, module '{node.module_path}') has no "
                          f"usable DTensor sharding strategy ({reason}); planning it replicated",
                          ReplicateFallbackWarning, stacklevel=2)
            return NodeStrategies(node, [self._replicated(node)], fallback=reason)
        return NodeStrategies(node, strategies)

    def _replicated(self, node: Node) -> Strategy:
        r = tuple(Replicate() for _ in self.mesh_shape)
        return Strategy(tuple(r for _ in node.args), tuple(r for _ in node.outputs))

    def _signature(self, fx_node: torch.fx.Node, single: bool) -> tuple:
        """What DTensor's answer for this node depends on: op, argument values,
        tensor shapes/strides/dtypes and (for input-following strategy functions)
        the candidate placements of each input. Repeated blocks share it."""

        def sig(a):
            if isinstance(a, torch.fx.Node):
                val = a.meta["val"]
                cands = () if single else tuple(self.candidates_of(a.name, 0))
                return ("T", tuple(val.shape), tuple(val.stride()), val.dtype, cands)
            if isinstance(a, (list, tuple)):
                return tuple(sig(x) for x in a)
            return a if isinstance(a, (int, float, bool, str, type(None), torch.dtype,
                                       torch.device, torch.layout, torch.memory_format)) else repr(a)

        return (fx_node.target, sig(fx_node.args),
                tuple((k, sig(v)) for k, v in sorted(fx_node.kwargs.items())))

    def _from_dtensor(self, node: Node) -> list[Strategy]:
        fx_node = self.fx_nodes[node.name]
        if fx_node.target is SDPA:
            return self._fused_attention(node, fx_node)
        op = fx_node.target
        single, _ = op_strategy_functions(op)
        key = self._signature(fx_node, single is not None)
        return _memoised(self._cache, key, lambda: (
            self._keep(node, self._expanded(fx_node, single, key)) if single is not None
            else self._query_dtensor(node, fx_node)))

    def _query_dtensor(self, node: Node, fx_node: torch.fx.Node) -> list[Strategy]:
        """DTensor's strategies for an op registered without a single-dim
        strategy, on this mesh, for its inputs' candidate placements."""
        _, func = op_strategy_functions(fx_node.target)
        if func is None:
            raise _NoStrategy("op not registered with DTensor")
        tensor_args = [a for a in fx_node.args if isinstance(a, torch.fx.Node)]
        try:
            return self._keep(node, _rows(self._call_strategy(fx_node, None, func, only=None)))
        except _NoStrategy:
            if len(tensor_args) != 1:
                raise
        # One input whose candidates include some DTensor cannot take at all (an
        # unevenly sharded dim a view would unflatten): ask per candidate.
        kept: dict[Strategy, None] = {}
        for cand in self.candidates_of(tensor_args[0].name, 0):
            try:
                result = self._call_strategy(fx_node, None, func, only=cand)
            except _NoStrategy:
                continue
            kept.update(dict.fromkeys(self._keep(node, _rows(result))))
        if not kept:
            raise _NoStrategy("DTensor rejects every input placement")
        return list(kept)

    def _fused_attention(self, node: Node, fx_node: torch.fx.Node) -> list[Strategy]:
        """Strategies of ``F.scaled_dot_product_attention``, kept as one node:
        DTensor's for the fused kernel it runs (flash without a mask, the
        memory-efficient kernel with one), its attention output alone. That
        kernel has a single-dim strategy from torch 2.14 on, a strategy
        function before."""
        call = _FusedAttentionCall(fx_node)
        single, func = op_strategy_functions(call.target)
        if single is None and func is None:
            raise _NoStrategy(f"{call.target} not registered with DTensor")
        key = ("fused attention", self._signature(call, single is not None))

        def make() -> list[Strategy]:
            if single is not None:
                rows = self._expanded(call, single, key[1])
            else:
                rows = _rows(self._call_strategy(call, None, func, only=None))
            return self._keep(node, [(ins, outs[:1]) for ins, outs in rows])
        return _memoised(self._cache, key, make)

    def _expanded(self, fx_node: torch.fx.Node, single, signature: tuple) -> list[_Row]:
        """DTensor's single-dim strategy of ``fx_node`` expanded to every
        combination over the mesh axes, as placements, made on a mesh of as
        many axes of size 1 and shared by every mesh shape of that many axes.

        The expansion (``expand_to_full_mesh_op_strategy``) reads the mesh for
        its number of axes and for one filter only: each sharded input dim at
        least as long as its number of shards so far. On size-1 axes that
        filter drops the shards of empty dims, as on any mesh, and keeps the
        rest; what it would drop besides on this mesh (a non-empty dim shorter
        than its shards) is not divisible by them, which :meth:`_keep` drops.
        Kept, the strategies are the same, in the same order, as DTensor's
        answer on this mesh (``test_shared_expansions_equal_dtensors_answer_on_each_mesh``).
        ``signature``: :meth:`_signature` of ``fx_node`` for a single-dim strategy.
        """
        def expand() -> list[_Row]:
            if self._unit_mesh is None:
                self._unit_mesh = _unit_mesh(self.mesh)
            return _rows(self._call_strategy(fx_node, single, None, only=None,
                                             mesh=self._unit_mesh))
        return _memoised(self._expansions, (len(self.mesh_shape), signature), expand)

    def _call_strategy(self, fx_node: torch.fx.Node, single, func,
                       only: Placements | None, mesh: DeviceMesh | None = None) -> OpStrategy:
        """DTensor's OpStrategy for ``fx_node`` on ``mesh`` (default: this
        builder's); ``only`` restricts the (single) tensor input to one
        candidate placement."""
        op = fx_node.target
        mesh = self.mesh if mesh is None else mesh

        def to_strategy(a):
            if isinstance(a, torch.fx.Node):
                val = a.meta["val"]
                if single is not None:
                    # Single-dim strategies expand to every combination by themselves;
                    # they only need to see which placement types occur (Shard here).
                    probe = tuple(Shard(0) if (i == 0 and val.dim() > 0) else Replicate()
                                  for i in range(mesh.ndim))
                    return OpStrategy([OpSpec(_spec(mesh, probe, val))])
                cands = [only] if only is not None else self.candidates_of(a.name, 0)
                return OpStrategy([OpSpec(_spec(mesh, p, val)) for p in cands])
            if isinstance(a, (list, tuple)) and a and all(isinstance(x, torch.fx.Node) for x in a):
                return TupleStrategy(tuple(to_strategy(x) for x in a))
            return a

        args = tuple(to_strategy(a) for a in fx_node.args)
        kwargs = {k: to_strategy(v) for k, v in fx_node.kwargs.items()}
        schema = OpSchema(op, args, kwargs, schema_info=op_schema_info(op))
        try:
            if single is not None:
                expand = single_dim_expansion()(
                    mesh, schema, single, _out_meta(fx_node.meta["val"]))
                result = expand(op, schema.args_meta, schema.kwargs_meta)
            else:
                result = func(schema)
        except Exception as err:  # noqa: BLE001 - DTensor rejects this op's inputs
            first = (str(err).strip().splitlines() or [""])[0][:120]
            raise _NoStrategy(f"{type(err).__name__}: {first}") from err
        if not isinstance(result, OpStrategy):
            raise _NoStrategy(f"{type(result).__name__} results are not supported yet")
        return result

    def _keep(self, node: Node, rows: list[_Row]) -> list[Strategy]:
        seen: dict[Strategy, None] = {}
        for ins, outs in rows:
            if ins is None:
                ins = (outs[0],) * len(node.args)
            if len(ins) != len(node.args):
                continue
            tensor_outs = [o for o in outs if o is not None]
            if len(tensor_outs) != len(node.outputs):
                continue
            # Partial inputs are kept only where a contraction consumes them (the
            # bias of a row-parallel addmm) or a view carries them on (so that a
            # row-parallel [tokens, hidden] output viewed as [batch, seq, hidden]
            # can be reduce-scattered on seq: Megatron's sequence parallelism);
            # elsewhere the plan reduces first, which costs the same collective
            # and keeps the search small.
            ok = node.flops > 0 or node.bytes_moved == 0 or not any(
                isinstance(p, Partial) for pl in ins for p in pl)
            for pl, info in itertools.chain(zip(ins, node.inputs), zip(tensor_outs, node.outputs)):
                if not ok:
                    break
                if not all(_is_kept(p) for p in pl) or not divisible(
                        info.shape, pl, self.mesh_shape):
                    ok = False
                    break
            if ok:
                st = Strategy(tuple(tuple(pl) for pl in ins), tuple(tuple(o) for o in tensor_outs))
                seen.setdefault(st, None)
        return list(seen)


class _NoStrategy(Exception):
    pass


class _FusedAttentionCall:
    """An ``aten.scaled_dot_product_attention`` node as a call of the fused
    kernel DTensor has strategies for (the node's ``target``, ``args``,
    ``kwargs`` and ``meta["val"]``, the kernel's outputs, as
    :meth:`StrategyBuilder._call_strategy` reads them)."""

    def __init__(self, fx_node: torch.fx.Node):
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        given = dict(zip(names, fx_node.args))
        given.update(fx_node.kwargs)
        q, k, v = given["query"], given["key"], given["value"]
        dropout, causal = given.get("dropout_p", 0.0), given.get("is_causal", False)
        mask = given.get("attn_mask")
        aten = torch.ops.aten
        self.name = fx_node.name
        if mask is None:
            self.target = aten._scaled_dot_product_flash_attention.default
            self.args = (q, k, v, dropout, causal, False)
        else:
            self.target = aten._scaled_dot_product_efficient_attention.default
            self.args = (q, k, v, mask, False, dropout, causal)
        self.kwargs = {"scale": given["scale"]} if given.get("scale") is not None else {}

    @functools.cached_property
    def meta(self) -> dict:
        """``{"val": the fused kernel's outputs}``, run on the meta device (a
        single-dim strategy is expanded with the layout of every output)."""
        def on_meta(a):
            if isinstance(a, torch.fx.Node):
                val = a.meta["val"]
                return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype,
                                           device="meta")
            return a

        return {"val": self.target(*(on_meta(a) for a in self.args),
                                   **{k: on_meta(v) for k, v in self.kwargs.items()})}


def _memoised(cache: dict, key: tuple, make: Callable[[], list]) -> list:
    """``make()`` once per ``key`` of ``cache``; the :class:`_NoStrategy` it
    raises is kept too, and raised again for the same key."""
    found = cache.get(key)
    if found is None:
        try:
            found = make()
        except _NoStrategy as err:
            found = err
        cache[key] = found
    if isinstance(found, _NoStrategy):
        raise found
    return found


def _without_dtensor_costs() -> contextlib.AbstractContextManager[None]:
    """DTensor's strategy functions price every input redistribution with their own
    cost model while they enumerate; the planner prices with costmodel instead,
    so those costs (two thirds of the enumeration time) are skipped: zero."""
    return without_dtensor_redistribute_costs()


def _unit_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """A mesh of as many axes as ``mesh``, each of size 1 (made while the
    process group ``mesh`` lives in is up)."""
    return mesh_without_groups(torch.zeros((1,) * mesh.ndim, dtype=torch.int64))


def build_strategies(graph: Graph, mesh: DeviceMesh | Sequence[int],
                     cache: dict[tuple, list[Strategy] | Exception] | None = None,
                     expansions: dict[tuple, list[_Row] | Exception] | None = None
                     ) -> list[NodeStrategies]:
    """Strategies for every node of ``graph`` (topological order) on ``mesh``.

    ``mesh``: a DeviceMesh, or a mesh shape, whose :func:`fake_mesh` is then
    made only if a node's strategies are not in the caches (a llama3-8b
    search finds 52 of its 111 stage graphs' strategies wholly there; the
    fake mesh takes ~2 ms each time).
    ``cache``: DTensor's answers by structural signature, to share between
    graphs planned on meshes of one shape (e.g. the stages of a pipeline).
    ``expansions``: DTensor's single-dim strategies expanded to a number of
    mesh axes, to share between graphs planned on meshes of any shape."""
    if isinstance(mesh, DeviceMesh):
        return StrategyBuilder(graph, mesh, cache, expansions).build()
    shape = tuple(mesh)
    with contextlib.ExitStack() as made:
        return StrategyBuilder(graph, lambda: made.enter_context(fake_mesh(shape)), cache,
                               expansions, mesh_shape=shape).build()
