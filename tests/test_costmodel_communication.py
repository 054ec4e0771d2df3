"""Cost model tests of communication: collectives, mesh axes' links and resharding,
against closed forms and DTensor itself."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

import costmodel
from costmodel import (
    Cluster,
    ClusterError,
    Link,
    axis_links,
    collective_time,
    load_cluster,
    reshard_steps,
    reshard_time,
)
from ir.placements import parse_placement, placement_str

LINK = Link("test", bandwidth=100e9, latency=5e-6)


# --- collectives: closed forms ---------------------------------------------

def test_ring_all_reduce_closed_form():
    n, B = 8, 1e9
    expected = 2 * (n - 1) / n * B / LINK.bandwidth + 2 * (n - 1) * LINK.latency
    assert collective_time("all_reduce", B, n, LINK) == pytest.approx(expected, rel=1e-12)


def test_tree_all_reduce_wins_for_small_messages():
    n, B = 64, 8.0
    ring = 2 * (n - 1) / n * B / LINK.bandwidth + 2 * (n - 1) * LINK.latency
    tree = 2 * math.log2(n) * (LINK.latency + B / LINK.bandwidth)
    assert tree < ring
    assert collective_time("all_reduce", B, n, LINK) == pytest.approx(tree, rel=1e-12)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_to_all"])
def test_gather_scatter_alltoall_closed_form(kind):
    n, B = 4, 3e8
    expected = (n - 1) / n * B / LINK.bandwidth + (n - 1) * LINK.latency
    assert collective_time(kind, B, n, LINK) == pytest.approx(expected, rel=1e-12)


def test_broadcast_and_p2p():
    B = 1e9
    # large message: pipelined ring B/bw + (n-1)a beats the tree's log2(n) B/bw
    assert collective_time("broadcast", B, 8, LINK) == pytest.approx(B / LINK.bandwidth + 7 * LINK.latency)
    # tiny message on a big group: binomial tree's log2(n) steps win
    assert collective_time("broadcast", 4.0, 64, LINK) == pytest.approx(6 * (LINK.latency + 4.0 / LINK.bandwidth))
    assert collective_time("p2p", B, 2, LINK) == pytest.approx(B / LINK.bandwidth + LINK.latency)


def test_collective_edge_cases():
    for kind in costmodel.COLLECTIVES:
        assert collective_time(kind, 1e9, 1, LINK) == 0.0
        assert collective_time(kind, 0, 8, LINK) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time("allreduce", 1.0, 2, LINK)
    with pytest.raises(ValueError):
        collective_time("all_reduce", -1.0, 2, LINK)
    with pytest.raises(ValueError):
        collective_time("all_reduce", 1.0, 0, LINK)


def test_collective_time_grows_with_bytes_and_group():
    for kind in costmodel.COLLECTIVES:
        assert collective_time(kind, 2e9, 8, LINK) > collective_time(kind, 1e9, 8, LINK)


# --- mesh axis -> physical link ----------------------------------------------

def test_axis_links_dgx_two_nodes():
    cl = load_cluster("dgx-a100-80g:2")
    assert cl.num_devices == 16
    assert axis_links(cl, (2, 8)) == [cl.inter_node, cl.intra_node]
    # groups spanning nodes with several devices per node may go hierarchically
    hier = lambda g: dataclasses.replace(cl.inter_node, local=(cl.intra_node, g))  # noqa: E731
    assert axis_links(cl, (16,)) == [hier(8)]
    assert axis_links(cl, (8, 2)) == [hier(4), cl.intra_node]  # axis 0 stride 2 spans nodes
    assert axis_links(cl, (4, 4)) == [hier(2), cl.intra_node]
    assert axis_links(cl, (2, 1, 8)) == [cl.inter_node, cl.intra_node, cl.intra_node]
    assert cl.inter_node.name == "infiniband" and cl.intra_node.name == "nvlink"


def test_axis_links_single_node_and_local_cpu():
    cl = load_cluster("dgx-h100")
    assert axis_links(cl, (2, 4)) == [cl.intra_node, cl.intra_node]
    cpu = load_cluster("local-cpu:4")
    links = axis_links(cpu, (2, 2))
    assert [l.name for l in links] == ["loopback", "loopback"]


def test_axis_links_wrong_size():
    with pytest.raises(ClusterError, match="16"):
        axis_links(load_cluster("dgx-a100-80g:2"), (2, 4))
    with pytest.raises(ClusterError):
        axis_links(load_cluster("local-cpu:4"), (0, 4))


# --- resharding ---------------------------------------------------------------

SHAPE = (64, 32)  # float32: 8192 bytes
NBYTES = 64 * 32 * 4


def test_reshard_1d_matches_collectives():
    mesh, links = (4,), [LINK]
    def t(a, b):
        return reshard_time([a], [b], SHAPE, 4, mesh, links)
    assert t(Shard(0), Replicate()) == pytest.approx(collective_time("all_gather", NBYTES, 4, LINK))
    assert t(Partial(), Replicate()) == pytest.approx(collective_time("all_reduce", NBYTES, 4, LINK))
    assert t(Partial(), Shard(1)) == pytest.approx(collective_time("reduce_scatter", NBYTES, 4, LINK))
    assert t(Shard(0), Shard(1)) == pytest.approx(collective_time("all_to_all", NBYTES / 4, 4, LINK))
    assert t(Shard(1), Partial()) == pytest.approx(collective_time("all_gather", NBYTES, 4, LINK))
    assert t(Replicate(), Shard(0)) == 0.0
    assert t(Replicate(), Partial()) == 0.0
    assert t(Shard(0), Shard(0)) == 0.0
    assert t(Partial(), Partial()) == 0.0
    assert t(Partial("sum"), Partial("avg")) == pytest.approx(collective_time("all_reduce", NBYTES, 4, LINK))
    # JSON strings are accepted as well
    assert reshard_time(["S(0)"], ["R"], SHAPE, 4, mesh, links) == t(Shard(0), Replicate())


def test_edge_prices_are_each_pairs_reshard_and_its_gradients_way_back():
    """ReshardPricer.edge_seconds, what the intra-op problem's edges cost: per
    (producer placements, consumer placements) the forward reshard plus, for a
    tensor that needs a gradient, the gradient's reshard from consumer to
    producer, where a partial sum's gradient is replicated."""
    from costmodel.resharding import ReshardPricer, gradient_placements

    cl = load_cluster("dgx-a100-80g:2")
    mesh = (2, 8)
    links = axis_links(cl, mesh)
    pricer = ReshardPricer(mesh, links)
    outs = [(Partial(), Shard(1)), (Shard(0), Replicate()), (Replicate(), Replicate())]
    ins = [(Replicate(), Shard(1)), (Shard(0), Shard(1))]
    srcs = tuple(pricer.spec_id(p) for p in outs)
    # equal placements get one id, whether the same tuple object or not
    assert pricer.spec_id(tuple(list(outs[0]))) == srcs[0]
    assert gradient_placements(outs[0]) == (Replicate(), Shard(1))
    dsts = tuple(pricer.spec_id(p) for p in ins)
    for with_gradient in (False, True):
        got = pricer.edge_seconds(srcs, dsts, SHAPE, 4, with_gradient)
        for a, row in zip(outs, got):
            for b, seconds in zip(ins, row):
                want = reshard_time(a, b, SHAPE, 4, mesh, links)
                if with_gradient:
                    want += reshard_time(gradient_placements(b), gradient_placements(a), SHAPE, 4,
                                         mesh, links)
                assert seconds == want
        assert pricer.edge_seconds(srcs, dsts, SHAPE, 4, with_gradient) is got  # memoised


