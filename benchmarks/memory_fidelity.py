"""Predicted peak memory against torch's own count of the same training step.

    python benchmarks/memory_fidelity.py --no-math        # the whole grid, ~8 min on 2 cores
    python benchmarks/memory_fidelity.py --quick          # gpt-tiny only
    python benchmarks/memory_fidelity.py --no-fake        # the real CPU models only
    python benchmarks/memory_fidelity.py --plan-only --plans DIR   # plans to carry to a GPU
    python benchmarks/memory_fidelity.py --device cuda --plans DIR # on the GPU (see below)
    python benchmarks/memory_fidelity.py --ranks          # per-rank table, 4 CPU ranks (~10 min)

For every precision (``fp32``, ``bf16``, ``bf16-mixed``) and with and without
activation checkpointing (``recompute=False`` / ``True``: no layer / every layer):

* predicted: ``planner.plan(..., mesh_shape=(1,), precision=p, recompute=r)`` on one
  device, ``plan.predicted["memory_bytes_per_device"]["peak"]`` (bytes). The plan
  gets an unbounded memory budget (1e15 bytes), so that a forced ``recompute``
  always has a plan: only its prediction is read.
* measured on the CPU, the verdict: one steady-state step of the plan's own
  runtime on one rank (:func:`measure_executor_step`: ``parallelize(plan)``, what
  ``planner run`` and ``planner train`` build, the training job's step, AdamW
  foreach), every tensor storage counted from before the build
  (:class:`LiveStorages`), so that anything the runtime holds beyond what is
  priced shows (``--no-executor`` leaves it out);
* measured on the CPU beside it: one steady-state step of :class:`benchmarks.plain_loop.PlainLoop`
  (the same model, precision and the *plan's* ``checkpoint`` layers), counted by
  torch's ``torch.distributed._tools.mem_tracker.MemTracker`` (live tensor storages,
  bytes). The step is the second: a first, untracked step allocates the AdamW
  states, so the count covers parameters, buffers, inputs and optimizer states held
  before the step, plus everything forward, backward, ``optimizer.step()`` and
  ``zero_grad`` allocate: the steady state the planner's memory model prices.
* measured with ``--device cuda``: ``torch.cuda.max_memory_allocated`` of a
  steady-state step of the plain loop and of the plan's executor (what ``planner
  run`` runs on a rank), on one GPU (:mod:`benchmarks.cuda_memory`); the plain loop
  gives the verdict. The GPU image has no OR-Tools: make the plans here with
  ``--plan-only --plans DIR`` and carry DIR. ``--measured-from`` prices an earlier
  result's measurements again with this checkout's planner.

Models (:data:`MODELS`): real ones run on this CPU (``gpt-tiny``, 8 x 32, and a
4-layer 256-wide GPT, Llama and MoE, 4 x 256), priced on ``local-cpu:1``; and the grid of issue
40 under ``FakeTensorMode`` on the CPU (nothing is allocated; MemTracker counts the
fake storages), priced on one H100: gpt2, gpt3-350m, gpt3-1.3b, gpt3-2.7b, llama3-8b
with 4 layers, moe-8x with 2, deepseek-v3 with a dense and a MoE layer, each at its
full width and vocabulary.

On the CPU each step is measured with torch's default
``scaled_dot_product_attention`` kernel (what a user's loop runs; the verdict) and,
unless ``--no-math``, with the math kernel forced (``SDPBackend.MATH``: the s x s
scores the capture records), so that a gap can be put on attention or elsewhere.
A model made from a config has a factory here (:data:`FACTORIES`) that its
plans name as their source, so that the runtime builds it as it builds any
plan's model. Verdict (on the executor where measured, else the plain loop):
predicted / measured within [1 - :data:`UNDER`, 1 + :data:`TOLERANCE`]
(3 % under, 5 % over).

``--ranks``: instead of the grid, a per-rank table (:func:`ranks_main`) of a small
model (``--rank-model``, default ``llama-4x256``, in ``--rank-precision``, default
bf16-mixed) under four plans on ``local-cpu:4`` (:data:`RANK_PLANS`: the 2 x 2
search, two 1F1B pipeline stages of 2 ranks, ZeRO-3 over 4 ranks, context
parallelism of 2), each run by torchrun (gloo, 4 CPU ranks); on every rank the
2nd step of ``parallelize(plan)`` counted as :func:`measure_executor_step` counts
it, against the plan's predicted peak per device. Writes
``benchmarks/results/memory_fidelity_ranks.json`` (or ``--ranks-out``).

Writes ``benchmarks/results/memory_fidelity.json`` (or ``--out``) and prints the
table. Units: bytes (the table shows MB = 1e6 bytes).
Exit status: 0 every case measured, 1 some case failed (its error is in the JSON),
2 ``--device cuda`` without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
import warnings
import weakref
from typing import Any, Callable, Iterator

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from benchmarks.common import load_average, machine_block, write_results, wrote_message
from benchmarks.plain_loop import PlainLoop, plan_one_device, predicted_of, tracked_peak_memory

PRECISIONS = ("fp32", "bf16", "bf16-mixed")
#: the verdict: predicted / measured at most TOLERANCE over and UNDER under 1
TOLERANCE = 0.05
UNDER = 0.03
UNBOUNDED_BYTES = 1e15
RECOMPUTE = {"off": False, "on": True, "auto": None}
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                           "memory_fidelity.json")


def _cpu_small_config() -> Any:
    from models.zoo import GPTConfig

    return GPTConfig(n_layer=4, n_embd=256, n_head=8, vocab_size=2048, block_size=256)


def _cut(zoo_name: str, layers: int, **more: int) -> Any:
    """A config factory: the zoo model ``zoo_name`` with only ``layers`` layers
    (its full width and vocabulary) and the ``more`` fields replaced."""
    def config() -> Any:
        import dataclasses

        from models import zoo
        cfg = zoo.config(zoo_name)
        field = "n_layer" if hasattr(cfg, "n_layer") else "n_layers"
        return dataclasses.replace(cfg, **{field: layers}, **more)
    return config


def _sized(zoo_name: str, **fields: int) -> Any:
    """A config factory: the zoo model ``zoo_name`` with ``fields`` replaced."""
    def config() -> Any:
        import dataclasses

        from models import zoo
        return dataclasses.replace(zoo.config(zoo_name), **fields)
    return config


#: name -> (zoo name or None, config factory or None, batch, seq, cluster, fake).
#: The fake models (FakeTensorMode on CPU, priced on one H100) are the grid the
#: GPU run measures too, at the same shapes: each fits an 80 GB GPU in fp32
#: without checkpointing.
MODELS: dict[str, tuple[str | None, Any, int, int, str, bool]] = {
    "gpt-tiny": ("gpt-tiny", None, 8, 32, "local-cpu:1", False),
    "gpt-4x256": (None, _cpu_small_config, 4, 256, "local-cpu:1", False),
    "llama-4x256": (None, _sized("llama-tiny", n_layers=4, dim=256, n_heads=8, n_kv_heads=4,
                                 ffn_dim=688, vocab_size=2048, max_seq_len=256),
                    4, 256, "local-cpu:1", False),
    "moe-4x256": (None, _sized("moe-tiny", n_layer=4, n_embd=256, n_head=8, n_expert=4,
                               expert_hidden=512, vocab_size=2048, block_size=256,
                               group_size=256), 4, 256, "local-cpu:1", False),
    "gpt2": ("gpt2", None, 8, 1024, "h100:1", True),
    "gpt3-350m": ("gpt3-350m", None, 4, 2048, "h100:1", True),
    "gpt3-1.3b": ("gpt3-1.3b", None, 4, 2048, "h100:1", True),
    "gpt3-2.7b": ("gpt3-2.7b", None, 1, 2048, "h100:1", True),
    "llama3-8b-4l": (None, _cut("llama3-8b", 4), 2, 2048, "h100:1", True),
    "moe-8x-2l": (None, _cut("moe-8x", 2), 2, 2048, "h100:1", True),
    # one dense layer and one of 256 experts, as the model's layers are (too big for
    # one GPU in fp32: measured on fake tensors only)
    "deepseek-v3-2l": (None, _cut("deepseek-v3", 2, n_dense_layers=1), 1, 4096, "h100:1", True),
}
#: the models :data:`MODELS` builds from a config: name -> the factory a plan
#: names as its model source (``benchmarks.memory_fidelity:FACTORY``), so that the
#: runtime builds them itself, on meta, as ``planner run`` builds any plan's model
FACTORIES = {"gpt-4x256": "gpt_4x256", "llama-4x256": "llama_4x256", "moe-4x256": "moe_4x256",
             "llama3-8b-4l": "llama3_8b_4l", "moe-8x-2l": "moe_8x_2l",
             "deepseek-v3-2l": "deepseek_v3_2l"}


def _source(name: str) -> str:
    """The model source of ``name``'s plans: its zoo name or its factory."""
    return MODELS[name][0] or f"benchmarks.memory_fidelity:{FACTORIES[name]}"


