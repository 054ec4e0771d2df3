"""Per-rank measurement loop of ``planner profile`` (see :mod:`costmodel.profiling`).

One process ``python -m costmodel.profiling.worker SPEC.json RANK WORLD`` is one
rank, started by :func:`costmodel.profiling.run.measure`. Every rank runs the same
measurements at the same time, as the ranks of a planned SPMD step would:

* ``overhead``: seconds per eager call of a tiny elementwise op (dispatch +
  launch), the cost model's ``kernel_overhead``;
* ``dispatch`` and ``fsdp_unit``: the distributed runtime's host costs, each a
  step timed plain and distributed (needs ranks > 1;
  :mod:`costmodel.profiling.runtime_costs`);
* ``compiled_call``: seconds per forward+backward call of a compiled region of
  each count of replicated DTensor parameters, host-bound
  (:mod:`costmodel.profiling.compiled_call`);
* ``memory``: seconds per ``dst.copy_(src)`` of a large tensor (bytes moved =
  2 x size: one read, one write);
* ``gemms``: seconds per ``torch.mm`` of each ``(m, k, n, dtype)``;
* ``unaligned_gemms``: the same, recorded in ``gemms`` with ``"unaligned": true``
  (a row not a multiple of 16 bytes);
* ``redistribute``: seconds per DTensor ``redistribute`` over all ranks that
  issues each of these collective kinds (:data:`REDISTRIBUTIONS`), at the same
  sizes: the path a plan's reshards take (functional collectives, DTensor's
  host work, layout copies), waited for; with ``redistribute_burst`` each
  follows a burst of compute, as a step's reshards do (a rank that computed
  waits longer: its peer's compute ended at another time, and gloo's thread
  wakes on a core that was busy), and ``redistribute_burst`` times the burst
  alone;
* ``collectives``: seconds per collective of each kind and size, with sizes
  as :func:`costmodel.collectives.collective_time` defines them (the gathered
  tensor for all_gather, the unsharded input for reduce_scatter, bytes per
  device for all_to_all), for each of ``group_sizes`` (default: the world):
  a group size ``g`` < world runs world/g disjoint groups at once, as the
  groups of one mesh axis do.

Timing: a first pass makes one warm-up call per item and picks ``k``, the
number of back-to-back calls one repetition times (the same on every rank, so
that a repetition lasts at least ``min_rep_s``). Then ``reps`` passes each
time one repetition of every item, interleaved, so that load from elsewhere
on the machine spreads over all items. Each repetition starts at a barrier.
Per repetition, a collective's time is the slowest rank's duration / ``k``;
a compute kernel's (on CPU) is first start to last end over all ranks / ``k``,
i.e. the per-rank time when every rank computes at once, cores shared (on GPU,
each rank has its own device: the slowest rank's duration). The reported
``seconds`` is the median over repetitions; ``reps`` keeps them all.

Rank 0 prints ``step <label>`` after every measurement and writes the result
JSON to ``spec["result_path"]``; a failing rank prints its traceback on stderr
and exits 1.
Units: seconds, bytes, FLOPs.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from costmodel.host_allocator import keep_freed_host_memory
from costmodel.profiling.memory_probe import chain_measurements
from costmodel.profiling.runtime_costs import (dispatch_steps, fsdp_unit_steps, pipeline_steps,
                                               split_backward_steps)

__all__ = ["COLLECTIVE_KINDS", "ItemRunner", "Measure", "Rank", "TimedItem", "count_steps", "join", "main",
           "run_worker", "serve", "timed_steps"]

#: Collectives measured, in this order (names as in costmodel.collectives).
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")

#: What a rank runs: ``(rank, world, spec, report) -> result``; ``report(label)``
#: after every measurement step.
Measure = Callable[[int, int, dict[str, Any], Callable[[str], None]], dict[str, Any]]

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def count_steps(spec: dict[str, Any]) -> int:
    """Progress steps :func:`run_worker` reports for ``spec``: one per item and pass."""
    items = (int(bool(spec.get("overhead"))) + 2 * int(bool(spec.get("dispatch")))
             + 2 * int(bool(spec.get("fsdp_unit"))) + 2 * int(bool(spec.get("pipeline")))
             + int(bool(spec.get("host"))) + len(spec.get("compiled_call", ()))
             + int(bool(spec.get("memory_chain"))) + int(bool(spec.get("fused_chain")))
             + len(spec.get("memory_bytes", ()))
             + len(spec.get("gemms", ())) + len(spec.get("unaligned_gemms", ()))
             + len(spec.get("attention", ()))
             + len(spec.get("collectives", ())) * len(spec.get("sizes", ()))
             * len(spec.get("group_sizes") or [0])
             + len(spec.get("redistribute", ())) * len(spec.get("sizes", ()))
             + int(bool(spec.get("redistribute") and spec.get("redistribute_burst"))))
    return timed_steps(items, spec)


def timed_steps(items: int, spec: dict[str, Any]) -> int:
    """Progress steps :class:`ItemRunner` reports for ``items`` items of
    ``spec``: a warm-up of each, then one per item and pass."""
    return items * (int(spec["reps"]) + 1)


class TimedItem:
    """One measurement: a closure, how ranks are combined, and its record."""

    def __init__(self, label: str, fn: Callable[[], Any], min_rep_s: float, collective: bool,
                 record: dict[str, Any]) -> None:
        self.label, self.fn, self.min_rep_s, self.collective, self.record = label, fn, min_rep_s, collective, record
        self.k = 1
        self.starts: list[float] = []
        self.ends: list[float] = []


class ItemRunner:
    """Times items as the module docstring says, agreeing on ``k`` across ranks."""

    def __init__(self, torch: Any, dist: Any, device: Any, world: int, reps: int,
                 report: Callable[[str], None]) -> None:
        self.torch, self.dist, self.device, self.world, self.reps = torch, dist, device, world, reps
        self.cuda = device.type == "cuda"
        self.report = report

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def _barrier(self) -> None:
        self._sync()
        if self.world > 1:
            if self.cuda:
                self.dist.barrier(device_ids=[self.device.index])
            else:
                self.dist.barrier()
        self._sync()

    def _gather(self, values: list[float]) -> list[list[float]]:
        """``values`` of every rank (rank-major)."""
        if self.world == 1:
            return [values]
        t = self.torch.tensor(values, dtype=self.torch.float64, device=self.device)
        out = [self.torch.empty_like(t) for _ in range(self.world)]
        self.dist.all_gather(out, t)
        return [o.tolist() for o in out]

    def _one_rep(self, item: TimedItem) -> None:
        self._barrier()
        t0 = time.perf_counter()
        for _ in range(item.k):
            item.fn()
        self._sync()
        item.starts.append(t0)
        item.ends.append(time.perf_counter())

    def run(self, items: list[TimedItem], max_k: int = 10_000) -> None:
        # Warm-up and calibration pass: every rank agrees on the slowest rank's k.
        for item in items:
            self._barrier()
            item.fn()  # warm-up (allocation, algorithm selection, connections)
            self._sync()
            t0 = time.perf_counter()
            item.fn()
            self._sync()
            one = max(r[0] for r in self._gather([time.perf_counter() - t0]))
            item.k = int(max(1, min(max_k, math.ceil(item.min_rep_s / max(one, 1e-9)))))
            self.report(f"warm-up {item.label}")
        # Measurement passes, interleaved so that a burst of load elsewhere on
        # the machine spreads over all items instead of spoiling one.
        for p in range(self.reps):
            for item in items:
                self._one_rep(item)
                self.report(f"pass {p + 1}/{self.reps} {item.label}")
        for item in items:
            starts = self._gather(item.starts)
            ends = self._gather(item.ends)
            if item.collective:
                # the slowest rank's duration (the collective synchronises the ranks itself)
                per_rep = [max(e[i] - s[i] for s, e in zip(starts, ends)) / item.k for i in range(self.reps)]
            else:
                # all ranks compute at once: first start to last end (perf_counter is
                # CLOCK_MONOTONIC, one clock for every process of the machine)
                per_rep = [(max(e[i] for e in ends) - min(s[i] for s in starts)) / item.k
                           for i in range(self.reps)] if not self.cuda else \
                          [max(e[i] - s[i] for s, e in zip(starts, ends)) / item.k for i in range(self.reps)]
            item.record.update(seconds=statistics.median(per_rep), reps=per_rep, calls_per_rep=item.k)


def _collective_fn(kind: str, numel: int, group_size: int, torch: Any, dist: Any, device: Any,
                   dtype: Any, group: Any = None, src: int = 0,
                   buffers: dict[int, tuple[Any, Any, Any]] | None = None) -> Callable[[], Any]:
    """A closure issuing one ``kind`` collective over ``numel`` elements (cost-model bytes).

    ``group`` is the process group (None: the world), ``src`` the global rank
    a broadcast starts from. ``buffers`` (numel -> (full, shard, out)) lets
    every kind of one size share its tensors; all hold zeros, so repeated sums
    stay finite.
    """
    bufs = None if buffers is None else buffers.get(numel)
    if bufs is None:
        bufs = (torch.zeros(numel, dtype=dtype, device=device),
                torch.zeros(numel // group_size, dtype=dtype, device=device),
                torch.zeros(numel, dtype=dtype, device=device))
        if buffers is not None:
            buffers[numel] = bufs
    full, shard, out = bufs
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if kind == "broadcast":
        return lambda: dist.broadcast(full, src=src, group=group)
    if kind == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, shard, group=group)
    if kind == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(shard, full, group=group)
    if kind == "all_to_all":
        return lambda: dist.all_to_all_single(out, full, group=group)
    raise ValueError(f"unknown collective kind {kind!r}")


#: DTensor transitions on a 1-D mesh that issue each collective kind:
#: (source placement, destination placement) of a [rows, cols] tensor.
REDISTRIBUTIONS = {"all_gather": ("S(0)", "R"), "all_reduce": ("P", "R"),
                   "reduce_scatter": ("P", "S(0)"), "all_to_all": ("S(1)", "S(0)")}


def _redistribute_fn(kind: str, nbytes: int, r: "Rank", dtype: Any,
                     mesh: Any) -> tuple[Callable[[], Any], int]:
    """A closure redistributing a DTensor over ``mesh`` (every rank) as a
    plan's reshard does, issuing one ``kind`` collective of about ``nbytes``
    (cost-model bytes, as :func:`_collective_fn`), waited for; and the bytes
    it moves."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    torch, g = r.torch, r.world
    place = {"R": Replicate(), "P": Partial(), "S(0)": Shard(0), "S(1)": Shard(1)}
    src, dst = REDISTRIBUTIONS[kind]
    elem = torch.tensor([], dtype=dtype).element_size()
    # the whole tensor: g*g rows of `cols` elements, so every shard splits evenly
    whole = nbytes * (g if kind == "all_to_all" else 1)
    cols = max(g, (whole // elem) // (g * g) // g * g)
    rows = g * g
    local_shape = {"S(0)": (rows // g, cols), "S(1)": (rows, cols // g)}.get(src, (rows, cols))
    x = DTensor.from_local(torch.zeros(local_shape, dtype=dtype, device=r.device), mesh,
                           [place[src]], run_check=False)
    moved = rows * cols * elem // (g if kind == "all_to_all" else 1)

    def step() -> Any:
        local = x.redistribute(mesh, [place[dst]]).to_local()
        wait = getattr(local, "wait", None)  # an asynchronous collective's result
        return wait() if wait is not None else local
    return step, moved


def _burst_fn(r: "Rank", size: int) -> Callable[[], Any]:
    """Three chained ``size`` x ``size`` fp32 GEMMs: the compute a rank does
    between two of a plan's reshards."""
    a = r.torch.randn(size, size, device=r.device)
    return lambda: a @ a @ a @ a


def _redistribute_items(r: "Rank", spec: dict[str, Any], dtype: Any,
                        out: dict[str, Any]) -> list["TimedItem"]:
    """One item per kind of ``spec["redistribute"]`` and size, over every rank,
    each appending its record (as a collective's) to ``out["redistribute"]``.
    With ``spec["redistribute_burst"]`` (a GEMM size) each redistribute follows
    a burst of compute, as in a step, and the burst alone is one more item
    (``out["redistribute_burst"]``), to subtract."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh(r.device.type, list(range(r.world)))
    min_rep_s = float(spec["collective_min_rep_s"])
    items: list[TimedItem] = []
    burst = _burst_fn(r, int(spec["redistribute_burst"])) if spec.get("redistribute_burst") else None
    if burst is not None:
        out["redistribute_burst"] = {"gemm": int(spec["redistribute_burst"])}
        items.append(TimedItem("compute burst", burst, min_rep_s, True, out["redistribute_burst"]))
    for kind in spec.get("redistribute", ()):
        for nbytes in spec.get("sizes", ()):
            fn, moved = _redistribute_fn(kind, int(nbytes), r, dtype, mesh)
            if burst is not None:
                fn = (lambda f: lambda: (burst(), f()))(fn)
            rec = {"kind": kind, "nbytes": moved, "group_size": r.world, "groups": 1}
            out["redistribute"].append(rec)
            items.append(TimedItem(f"redistribute {kind} {moved} B", fn, min_rep_s, True, rec))
    return items


def _tiny_training_step(torch: Any, device: Any, model_name: str) -> tuple[Callable[[], Any], int]:
    """One training step (forward, backward, foreach AdamW, gradients set to
    None) of the zoo model ``model_name``, small enough that the host, not the
    device, bounds it; and the ops the cost model charges the host for in it
    (``costmodel.compute.host_passes`` of its captured program)."""
    from costmodel.compute import host_passes
    from models import zoo
    from ir.trace import trace

    meta_model, meta_inputs = zoo.build(model_name, device="meta")
    passes = host_passes(trace(meta_model, meta_inputs))
    model, inputs = zoo.build(model_name, device=str(device))
    opt = torch.optim.AdamW(model.parameters(), foreach=True)

    def step() -> None:
        model(*inputs).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, passes


def _attention_fn(torch: Any, device: Any, dtype: Any, b: int, h: int, seq: int,
                  d: int) -> Callable[[], Any]:
    """Forward and backward of causal ``scaled_dot_product_attention`` (the
    device's fused kernel) on [b, h, seq, d] queries, keys and values."""
    q, k, v = (torch.randn(b, h, seq, d, dtype=dtype, device=device, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(b, h, seq, d, dtype=dtype, device=device)

    def step() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        q.grad = k.grad = v.grad = None
        out.backward(grad)
    return step


@dataclass(frozen=True)
class Rank:
    """This process's place in the measurement: the ``torch`` and
    ``torch.distributed`` modules, its device, its rank and the world size."""

    torch: Any
    dist: Any
    device: Any
    rank: int
    world: int


def join(rank: int, world: int, spec: dict[str, Any]) -> Rank:
    """Set this rank's threads, device (TF32 off on GPU) and host allocator
    (:mod:`costmodel.host_allocator`) and, with more than one rank, join the
    process group at ``spec["init_method"]``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(spec.get("threads", 1)))
    cuda = spec["device"] == "cuda"
    if not cuda:  # the allocator a plan's CPU ranks run under
        keep_freed_host_memory()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
    if world > 1:
        dist.init_process_group(spec["backend"], init_method=spec["init_method"], rank=rank, world_size=world,
                                **({"device_id": device} if cuda else {}))
    return Rank(torch, dist, device, rank, world)


def _kernel_items(r: Rank, spec: dict[str, Any], min_rep_s: float, out: dict[str, Any]) -> list[TimedItem]:
    """The copies, GEMMs and fused attentions of ``spec``; each appends its
    record to ``out["memory"]``, ``out["gemms"]`` or ``out["attention"]``."""
    torch, device = r.torch, r.device
    items: list[TimedItem] = []
    for nbytes in spec.get("memory_bytes", ()):
        src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        dst = torch.zeros_like(src)
        rec = {"bytes": 2 * src.numel() * 4, "size": src.numel() * 4}
        out["memory"].append(rec)
        items.append(TimedItem(f"copy {nbytes / 2**20:.0f} MiB", (lambda s, d: lambda: d.copy_(s))(src, dst),
                           min_rep_s, False, rec))
    gemms = [(g, False) for g in spec.get("gemms", ())]
    gemms += [(g, True) for g in spec.get("unaligned_gemms", ())]
    for (m, k, n, dtype_name), unaligned in gemms:
        dtype = getattr(torch, _DTYPES[dtype_name])
        x = torch.randn(m, k, dtype=dtype, device=device)
        w = torch.randn(k, n, dtype=dtype, device=device)
        y = torch.zeros(m, n, dtype=dtype, device=device)
        elem = x.element_size()
        rec = {"m": m, "k": k, "n": n, "dtype": dtype_name, "flops": 2 * m * k * n,
               "bytes": elem * (m * k + k * n + m * n), **({"unaligned": True} if unaligned else {})}
        out["gemms"].append(rec)
        items.append(TimedItem(f"gemm {m}x{k}x{n}", (lambda x, w, y: lambda: torch.mm(x, w, out=y))(x, w, y),
                           min_rep_s, False, rec))
    out["attention"] = []
    for b, h, seq, d, dtype_name in spec.get("attention", ()):
        rec = {"shape": [b, h, seq, d], "dtype": dtype_name,
               "flops": 2.0 * b * h * seq * seq * 2 * d / 2}  # executed forward FLOPs, causal
        out["attention"].append(rec)
        items.append(TimedItem(f"attention {b}x{h}x{seq}x{d}", _attention_fn(
            torch, device, getattr(torch, _DTYPES[dtype_name]), b, h, seq, d), min_rep_s,
            False, rec))
    return items


def _compute_items(r: Rank, spec: dict[str, Any], out: dict[str, Any],
                   report: Callable[[str], None]) -> list[TimedItem]:
    """Every non-collective measurement of ``spec``, in the order they run;
    each records into its place in ``out`` (``report``: see
    :func:`_compiled_call_items`)."""
    torch, device = r.torch, r.device
    min_rep_s = float(spec["compute_min_rep_s"])
    items: list[TimedItem] = []
    if spec.get("overhead"):
        a = torch.zeros(1, device=device)
        b = torch.zeros(1, device=device)
        out["overhead"] = {}
        items.append(TimedItem("kernel overhead", lambda: torch.add(a, b, out=a), min_rep_s, False, out["overhead"]))
    if spec.get("host"):  # eager PyTorch's host time per op: a host-bound training step
        step, passes = _tiny_training_step(torch, device, spec["host"])
        out["host"] = {"model": spec["host"], "passes": passes}
        items.append(TimedItem("host per op", step, min_rep_s, False, out["host"]))
    for key, steps in (("dispatch", dispatch_steps), ("fsdp_unit", fsdp_unit_steps),
                       ("pipeline", pipeline_steps), ("split_backward", split_backward_steps)):
        if spec.get(key) and r.dist.is_initialized():  # the distributed runtime's host costs
            items += [TimedItem(label, fn, min_rep_s, False, record)
                      for label, fn, record in steps(r, out)]
    if spec.get("compiled_call"):
        items += _compiled_call_items(r, spec["compiled_call"], int(spec["reps"]), min_rep_s,
                                      out, report)
    items += [TimedItem(label, fn, min_rep_s, False, rec)
              for label, fn, rec in chain_measurements(r, spec, out, report)]
    return items + _kernel_items(r, spec, min_rep_s, out)


def _compiled_call_items(r: Rank, counts: list[int], reps: int, min_rep_s: float,
                         out: dict[str, Any], report: Callable[[str], None]) -> list[TimedItem]:
    """A compiled region's call with each of ``counts`` parameters
    (:mod:`costmodel.profiling.compiled_call`); records into
    ``out["compiled_call"]``. A region that cannot compile here (no C++
    compiler, no Triton) is recorded in ``out["unsupported"]`` instead, and
    the progress steps of its ``reps`` passes reported as done."""
    from torch.distributed.device_mesh import DeviceMesh

    from costmodel.profiling.compiled_call import compiles, region_call_fn

    if not r.dist.is_initialized():  # one rank: a group of one, for the region's mesh
        r.dist.init_process_group("nccl" if r.device.type == "cuda" else "gloo",
                                  store=r.dist.HashStore(), rank=0, world_size=1)
    mesh = DeviceMesh(r.device.type, list(range(r.world)))
    items, records = [], []
    for k in counts:
        fn = region_call_fn(r.torch, mesh, k)
        if not compiles(fn, out, "compiled_call", len(counts) * (reps + 1), report):
            return []
        rec = {"params": k}
        records.append(rec)
        items.append(TimedItem(f"compiled call of {k} parameters", fn, min_rep_s, False, rec))
    out["compiled_call"] = records
    return items


def _collective_groups(r: Rank, spec: dict[str, Any]) -> list[tuple[int, Any]]:
    """``(group size, this rank's process group)`` for each of ``spec["group_sizes"]``
    (default: the world; none when ``spec`` has no collectives). The world is
    group None; a smaller size ``g`` splits the world into world/g disjoint
    groups that run at once."""
    sizes = [int(g) for g in (spec.get("group_sizes") or [r.world])] if spec.get("collectives") else []
    groups: list[tuple[int, Any]] = []
    for g in sizes:
        if g < 2 or g > r.world or r.world % g:
            raise ValueError(f"group size {g} must be in 2..{r.world} and divide the world size {r.world}")
        groups.append((g, None if g == r.world else r.dist.new_subgroups(g)[0]))
    return groups


def _supported_kinds(r: Rank, spec: dict[str, Any], dtype: Any, n_groups: int, unsupported: dict[str, str],
                     report: Callable[[str], None]) -> list[str]:
    """The collectives of ``spec`` the backend runs, in order; each one it
    lacks goes into ``unsupported`` with its error, and its progress steps are
    reported as done."""
    kinds = list(spec.get("collectives", ()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind in list(kinds):
            try:  # a backend without this collective raises the same way on every rank
                _collective_fn(kind, r.world * 16, r.world, r.torch, r.dist, r.device, dtype)()
            except (RuntimeError, NotImplementedError, ValueError) as err:
                unsupported[kind] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                kinds.remove(kind)
                for _ in range(len(spec.get("sizes", ())) * n_groups * (int(spec["reps"]) + 1)):
                    report(f"{kind} unsupported")
    return kinds


def _collective_items(r: Rank, spec: dict[str, Any], dtype: Any, kinds: list[str],
                      groups: list[tuple[int, Any]], records: list[dict[str, Any]]) -> list[TimedItem]:
    """One item per group size, kind and size (bytes rounded down to whole
    elements that split evenly over the group); each appends its record to ``records``."""
    elem = r.torch.tensor([], dtype=dtype).element_size()
    items: list[TimedItem] = []
    buffers: dict[int, dict[int, tuple[Any, Any, Any]]] = {}  # group size -> numel -> tensors
    for g, group in groups:
        src = (r.rank // g) * g  # first global rank of this rank's group
        for kind in kinds:
            for nbytes in spec.get("sizes", ()):
                numel = max(g, (int(nbytes) // elem) // g * g)
                rec = {"kind": kind, "nbytes": numel * elem, "group_size": g, "groups": r.world // g}
                records.append(rec)
                fn = _collective_fn(kind, numel, g, r.torch, r.dist, r.device, dtype, group, src,
                                    buffers.setdefault(g, {}))
                items.append(TimedItem(f"{kind} {numel * elem} B /{g}", fn, float(spec["collective_min_rep_s"]), True, rec))
    return items


def _measure(rank: int, world: int, spec: dict[str, Any], report: Callable[[str], None]) -> dict[str, Any]:
    """Join, run the compute measurements, then the collectives, and leave;
    the result dict as the module docstring describes."""
    r = join(rank, world, spec)
    runner = ItemRunner(r.torch, r.dist, r.device, world, int(spec["reps"]), report)
    out: dict[str, Any] = {"overhead": None, "memory": [], "gemms": [], "collectives": [], "unsupported": {}}
    runner.run(_compute_items(r, spec, out, report))

    dtype = getattr(r.torch, _DTYPES[spec.get("collective_dtype", "float32")])
    groups = _collective_groups(r, spec)
    kinds = _supported_kinds(r, spec, dtype, len(groups), out["unsupported"], report)
    items = _collective_items(r, spec, dtype, kinds, groups, out["collectives"])
    out["redistribute"] = []
    if r.world > 1:
        items += _redistribute_items(r, spec, dtype, out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner.run(items)
    if r.dist.is_initialized():
        r.dist.barrier()
        r.dist.destroy_process_group()
    return out


def run_worker(rank: int, world: int, spec: dict[str, Any], emit: Callable[[str], None] | None = None,
               measure: Measure | None = None) -> dict[str, Any]:
    """Measure as rank ``rank`` of ``world``; returns the result (meaningful on rank 0).

    ``emit(label)`` is called on rank 0 after every measurement step;
    ``measure`` is what the rank runs (default: the measurements of this
    module's docstring; :mod:`codegen.runtime_probe` gives its own).
    """
    os.environ["OMP_NUM_THREADS"] = str(spec.get("threads", 1))

    def report(label: str) -> None:
        if rank == 0 and emit is not None:
            emit(label)

    return (measure or _measure)(rank, world, spec, report)


def main(argv: list[str] | None = None, measure: Measure | None = None,
         module: str = "costmodel.profiling.worker") -> int:
    """``python -m costmodel.profiling.worker SPEC.json RANK WORLD`` (or the
    rank program ``module`` that runs ``measure`` through this same protocol).

    Rank 0 prints ``step <label>`` lines on stdout as it goes and writes the
    result JSON to ``spec["result_path"]``. A failing rank prints its
    traceback on stderr and exits 1.
    """
    import json

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print(f"usage: python -m {module} SPEC.json RANK WORLD", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as f:
        spec = json.load(f)
    rank, world = int(args[1]), int(args[2])

    def emit(label: str) -> None:
        print(f"step {label}", flush=True)

    try:
        result = run_worker(rank, world, spec, emit, measure)
    except Exception:  # noqa: BLE001 - reported to the parent through stderr and the exit code
        print(f"rank {rank}: {traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1
    if rank == 0:
        tmp = spec["result_path"] + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(result, f)
        os.replace(tmp, spec["result_path"])
    return 0


def serve(measure: Measure | None = None, module: str = "costmodel.profiling.worker") -> None:
    """Run :func:`main` as this process's program and leave without the
    interpreter's teardown: the process group is destroyed and rank 0's
    result written by then, and tearing down a native thread that is still
    joinable aborts the process ("terminate called without an active
    exception"), which would fail a measurement that has finished."""
    code = main(None, measure, module)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    serve()
