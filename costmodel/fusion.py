"""What a compiled program's kernels move: inductor's fusion of memory-bound chains.

Under ``torch.compile`` (inductor) the ops of a captured program that do no
FLOPs of their own (elementwise ops, normalisations, reductions, the views
between them) stop running one kernel each: inductor fuses every connected
chain of them into a few kernels that read the chain's inputs once and write
only the values that leave it. Contractions (GEMMs, the fused attention
kernel) and ops inductor runs as library fallbacks stay one kernel each.

:func:`fused_chains` finds those chains in a :class:`ir.graph.Graph` and prices
each as a roofline pass over its own bytes: a chain's external inputs (each read
once) and its escaping outputs (each written once), in one kernel per op
that writes an escaping value. :func:`fused_shares` gives each op its part
of that, read off its own neighbourhood, so that a node's price still
scales with its own strategy's shard factor and the copies of a repeated
block price alike. A fused kernel also applies each op to each element it
makes; on a CPU rank that work (exp, sin, divides on one thread's vector
units), not the bytes, bounds it (:func:`fused_seconds`).

Units: bytes, elements; kernels counted per training pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from costmodel.cluster import DeviceSpec
from ir.graph import OP, Graph, Node

__all__ = ["FusedChain", "UNFUSED_TARGETS", "fused_chains", "fused_seconds", "fused_shares",
           "fusible"]

#: Memory-bound ATen ops inductor runs as library fallbacks (sorting, data-
#: dependent shapes, sampling): each stays one kernel of its own.
UNFUSED_TARGETS = frozenset({
    "aten.sort.default", "aten.sort.stable", "aten.topk.default", "aten.argsort.default",
    "aten.nonzero.default", "aten.unique.default", "aten._unique2.default",
    "aten.masked_select.default", "aten.multinomial.default", "aten.histc.default",
    "aten.bincount.default", "aten._local_scalar_dense.default", "aten.item.default",
})


@dataclass(frozen=True)
class FusedChain:
    """One connected chain of memory-bound ops as inductor runs it.

    Attributes:
        members: the ops of the chain, in graph order (views included).
        bytes_moved: bytes its kernels read and write in the forward: each
            external input once and each value leaving the chain once.
        eager_bytes: what the same ops move when each runs alone, bytes.
        kernels: kernels the chain runs as in the forward pass.
        elements: elements its ops make in the forward (each op's outputs').
    """

    members: tuple[str, ...]
    bytes_moved: float
    eager_bytes: float
    kernels: int
    elements: float = 0.0


def fusible(node: Node) -> bool:
    """Whether inductor fuses ``node`` with its memory-bound neighbours: an op
    with no FLOPs of its own (a contraction or the fused attention kernel has
    them) that is no library fallback (:data:`UNFUSED_TARGETS`). Views and
    tuple projections count, as they only relay a fused chain's values."""
    return node.kind == OP and node.flops == 0 and node.target not in UNFUSED_TARGETS


def fused_chains(graph: Graph) -> list[FusedChain]:
    """The fused chains of ``graph``'s forward, in graph order of their first
    op, with their totals of :func:`fused_shares`.

    Two fusible ops are in one chain when one reads the other's output and
    no kernel that is not fused lies between them (:func:`_epochs`): a
    residual add after a projection cannot share a kernel with the
    normalisation that fed the projection. Chains of views alone (no bytes)
    are left out: they run no kernel."""
    shares = fused_shares(graph)
    by_name = graph.by_name
    chains = []
    for members in _chain_members(graph):
        eager = sum(by_name[m].bytes_moved for m in members)
        if eager > 0:
            own = [shares[m] for m in members if m in shares]
            chains.append(FusedChain(tuple(members), sum(b for b, _, _ in own), float(eager),
                                     int(sum(k for _, k, _ in own)), sum(e for _, _, e in own)))
    return chains