def _factory(name: str) -> Callable[..., tuple[torch.nn.Module, tuple]]:
    def factory(batch_size: int | None = None, seq_len: int | None = None
                ) -> tuple[torch.nn.Module, tuple]:
        from models import zoo

        _, cfg, batch, seq, _, _ = MODELS[name]
        return zoo.build_from_config(cfg(), device=torch.get_default_device(),
                                     batch_size=batch_size or batch, seq_len=seq_len or seq)
    factory.__name__ = FACTORIES[name]
    factory.__doc__ = f"``{name}`` of :data:`MODELS` on the default device (a plan's model source)."
    return factory


gpt_4x256 = _factory("gpt-4x256")
llama_4x256 = _factory("llama-4x256")
moe_4x256 = _factory("moe-4x256")
llama3_8b_4l = _factory("llama3-8b-4l")
moe_8x_2l = _factory("moe-8x-2l")
deepseek_v3_2l = _factory("deepseek-v3-2l")


def _cluster(spec: str) -> Any:
    from costmodel.presets import load_cluster

    if spec == "h100:1":  # one H100: the dgx-h100 preset cut to one device
        return load_cluster("dgx-h100").sub_cluster(1, 1)
    return load_cluster(spec)


def _build(name: str, device: str, batch: int, seq: int) -> tuple[torch.nn.Module, tuple]:
    from models import zoo
    zoo_name, cfg, _, _, _, _ = MODELS[name]
    if zoo_name is not None:
        return zoo.build(zoo_name, device=device, batch_size=batch, seq_len=seq)
    return zoo.build_from_config(cfg(), device=device, batch_size=batch, seq_len=seq)


