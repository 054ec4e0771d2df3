"""Context parallelism at run time: each sequence split over a cp group of
ranks, attention across the group's chunks (:mod:`planner.search.cp_search`
prices it).

A plan with ``training["context_parallel"]`` (cp, and the exchange
``comm_type``) is a plan of one cp rank's program: the model's inputs
``[batch, seq]`` cut into ``[batch x cp, seq / cp]`` rows whose batch rows mesh
axis 0 shards (its ranks are ``outer x cp``: ``a0 = o cp + c``). This module
makes that program compute the whole sequences' training step:

* :func:`cut_sequences` lays a whole batch out as those rows, with torch's
  causal load balancing: each sequence is cut into 2 cp chunks, and the row
  that lands on the rank of cp index ``c`` holds chunks ``c`` and
  ``2 cp - 1 - c``; the ranks of one cp group (the same ``o`` and the same
  place on the other mesh axes) hold the same sequences, in the same order;
* :class:`ContextParallelRuntime` gives the program's token positions (an
  ``arange`` over the rank's ``seq / cp`` tokens) the positions of the rank's
  two chunks, and runs each fused attention over the whole sequence:

  - ``p2p``: ring attention (:class:`_Ring`): K/V blocks passed around the
    cp group, one block's attention while the next one travels; the
    backward passes the K/V blocks again with their dK/dV accumulators;
  - ``all_gather``: K/V all-gathered over the cp group (:class:`_Gathered`;
    autograd's backward reduce-scatters dK/dV);

  either way attention runs block by block (:class:`_BlockedAttention`): a
  rank's queries over each rank's K/V block, causally over its own, the
  partial outputs merged by their log-sum-exp.

Each attention block runs a fused kernel of the ranks' device that returns
the log-sum-exp the merge needs (:mod:`codegen.cp_kernels`): on CPU ranks
(gloo) the CPU flash kernel ``F.scaled_dot_product_attention`` runs there; on
CUDA ranks (NCCL) FlashAttention-2 for fp16/bf16 on sm80+, else the
memory-efficient kernel. torch's own ``context_parallel`` handles only the
CUDA kernels and a module's own attention calls, so this runtime runs the
captured program's. The checks that a plan can run so
(:meth:`ContextParallelRuntime.check`) are made before any step; a block no
kernel of its device runs (dtype, head dim) is refused at its first step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from codegen.capture import PlanMismatchError
from codegen.cp_kernels import block_kernel, cut_chunks, joined_chunks
from codegen.node_runner import has_fused_attention_layout
from codegen.redistribution import laid_out, redistribute
from costmodel.compute import FUSED_ATTENTION
from ir.graph import INPUT, Graph
from ir.torch_compat import (FUSED_ATTENTION_ORDER, SDPA, all_gather_autograd,
                             from_local_with_grad_placements,
                             is_assertion_op, tree_leaves, tree_map)
from plan.cp_rules import carries_rows, kv_head_repeats, local_kv_repeats
from plan.format import Plan

__all__ = ["ContextParallelLayout", "ContextParallelRuntime", "chunk_positions",
           "cut_sequences", "emulated_attention", "layout_of"]

_ARANGES = {torch.ops.aten.arange.default, torch.ops.aten.arange.start,
            torch.ops.aten.arange.start_step}


@dataclass(frozen=True)
class ContextParallelLayout:
    """How a plan's cp groups lie on its (stage) mesh: ``size`` (cp) ranks of mesh
    axis 0 at consecutive places ``o cp .. o cp + cp - 1`` (``outer`` groups
    of them along the axis), exchanging K/V by ``comm_type``."""

    size: int
    outer: int
    comm_type: str


def layout_of(plan: Plan) -> ContextParallelLayout | None:
    """The plan's cp layout, or None for a plan without context parallelism.

    Raises:
        PlanMismatchError: mesh axis 0 does not hold whole cp groups.
    """
    record = (plan.training or {}).get("context_parallel")
    if not record or int(record.get("size", 1)) <= 1:
        return None
    cp = int(record["size"])
    stage_mesh = plan.pipeline.stage_mesh["shape"] if plan.pipeline is not None else plan.mesh_shape
    axis0 = int(stage_mesh[0])
    if axis0 % cp:
        raise PlanMismatchError(f"context parallel size {cp} does not divide mesh axis 0 "
                                f"({axis0} ranks), which holds the cp groups; re-plan")
    return ContextParallelLayout(cp, axis0 // cp, str(record.get("comm_type", "p2p")))


def cut_sequences(inputs: Sequence[Any], layout: ContextParallelLayout) -> tuple:
    """A whole batch's ``[batch, seq, ...]`` tensors as one cp rank's program
    takes them, ``[batch x cp, seq / cp, ...]``: row ``(o cp + c) b + j``
    (``b = batch / outer``) holds chunks ``c`` and ``2 cp - 1 - c`` (of
    ``seq / 2 cp`` tokens each) of sequence ``o b + j``. Sharded by rows over
    mesh axis 0 (its place ``o cp + c`` outermost), each rank of a cp group
    gets its two chunks of the same sequences. Other values pass unchanged.

    Raises:
        ValueError: a tensor's batch or sequence does not divide so.
    """
    cp, outer = layout.size, layout.outer
    out = []
    for t in inputs:
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            out.append(t)
            continue
        batch, seq = t.shape[:2]
        if batch % outer or seq % (2 * cp):
            raise ValueError(f"a batch of {batch} sequences of {seq} tokens does not split into "
                             f"{outer} groups of 2 x {cp} chunks each (context parallelism)")
        rest = t.shape[2:]
        chunks = t.reshape(outer, batch // outer, 2 * cp, seq // (2 * cp), *rest)
        pairs = [torch.cat([chunks[:, :, c], chunks[:, :, 2 * cp - 1 - c]], dim=2)
                 for c in range(cp)]  # each [outer, b, seq / cp, ...]
        out.append(torch.stack(pairs, dim=1).reshape(batch * cp, seq // cp, *rest))
    return tuple(out)


def chunk_positions(local_tokens: int, cp: int, index: int,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """The positions in its sequence of the ``local_tokens`` (``seq / cp``)
    tokens the rank of cp index ``index`` holds: chunks ``index`` and
    ``2 cp - 1 - index``, int64."""
    half = local_tokens // 2
    return torch.cat([torch.arange(index * half, (index + 1) * half, device=device),
                      torch.arange((2 * cp - 1 - index) * half, (2 * cp - index) * half,
                               device=device)])


def _is_positions(node: torch.fx.Node, local_tokens: int) -> bool:
    """Whether ``node`` is ``arange(local_tokens)``: the program's token
    positions (start 0, step 1, as many as a rank's tokens of a sequence)."""
    if node.op != "call_function" or node.target not in _ARANGES:
        return False
    args = [a for a in node.args if not isinstance(a, torch.fx.Node)]
    if node.target is torch.ops.aten.arange.default:
        start, end, step = 0, args[0] if args else None, 1
    else:
        start, end = args[0], args[1]
        step = args[2] if len(args) > 2 else node.kwargs.get("step", 1)
    return start == 0 and step == 1 and end == local_tokens


class ContextParallelRuntime:
    """The cp group of this rank, and what its program runs differently.

    Args:
        plan: the plan, read on the mesh.
        mesh: its DeviceMesh (every rank builds this in the same order: the cp
            groups are made here).
        program: the captured program's graph.
        graph: its :class:`ir.graph.Graph`.
        layout: :func:`layout_of` the plan.
        local_tokens: tokens of a sequence per rank (``seq / cp``).
    """

    def __init__(self, plan: Plan, mesh: DeviceMesh, program: torch.fx.Graph, graph: Graph,
                 layout: ContextParallelLayout, local_tokens: int):
        if mesh.device_type not in ("cpu", "cuda"):
            raise PlanMismatchError(
                f"context parallelism runs on CPU and CUDA ranks (fused attention kernels that "
                f"return the log-sum-exp), not on {mesh.device_type}; plan without it")
        self.layout = layout
        self.local_tokens = local_tokens
        #: the program's fused attention ops (names), each run across the cp group
        self.attention_ops = {n.name for n in program.nodes
                              if n.op == "call_function" and n.target is SDPA}
        for n in program.nodes:
            if n.name in self.attention_ops:
                self._check_attention(plan, n)
        aranges = {n.name for n in program.nodes if _is_positions(n, local_tokens)}
        carried = self._check_rows(plan, graph)
        #: per attention op, how often each K/V head repeats in its k and v
        #: (grouped-query attention): the ranks exchange each K/V head once
        self.kv_repeats = {n.name: (kv_head_repeats(graph, n, 1), kv_head_repeats(graph, n, 2))
                           for n in graph.nodes if n.target == FUSED_ATTENTION}
        #: the program's token positions (aranges), and the ops computing from
        #: them and not from the rows (the positions among them)
        self.position_aranges, self.position_values = self._check_positions(
            plan, program, aranges, carried)
        self.group_ranks, self.index, self.group = _cp_group(mesh, layout)
        self.positions = chunk_positions(local_tokens, layout.size, self.index,
                                         mesh.device_type)

    @staticmethod
    def _check_rows(plan: Plan, graph: Graph) -> set[str]:
        """Refuse (:class:`PlanMismatchError`) token rows not split over mesh
        axis 0 (:func:`planner.search.cp_search.pinned_strategies` says why);
        the names of the values of ``graph`` computed from the rows
        (:func:`plan.cp_rules.carries_rows`)."""
        users = [n for n in graph.nodes if n.kind == INPUT]
        user_names = {n.name for n in users}
        inputs = dict(plan.inputs)  # a pipeline's first stage places them
        for st in (plan.pipeline.stages if plan.pipeline is not None else ()):
            inputs.update({k: v for k, v in st.inputs.items() if k in user_names})
        rows = users[0].output.shape[0]
        carried: set[str] = set()
        for n in graph.nodes:
            entry = plan.nodes.get(n.name)
            if n.name in inputs:
                placements = [inputs[n.name]]
            else:
                placements = list(entry.outputs[:1]) if entry is not None else []
            if carries_rows(n, rows, carried) and any(p[0] != "S(0)" for p in placements):
                raise PlanMismatchError(
                    f"the plan holds the token rows of {n.name} as {placements[0]} on mesh axis "
                    f"0; context parallelism needs them S(0) there; re-plan")
        return carried

    @staticmethod
    def _check_positions(plan: Plan, program: torch.fx.Graph, aranges: set[str],
                         carried: set[str]) -> tuple[set[str], set[str]]:
        """Refuse (:class:`PlanMismatchError`) values of the token positions
        split or gathered over mesh axis 0 (each rank holds its own positions
        under one name). ``aranges``: the program's ops that may be its
        positions (:func:`_is_positions`); ``carried``: the values computed
        from the rows. Returns the names of the positions (those aranges not
        computed from the rows) and of the ops computing from them and not
        from the rows."""
        positions_at: set[str] = set()
        values: set[str] = set()
        for n in program.nodes:
            if n.op != "call_function":
                continue
            if n.name in carried or is_assertion_op(n.target):  # checks move no data
                continue
            reads = {a.name for a in n.all_input_nodes}
            if n.name in aranges:
                positions_at.add(n.name)
            if n.name in positions_at or reads & values:
                values.add(n.name)
            entry = plan.nodes.get(n.name)
            if entry is None:
                continue
            placed = [p for a, p in zip(n.all_input_nodes, entry.inputs) if a.name in values]
            if n.name in values:
                placed += list(entry.outputs)
            if any(p and p[0] != "R" for p in placed):
                raise PlanMismatchError(
                    f"the plan splits values of the token positions over mesh axis 0 (at "
                    f"{n.name}), whose ranks each hold other positions under context "
                    f"parallelism; re-plan")
        return positions_at, values

    @staticmethod
    def _check_attention(plan: Plan, node: torch.fx.Node) -> None:
        args = list(node.args) + [None] * (6 - len(node.args))
        mask = node.kwargs.get("attn_mask", args[3])
        dropout = node.kwargs.get("dropout_p", args[4] or 0.0)
        causal = node.kwargs.get("is_causal", args[5])
        if mask is not None or dropout or not causal or node.kwargs.get("enable_gqa"):
            raise PlanMismatchError(
                f"attention {node.name} is not causal fused attention without a mask or "
                f"dropout, which is all context parallelism runs; plan without it")
        entry = plan.nodes.get(node.name)
        if entry is None or any(not p or p[0] != "S(0)" for p in entry.inputs[:3]):
            raise PlanMismatchError(f"attention {node.name}'s q, k and v must be S(0) on mesh "
                                    f"axis 0 under context parallelism; re-plan")

    def positions_region(self, calls: Sequence[torch.fx.Node]) -> list[torch.fx.Node]:
        """The ops of ``calls`` (in their order) that compute the token
        positions' values, and the ops those read that no row reaches
        (constants, parameters' values): a compiled program runs them first,
        eager, as one region (:class:`codegen.program_code.EagerRegion`)."""
        named = {n.name: n for n in calls}
        wanted = [named[name] for name in self.position_aranges | self.position_values
                  if name in named]
        region: set[torch.fx.Node] = set()
        while wanted:
            n = wanted.pop()
            if n not in region:
                region.add(n)
                wanted.extend(a for a in n.all_input_nodes if a.name in named)
        return [n for n in calls if n in region]

    # ------------------------------------------------------------ at run time
    def constant(self, node: torch.fx.Node, value: Any) -> Any:
        """``value`` of constant op ``node``; the token positions this rank
        holds where ``node`` is the program's positions."""
        if node.name in self.position_aranges:
            return self.positions.to(device=value.device, dtype=value.dtype)
        return value

    def run_positions(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
        """Op ``node`` of the token positions' values (a position embedding's
        lookup, say) on this rank's own positions: run on whole local tensors,
        its outputs replicated DTensors that differ along mesh axis 0. The
        gradient reaching them is each rank's own (a partial sum over mesh
        axis 0) and is taken back to the parameters as such, to be summed
        with the other ranks' there, not before: summed before, the ranks'
        gradients would meet at other ranks' positions."""
        mesh = next(v for v in tree_leaves((args, kwargs)) if isinstance(v, DTensor)).device_mesh
        whole = (Replicate(),) * mesh.ndim
        own = (Partial(),) + (Replicate(),) * (mesh.ndim - 1)

        def local(v: Any) -> Any:
            if not isinstance(v, DTensor):
                return v
            return redistribute(v, mesh, whole).to_local(grad_placements=own)

        local_args, local_kwargs = tree_map(local, (args, kwargs))
        out = node.target(*local_args, **local_kwargs)
        return tree_map(lambda t: from_local_with_grad_placements(
            t, mesh, whole, shape=t.shape, stride=t.stride(), grad_placements=own)
            if isinstance(t, torch.Tensor) else t, out)

    def attention(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
        """Causal attention of this rank's queries over the whole sequences of
        its cp group (``args``/``kwargs`` of fused attention op ``node``, q, k,
        v DTensors split over mesh axis 0); a DTensor placed as q, laid out in
        memory as the capture gave ``node``'s output."""
        q, k, v = args[:3]
        scale = kwargs.get("scale")
        ql = q.to_local()
        # each K/V head once: its copies' gradients meet at the repeat upstream
        kl, vl = (_one_per_head(t, local_kv_repeats(n_rep, t.shape[1]))
                  for t, n_rep in zip((k.to_local(), v.to_local()),
                                      self.kv_repeats.get(node.name, (1, 1))))
        if self.layout.comm_type == "p2p":
            exchange: _Ring | _Gathered = _Ring(self)
        else:  # autograd's backward of the gather reduce-scatters dK/dV
            exchange = _Gathered(self.index, self.layout.size)
            kl, vl = (all_gather_autograd(t.contiguous(), 0, self.group) for t in (kl, vl))
        out = _BlockedAttention.apply(ql, kl, vl, exchange, scale)
        shape = (*q.shape[:-1], v.shape[-1])
        order = FUSED_ATTENTION_ORDER if has_fused_attention_layout(node) else range(4)
        return laid_out(out, q.device_mesh, q.placements, shape, tuple(order))


def _cp_group(mesh: DeviceMesh, layout: ContextParallelLayout) -> tuple[list[int], int, Any]:
    """This rank's cp group on (stage) ``mesh``: its global ranks, this rank's
    cp index in it, and its process group. Every rank of the job makes every
    group, in one order (a process group is made by all ranks): the job's
    ranks laid out as ``(pipeline ranks, *mesh.shape)``, row-major, as
    ``init_device_mesh`` lays out a plan's world mesh; per stage mesh, axis 0
    is ``(outer, cp)``.

    Raises:
        PlanMismatchError: ``mesh`` is not one of those stage meshes.
    """
    cp = layout.size
    world = torch.arange(dist.get_world_size()).reshape(-1, *mesh.shape)
    if not any(torch.equal(stage, mesh.mesh.cpu()) for stage in world):
        raise PlanMismatchError(f"the ranks of mesh {mesh.mesh.tolist()} are not one stage mesh "
                                f"of a world laid out as {list(world.shape)}; relaunch the plan")
    groups = [stage.reshape(layout.outer, cp, -1)[o, :, i].tolist()
              for stage in world for o in range(layout.outer)
              for i in range(stage.numel() // (layout.outer * cp))]
    me = dist.get_rank()
    mine = next(g for g in groups if me in g)
    group, _ = dist.new_subgroups_by_enumeration(groups)
    return mine, mine.index(me), group


class _Ring:
    """Passing blocks to the next rank of a cp group while taking the
    previous rank's (point-to-point, asynchronous)."""

    def __init__(self, runtime: ContextParallelRuntime):
        ranks, i = runtime.group_ranks, runtime.index
        self.size, self.index, self.group = len(ranks), i, runtime.group
        self.next, self.prev = ranks[(i + 1) % len(ranks)], ranks[(i - 1) % len(ranks)]

    def pass_on(self, tensors: Sequence[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
        """Start sending ``tensors`` on and receiving the previous rank's
        blocks of the same shapes; returns a wait that gives them."""
        sent = [t.contiguous() for t in tensors]
        got = [torch.empty_like(t) for t in sent]
        ops = ([dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
               + [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in got])
        requests = dist.batch_isend_irecv(ops)

        def wait() -> list[torch.Tensor]:
            for r in requests:
                r.wait()
            return got
        return wait

    def forward_blocks(self, k: torch.Tensor, v: torch.Tensor
                       ) -> Iterator[tuple[int, list[torch.Tensor]]]:
        """Each cp rank's K/V block with that rank's cp index: this rank's own
        first, then each one arriving from the previous rank, sent on while
        the one before it is in use."""
        kv = [k, v]
        for step in range(self.size):
            arriving = self.pass_on(kv) if step < self.size - 1 else None
            yield (self.index - step) % self.size, kv
            if arriving is not None:
                kv = arriving()

    def backward_blocks(self, k: torch.Tensor, v: torch.Tensor, grads: list[torch.Tensor]
                        ) -> Iterator[tuple[int, list[torch.Tensor], list[torch.Tensor]]]:
        """:meth:`forward_blocks` again, each block with float32 dK/dV
        accumulators to add into; they travel with their block and, one hop
        after the last, reach its own rank: then ``grads`` holds this rank's."""
        kv = [k, v]
        dkv = [torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
        for step in range(self.size):
            arriving = self.pass_on(kv) if step < self.size - 1 else None
            yield (self.index - step) % self.size, kv, dkv
            dkv = self.pass_on(dkv)()
            if arriving is not None:
                kv = arriving()
        grads[:] = dkv


class _Gathered:
    """The K/V blocks of a cp group all-gathered along the rows (cp index
    ``index`` of ``size``): each block indexed where it lies."""

    def __init__(self, index: int, size: int):
        self.index, self.size = index, size

    def forward_blocks(self, k: torch.Tensor, v: torch.Tensor
                       ) -> Iterator[tuple[int, list[torch.Tensor]]]:
        """Each cp rank's K/V block (of gathered ``k``, ``v``) with its cp index."""
        blocks = list(zip(k.chunk(self.size, dim=0), v.chunk(self.size, dim=0)))
        for step in range(self.size):
            source = (self.index - step) % self.size
            yield source, list(blocks[source])

    def backward_blocks(self, k: torch.Tensor, v: torch.Tensor, grads: list[torch.Tensor]
                        ) -> Iterator[tuple[int, list[torch.Tensor], list[torch.Tensor]]]:
        """:meth:`forward_blocks` with each block's part of the float32 dK/dV
        of the gathered K/V, which ``grads`` holds."""
        grads[:] = [torch.zeros_like(k, dtype=torch.float32),
                    torch.zeros_like(v, dtype=torch.float32)]
        parts = list(zip(grads[0].chunk(self.size, dim=0), grads[1].chunk(self.size, dim=0)))
        for source, kv in self.forward_blocks(k, v):
            yield source, kv, list(parts[source])


def _block(index: int, source: int, half: int) -> tuple[slice, slice, bool]:
    """Which of this rank's query rows attend to which keys of the K/V block
    of cp rank ``source`` (each rank: chunks i and 2 cp - 1 - i, ``half``
    tokens each), and whether causally: its own block causally; an earlier
    rank's first chunk by all queries (its second chunk lies after both of
    this rank's); a later rank's whole block by this rank's second chunk."""
    every = slice(None)
    if source == index:
        return every, every, True
    if source < index:
        return every, slice(0, half), False
    return slice(half, None), every, False


def _one_per_head(t: torch.Tensor, copies: int) -> torch.Tensor:
    """``[rows, heads, tokens, dim]`` block ``t`` whose runs of ``copies``
    heads repeat one K/V head, each K/V head once (the run's first; autograd
    gives the others no gradient, as the repeat upstream sums the run's)."""
    return t if copies == 1 else t.unflatten(1, (-1, copies))[:, :, 0]


def _repeated(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Block ``t`` of :func:`_one_per_head` with each head repeated side by
    side up to ``heads`` heads, as attention reads it."""
    copies = heads // t.shape[1]
    if copies == 1:
        return t
    rows, kv, tokens, dim = t.shape
    return t[:, :, None].expand(rows, kv, copies, tokens, dim).reshape(rows, heads, tokens, dim)


def _per_kv_head(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of a :func:`_repeated` block: each run of copies summed."""
    return grad if grad.shape[1] == kv_heads else grad.unflatten(1, (kv_heads, -1)).sum(2)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Fold one block's attention (``block_out``, its log-sum-exp) into the
    running ``out`` and ``lse`` (float32, in place)."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1))
    out.add_(block_out.float() * torch.exp(block_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


class _BlockedAttention(torch.autograd.Function):
    """Causal attention over a cp group's load-balanced chunks, block by
    block, each block's K/V from ``exchange`` (:class:`_Ring` or
    :class:`_Gathered`); local tensors ``[rows, heads, seq / cp, dim]`` (k and
    v: as ``exchange`` takes them, each of grouped-query attention's K/V
    heads once, :func:`_one_per_head`). Each block runs the device's fused
    kernel (:func:`codegen.cp_kernels.block_kernel`) and the partial outputs
    are merged by their log-sum-exp."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                exchange: _Ring | _Gathered, scale: float | None) -> torch.Tensor:
        try:
            kernel = block_kernel(q, v)
        except ValueError as e:
            raise PlanMismatchError(str(e)) from None
        saved = {}  # per source block, what its kernel's backward needs of the call
        half, heads = q.shape[2] // 2, q.shape[1]
        # laid out [rows, tokens, heads, dim], as fused kernels write it (the
        # layout the capture gives attention's output): no copy to relay it
        out = torch.zeros((q.shape[0], q.shape[2], q.shape[1], v.shape[-1]),
                          dtype=torch.float32, device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for source, kv in exchange.forward_blocks(k, v):
            rows, keys, causal = _block(exchange.index, source, half)
            block_out, block_lse, saved[source] = kernel.forward(
                q[:, :, rows], _repeated(kv[0][:, :, keys], heads),
                _repeated(kv[1][:, :, keys], heads), causal, scale)
            _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.exchange, ctx.scale, ctx.kernel, ctx.saved = exchange, scale, kernel, saved
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        exchange, half, heads = ctx.exchange, q.shape[2] // 2, q.shape[1]
        grad_out = grad_out.to(q.dtype)
        dq = torch.zeros_like(q, dtype=torch.float32)
        grads: list[torch.Tensor] = []
        for source, kv, dkv in exchange.backward_blocks(k, v, grads):
            rows, keys, causal = _block(exchange.index, source, half)
            gq, gk, gv = ctx.kernel.backward(grad_out[:, :, rows], q[:, :, rows],
                                             _repeated(kv[0][:, :, keys], heads),
                                             _repeated(kv[1][:, :, keys], heads),
                                             out[:, :, rows], lse[:, :, rows], causal,
                                             ctx.scale, ctx.saved[source])
            dq[:, :, rows] += gq
            dkv[0][:, :, keys] += _per_kv_head(gk, k.shape[1])
            dkv[1][:, :, keys] += _per_kv_head(gv, v.shape[1])
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None


def emulated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int,
                       scale: float | None = None) -> torch.Tensor:
    """Causal attention of whole sequences ``q``, ``k``, ``v`` (``[rows, heads,
    seq, dim]``; k and v may have fewer heads, each repeated side by side as
    grouped-query attention reads them) as a cp group of ``cp`` ranks computes
    it, in one process: each rank's chunks (:func:`cut_chunks`) through
    :class:`_BlockedAttention` over the group's K/V
    blocks as the all-gather gives them. Differentiable: autograd sums each
    K/V block's gradient over the ranks, as the gather's reduce-scatter."""
    qs = cut_chunks(q, cp)
    k_all, v_all = (torch.cat(cut_chunks(t, cp), dim=0) for t in (k, v))
    outs = [_BlockedAttention.apply(qs[c], k_all, v_all, _Gathered(c, cp), scale)
            for c in range(cp)]
    return joined_chunks(outs)
