"""Context-parallel plans run (issue 39): each sequence split over a cp group,
ring attention (or K/V all-gathered) across it, against one process on the
whole sequences (``planner run --check``, :mod:`codegen.context_parallel`)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from codegen.context_parallel import ContextParallelLayout, chunk_positions, cut_sequences
from training.launch import launch
from codegen.runnable import unrunnable_reason
from planner.api import plan
from plan.format import load_plan
from models.source import build_model


def test_cut_sequences_gives_each_rank_of_a_cp_group_its_two_chunks_of_the_same_sequences():
    cp, outer, batch, seq = 2, 2, 4, 16
    layout = ContextParallelLayout(cp, outer, "p2p")
    tokens = torch.arange(batch * seq).reshape(batch, seq)  # token = sequence x seq + position
    (cut,) = cut_sequences([tokens], layout)
    assert cut.shape == (batch * cp, seq // cp)
    rows = batch * cp // (outer * cp)  # rows per place of mesh axis 0
    for a0 in range(outer * cp):
        o, c = divmod(a0, cp)
        held = cut[a0 * rows:(a0 + 1) * rows]
        sequences = held // seq
        # the ranks of one cp group (same o) hold the same sequences ...
        assert torch.equal(sequences[:, 0], torch.arange(o * rows, (o + 1) * rows))
        assert bool((sequences == sequences[:, :1]).all())
        # ... each its two load-balanced chunks, at the positions the runtime gives it
        assert torch.equal(held[0] % seq, chunk_positions(seq // cp, cp, c))
    assert sorted(cut.flatten().tolist()) == list(range(batch * seq))


def test_chunk_positions_are_chunks_i_and_2cp_minus_1_minus_i():
    assert chunk_positions(4, 4, 1).tolist() == [2, 3, 12, 13]
    every = torch.cat([chunk_positions(4, 4, c) for c in range(4)])
    assert sorted(every.tolist()) == list(range(16))


class _Attention(torch.nn.Module):
    """Causal attention of 4 query heads over 2 K/V heads, repeated either side
    by side (grouped-query attention's ``expand``) or tiled (``repeat``)."""

    def __init__(self, tiled: bool):
        super().__init__()
        self.tiled = tiled
        self.kv = torch.nn.Linear(8, 2 * 2 * 4)

    def forward(self, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        k, v = self.kv(x).view(b, t, 2, 2, 4).unbind(2)  # [b, t, kv heads, dim] each
        if self.tiled:
            k, v = k.repeat(1, 1, 2, 1), v.repeat(1, 1, 2, 1)
        else:
            k, v = (z[:, :, :, None].expand(b, t, 2, 2, 4).reshape(b, t, 4, 4) for z in (k, v))
        return F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True)


def test_the_exchange_counts_and_sends_each_kv_head_once():
    """Grouped-query attention's repeated K/V heads are priced and exchanged once
    each where the repeat puts a K/V head's copies side by side; the runtime's
    block of each head once gives the attention and gradients of the repeat."""
    from codegen.context_parallel import _one_per_head, _repeated
    from ir import trace
    from plan.cp_rules import kv_head_repeats, local_kv_repeats
    from planner.search.cp_search import kv_block_bytes

    def attention_node(graph: Any) -> Any:
        return next(n for n in graph.nodes if n.target == "aten.scaled_dot_product_attention.default")

    model, inputs = build_model("llama-tiny", device="meta")  # 4 heads, 2 K/V heads
    graph = trace(model, inputs)
    n = attention_node(graph)
    assert (kv_head_repeats(graph, n, 1), kv_head_repeats(graph, n, 2)) == (2, 2)
    k = graph[n.args[1]].outputs[0]
    whole = 2 * k.numel * k.itemsize
    assert kv_block_bytes(graph, n, None, (1,)) == whole / 2
    heads_split = [[Shard(1)]] * 3  # q, k and v: heads over the one mesh axis
    assert kv_block_bytes(graph, n, heads_split, (2,)) == whole / 2 / 2  # one K/V head each
    assert kv_block_bytes(graph, n, heads_split, (4,)) == whole / 4  # one query head each
    assert (local_kv_repeats(16, 16), local_kv_repeats(2, 1), local_kv_repeats(6, 4)) == (16, 1, 2)
    gpt, gpt_inputs = build_model("gpt-tiny", device="meta")
    gpt_graph = trace(gpt, gpt_inputs)
    assert kv_head_repeats(gpt_graph, attention_node(gpt_graph), 1) == 1
    q, x = torch.randn(2, 4, 6, 4), torch.randn(2, 6, 8)
    for tiled, want in ((False, 2), (True, 1)):
        g = trace(_Attention(tiled), (q, x))
        assert kv_head_repeats(g, attention_node(g), 1) == want, tiled

    kv = torch.randn(2, 2, 6, 4, requires_grad=True)  # [rows, K/V heads, tokens, dim]
    repeated = kv[:, :, None].expand(2, 2, 2, 6, 4).reshape(2, 4, 6, 4)
    grads = []
    for k_read in (repeated, _repeated(_one_per_head(repeated, 2), 4)):
        out = F.scaled_dot_product_attention(q, k_read, k_read, is_causal=True)
        grads.append(torch.autograd.grad(out.square().sum(), kv)[0])
        assert torch.equal(k_read, repeated)
    assert torch.allclose(grads[0], grads[1], rtol=1e-6, atol=1e-6)


def _cp_plan(tmp_path: Any, model: str, devices: int, cp: int, *, precision: str = "fp32",
             comm_type: str | None = None, pp: tuple[int, ...] = (1,),
             schedule: str | None = None, zero: int | None = None,
             batch_size: int | None = None) -> Any:
    """A searched plan of zoo ``model`` (of ``batch_size`` sequences, where
    given) with context parallel size ``cp`` on ``local-cpu:devices`` (its
    exchange set to ``comm_type`` where given: the runtime runs what the plan
    says), saved; returns its path."""
    zoo_kwargs = {} if batch_size is None else {"batch_size": batch_size}
    m, inputs = build_model(model, device="meta", seed=0, **zoo_kwargs)
    p = plan(m, f"local-cpu:{devices}", example_inputs=inputs, context_parallel=(cp,), pp=pp,
             precision=precision, model_source=model, zoo_kwargs=zoo_kwargs, time_limit_s=5.0,
             schedules=(schedule,) if schedule else None,
             zero_stages=(zero,) if zero is not None else None)
    path = tmp_path / f"{model}_{devices}_{cp}.json"
    p.save(path)
    if comm_type is not None:
        record = json.loads(path.read_text())
        record["training"]["context_parallel"]["comm_type"] = comm_type
        path.write_text(json.dumps(record))
    return path


@pytest.mark.multiprocess
@pytest.mark.parametrize("model,devices,cp,precision,comm_type", [
    ("gpt-tiny", 4, 4, "fp32", None),             # cp alone, 4 ranks, ring
    ("llama-tiny", 2, 2, "fp32", "all_gather"),   # grouped-query heads, 2 ranks, K/V gathered
    ("llama-tiny", 4, 2, "bf16-mixed", None),     # cp x tensor parallel on a 2x2 mesh
])
def test_context_parallel_plans_train_as_one_process_does(tmp_path, model, devices, cp,
                                                          precision, comm_type):
    with_tp = devices == 4 and cp == 2
    # without ZeRO there, and of two sequences: with more the search takes the
    # whole mesh for cp x data parallelism, and this case is cp x tensor parallelism
    path = _cp_plan(tmp_path, model, devices, cp, precision=precision, comm_type=comm_type,
                    zero=0 if with_tp else None, batch_size=2 if with_tp else None)
    p = load_plan(path)
    assert p.training["context_parallel"]["size"] == cp and unrunnable_reason(p) is None
    if with_tp:  # the other mesh axis splits weights (tensor parallelism)
        assert tuple(p.mesh_shape) == (2, 2)
        assert any(pl[1] != "R" for pl in p.parameters.values())
    result = launch(path, check=True, steps=2, timeout_s=240)
    tolerance = 1e-5 if precision == "fp32" else 5e-2
    assert result["passed"], result["output"]
    assert result["max_loss_rel_err"] <= tolerance
    assert result["max_rel_grad_err"] <= tolerance and not result["missing_grads"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("model,schedule,zero", [
    ("gpt-tiny", "zbv", 0),            # the backward split in two (input, then weights)
    # FSDP2 stages, gathered unit by unit (ZeRO-3 pipelines: tests/test_pipeline_run.py)
    pytest.param("llama-tiny", "1f1b", 3, marks=pytest.mark.slow),
])
def test_context_parallel_pipelines_train_as_one_process_does(tmp_path, model, schedule, zero):
    path = _cp_plan(tmp_path, model, 4, 2, pp=(2,), schedule=schedule, zero=zero)
    p = load_plan(path)
    assert p.pipeline is not None and p.pipeline.schedule == schedule
    assert unrunnable_reason(p) is None
    result = launch(path, check=True, steps=2, timeout_s=240)
    assert result["passed"], result["output"]
    assert result["max_loss_rel_err"] <= 1e-5 and result["max_rel_grad_err"] <= 1e-5