def _cpu_takes_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                    scale: float | None) -> bool:
    """Whether the CPU's ``scaled_dot_product_attention`` runs the math path for
    these head sizes and dtype: its own choice (``torch._fused_sdp_choice``, 0 is
    math) asked on small real tensors of the same dtype and head sizes (under
    FakeTensorMode the op answers math for any shape)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        small = [torch.zeros(1, 1, 8, t.shape[-1], dtype=t.dtype) for t in (q, k, v)]
        return int(torch._fused_sdp_choice(*small, None, 0.0, is_causal, scale=scale)) == 0


@contextlib.contextmanager
def _target_attention() -> Iterator[None]:
    """Fake models are priced on an H100: where the CPU has no fused attention
    kernel for a shape (DeepSeek-V3's value heads of 128 beside query/key heads
    of 192: CPU's flash kernel needs equal head sizes) and would take the math
    path (an s x s score matrix, in fp32 for bf16 inputs), which no GPU runs,
    ``F.scaled_dot_product_attention`` runs CUDA's memory-efficient kernel
    instead, what SDPA picks there for unequal head sizes (flash needs them
    equal), through its meta kernels on the fake tensors. It saves what the
    planner prices for the fused node: q, k, v, the output and a float32
    log-sum-exp. Shapes the CPU runs fused are left alone (CPU's flash kernel
    saves what CUDA's does). The function is replaced for the duration, not
    hooked through a mode, so that a checkpointed layer's recomputation (run
    by the autograd engine) calls the same kernel."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
             is_causal: bool = False, scale: float | None = None,
             enable_gqa: bool = False) -> torch.Tensor:
        if (attn_mask is None and not dropout_p and not enable_gqa and query.dim() == 4
                and query.shape[-1] % 8 == 0 and value.shape[-1] % 8 == 0
                and _cpu_takes_math(query, key, value, is_causal, scale)):
            grad = any(t.requires_grad for t in (query, key, value))
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, None, grad, 0.0, is_causal, scale=scale)[0]
        return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                        enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def _attention(kind: str, fake: bool = False) -> Iterator[None]:
    """``default``: the kernel SDPA picks (for ``fake`` models, the target GPU's
    where the CPU would take the math path: :func:`_target_attention`);
    ``math``: the math kernel forced."""
    if kind == "default":
        with _target_attention() if fake else contextlib.nullcontext():
            yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


def measure_step(name: str, precision: str, checkpoint: list[str], attention: str,
                 batch: int, seq: int) -> dict[str, Any]:
    """MemTracker's peak of one steady-state step (bytes), real or fake per ``MODELS``."""
    fake = MODELS[name][5]
    t0 = time.perf_counter()
    mode: Any = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
    with mode, _attention(attention, fake):
        model, inputs = _build(name, "cpu", batch, seq)
        loop = PlainLoop(model, inputs, precision=precision, checkpoint=checkpoint)
        out = tracked_peak_memory(loop, warmup=1)
        del loop, model, inputs
    gc.collect()
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


class LiveStorages(TorchDispatchMode):
    """Bytes of the tensor storages made while it is active and still alive,
    and their peak: what a process holds, counted as MemTracker counts a
    storage (``nbytes``: numel x itemsize, no allocator rounding), but every
    storage made under it, not only those registered with it, so that a copy
    nobody asked for (a second weight, a cache) counts too.

    Every op's outputs are seen (autograd's backward ops too: the mode is
    propagated to the engine); a storage counts from the first op that
    returns it until its Python object dies (a weak reference). Meta tensors
    do not count; fake ones count only when made by ``fake_mode`` (the
    measured model's; the capture's own fake tensors are no memory).
    ``track_resizes``: storages resized in place (FSDP2's) are read again at
    every op (slower: for the multi-rank table)."""

    def __init__(self, fake_mode: Any = None, *, track_resizes: bool = False) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        #: read every live storage's size again at each op (FSDP2: see _resized)
        self.track_resizes = track_resizes
        self._live: dict[int, tuple[Any, int]] = {}
        self.current = 0
        self.peak = 0

    def reset_peak(self) -> int:
        """Start a new peak from what is live now (bytes)."""
        gc.collect()
        self.peak = self.current
        return self.current

    def _storage(self, t: torch.Tensor) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            t = t._local_tensor
        if t.is_meta:
            return None
        if isinstance(t, FakeTensor):
            if self.fake_mode is None or t.fake_mode is not self.fake_mode:
                return None
        elif type(t) not in (torch.Tensor, torch.nn.Parameter):
            return None  # the capture's functional wrappers and the like
        return t.untyped_storage()

    def _add(self, t: torch.Tensor) -> None:
        st = self._storage(t)
        if st is None:
            return
        key, nbytes = id(st), int(st.nbytes())
        if key in self._live:  # seen before (a view, an in-place op): maybe resized
            ref, old = self._live[key]
            self._live[key] = (ref, nbytes)
            self.current += nbytes - old
            return

        def freed(_: Any, key: int = key) -> None:
            entry = self._live.pop(key, None)
            if entry is not None:
                self.current -= entry[1]

        self._live[key] = (weakref.ref(st, freed), nbytes)
        self.current += nbytes

    def _resized(self) -> None:
        """Read again the size of every live storage: FSDP2 frees a gathered
        parameter by resizing its storage to 0 (and gathers into it again),
        outside any op this mode sees."""
        current = 0
        for key, (ref, old) in list(self._live.items()):
            st = ref()
            if st is None:
                continue
            nbytes = int(st.nbytes())
            if nbytes != old:
                self._live[key] = (ref, nbytes)
            current += nbytes
        self.current = current

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.track_resizes:
            self._resized()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak = max(self.peak, self.current)
        return out