def fused_shares(graph: Graph, eager: frozenset[str] = frozenset()
                 ) -> dict[str, tuple[float, float, float]]:
    """Op name -> its part of its fused chain: ``(bytes, kernels, elements)``. An op's
    bytes are those it alone accounts for: each value it reads from outside
    the chain (through the chain's views of it too), split evenly among the
    chain's readers of it, and the values it computes that leave the chain
    (through the views of them too); its kernels, one if it writes such a
    value (a kernel ends where a value is written); its elements, those of
    its outputs, each made by applying the op once. The parts depend on each
    op's own neighbourhood only, so that the copies of a repeated block price
    alike. Ops in no chain (contractions, library fallbacks, views) are absent,
    and so are the ``eager`` ops, which run outside any compiled region (each
    its own kernel, between the chains it cuts)."""
    by_name, users, outputs = graph.by_name, graph.users(), set(graph.output_names)
    shares: dict[str, tuple[float, float, float]] = {}
    for chain in _chain_members(graph, eager):
        members = set(chain)
        computing = [by_name[m] for m in chain if not by_name[m].is_view]
        reads = {n.name: _outside_reads(n, members, by_name) for n in computing}
        readers: dict[str, int] = {}
        for read in reads.values():
            for source in read:
                readers[source] = readers.get(source, 0) + 1
        writers: dict[str, float] = {}
        for name in chain:
            if name in outputs or any(u not in members for u in users.get(name, ())):
                writer = _computing_member(by_name[name], members, by_name)
                if writer is not None:
                    writers[writer.name] = float(sum(o.nbytes for o in writer.outputs))
        for n in computing:
            nbytes = sum(b / readers[a] for a, b in reads[n.name].items())
            shares[n.name] = (nbytes + writers.get(n.name, 0.0),
                              1.0 if n.name in writers else 0.0,
                              float(sum(o.numel for o in n.outputs)))
    return shares


def _chain_members(graph: Graph, eager: frozenset[str] = frozenset()) -> list[list[str]]:
    """The ops of each chain, in graph order (see :func:`fused_chains`), none
    of the ``eager`` ops among them."""
    by_name = graph.by_name
    parent = {n.name: n.name for n in graph.nodes if fusible(n) and n.name not in eager}

    def root(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    epoch = _epochs(graph, frozenset(parent))
    for name in parent:
        for arg in by_name[name].args:
            if arg in parent and epoch[arg] == epoch[name]:
                parent[root(name)] = root(arg)
    groups: dict[str, list[str]] = {}
    for n in graph.nodes:
        if n.name in parent:
            groups.setdefault(root(n.name), []).append(n.name)
    return list(groups.values())


def _epochs(graph: Graph, fused: frozenset[str]) -> dict[str, int]:
    """Node name -> how many unfused kernels lie on the longest path to it
    from the program's inputs (an op not among the ``fused`` counts itself).
    Ops of one chain share a count: a path from one to the other through an
    unfused kernel would make it differ."""
    epoch: dict[str, int] = {}
    for n in graph.nodes:
        before = max((epoch[a] for a in n.args), default=0)
        epoch[n.name] = before + (1 if n.kind == OP and n.name not in fused else 0)
    return epoch


def _outside_reads(node: Node, members: set[str], by_name: dict[str, Node]) -> dict[str, float]:
    """Value name -> bytes ``node`` reads of it from outside its chain,
    following the chain's views of such values back to them."""
    read: dict[str, float] = {}
    for arg, info in zip(node.args, node.inputs):
        while arg in members and by_name[arg].is_view:
            view = by_name[arg]
            # a tuple projection (getitem) has no tensor input: it reads the
            # part of its producer's outputs it projects
            arg, info = view.args[0], (view.inputs or view.outputs)[0]
        if arg not in members:
            read[arg] = max(read.get(arg, 0.0), float(info.nbytes))
    return read


def _computing_member(node: Node, members: set[str], by_name: dict[str, Node]) -> Node | None:
    """The member whose kernel writes ``node``'s value: ``node`` itself, or
    for a view the first non-view member up its chain of views (None: it
    views a value from outside the chain)."""
    while node.is_view:
        inside = [a for a in node.args if a in members]
        if not inside:
            return None
        node = by_name[inside[0]]
    return node


def fused_seconds(share: tuple[float, float, float], shard_factor: int,
                  device: DeviceSpec) -> float:
    """Seconds of one pass over an op's share of a fused chain
    (:func:`fused_shares`), split over ``shard_factor`` devices: its bytes at
    the device's streaming bandwidth or, where the device's
    ``fused_element_rate`` is measured and slower, its elements at that rate;
    plus its share of the chain's launches."""
    nbytes, kernels, elements = share
    busy = nbytes / device.streaming_bandwidth
    if device.fused_element_rate > 0:
        busy = max(busy, elements / device.fused_element_rate)
    return busy / shard_factor + kernels * device.kernel_overhead
