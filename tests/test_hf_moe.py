"""Hugging Face MoE models (issue 48): the backward of an index under DTensor
(``IndexBackward0 returned an invalid gradient``: DTensor's cached decision
for a ``new_zeros`` of another size) and of DeepSeek-V3's key assembly
(``copy``, ``slice_scatter``), the grouped expert matmul (transformers'
fallback in fp32 captures, torch's ``aten._grouped_mm`` in bf16 ones)
planned and run sharded (expert parallel with its all-to-all, by rows, by
columns, by the contraction) on 4 gloo ranks, and a Mixtral plan that runs
and checks in each precision."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers", reason="Hugging Face transformers is not installed "
                    "(pip install '.[hf]')")

import transformers.integrations.moe  # noqa: E402,F401 - registers transformers' ops

from ir.grouped_mm import exchange_axis, register_grouped_mm_sharding  # noqa: E402
from ir.grouped_mm_aten import register_aten_grouped_mm_sharding  # noqa: E402
from ir.torch_compat import fake_store_type, register_zeros_like_input_sharding  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIXTRAL = ("hf:mixtral,num_hidden_layers=2,hidden_size=64,intermediate_size=128,"
           "num_attention_heads=4,num_key_value_heads=2,vocab_size=128,num_local_experts=4,"
           "max_position_embeddings=64")


def _fake_mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", store=fake_store_type()(), rank=0, world_size=world)
    return init_device_mesh("cpu", (world,))


def test_new_zeros_of_another_size_gets_its_own_shape():
    """DTensor caches a sharding decision by the op's arguments; ``size`` must
    be in the key, or the second ``new_zeros`` gets the first one's shape."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    register_zeros_like_input_sharding()
    mesh = _fake_mesh(2)
    try:
        whole = DTensor.from_local(torch.randn(512, 64), mesh, [Replicate()], run_check=False)
        assert whole.new_zeros([512, 64]).shape == (512, 64)
        smaller = whole.new_zeros([256, 64])
        assert smaller.shape == (256, 64) and smaller.to_local().shape == (256, 64)
        rows = DTensor.from_local(torch.randn(256, 64), mesh, [Shard(0)], run_check=False)
        assert rows.new_zeros([512, 64]).placements == (Shard(0),)
        other = rows.new_zeros([256, 8])
        assert other.shape == (256, 8) and other.to_local().shape == (256, 8)
    finally:
        dist.destroy_process_group()