@contextlib.contextmanager
def _one_rank_group() -> Iterator[None]:
    """A one-rank gloo process group for the executor (planning refuses one,
    so it lives only while the executor is measured)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def measure_executor_step(name: str, precision: str, plan: Any, attention: str,
                          batch: int, seq: int) -> dict[str, Any]:
    """The peak of one steady-state step of the plan's own runtime, on one CPU
    rank: :func:`codegen.parallel_model.parallelize` of the plan (what ``planner
    run`` and ``planner train`` build on a rank: the plan's model source built on
    meta, each tensor materialised alone; a fake model is built here, handed
    over and dropped, as the meta build's capture cannot run under a second
    fake mode), ``ParallelModel.optimizer(AdamW, foreach=True)``, and per
    step ``step()``, ``opt.step()``, ``zero_grad(set_to_none=True)`` (the
    training job's step, :mod:`training.job`). Counted by :class:`LiveStorages`
    from before the build: what the runtime holds before the step (``before_step_bytes``:
    parameters, buffers, inputs, optimizer states, and anything else it keeps)
    plus what the step allocates. The step is the second, as for the plain loop."""
    from codegen.parallel_model import parallelize

    fake = MODELS[name][5]
    t0 = time.perf_counter()
    mode: Any = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
    with mode as fake_mode, _attention(attention, fake), _one_rank_group(), \
            warnings.catch_warnings(), LiveStorages(fake_mode if fake else None) as live:
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model, inputs = _build(name, "cpu", batch, seq)
        if not fake and plan.model.get("source") == _source(name):
            del model  # the runtime builds the plan's model itself, on meta
            runtime = parallelize(plan)
        else:  # fake tensors (the meta build captures under a fake mode of its own)
            runtime = parallelize(plan, model, inputs)
            del model
        held = live.reset_peak()
        opt = runtime.optimizer(torch.optim.AdamW, lr=1e-4, foreach=True)

        def step() -> None:
            runtime.step(*inputs)
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        before = live.reset_peak()
        step()
        peak = live.peak
    return {"peak_bytes": int(peak), "before_step_bytes": int(before),
            "built_bytes": int(held), "kind": "live_storages",
            "wall_s": round(time.perf_counter() - t0, 2)}


# --- the multi-rank table (--ranks) --------------------------------------------

#: plan kinds of the multi-rank table, on 4 CPU ranks (local-cpu:4, gloo)
RANK_PLANS = ("2x2", "pp2-1f1b", "zero3", "cp2")
RANK_WORLD = 4
DEFAULT_RANKS_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                 "memory_fidelity_ranks.json")


def make_rank_plan(kind: str, name: str, precision: str, time_limit_s: float) -> Any:
    """A ``kind`` plan (:data:`RANK_PLANS`) of model ``name`` on ``local-cpu:4``:
    ``2x2`` the search on a (2, 2) mesh; ``pp2-1f1b`` two stages of a (2,) mesh,
    1F1B over 2 micro-batches; ``zero3`` one stage of 4 ranks under ZeRO-3
    (FSDP2), 1F1B over 2 micro-batches; ``cp2`` context parallelism of 2."""
    from planner.api import pipeline_plan, plan as search_plan

    _, _, batch, seq, _, _ = MODELS[name]
    model, inputs = _build(name, "meta", batch, seq)
    common = dict(example_inputs=inputs, model_source=_source(name), precision=precision,
                  zoo_kwargs={"batch_size": batch, "seq_len": seq}, time_limit_s=time_limit_s)
    cluster = f"local-cpu:{RANK_WORLD}"
    if kind == "2x2":
        return search_plan(model, cluster, mesh_shape=(2, 2), **common)
    if kind == "pp2-1f1b":
        return pipeline_plan(model, cluster, pp=2, stage_mesh=(2,), schedule="1f1b",
                             num_microbatches=2, **common)
    if kind == "zero3":
        return pipeline_plan(model, cluster, pp=1, stage_mesh=(4,), schedule="1f1b",
                             num_microbatches=2, zero_stage=3, **common)
    if kind == "cp2":
        return search_plan(model, cluster, context_parallel=(2,), pp=(1,), **common)
    raise ValueError(f"unknown plan kind {kind!r}; one of {', '.join(RANK_PLANS)}")


def rank_worker(plan_path: str, out_path: str) -> None:
    """One rank under torchrun: :func:`measure_executor_step`'s count on this
    rank's part of the plan (``parallelize``, the model built on meta, every
    storage counted from before the build), written to ``out_path`` by rank 0
    with every rank's figures."""
    import json

    import torch.distributed as dist

    from codegen.parallel_model import parallelize
    from codegen.plan_model import build_plan_model
    from plan.format import load_plan

    plan = load_plan(plan_path)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t0 = time.perf_counter()
    with warnings.catch_warnings(), LiveStorages(track_resizes=True) as live:
        warnings.simplefilter("ignore")
        _, meta_inputs = build_plan_model(plan, "meta")
        inputs = tuple(torch.zeros(t.shape, dtype=t.dtype) if isinstance(t, torch.Tensor)
                       else t for t in meta_inputs)
        runtime = parallelize(plan)
        built = live.reset_peak()
        opt = runtime.optimizer(torch.optim.AdamW, lr=1e-4, foreach=True)
        losses = []

        def step() -> None:
            losses.append(float(runtime.step(*inputs)))
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        before = live.reset_peak()
        step()
        row = {"rank": rank, "peak_bytes": int(live.peak), "before_step_bytes": int(before),
               "built_bytes": int(built), "losses": losses,
               "wall_s": round(time.perf_counter() - t0, 2)}
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def run_rank_plan(kind: str, name: str, precision: str, time_limit_s: float,
                  timeout_s: float) -> dict[str, Any]:
    """Plan ``kind``, run it on :data:`RANK_WORLD` CPU ranks (torchrun, gloo)
    and compare each rank's measured peak with the plan's prediction."""
    import json
    import subprocess
    import tempfile

    from benchmarks.common import job_env

    row: dict[str, Any] = {"plan": kind, "model": name, "precision": precision}
    t0 = time.perf_counter()
    try:
        plan = make_rank_plan(kind, name, precision, time_limit_s)
    except Exception as err:  # noqa: BLE001 - one plan's failure is recorded
        row["error"] = f"plan: {type(err).__name__}: {_line(err)}"
        return row
    row["plan_s"] = round(time.perf_counter() - t0, 1)
    memory = dict(plan.predicted.get("memory_bytes_per_device", {}))
    row.update(mesh=list(plan.mesh_shape), predicted=memory,
               checkpoint=len(plan.checkpoint),
               context_parallel=plan.training.get("context_parallel"))
    if plan.pipeline is not None:
        row.update(pp=plan.pipeline.pp, schedule=plan.pipeline.schedule,
                   num_microbatches=plan.pipeline.num_microbatches,
                   zero_stages=[st.zero_stage for st in plan.pipeline.stages])
    with tempfile.TemporaryDirectory(prefix="memory-ranks-") as workdir:
        plan_path, out = os.path.join(workdir, "plan.json"), os.path.join(workdir, "ranks.json")
        plan.save(plan_path)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={RANK_WORLD}", os.path.abspath(__file__), "--rank-worker",
               plan_path, out]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=job_env(), capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            row["error"] = f"run: over {timeout_s:.0f} s"
            return row
        row["run_s"] = round(time.perf_counter() - t0, 1)
        if proc.returncode != 0 or not os.path.exists(out):
            first = proc.stderr.find("Traceback")
            row["error"] = "run: " + proc.stderr[max(first, 0):][-1500:]
            return row
        with open(out) as f:
            ranks = json.load(f)
    peak = memory.get("peak")
    for r in ranks:
        r["ratio"] = peak / r["peak_bytes"] if peak and r["peak_bytes"] else None
    row["ranks"] = ranks
    return row


