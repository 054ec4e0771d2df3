"""A plan that records ``training.compile`` runs its program through torch.compile.

Compiling is slow on CPU, so one launch covers the whole path: a two-rank
plan's program compiles, its steps match one eager process (``--check``), and
the log says how long it took. ``benchmarks/compile_checks.py`` runs the other
plan kinds. The fallback is checked in process
with a backend that refuses to compile.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from codegen.compiled_program import CompileReport, CompiledRegion
from training.launch import launch

RTOL = 1e-5


def test_region_that_cannot_compile_runs_eager_and_says_why():
    def refuse(gm, example_inputs):
        raise RuntimeError("this backend compiles nothing")

    report = CompileReport()
    region = CompiledRegion(lambda x: torch.sin(x) * 2, "layer 3", report, backend=refuse)
    x = torch.arange(4.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = region(x), region(x)
    torch.testing.assert_close(first, torch.sin(x) * 2)
    torch.testing.assert_close(second, first)
    lines = [str(w.message) for w in caught]
    assert len(lines) == 1 and lines[0].startswith("compile: layer 3 runs eager: ")
    assert "this backend compiles nothing" in lines[0]
    assert report.lines() == lines and not report.regions[0].compiled


def test_placement_checks_trace_into_the_graph():
    """The lowered program's placement calls (``ToPlacement``) ask
    ``is_mask_partial``; an exception dynamo meets while tracing it (a failing
    import) made it give up the whole program, which then ran eager op by op
    with only the redistributions compiled: on two ranks no faster than eager."""
    from torch.distributed.tensor import Replicate

    from ir.torch_compat import is_mask_partial

    def placed(x):
        return x + 1 if any(is_mask_partial(p) for p in (Replicate(),)) else x * 2

    compiled = torch.compile(placed, backend="eager", fullgraph=True)  # raises on a break
    torch.testing.assert_close(compiled(torch.ones(2)), torch.full((2,), 2.0))


def test_a_checkpointed_layer_traces_into_the_compiled_graph():
    """On one device a checkpointed layer compiles with the program around it,
    its recomputation too: the checkpoint traces without a graph break (torch's
    early-stop context manager broke the graph, and the layer ran eagerly)."""
    from codegen.checkpointed_layers import checkpointed

    def program(x):
        return checkpointed(lambda v: (torch.sin(v) * v).exp(), x).sum()

    x = torch.linspace(-1, 1, 8, requires_grad=True)
    compiled = torch.compile(program, backend="aot_eager", fullgraph=True)  # raises on a break
    compiled(x).backward()
    got, x.grad = x.grad, None
    program(x).backward()
    torch.testing.assert_close(got, x.grad)


def _checked_run(made, path) -> str:
    """Save plan ``made`` at ``path``, run two steps of it checked against one
    eager process (within :data:`RTOL`); the ranks' output."""
    made.save(path)
    result = launch(path, check=True, steps=2, timeout_s=400)
    assert result["passed"], result.get("output")
    assert result["max_loss_rel_err"] <= RTOL and result["max_rel_grad_err"] <= RTOL
    return result["output"]


@pytest.mark.multiprocess
def test_compiled_two_rank_plan_matches_one_eager_process(tmp_path):
    """The DTensor program, lowered (the plan's placements written into it) and
    compiled with inductor, trains as one eager process does; each of its
    checkpointed layers compiles as a region of its own, run inside the
    checkpoint, between the program's two graphs."""
    from models.source import build_model
    from planner.api import plan

    model, inputs = build_model("gpt-tiny", device="meta")
    made = plan(model, "local-cpu:2", example_inputs=inputs, mesh_shape=(2,),
                model_source="gpt-tiny", time_limit_s=10, compile=True, recompute="all")
    assert made.training["compile"] is True and made.compiles and len(made.checkpoint) == 2
    assert "compile" not in made.with_compile(False).training
    output = _checked_run(made, tmp_path / "compiled.json")
    assert "in 2 graphs around 2 region(s) compiled on their own" in output, output
    assert output.count("compile: the program's checkpointed layer") == 2
    assert "runs eager" not in output and "parts run eager" not in output



@pytest.mark.multiprocess
def test_context_parallel_plan_compiles_around_its_attention_exchange(tmp_path):
    """A cp plan's program compiles: the rank's token positions are computed
    eager first, each attention's ring exchange runs eager between the
    graphs, and the rest compiles; it trains as one eager process does."""
    from models.source import build_model
    from planner.api import plan

    model, inputs = build_model("gpt-tiny", device="meta")
    made = plan(model, "local-cpu:2", example_inputs=inputs, context_parallel=(2,),
                model_source="gpt-tiny", time_limit_s=5, compile=True)
    assert made.training["context_parallel"]["size"] == 2 and made.pipeline is None
    output = _checked_run(made, tmp_path / "cp.json")
    assert "compile: the program compiled in" in output, output
    assert "in 3 graphs (parts run eager)" in output, output  # gpt-tiny's 2 attentions
    assert "runs eager:" not in output


_COMPILE_ONCE = """
import json
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from codegen.compiled_program import CompileReport, CompiledRegion

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
hash(mesh)  # as DTensor's sharding caches do: the mesh keeps Python's salted hash

def program(w, x, mesh):  # a lowered program: the mesh is one of its inputs
    y = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return (y @ w).relu().redistribute(mesh, (Replicate(),)).to_local().sum()

report = CompileReport()
w = distribute_tensor(torch.ones(8, 8), mesh, [Replicate()]).requires_grad_()
CompiledRegion(program, "the program", report)(w, torch.ones(4, 8), mesh).backward()
region = report.regions[0]
print(json.dumps({"line": region.line(), "fx_hits": region.cache_hits,
                  "fx_misses": region.cache_misses, "aot_hits": region.aot_hits,
                  "aot_misses": region.aot_misses}))
dist.destroy_process_group()
"""


def test_second_launch_takes_the_compiled_graphs_from_the_cache(tmp_path):
    """A restart reuses the compiled graphs: a DTensor program compiled in one
    process is, in a fresh process sharing the cache folder, found in
    AOTAutograd's and inductor's caches (their keys once held the mesh's
    per-process salted hash, and every launch missed both)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def launch(hash_seed: str) -> dict:  # two launches salt Python's hash differently
        done = subprocess.run([sys.executable, "-c", _COMPILE_ONCE], cwd=root,
                              env={**env, "PYTHONHASHSEED": hash_seed},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = launch("1"), launch("2")
    assert first["aot_misses"] == 1 and first["fx_misses"] >= 1 and first["fx_hits"] == 0
    assert second["aot_hits"] == 1 and second["aot_misses"] == 0, second
    assert second["fx_hits"] == 2 and second["fx_misses"] == 0, second  # forward and backward
    assert "2 graph(s) from the compile cache, AOTAutograd's cache hit" in second["line"]
