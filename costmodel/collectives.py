"""Collective communication time: alpha-beta model per logical mesh axis.

Units: seconds, bytes, bytes/s.

A logical mesh is laid over the cluster's devices in row-major order
(device id = node * devices_per_node + local; the last mesh axis varies
fastest). :func:`axis_links` says which physical :class:`Link` the groups of
each mesh axis use; :func:`collective_time` prices one collective on one group
with the alpha-beta model (alpha = ``link.latency`` per step,
beta = 1 / ``link.bandwidth``).

Formulas (n = group size, B = bytes, bw = bytes/s, a = seconds):

============== ===================================================== =================
kind           time                                                  B is
============== ===================================================== =================
all_reduce     min(ring 2(n-1)/n B/bw + 2(n-1) a,                    the tensor
               tree 2 ceil(log2 n) (a + B/bw))
all_gather     (n-1)/n B/bw + (n-1) a                                the gathered tensor
reduce_scatter (n-1)/n B/bw + (n-1) a                                the unsharded input
all_to_all     (n-1)/n B/bw + (n-1) a; over nodes of g devices:      bytes per device
               max((g-1)/n B/bw_node + (g-1) a_node,
                   (n-g)/n B/bw_net + (n-g) a_net)
broadcast      min(pipelined ring B/bw + (n-1) a,                    the tensor
               binomial tree ceil(log2 n) (a + B/bw))
p2p            B/bw + a                                              the message
============== ===================================================== =================

``group_size == 1`` or ``nbytes == 0`` costs nothing (no collective is issued).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from .cluster import Cluster, Link, check_mesh_shape

__all__ = ["COLLECTIVES", "axis_links", "collective_time"]

#: Collective kinds :func:`collective_time` knows.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")


def axis_links(cluster: Cluster, mesh_shape: Sequence[int]) -> list[Link]:
    """The physical link each axis of a logical mesh over ``cluster`` uses.

    An axis whose every group stays inside one node gets ``cluster.intra_node``;
    an axis whose groups span nodes gets ``cluster.inter_node`` (the network
    is the bottleneck). Size-1 axes get ``intra_node`` (they never communicate).

    When a spanning group also holds several devices of the same node (e.g.
    mesh ``(16,)`` on two 8-GPU nodes), the returned link carries ``local =
    (intra_node, devices per node)`` and :func:`collective_time` takes the
    cheaper of the flat collective over the network and the hierarchical one
    (reduce-scatter in the node, all-reduce across nodes on 1/g of the bytes,
    all-gather in the node). On DGX systems (a NIC per GPU) the two are close; on
    p3.16xlarge (one 25 Gb/s NIC per node) the hierarchical one is ~8x cheaper.

    Raises:
        ClusterError: ``prod(mesh_shape) != cluster.num_devices`` or a bad shape.
            (For a pipeline stage's sub-mesh, use ``cluster.sub_cluster``.)
    """
    shape = check_mesh_shape(mesh_shape, cluster)
    links: list[Link] = []
    dpn = cluster.devices_per_node
    for k, size in enumerate(shape):
        stride = math.prod(shape[k + 1:])
        # Device ids in a group are base + j*stride, j < size; node ids are
        # monotonic in device id, so a group is inside one node iff its first
        # and last device are.
        span = (size - 1) * stride
        inside = all(
            d // dpn == (d + span) // dpn
            for d in range(cluster.num_devices)
            if (d // stride) % size == 0
        )
        if inside:
            links.append(cluster.intra_node)
            continue
        # devices of one group that share a node (contiguous ids on a node)
        per_node = max(1, min(size, dpn // stride)) if stride < dpn else 1
        links.append(dataclasses.replace(cluster.inter_node, local=(cluster.intra_node, per_node))
                     if per_node > 1 else cluster.inter_node)
    return links


def collective_time(kind: str, nbytes: float, group_size: int, link: Link) -> float:
    """Seconds for one collective of ``kind`` over ``group_size`` devices on ``link``.

    Args:
        kind: one of :data:`COLLECTIVES`.
        nbytes: bytes, as the table in the module docstring defines per kind
            (full tensor for all_gather/reduce_scatter, per-device for all_to_all).
        group_size: devices in the group (>= 1).
        link: the link the group communicates over.

    Raises:
        ValueError: unknown kind, negative bytes, or group_size < 1.
    """
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective kind {kind!r}; known: {', '.join(COLLECTIVES)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    if not nbytes >= 0:  # also rejects NaN
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    n = group_size
    if n == 1 or nbytes == 0:
        return 0.0
    flat = _flat_time(kind, nbytes, n, link)
    if link.local is None or kind == "p2p" or n % link.local[1]:
        return flat
    if kind == "all_to_all":
        return _two_link_all_to_all_time(nbytes, n, link)
    return min(flat, _hierarchical_time(kind, nbytes, n, link))


def _two_link_all_to_all_time(nbytes: float, n: int, link: Link) -> float:
    """All-to-all of ``nbytes`` per device over ``n`` devices, g of them in each
    node: a device's shares for the g - 1 peers of its node go over the in-node
    link and those for the n - g others over its network share, both at once
    (expert parallelism's token dispatch across nodes)."""
    local, g = link.local
    inner = dataclasses.replace(link, local=None)
    a_local, bw_local = local.alpha_beta("all_to_all")
    a_net, bw_net = inner.alpha_beta("all_to_all")
    in_node = (g - 1) / n * nbytes / bw_local + (g - 1) * a_local
    across = (n - g) / n * nbytes / bw_net + (n - g) * a_net
    return max(in_node, across)


def _hierarchical_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Two-level collective: g devices per node over the in-node link, n/g nodes
    over ``link`` (each device sending its share over its own network share)."""
    local, g = link.local
    k = n // g
    inner = dataclasses.replace(link, local=None)
    if kind == "all_reduce":
        return (_flat_time("reduce_scatter", nbytes, g, local)
                + _flat_time("all_reduce", nbytes / g, k, inner)
                + _flat_time("all_gather", nbytes, g, local))
    if kind == "all_gather":
        return _flat_time("all_gather", nbytes / g, k, inner) + _flat_time("all_gather", nbytes, g, local)
    if kind == "reduce_scatter":
        return (_flat_time("reduce_scatter", nbytes, g, local)
                + _flat_time("reduce_scatter", nbytes / g, k, inner))
    return _flat_time("broadcast", nbytes, k, inner) + _flat_time("broadcast", nbytes, g, local)


def _flat_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """One-level alpha-beta time of the module docstring's table."""
    if n == 1 or nbytes == 0:
        return 0.0
    a, bandwidth = link.alpha_beta(kind)
    t = nbytes / bandwidth
    steps = math.ceil(math.log2(n))
    if kind == "all_reduce":
        ring = 2 * (n - 1) / n * t + 2 * (n - 1) * a
        tree = 2 * steps * (a + t)
        return min(ring, tree)
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * t + (n - 1) * a
    if kind == "broadcast":
        return min(t + (n - 1) * a, steps * (a + t))
    return t + a  # p2p