def print_rank_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'plan':<9} {'mesh':<7} {'rank':>4} {'pred MB':>9} {'before MB':>10} "
            f"{'peak MB':>9} {'ratio':>6}")
    print(head)
    print("-" * len(head))
    for row in rows:
        if "error" in row:
            print(f"{row['plan']:<9} error: {row['error'][:300]}")
            continue
        mesh = "x".join(map(str, row["mesh"]))
        for r in row["ranks"]:
            ratio = f"{r['ratio']:.3f}" if r.get("ratio") else "-"
            print(f"{row['plan']:<9} {mesh:<7} {r['rank']:>4} "
                  f"{_mb(row['predicted'].get('peak')):>9} {_mb(r['before_step_bytes']):>10} "
                  f"{_mb(r['peak_bytes']):>9} {ratio:>6}")


def ranks_main(args: argparse.Namespace) -> int:
    """The multi-rank table: each plan of ``args.rank_plans`` on 4 CPU ranks."""
    load_before = load_average()
    start = time.perf_counter()
    rows = []
    for kind in args.rank_plans:
        row = run_rank_plan(kind, args.rank_model, args.rank_precision, args.time_limit,
                            args.rank_timeout)
        rows.append(row)
        ratios = [r["ratio"] for r in row.get("ranks", []) if r.get("ratio")]
        print(f"  {kind}: " + (row["error"][:200] if "error" in row else
                               f"ratios {min(ratios):.3f}-{max(ratios):.3f}"), flush=True)
    print()
    print_rank_table(rows)
    result = {
        "benchmark": "memory_fidelity_ranks",
        "definition": (f"predicted = plan.predicted['memory_bytes_per_device']['peak'] of each "
                       f"plan on local-cpu:{RANK_WORLD}; measured = on every rank (torchrun, "
                       f"gloo, {RANK_WORLD} CPU ranks) the peak of the 2nd step of "
                       "parallelize(plan) (model built on meta by the runtime; "
                       "ParallelModel.step, AdamW foreach step, zero_grad), every tensor "
                       "storage alive counted from before the build (LiveStorages, storage "
                       "resizes read at every op); ratio = predicted / measured"),
        "tolerance": {"over": TOLERANCE, "under": UNDER},
        "machine": machine_block(load_before, after=True),
        "rows": rows,
        "wall_s": round(time.perf_counter() - start, 1),
    }
    write_results(args.ranks_out, result)
    print(wrote_message(args.ranks_out, result))
    return 1 if any("error" in r for r in rows) else 0


