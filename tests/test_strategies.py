"""Strategies read from DTensor: shared expansions give DTensor's own answer."""

import pytest

from ir import trace
from models.zoo import GPTConfig, build_from_config
from models.zoo.llama import LlamaConfig
from planner.ilp.strategies import StrategyBuilder, _rows, build_strategies, fake_mesh

# Small dims (batch 2, sequence 6, 2 heads) so that the larger meshes cannot
# shard some of them: DTensor's own shardability check then drops strategies.
_MODELS = {
    "gpt": GPTConfig(2, 24, 2, vocab_size=64, block_size=6),
    "llama": LlamaConfig(2, 24, 2, 1, 40, vocab_size=64, max_seq_len=6),
}
_MESHES = [(2,), (8,), (3,), (2, 4), (4, 2), (8, 2), (2, 3), (2, 2, 2)]


@pytest.mark.parametrize("family", sorted(_MODELS))
def test_shared_expansions_equal_dtensors_answer_on_each_mesh(family):
    """One expansion of each single-dim strategy per number of mesh axes,
    shared by every mesh shape, keeps exactly the strategies (in order) that
    DTensor's expansion on the mesh itself gives."""
    model, inputs = build_from_config(_MODELS[family], batch_size=2)
    graph = trace(model, inputs)
    shared: dict = {}
    compared: set = set()  # (mesh shape, node signature): repeated blocks asked once
    for shape in _MESHES:
        with fake_mesh(shape) as mesh:
            built = build_strategies(graph, mesh, expansions=shared)
            direct = StrategyBuilder(graph, mesh)
            for ns in built:
                direct._record(ns)
                fx_node = direct.fx_nodes.get(ns.node.name)
                single = None if fx_node is None else \
                    direct.prop.op_single_dim_strategy_funcs.get(fx_node.target)
                if single is None or ns.fallback is not None:
                    continue
                key = (shape, direct._signature(fx_node, True))
                if key in compared:
                    continue
                answer = direct._call_strategy(fx_node, single, None, only=None)
                assert ns.strategies == direct._keep(ns.node, _rows(answer)), (shape, ns.node.name)
                compared.add(key)
    assert len(compared) > 100
    assert {k[0] for k in shared} == {1, 2, 3}


def test_a_mesh_shape_makes_a_fake_mesh_only_for_what_the_caches_lack(monkeypatch):
    """Given a mesh shape, strategies are those of its fake mesh; a graph whose
    strategies are all in the caches makes no mesh, and none is left up."""
    import torch.distributed as dist

    from planner.ilp import strategies
    model, inputs = build_from_config(_MODELS["gpt"], batch_size=2)
    graph = trace(model, inputs)
    with fake_mesh((2, 4)) as mesh:
        want = build_strategies(graph, mesh)
    made = []
    real = strategies.fake_mesh
    monkeypatch.setattr(strategies, "fake_mesh", lambda shape: made.append(shape) or real(shape))
    cache: dict = {}
    expansions: dict = {}
    first = build_strategies(graph, (2, 4), cache, expansions)
    assert made == [(2, 4)] and not dist.is_initialized()
    again = build_strategies(graph, (2, 4), cache, expansions)
    assert made == [(2, 4)] and not dist.is_initialized()
    for got in (first, again):
        assert [(ns.node.name, ns.strategies, ns.fallback) for ns in got] == \
            [(ns.node.name, ns.strategies, ns.fallback) for ns in want]


def test_expansions_that_came_back_pickled_from_a_forked_search_give_the_same_strategies():
    """A forked search process sends its strategy caches back pickled; an
    unpickled ``_MaskPartial`` (vocab-parallel embedding) cannot be hashed, so
    the filter must not memoise it, and it keeps what the fresh rows keep."""
    import io

    from torch.distributed.tensor.placement_types import Replicate, Shard

    from planner.search import forked_workers as forked
    model, inputs = build_from_config(_MODELS["gpt"], batch_size=2)
    graph = trace(model, inputs)
    shared: dict = {}
    with fake_mesh((2,)) as mesh:
        fresh = build_strategies(graph, mesh, expansions=shared)
    masked = [key for key, rows in shared.items() if not isinstance(rows, Exception) and any(
        type(p) not in (Replicate, Shard) and type(p).__name__ == "_MaskPartial"
        for ins, outs in rows for pl in (*(ins or ()), *outs) if pl for p in pl)]
    assert masked, "the embedding's expansion holds a _MaskPartial"
    buffer = io.BytesIO()
    forked._SharedPickler(buffer, ()).dump(shared)  # as a forked search sends it back
    buffer.seek(0)
    unpickled = forked._SharedUnpickler(buffer, ()).load()
    with fake_mesh((4,)) as mesh:
        again = build_strategies(graph, mesh, expansions=unpickled)
    with fake_mesh((4,)) as mesh:
        want = build_strategies(graph, mesh)
    assert [ns.strategies for ns in again] == [ns.strategies for ns in want]
    assert len(fresh) == len(again)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "deepseek-tiny"])
def test_zoo_transformers_have_a_dtensor_strategy_for_every_op(name):
    """Every op of the small transformers, fused attention, llama's
    concatenations and DeepSeek's routing (sort, scatter, gather) included, has
    a usable DTensor strategy in every precision
    (a torch release that moves an op to another strategy table would
    otherwise plan it replicated, silently but for a warning)."""
    import warnings

    from models import zoo
    from ir.precision import compute_copy, get_precision
    from planner.ilp.strategies import ReplicateFallbackWarning

    for precision in ("fp32", "bf16-mixed"):
        model, inputs = compute_copy(*zoo.build(name), get_precision(precision))
        graph = trace(model, inputs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build_strategies(graph, (2, 2))
        fallbacks = [str(w.message) for w in caught
                     if issubclass(w.category, ReplicateFallbackWarning)]
        assert fallbacks == [], (precision, fallbacks[:3])