def test_the_backward_of_a_gather_of_rows_then_of_their_order():
    """The MoE layer's ``hidden[perm // k]`` then ``out[inv_perm]``: the two
    index backwards zero a [512, 64] and then a [256, 64] gradient from a
    [512, 64] one (issue 48's ``IndexBackward0 returned an invalid gradient
    ... got [512, 64] but expected shape compatible with [256, 64]``)."""
    from torch.distributed.tensor import DTensor, Replicate

    register_zeros_like_input_sharding()
    mesh = _fake_mesh(2)
    try:
        hidden = torch.randn(256, 64, requires_grad=True)
        x = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
        perm = DTensor.from_local(torch.randperm(512), mesh, [Replicate()], run_check=False)
        weights = DTensor.from_local(torch.randn(512, 64), mesh, [Replicate()], run_check=False)
        (x[perm // 2][perm] * weights).sum().backward()
        assert hidden.grad is not None and hidden.grad.shape == (256, 64)
    finally:
        dist.destroy_process_group()


def test_the_backward_of_writing_a_keys_two_parts_into_one_tensor():
    """DeepSeek-V3's attention writes each key's two parts into a new tensor,
    captured as ``copy`` and ``slice_scatter`` for each: ``aten.copy`` had no
    derivative (``derivative for aten::copy is not implemented``) nor DTensor
    strategy (it was planned replicated), and the
    backward of ``slice_scatter`` makes the zeros of a part as a plain tensor,
    which DTensor refused beside the gradient (``got mixed torch.Tensor and
    DTensor``)."""
    from torch.distributed.tensor import DTensor, Shard

    from ir.functional_backward import COPY, VIEW_SCATTERS, register_functional_backward

    register_functional_backward({COPY, *VIEW_SCATTERS})
    aten = torch.ops.aten
    mesh = _fake_mesh(2)
    try:
        parts = [DTensor.from_local(torch.randn(4, 8), mesh, [Shard(0)], run_check=False)
                 .requires_grad_() for _ in range(2)]
        key = DTensor.from_local(torch.zeros(4, 16), mesh, [Shard(0)], run_check=False)
        for k, (part, scale) in enumerate(zip(parts, (2, 3))):
            written = aten.copy.default(aten.slice.Tensor(key, 1, 8 * k, 8 * k + 8),
                                        part * scale)
            key = aten.slice_scatter.default(key, written, 1, 8 * k, 8 * k + 8)
        key.sum().backward()
        assert [float(p.grad.to_local().unique()) for p in parts] == [2.0, 3.0]
        with torch.no_grad():  # DTensor's strategy for the copy: as its destination
            written = aten.copy.default(key, parts[0].repeat(1, 2))
        assert written.placements == (Shard(0),) and written.to_local().shape == (4, 16)
    finally:
        dist.destroy_process_group()
    src = torch.randn(3, dtype=torch.float64, requires_grad=True)  # broadcast and cast
    aten.copy.default(torch.zeros(2, 3), src).sum().backward()
    assert src.grad.dtype == torch.float64 and src.grad.tolist() == [2.0] * 3


def _meta_graph(precision: str = "fp32"):
    from ir.device_capture import on_device_type
    from ir.precision import compute_copy, get_precision
    from ir.trace import trace
    from models.source import build_model

    model, inputs = build_model(MIXTRAL, device="meta", batch_size=2, seq_len=16)
    return trace(*on_device_type(*compute_copy(model, inputs, get_precision(precision)), "cpu"))


@pytest.mark.parametrize("precision, target, backward", [
    ("fp32", "transformers.grouped_mm_fallback.default", (2, 1)),
    ("bf16", "aten._grouped_mm.default", (2, 2))])
def test_the_grouped_matmul_has_flops_and_expert_parallel_strategies(precision, target, backward):
    """Planned, the experts' grouped matmul counts its FLOPs and DTensor
    offers it sharded by experts (with an all-to-all the cost model prices),
    by rows, by columns and by the contraction, besides replicated: in fp32
    transformers' fallback, in bf16 torch's own kernel (``backward``: the
    x- and y-sized all-to-alls of an expert-parallel backward; torch's moves
    dy twice)."""
    from torch.distributed.tensor import Replicate, Shard

    from costmodel.presets import load_cluster
    from costmodel.strategy_cost import IntraOpCost
    from planner.ilp.strategies import build_strategies

    graph = _meta_graph(precision)
    nodes = [n for n in graph.nodes if n.target == target]
    assert len(nodes) == 4  # up and down projections of 2 layers
    x, w = nodes[0].inputs[:2]  # 32 tokens x top-2 rows, experts [4, 64, 256]
    assert nodes[0].flops == 2 * 64 * 64 * 256 and tuple(w.shape) == (4, 64, 256)
    for shape in ((4,), (2, 2)):
        found = {ns.node.name: ns for ns in build_strategies(graph, shape)}
        ns = found[nodes[0].name]
        assert ns.fallback is None
        expert = [s for s in ns.strategies
                  if exchange_axis(ns.node.target, s.inputs, (2, 3)) is not None]
        assert expert and all(sum(p == Shard(0) for p in s.inputs[1]) == 1 for s in expert)
        kinds = {(s.inputs[0][0], s.inputs[1][0]) for s in ns.strategies}
        assert {(Shard(0), Shard(0)), (Shard(0), Replicate()), (Replicate(), Shard(2)),
                (Shard(1), Shard(1)), (Replicate(), Replicate())} <= kinds
        if shape == (4,):
            cost = IntraOpCost(graph, load_cluster("local-cpu:4"), shape, precision)
            by_kind = {(s.inputs[0][0], s.inputs[1][0]): s for s in ns.strategies}
            ep = cost.expert_exchange(ns.node, by_kind[(Shard(0), Shard(0))])
            assert ep[0] > 0 and ep[1] > ep[0]
            if backward == (2, 2):  # x and y there and back, forward; twice, backward
                assert ep[1] == pytest.approx(2 * ep[0])
            else:  # x, dy and dx: y-sized once
                assert ep[1] < 2 * ep[0]
            assert cost.expert_exchange(ns.node, by_kind[(Shard(0), Replicate())]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="ranks of x and w"):
        exchange_axis("aten._grouped_mm.default", [[Shard(0)], [Shard(0)]])
    assert exchange_axis("aten._grouped_mm.default", [[Shard(0)], [Shard(0)]], (3, 3)) is None


# (x, w, y placements) per mesh shape: every kind of ir.grouped_mm on one axis
# (x is redistributed where w's placement asks for another), and expert
# parallelism with rows, columns or the contraction on another axis
CASES = {
    (4,): [("S(0)", "S(0)", "S(0)"), ("S(0)", "R", "S(0)"), ("R", "S(2)", "S(1)"),
           ("S(1)", "S(1)", "P"), ("R", "R", "R"), ("R", "S(0)", "S(0)"), ("S(1)", "S(0)", "S(0)")],
    (2, 2): [("S(0),S(0)", "S(0),R", "S(0),S(0)"), ("S(0),S(0)", "R,S(0)", "S(0),S(0)"),
             ("S(0),R", "S(0),S(2)", "S(0),S(1)"), ("S(0),S(1)", "S(0),S(1)", "S(0),P"),
             ("R,S(0)", "S(0),S(0)", "S(0),S(0)")],
}


def _grouped_mm_rank(rank: int, world: int, port: int, dtypes: tuple) -> None:
    """Each of CASES on this rank against one process's values, for each of
    ``dtypes``: transformers' fallback (None: fp32) or torch's
    ``aten._grouped_mm`` in that dtype, called as transformers does, on a
    transposed view of the experts' ``[E, N, K]`` weight."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    register_grouped_mm_sharding()
    register_aten_grouped_mm_sharding()
    for dtype in dtypes:
        _check_grouped_mm_cases(dtype)
    dist.destroy_process_group()


def _check_grouped_mm_cases(dtype: torch.dtype | None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from ir.placements import parse_placements

    transposed = dtype is not None
    # tol: relative, and absolute as a fraction of the largest value (bf16's
    # partial sums round at their own scale: 1 unit is 1/128 to 1/256 of it)
    if transposed:  # torch's kernel leaves y's and dx's rows past offs[-1] unwritten
        op, tol, rows = torch._grouped_mm, (1e-5 if dtype == torch.float32 else 2e-2), 22
    else:
        op, dtype, tol, rows = torch.ops.transformers.grouped_mm_fallback, torch.float32, 1e-5, 24

    def flip(p: torch.Tensor) -> torch.Tensor:  # the weight as the op takes it
        return p.transpose(-2, -1) if transposed else p

    torch.manual_seed(0)
    x0, g0 = torch.randn(24, 16, dtype=dtype), torch.randn(24, 32, dtype=dtype)
    p0 = flip(torch.randn(4, 16, 32, dtype=dtype)).contiguous()
    # expert 1 gets no row, the last 2 rows none (an expert-parallel sentinel's)
    offs = torch.cumsum(torch.tensor([7, 0, 10, 5]), 0).to(torch.int32)
    x, p = x0.clone().requires_grad_(), p0.clone().requires_grad_()
    y0 = op(x, flip(p), offs=offs)
    (y0 * g0).sum().backward()
    want = (y0.detach()[:rows], x.grad[:rows], p.grad)
    for shape, cases in CASES.items():
        mesh = init_device_mesh("cpu", shape)
        for xp, wp, yp in cases:
            w_at = parse_placements(wp.split(","))
            dx = distribute_tensor(x0, mesh, parse_placements(xp.split(","))).requires_grad_()
            # w's placements are the op argument's: dims 1 and 2 of p swapped
            p_at = [Shard(3 - q.dim) if transposed and isinstance(q, Shard) and q.dim else q
                    for q in w_at]
            dp = distribute_tensor(p0, mesh, p_at).requires_grad_()
            do = distribute_tensor(offs, mesh, parse_placements(["R"] * len(shape)))
            dg = distribute_tensor(g0, mesh, parse_placements(["R"] * len(shape)))
            y = op(dx, flip(dp), offs=do)
            assert isinstance(y, DTensor) and y.placements == tuple(parse_placements(yp.split(",")))
            (y * dg).sum().backward()
            got = (y.full_tensor()[:rows], dx.grad.full_tensor()[:rows], dp.grad.full_tensor())
            for name, a, b in zip(("y", "dx", "dw"), got, want):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()), msg=(
                    f"{op} {dtype}: {name} of x {xp}, w {wp} on mesh {shape}"))
            if Shard(0) in w_at:  # experts sharded (on the first such axis): their gradient too
                assert dp.grad.placements[w_at.index(Shard(0))] == Shard(0), (op, xp, wp, shape)
    if dtype == torch.bfloat16:  # torch's other forms run by DTensor's own (bf16 only): batches
        mesh = init_device_mesh("cpu", (4,))
        a, b = torch.randn(4, 8, 16, dtype=dtype), torch.randn(4, 16, 8, dtype=dtype)
        y = op(distribute_tensor(a, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Shard(0)]))
        assert y.placements == (Shard(0),)
        torch.testing.assert_close(y.full_tensor(), op(a, b), rtol=tol, atol=tol)


def _run_4_ranks(dtypes: tuple) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_grouped_mm_rank, args=(4, port, dtypes), nprocs=4, start_method="fork")


@pytest.mark.multiprocess
def test_the_grouped_matmul_runs_sharded_on_4_ranks_as_on_one():
    """On 4 gloo ranks, transformers' grouped matmul and its backward give one
    process's values under every placement of x and the experts: expert
    parallel (the all-to-all to the experts' ranks and back), rows, columns,
    contraction, combined on a 2 x 2 mesh, with an expert of no rows; and
    the same cases with torch's ``aten._grouped_mm`` (what a bf16 capture
    calls), in fp32 and bf16, its backward's two calls (dx, and the weight
    gradient grouped by the contraction) included: expert-sharded weights get
    expert-sharded gradients (the weight-gradient call has no weight and
    reads the forward's kinds), a shard of a narrow weight is aligned for
    the kernel (bf16 ``K / 4 = 4`` columns)."""
    _run_4_ranks((None, torch.float32, torch.bfloat16))


@pytest.mark.multiprocess
@pytest.mark.slow  # benchmarks/hf_models.py runs Mixtral and Qwen2-MoE with --check too
@pytest.mark.parametrize("precision, target", [
    ("fp32", "transformers.grouped_mm_fallback.default"), ("bf16", "aten._grouped_mm.default")])
def test_a_mixtral_plan_runs_and_checks_on_2_ranks(tmp_path, precision, target):
    """Issue 48: a Mixtral plan's backward failed at IndexBackward0; now its
    grouped matmuls (transformers' fallback in fp32, torch's kernel in bf16)
    are planned sharded, run so and match one process."""
    from plan.format import load_plan

    env = dict(os.environ, OMP_NUM_THREADS="1")
    plan_path = str(tmp_path / "mixtral.json")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True,
                              text=True, cwd=ROOT, env=env, timeout=300)

    planned = cli("plan", "--model", MIXTRAL, "--cluster", "local-cpu:2", "--mesh", "2",
                  "--batch-size", "2", "--seq-len", "16", "--precision", precision, "--quiet",
                  "-o", plan_path)
    assert planned.returncode == 0, planned.stderr
    assert "grouped_mm" not in planned.stderr  # no replicate fallback warning
    experts = [e for e in load_plan(plan_path).nodes.values() if e.op == target]
    assert len(experts) == 4 and any(e.outputs != [["R"]] for e in experts)
    run = cli("run", plan_path, "--check")
    assert run.returncode == 0 and "check PASSED" in run.stdout, run.stdout + run.stderr


def test_the_search_shards_large_experts_over_the_expert_axis():
    """Issue 48: with experts worth splitting (8 of 1024 x 4096, bf16 on 8
    H100s), the plan places the first grouped matmul expert parallel: its
    weight split by experts (``S(0)``), its tokens exchanged (all-to-all)."""
    from models.source import build_model
    from planner.api import plan

    spec = ("hf:mixtral,num_hidden_layers=2,hidden_size=1024,intermediate_size=4096,"
            "num_attention_heads=8,num_key_value_heads=2,vocab_size=1024,num_local_experts=8,"
            "max_position_embeddings=2048")
    model, inputs = build_model(spec, device="meta", batch_size=16, seq_len=1024)
    p = plan(model, "dgx-h100:1", example_inputs=inputs, mesh_shape=(8,),
             precision="bf16-mixed", time_limit_s=10.0)
    assert all(p.parameters[f"hf.model.layers.{i}.mlp.experts.gate_up_proj"] == ["S(0)"]
               for i in range(2))
    grouped = [e for e in p.nodes.values() if e.op == "aten._grouped_mm.default"]
    assert any(e.inputs[1] == ["S(0)"] for e in grouped)