def _plan_file(plans_dir: str, name: str, precision: str, recompute: bool | None,
               batch: int, seq: int) -> str:
    return os.path.join(plans_dir, f"{name}-{batch}x{seq}-{precision}-"
                                   f"{_RECOMPUTE_NAME[recompute]}.json")


def make_plan(name: str, precision: str, recompute: bool | None, batch: int, seq: int,
              time_limit_s: float, plans_dir: str | None = None) -> tuple[Any, bool]:
    """The row's one-device plan (unbounded memory budget), and whether it was
    loaded: from ``plans_dir`` when it holds the row's plan, else planned here
    (and saved there when given)."""
    from plan.format import load_plan

    path = _plan_file(plans_dir, name, precision, recompute, batch, seq) if plans_dir else None
    if path and os.path.exists(path):
        return load_plan(path), True
    model, inputs = _build(name, "meta", batch, seq)
    plan = plan_one_device(model, inputs, _cluster(MODELS[name][4]), precision=precision,
                           recompute=recompute, model_source=_source(name),
                           zoo_kwargs={"batch_size": batch, "seq_len": seq},
                           memory_budget=UNBOUNDED_BYTES, time_limit_s=time_limit_s)
    if path:
        os.makedirs(plans_dir, exist_ok=True)
        plan.save(path)
    return plan, False


def within(ratio: float) -> bool:
    """The verdict: predicted / measured in [1 - UNDER, 1 + TOLERANCE]."""
    return 1.0 - UNDER <= ratio <= 1.0 + TOLERANCE


def measure_fake_or_cpu(name: str, precision: str, plan: Any, attentions: list[str],
                        batch: int, seq: int, executor: bool = True) -> dict[str, Any]:
    """The peaks of the plan's runtime (``executor``, the verdict's side, with
    the default attention kernel: :func:`measure_executor_step`) and of the
    plain loop per attention kernel (MemTracker), CPU or fake."""
    out: dict[str, Any] = {}
    if executor:
        try:
            out["executor"] = measure_executor_step(name, precision, plan, "default",
                                                    batch, seq)
        except Exception as err:  # noqa: BLE001 - the plain loop is still measured
            out["executor"] = {"error": f"{type(err).__name__}: {_line(err)}"}
    for attention in attentions:
        out[attention] = measure_step(name, precision, list(plan.checkpoint), attention,
                                      batch, seq)
    return out


def measure_cuda(name: str, precision: str, plan: Any, mesh: Any, batch: int, seq: int,
                 breakdown: bool) -> dict[str, Any]:
    """``max_memory_allocated`` of the plain loop and of the plan's executor."""
    from benchmarks.cuda_memory import executor_peaks, plain_peaks

    device = torch.device("cuda", torch.cuda.current_device())

    def build() -> tuple[torch.nn.Module, tuple]:
        return _build(name, device, batch, seq)

    out: dict[str, Any] = {}
    for kind, fn in (("plain", lambda: plain_peaks(build, precision, list(plan.checkpoint),
                                                    device, breakdown=breakdown)),
                     ("executor", lambda: executor_peaks(build, plan, mesh, device,
                                                         breakdown=breakdown))):
        try:
            out[kind] = fn()
        except Exception as err:  # noqa: BLE001 - the other side is still measured
            out[kind] = {"error": f"{type(err).__name__}: {_line(err)}"}
            torch.cuda.empty_cache()
    return out


def run_case(name: str, precision: str, recompute: bool | None, batch: int, seq: int,
             time_limit_s: float, measure: Callable[[str, str, Any, int, int], dict[str, Any]],
             plans_dir: str | None = None) -> dict[str, Any]:
    """One row: the plan's prediction and the measured peaks (``measure(name,
    precision, plan, batch, seq)`` -> ``{side: {"peak_bytes", ...}}``; the first
    side is the verdict's); errors recorded, not raised."""
    _, _, _, _, cluster_spec, fake = MODELS[name]
    row: dict[str, Any] = {"model": name, "batch_size": batch, "seq_len": seq,
                           "precision": precision, "recompute": recompute,
                           "cluster": cluster_spec, "fake": fake}
    try:
        t0 = time.perf_counter()
        plan, loaded = make_plan(name, precision, recompute, batch, seq, time_limit_s,
                                 plans_dir)
        row["plan_s"] = round(time.perf_counter() - t0, 2)
        row["plan_loaded"] = loaded
        pred = predicted_of(plan)
        row["predicted"] = pred
        row["plan_precision"] = pred["precision"]
    except Exception as err:  # noqa: BLE001 - one case's failure is recorded
        row["error"] = f"plan: {type(err).__name__}: {_line(err)}"
        return row
    try:
        row["measured"] = measure(name, precision, plan, batch, seq)
    except Exception as err:  # noqa: BLE001
        row["error"] = f"measure: {type(err).__name__}: {_line(err)}"
        return row
    for side, m in row["measured"].items():
        if "error" in m:
            row.setdefault("error", f"measure ({side}): {m['error']}")
        elif m.get("peak_bytes"):
            m["ratio"] = pred["peak_bytes"] / m["peak_bytes"]
    first = next(iter(row["measured"].values()), {})
    if first.get("ratio") is not None:
        row["ratio"] = first["ratio"]
        row["within_tolerance"] = within(first["ratio"])
    return row