def test_reshard_2d_accounts_for_other_axis_sharding():
    cl = load_cluster("dgx-a100-80g:2")
    mesh = (2, 8)
    links = axis_links(cl, mesh)
    inter, intra = links
    # axis 1 all-gather while axis 0 keeps the tensor split in 2
    got = reshard_time([Shard(0), Shard(1)], [Shard(0), Replicate()], SHAPE, 4, mesh, links)
    assert got == pytest.approx(collective_time("all_gather", NBYTES / 2, 8, intra))
    # axis 0 all-reduce while axis 1 keeps it split in 8, priced on InfiniBand
    got = reshard_time([Partial(), Shard(1)], [Replicate(), Shard(1)], SHAPE, 4, mesh, links)
    assert got == pytest.approx(collective_time("all_reduce", NBYTES / 8, 2, inter))
    # P -> S on axis 1 with axis 0 replicated: reduce-scatter of the whole tensor
    got = reshard_time([Replicate(), Partial()], [Replicate(), Shard(0)], SHAPE, 4, mesh, links)
    assert got == pytest.approx(collective_time("reduce_scatter", NBYTES, 8, intra))
    # both axes gathered: DTensor goes inner axis first (still split on axis 0), then outer
    got = reshard_time([Shard(0), Shard(1)], [Replicate(), Replicate()], SHAPE, 4, mesh, links)
    expected = collective_time("all_gather", NBYTES / 2, 8, intra) + collective_time("all_gather", NBYTES, 2, inter)
    assert got == pytest.approx(expected)


