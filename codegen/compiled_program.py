"""Run a region of the plan's per-rank program through ``torch.compile``.

A plan that records ``training.compile`` (:attr:`plan.format.Plan.compiles`)
runs its program compiled: the executor hands each region it has as Python
code (a ``torch.fx.GraphModule`` of the captured aten ops,
:meth:`codegen.executor.PlanExecutor._compile`) to :class:`CompiledRegion`,
which compiles it with inductor on its first call.

A region that cannot compile runs eager, that region only, and one warning
says which region and why: never silently. :class:`CompileReport` keeps, per
region, whether it compiled, the seconds its first (compiling) call took and
whether the compile caches held it already (a restart reusing the artifacts
of an earlier run): AOTAutograd's cache, one entry per region with its forward
and backward graphs, and inductor's FX-graph cache, one entry per graph. Their
keys pickle the program's inputs, its ``DeviceMesh`` among them, which carried
a hash Python salts per process, so no launch found another's entries:
:func:`ir.torch_compat.compile_cache.stable_mesh_cache_keys` leaves it out.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ir.torch_compat import compile_cache_counts, compile_counter, stable_mesh_cache_keys

__all__ = ["CompileReport", "CompiledRegion", "RegionCompile", "compile_cache_dir"]


@dataclass
class RegionCompile:
    """What compiling one region did.

    Attributes:
        region: the region's name (``program``, ``stage 1``...).
        compiled: whether it runs compiled (False: it fell back to eager).
        seconds: wall time of its first call, the one that compiles, in seconds
            (forward only; the backward graph compiles in the first backward;
            with the regions compiled inside it).
        cache_hits: inductor FX-graph cache hits during that call (graphs
            reused from an earlier run's artifacts rather than compiled again).
        reason: why it runs eager ("" when compiled).
        graphs: the graphs dynamo made of it (one where nothing breaks it up;
            more: parts of it run eager between them).
        cache_misses: FX-graph cache misses during that call (graphs inductor
            compiled afresh; one that could not be cached counts too).
        aot_hits: AOTAutograd cache hits during that call (a region's forward
            and backward graphs come as one entry, so both load in its first
            call).
        aot_misses: AOTAutograd cache misses (traced afresh) or bypasses.
        inner: regions compiled on their own inside it (checkpointed layers on
            a mesh), between its graphs.
    """

    region: str
    compiled: bool
    seconds: float
    cache_hits: int = 0
    reason: str = ""
    graphs: int = 0
    cache_misses: int = 0
    aot_hits: int = 0
    aot_misses: int = 0
    inner: int = 0

    def line(self) -> str:
        """One log line for it: the time, and what the compile caches held."""
        if not self.compiled:
            return f"compile: {self.region} runs eager: {self.reason}"
        split = ""
        if self.inner:
            split = f", in {self.graphs} graphs around {self.inner} region(s) compiled on their own"
        elif self.graphs > 1:
            split = f", in {self.graphs} graphs (parts run eager)"
        return f"compile: {self.region} compiled in {self.seconds:.1f} s{self._reuse()}{split}"

    def _reuse(self) -> str:
        """What came from the compile caches and what did not, as the line's tail."""
        parts = []
        if self.cache_hits:
            parts.append(f"{self.cache_hits} graph(s) from the compile cache")
        if self.cache_misses:
            parts.append(f"{self.cache_misses} graph(s) compiled afresh")
        if self.aot_hits or self.aot_misses:
            parts.append("AOTAutograd's cache " + ("missed" if self.aot_misses else "hit"))
        return "".join(", " + part for part in parts)


@dataclass
class CompileReport:
    """The regions of one rank's program and how each compiled, in first-call
    order (a region compiled inside another comes after it)."""

    regions: list[RegionCompile] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [r.line() for r in self.regions]


def _graphs_made() -> int:
    """The graphs dynamo has made so far in this process."""
    return compile_counter("stats", "unique_graphs")


def _first_line(err: BaseException) -> str:
    """``err`` in one line: its type and first line, and those of the error
    the compiler's own wraps (a backend's failure, say)."""
    def one(e: BaseException) -> str:
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"
    cause = getattr(err, "inner_exception", None) or err.__cause__
    return one(err) + (f" ({one(cause)})" if cause is not None else "")


class CompiledRegion:
    """``program`` compiled with ``torch.compile`` (inductor, static shapes) on
    its first call; eager from then on where that call fails to compile.

    Args:
        program: the region as Python code (a GraphModule or any callable).
        region: its name in the log lines.
        report: where the outcome of the first call is recorded.
        backend: ``torch.compile``'s backend (inductor).
        eager: what runs the region where it does not compile (default: ``program``).
    """

    def __init__(self, program: Callable[..., Any], region: str, report: CompileReport, *,
                 backend: str | Callable[..., Any] = "inductor",
                 eager: Callable[..., Any] | None = None):
        self.program = program
        self.eager = program if eager is None else eager
        self.region = region
        self.report = report
        stable_mesh_cache_keys()  # else no launch finds another's compiled graphs
        self._compiled: Callable[..., Any] | None = torch.compile(program, backend=backend,
                                                                 dynamic=False)
        self._called = False

    def __call__(self, *args: Any) -> Any:
        if self._called:
            return (self.eager if self._compiled is None else self._compiled)(*args)
        self._called = True
        cache, graphs, t0 = compile_cache_counts(), _graphs_made(), time.perf_counter()
        first = len(self.report.regions)
        try:
            out = self._compiled(*args)
        except Exception as err:  # noqa: BLE001 - compile failed: this region runs eager
            outcome = RegionCompile(self.region, False, time.perf_counter() - t0,
                                    reason=_first_line(err))
            self.report.regions.insert(first, outcome)
            warnings.warn(outcome.line(), stacklevel=2)
            self._compiled = None
            return self.eager(*args)
        seconds, now = time.perf_counter() - t0, compile_cache_counts()
        lookups = {k: now[k] - cache[k] for k in now}
        # regions compiled inside this one (checkpointed layers) count their own
        nested = self.report.regions[first:]
        self.report.regions.insert(first, RegionCompile(
            self.region, True, seconds,
            lookups["fx_hit"] - sum(r.cache_hits for r in nested),
            graphs=_graphs_made() - graphs - sum(r.graphs for r in nested),
            cache_misses=lookups["fx_miss"] - sum(r.cache_misses for r in nested),
            aot_hits=lookups["aot_hit"] - sum(r.aot_hits for r in nested),
            aot_misses=lookups["aot_miss"] - sum(r.aot_misses for r in nested),
            inner=len(nested)))
        return out


def compile_cache_dir(checkpoint_dir: str) -> str:
    """Where a training job keeps inductor's compiled artifacts: beside its
    checkpoints, so that a restart or a resumed job reuses them."""
    import os

    return os.path.join(checkpoint_dir, "compile_cache")