def _line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


_RECOMPUTE_NAME = {v: k for k, v in RECOMPUTE.items()}


def _mb(x: Any) -> str:
    return f"{x / 1e6:,.1f}" if isinstance(x, (int, float)) else "-"


def print_table(rows: list[dict[str, Any]]) -> None:
    """Predicted against each measured side (CPU: default and math attention;
    CUDA: plain loop and executor), in MB."""
    sides = list(dict.fromkeys(k for r in rows for k in r.get("measured", {})))
    head = (f"{'model':<14} {'b x s':>9} {'precision':<10} {'recompute':>9} {'ckpt':>4} "
            f"{'pred MB':>11} " + " ".join(f"{side[:8] + ' MB':>11} {'ratio':>6}"
                                           for side in sides) + "  verdict")
    print(head)
    print("-" * len(head))
    for r in rows:
        pred = r.get("predicted", {})
        ck = len(pred.get("checkpoint", [])) if pred else "-"
        verdict = ("PASS" if r.get("within_tolerance") else "FAIL") if "ratio" in r else "ERROR"
        cells = []
        for side in sides:
            m = r.get("measured", {}).get(side, {})
            ratio = f"{m['ratio']:.3f}" if m.get("ratio") is not None else "-"
            cells.append(f"{_mb(m.get('peak_bytes')):>11} {ratio:>6}")
        print(f"{r['model']:<14} {r['batch_size']:>4}x{r['seq_len']:<4} {r['precision']:<10} "
              f"{_RECOMPUTE_NAME[r['recompute']]:>9} {ck!s:>4} {_mb(pred.get('peak_bytes')):>11} "
              + " ".join(cells) + f"  {verdict}")
        if "error" in r:
            print(f"    error: {r['error']}")


def _earlier_rows(path: str) -> dict[tuple, dict[str, Any]]:
    """The measured rows of an earlier result, by (model, batch, seq, precision,
    checkpointed layers)."""
    import json

    with open(path) as f:
        rows = json.load(f)["rows"]
    return {(r["model"], r["batch_size"], r["seq_len"], r["precision"],
             tuple(r["predicted"]["checkpoint"])): r for r in rows if r.get("measured")}