def test_reshard_nested_sharding_goes_through_replicate():
    # (S(0), S(0)) -> (R, S(0)): DTensor un-nests axis 1 first, then axis 0, then re-slices.
    steps = reshard_steps(["S(0)", "S(0)"], ["R", "S(0)"], SHAPE, 4, (2, 4))
    assert [(s.mesh_axis, s.src, s.dst, s.collective) for s in steps] == [
        (1, "S(0)", "R", "all_gather"),
        (0, "S(0)", "R", "all_gather"),
        (1, "R", "S(0)", None),
    ]
    assert [s.nbytes for s in steps] == [NBYTES // 2, NBYTES, 0]


def test_reshard_uneven_is_conservative():
    # 10 rows over 4 devices: DTensor pads to ceil(10/4) = 3 rows per shard
    steps = reshard_steps(["S(0)"], ["S(1)"], (10, 8), 2, (4,))
    assert steps[0].collective == "all_to_all" and steps[0].nbytes == 3 * 8 * 2


def test_reshard_bad_input():
    with pytest.raises(ValueError, match="one placement per mesh axis"):
        reshard_time(["R"], ["R", "R"], SHAPE, 4, (2, 2), [LINK, LINK])
    with pytest.raises(ValueError, match="dim 2"):
        reshard_time(["S(2)"], ["R"], SHAPE, 4, (2,), [LINK])
    with pytest.raises(ValueError, match="one link per mesh axis"):
        reshard_time(["R"], ["R"], SHAPE, 4, (2,), [])


def test_reshard_steps_match_dtensor_planner():
    """Our step list equals DTensor's own greedy planner on a fake 2x4 mesh."""
    dist = pytest.importorskip("torch.distributed")
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:  # private API moved: the closed-form tests still hold
        pytest.skip(f"DTensor internals not available: {e}")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        mesh = init_device_mesh("cpu", (2, 4))
        shape = (8, 16, 4)
        meta = TensorMeta(torch.Size(shape), (64, 4, 1), torch.float32)
        choices = [Replicate(), Shard(0), Shard(1), Partial()]
        checked = 0
        for src in itertools.product(choices, repeat=2):
            for dst in itertools.product(choices, repeat=2):
                if any(isinstance(d, Partial) and isinstance(s, Shard) for s, d in zip(src, dst)):
                    continue  # DTensor refuses S -> P
                infos = _gen_transform_infos_non_cached(DTensorSpec(mesh, src, meta), DTensorSpec(mesh, dst, meta))
                theirs = [(i.mesh_dim, placement_str(i.src_dst_placements[0]), placement_str(i.src_dst_placements[1])) for i in infos]
                ours = [(s.mesh_axis, s.src, s.dst) for s in reshard_steps(src, dst, shape, 4, (2, 4))]
                assert ours == theirs, (src, dst)
                checked += 1
        assert checked > 150
    finally:
        dist.destroy_process_group()


def test_placement_strings():
    for p, s in [(Replicate(), "R"), (Shard(0), "S(0)"), (Shard(3), "S(3)"), (Partial(), "P"), (Partial("avg"), "P(avg)")]:
        assert placement_str(p) == s
        assert parse_placement(s) == p
    assert parse_placement("P(sum)") == Partial()
    assert parse_placement(" S( 1 ) ") == Shard(1)
    for bad in ["", "X", "S", "S(a)", "S(-1)", "P(foo)", "RR", "Shard(0)"]:
        with pytest.raises(ValueError, match="placement"):
            parse_placement(bad)


def test_link_per_collective_override_is_used_and_round_trips():
    from costmodel.cluster import Link
    from costmodel.collectives import collective_time
    from costmodel.presets import local_cpu_cluster

    link = Link("loopback", 1e9, 1e-4, (("reduce_scatter", 2e-4, 5e8),))
    n, nbytes = 4, 8e6
    assert collective_time("reduce_scatter", nbytes, n, link) == pytest.approx(
        (n - 1) / n * nbytes / 5e8 + (n - 1) * 2e-4)
    assert collective_time("all_gather", nbytes, n, link) == pytest.approx(
        (n - 1) / n * nbytes / 1e9 + (n - 1) * 1e-4)
    assert Link.from_dict(link.to_dict()) == link
    cluster = local_cpu_cluster(4, {"collective_links": {"broadcast": {"latency": 1e-5,
                                                                      "bandwidth": 3e9}}})
    assert Cluster.from_dict(cluster.to_dict()) == cluster
    assert cluster.intra_node.alpha_beta("broadcast") == (1e-5, 3e9)
    with pytest.raises(ClusterError, match="bandwidth"):
        Link.from_dict({"name": "x", "bandwidth": 1.0, "latency": 0.0,
                        "collectives": {"all_reduce": {"latency": 0.0, "bandwidth": -1}}})


def test_reshards_are_priced_at_the_redistribute_fits():
    """A plan's reshards go through DTensor's redistribute: priced at the
    link's redistribute fits where measured, the bare collective elsewhere."""
    from costmodel.cluster import Link
    from costmodel.collectives import collective_time
    from costmodel.resharding import ReshardPricer

    link = Link("loopback", 1e9, 1e-4, (("all_gather", 2e-4, 5e8),),
                per_redistribute=(("all_gather", 2e-3, 2.5e8),))
    assert Link.from_dict(link.to_dict()) == link
    shape, mesh = (64, 1024), (4,)
    gathered = 64 * 1024 * 4
    assert collective_time("all_gather", gathered, 4, link) == pytest.approx(
        3 / 4 * gathered / 5e8 + 3 * 2e-4)
    want = 3 / 4 * gathered / 2.5e8 + 3 * 2e-3
    assert reshard_time(["S(0)"], ["R"], shape, 4, mesh, [link]) == pytest.approx(want)
    pricer = ReshardPricer(mesh, [link])
    assert pricer.links == [link]
    assert pricer.time(["S(0)"], ["R"], shape, 4) == pytest.approx(want)
    # a kind without a redistribute fit keeps the link's own
    assert reshard_time(["P"], ["R"], shape, 4, mesh, [link]) == pytest.approx(
        collective_time("all_reduce", gathered, 4, link))


def test_axis_spanning_nodes_goes_hierarchical_where_cheaper():
    from costmodel.collectives import axis_links, collective_time
    from costmodel.presets import preset

    cluster = preset("p3.16xlarge", 2)
    (link,) = axis_links(cluster, (16,))
    intra, inter = cluster.intra_node, cluster.inter_node
    assert link.local == (intra, 8)
    nbytes = 1e9
    hier = (collective_time("reduce_scatter", nbytes, 8, intra)
            + collective_time("all_reduce", nbytes / 8, 2, inter)
            + collective_time("all_gather", nbytes, 8, intra))
    flat = collective_time("all_reduce", nbytes, 16, inter)
    assert collective_time("all_reduce", nbytes, 16, link) == pytest.approx(min(hier, flat))
    assert hier < flat / 4  # one NIC per node: the network share per GPU is tiny
    # an axis whose groups hold one device per node stays flat
    links = axis_links(cluster, (2, 8))
    assert links[0] == inter and links[1] == intra


def test_all_to_all_across_nodes_sends_node_peers_shares_over_nvlink():
    """Expert parallelism over 2 nodes of 8: 7 of a device's 15 shares stay in
    its node; its network share carries the other 8 meanwhile."""
    from costmodel.collectives import axis_links, collective_time
    from costmodel.presets import preset

    cluster = preset("h800", 2)
    (link,) = axis_links(cluster, (16,))
    intra, inter = cluster.intra_node, cluster.inter_node
    nbytes = 64e6
    in_node = collective_time("all_to_all", nbytes * 8 / 16, 8, intra)
    across = 8 / 16 * nbytes / inter.bandwidth + 8 * inter.latency
    flat = collective_time("all_to_all", nbytes, 16, inter)
    assert collective_time("all_to_all", nbytes, 16, link) == pytest.approx(max(in_node, across))
    assert across > in_node and max(in_node, across) < flat
    # all in one node: the in-node link only
    assert collective_time("all_to_all", nbytes, 8, intra) == pytest.approx(
        7 / 8 * nbytes / intra.bandwidth + 7 * intra.latency)


def test_reshard_staging_bytes_follow_dtensors_buffers():
    """What a forward redistribute allocates (the 2x2 plan's logits, 1024 x 2048
    bf16 on a 2 x 2 mesh): gloo's all-to-all gathers the whole tensor and cuts
    its piece from a concatenation (measured: a 2.1 MB all-gather and a 2.1 MB
    cat per rank); an all-gather of dim 0 is its result, of another dim a
    concatenation more."""
    from costmodel.resharding import reshard_staging_bytes, reshard_steps

    shard = 512 * 1024 * 2  # bytes of one device's logits before the reshard
    steps = reshard_steps(["S(0)", "S(1)"], ["S(0)", "S(0)"], (1024, 2048), 2, (2, 2))
    assert reshard_staging_bytes(steps, (2, 2), "gloo") == 2 * 2 * shard
    assert reshard_staging_bytes(steps, (2, 2), "nccl") == 2 * shard
    rows = reshard_steps(["S(0)"], ["R"], (1024, 2048), 2, (2,))
    cols = reshard_steps(["S(1)"], ["R"], (1024, 2048), 2, (2,))
    whole = 1024 * 2048 * 2
    assert reshard_staging_bytes(rows, (2,), "gloo") == whole
    assert reshard_staging_bytes(cols, (2,), "gloo") == 2 * whole
    assert reshard_staging_bytes(reshard_steps(["R"], ["S(0)"], (1024, 2048), 2, (2,)),
                                 (2,), "gloo") == 0
    assert reshard_staging_bytes(reshard_steps(["S(1)"], ["R"], (1024, 2048), 2, (1,)),
                                 (1,), "gloo") == 0  # one device: nothing moves