def _cuda_mesh() -> Any:
    """A one-rank NCCL group and its one-device mesh, for the executor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29573")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    return init_device_mesh("cuda", (1,))


DEFINITIONS = {
    "cpu": ("measured, real tensors on CPU or FakeTensorMode: executor = peak of the 2nd "
            "step of the plan's runtime on one rank (codegen.parallel_model.parallelize of "
            "the plan, model built on meta by the runtime; ParallelModel.step, AdamW foreach "
            "step, zero_grad), every tensor storage alive counted from before the build "
            "(LiveStorages); default / math = MemTracker peak of the 2nd step of "
            "benchmarks.plain_loop (AdamW foreach, the plan's checkpoint layers) with the "
            "default SDPA kernel / the math kernel forced; ratio = predicted / measured, the "
            "verdict on the executor"),
    "cuda": ("measured = torch.cuda.max_memory_allocated of one steady-state step (after "
             "one) of benchmarks.plain_loop (plain) and of codegen.executor.PlanExecutor "
             "(executor: what planner run runs on a rank), AdamW foreach, on one GPU "
             "(benchmarks.cuda_memory); ratio = predicted / measured, the verdict on plain"),
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS),
                    help="models to measure (default: all; --quick: gpt-tiny)")
    ap.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    ap.add_argument("--recompute", nargs="+", choices=sorted(RECOMPUTE), default=["off", "on"],
                    help="checkpointing of the plans: off (no layer), on (every layer), "
                         "auto (the solver's choice); default off on")
    ap.add_argument("--quick", action="store_true", help="gpt-tiny only")
    ap.add_argument("--no-fake", action="store_true", help="leave out the FakeTensorMode models")
    ap.add_argument("--no-math", action="store_true",
                    help="measure with the default attention kernel only (CPU)")
    ap.add_argument("--no-executor", action="store_true",
                    help="CPU: measure the plain loop only (the verdict then on it)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: MemTracker on CPU tensors or fake ones; cuda: "
                         "max_memory_allocated of the plain loop and the executor on one GPU")
    ap.add_argument("--plans", metavar="DIR",
                    help="load each row's plan from DIR when there, else plan and save it "
                         "there (the GPU machine has no ortools: plan here, carry DIR)")
    ap.add_argument("--plan-only", action="store_true",
                    help="make (and with --plans save) the plans, measure nothing")
    ap.add_argument("--measured-from", metavar="JSON",
                    help="take each row's measurements from this earlier result (e.g. a GPU "
                         "run) and price it again with this checkout's planner")
    ap.add_argument("--breakdown", nargs="*", default=[], metavar="MODEL",
                    help="CUDA: also list the allocations live at the peak for these models")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="rows that would start after this many seconds are skipped")
    ap.add_argument("--time-limit", type=float, default=30.0, help="ILP time limit, seconds")
    ap.add_argument("--out", default=DEFAULT_OUT, help="result JSON")
    ap.add_argument("--ranks", action="store_true",
                    help=f"instead of the grid: the multi-rank table ({RANK_WORLD} CPU ranks)")
    ap.add_argument("--rank-plans", nargs="+", choices=RANK_PLANS, default=list(RANK_PLANS))
    ap.add_argument("--rank-model", choices=list(MODELS), default="llama-4x256")
    ap.add_argument("--rank-precision", choices=PRECISIONS, default="bf16-mixed")
    ap.add_argument("--rank-timeout", type=float, default=600.0,
                    help="seconds each plan's torchrun job may take")
    ap.add_argument("--ranks-out", default=DEFAULT_RANKS_OUT, help="the table's result JSON")
    ap.add_argument("--rank-worker", nargs=2, metavar=("PLAN", "OUT"), help=argparse.SUPPRESS)
    return ap


def _measurer(args: argparse.Namespace, mesh: Any
              ) -> Callable[[str, str, Any, int, int], dict[str, Any]]:
    """``measure(name, precision, plan, batch, seq)``: a row's measured bytes
    (nothing under ``--plan-only``; an earlier result's under
    ``--measured-from``; else measured on ``args.device``)."""
    attentions = ["default"] if args.no_math else ["default", "math"]
    earlier = _earlier_rows(args.measured_from) if args.measured_from else None

    def measure(name: str, precision: str, plan: Any, batch: int, seq: int) -> dict[str, Any]:
        if args.plan_only:
            return {}
        if earlier is not None:
            row = earlier.get((name, batch, seq, precision, tuple(plan.checkpoint)))
            if row is None:
                raise LookupError(f"{args.measured_from} has no row of {name} {batch}x{seq} "
                                  f"{precision} with these checkpointed layers")
            return {side: {k: v for k, v in m.items() if k != "ratio"}
                    for side, m in row["measured"].items()}
        if args.device == "cuda":
            return measure_cuda(name, precision, plan, mesh, batch, seq,
                                breakdown=name in args.breakdown)
        return measure_fake_or_cpu(name, precision, plan, attentions, batch, seq,
                                   executor=not args.no_executor)

    return measure


def _rows(names: list[str], args: argparse.Namespace,
          measure: Callable[[str, str, Any, int, int], dict[str, Any]],
          start: float) -> list[dict[str, Any]]:
    """One row per model, precision and recompute setting; rows that would
    start after ``args.budget_s`` seconds from ``start`` are skipped."""
    rows: list[dict[str, Any]] = []
    for name in names:
        _, _, batch, seq, _, _ = MODELS[name]
        for precision in args.precisions:
            for recompute in (RECOMPUTE[k] for k in args.recompute):
                if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                    rows.append({"model": name, "batch_size": batch, "seq_len": seq,
                                 "precision": precision, "recompute": recompute,
                                 "skipped": "time budget"})
                    continue
                row = run_case(name, precision, recompute, batch, seq, args.time_limit,
                               measure, args.plans)
                rows.append(row)
                print(f"  {name} {precision} recompute={recompute}: "
                      + (f"ratio {row['ratio']:.3f}" if "ratio" in row else
                         row.get("error", "planned" if args.plan_only else "no ratio")),
                      flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    if args.rank_worker:
        rank_worker(*args.rank_worker)
        return 0
    if args.ranks:
        return ranks_main(args)
    if args.device == "cuda" and not (args.plan_only or args.measured_from) \
            and not torch.cuda.is_available():
        print("memory_fidelity: error: --device cuda but torch sees no CUDA GPU",
              file=sys.stderr)
        return 2

    names = args.models or (["gpt-tiny"] if args.quick else list(MODELS))
    if args.no_fake:
        names = [n for n in names if not MODELS[n][5]]
    measuring_cuda = args.device == "cuda" and not (args.plan_only or args.measured_from)
    measure = _measurer(args, _cuda_mesh() if measuring_cuda else None)

    load_before = load_average()
    start = time.perf_counter()
    rows = _rows(names, args, measure, start)
    done = [r for r in rows if "skipped" not in r]
    print()
    print_table(done)
    measured = [r for r in done if "ratio" in r]
    result = {
        "benchmark": "memory_fidelity",
        "definition": ("predicted = plan.predicted['memory_bytes_per_device']['peak'] of "
                       "planner.plan(mesh (1,), precision, recompute, memory budget 1e15); "
                       + DEFINITIONS[args.device]),
        "tolerance": {"over": TOLERANCE, "under": UNDER},
        "machine": machine_block(load_before, after=True),
        "rows": rows,
        "summary": {"cases": len(rows), "measured": len(measured),
                    "within_tolerance": sum(bool(r["within_tolerance"]) for r in measured),
                    "errors": sum("error" in r for r in rows),
                    "skipped": sum("skipped" in r for r in rows)},
        "wall_s": round(time.perf_counter() - start, 1),
    }
    if args.measured_from:
        result["measured_from"] = os.path.relpath(args.measured_from)
    if measuring_cuda:
        result["machine"]["gpu"] = torch.cuda.get_device_name(0)
        result["machine"]["cuda"] = torch.version.cuda
    write_results(args.out, result)
    print(f"\n{result['summary']['within_tolerance']} of {len(rows)} cases within "
          f"-{UNDER:.0%}/+{TOLERANCE:.0%}; {result['summary']['errors']} errors, "
          f"{result['summary']['skipped']} skipped")
    print(wrote_message(args.out, result))
    return 1 if result["summary"]["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
