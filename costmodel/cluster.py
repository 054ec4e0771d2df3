"""Cluster description: devices, links and how many of them there are.

Units everywhere: seconds, bytes, FLOPs, bytes/s, FLOP/s.

A :class:`Cluster` is ``num_nodes`` identical nodes of ``devices_per_node``
identical devices. Devices inside a node talk over ``intra_node`` (NVLink,
loopback, ...); devices in different nodes talk over ``inter_node``
(InfiniBand, Ethernet). Link bandwidths are *per device, per direction*:
the rate one device can push into the link while it also receives at the same
rate (what NCCL calls bus bandwidth).

The JSON form (``Cluster.to_dict`` / ``Cluster.from_dict``) is what a cluster
file holds; :func:`costmodel.presets.load_cluster` accepts a preset name,
``PRESET:NODES`` or such a file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

__all__ = ["ClusterError", "canonical_dtype", "candidate_mesh_shapes", "check_mesh_shape", "Link",
           "alpha_beta_table", "backend_reduce_scatters_by_all_reduce", "DeviceSpec", "Cluster",
           "BACKENDS", "DEFAULT_KERNEL_OVERHEAD", "DEFAULT_FLOP_EFFICIENCY",
           "DEFAULT_MEMORY_EFFICIENCY"]

#: Communication backends a cluster may name.
BACKENDS = ("nccl", "gloo")

#: Fixed cost of launching one GPU kernel, seconds (CUDA launch + tail, ~5 us).
DEFAULT_KERNEL_OVERHEAD = 5e-6
#: DeviceSpec fields only ``planner profile`` measures: the runtime's host costs (a compiled
#: region's call, an FSDP2 unit's collective call, a pipeline action, a split backward's
#: parameter group), fused kernels' rate
_MEASURED_ONLY_KEYS = ("compiled_call_overhead", "compiled_param_overhead", "fsdp_call_overhead",
                       "pipeline_action_overhead", "compiled_pipeline_action_overhead",
                       "split_backward_group_overhead", "fused_element_rate")
#: DeviceSpec fields a cluster file may leave out (their defaults apply)
_OPTIONAL_DEVICE_KEYS = ("kernel_overhead", "flop_efficiency", "memory_efficiency",
                         "half_saturation_flops", "dispatch_overhead", "attention_efficiency",
                         "attention_half_saturation_flops", "host_overhead",
                         "unaligned_gemm_efficiency", *_MEASURED_ONLY_KEYS)
#: Fraction of dense peak FLOP/s a large, well-shaped GEMM reaches (60-80% is
#: typical for transformer GEMMs on A100/H100; calibrated by profiling later).
DEFAULT_FLOP_EFFICIENCY = 0.7
#: Fraction of peak memory bandwidth a streaming kernel reaches (STREAM-like
#: kernels reach 80-90% of HBM peak).
DEFAULT_MEMORY_EFFICIENCY = 0.8

# dtype spellings accepted by DeviceSpec.flops, mapped to the canonical names
# used as keys of DeviceSpec.peak_flops.
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "f32": "float32", "bf16": "bfloat16",
                  "fp16": "float16", "half": "float16", "f16": "float16", "fp64": "float64",
                  "double": "float64", "tf32": "tfloat32", "fp8": "float8_e4m3fn"}


class ClusterError(ValueError):
    """A cluster description is missing, malformed or asks for something
    impossible; the message is one line naming the offending field and the fix."""


def check_mesh_shape(mesh_shape: Any, cluster: "Cluster | None" = None) -> tuple[int, ...]:
    """``mesh_shape`` as a tuple of ints: a logical device mesh, one size per
    axis, each at least 1; given ``cluster``, the sizes multiply to its devices.

    The one check of a mesh shape, whoever gives it (the command line, the
    planner, the cost model).

    Raises:
        ClusterError: what is wrong, and a shape that would do.
    """
    try:
        shape = tuple(mesh_shape)
    except TypeError:
        shape = ()
    if not shape or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in shape):
        raise ClusterError(f"mesh {mesh_shape!r} must be one or more positive integer sizes, "
                           f"such as 4 or 2x2")
    if cluster is not None and math.prod(shape) != cluster.num_devices:
        raise ClusterError(
            f"mesh {'x'.join(map(str, shape))} has {math.prod(shape)} devices but cluster "
            f"'{cluster.name}' has {cluster.num_devices}; give a mesh whose sizes multiply to "
            f"{cluster.num_devices}")
    return shape


def candidate_mesh_shapes(num_devices: int) -> list[tuple[int, ...]]:
    """Logical mesh shapes tried when the user gives none: (N,) and every (a, N/a)."""
    shapes: list[tuple[int, ...]] = [(num_devices,)]
    for a in range(2, num_devices):
        if num_devices % a == 0:
            shapes.append((a, num_devices // a))
    return shapes


def canonical_dtype(dtype: Any) -> str:
    """Canonical dtype name: ``torch.bfloat16``/``'bf16'`` -> ``'bfloat16'``."""
    name = str(dtype).strip().lower()
    if name.startswith("torch."):
        name = name[len("torch."):]
    return _DTYPE_ALIASES.get(name, name)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _need_positive(where: str, value: Any, unit: str) -> float:
    if not _is_number(value) or value <= 0:
        raise ClusterError(
            f"cluster field '{where}' must be a positive number ({unit}), got {value!r}; fix that field"
        )
    return value


def _need_nonnegative(where: str, value: Any, unit: str) -> float:
    if not _is_number(value) or value < 0:
        raise ClusterError(
            f"cluster field '{where}' must be a number >= 0 ({unit}), got {value!r}; fix that field"
        )
    return value


def _need_positive_int(where: str, value: Any, unit: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClusterError(
            f"cluster field '{where}' must be an integer >= 1 ({unit}), got {value!r}; fix that field"
        )
    return value


def _integral(value: Any) -> Any:
    """``8e10`` (a whole float, as JSON writers may emit) -> ``80000000000``."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _need_fraction(where: str, value: Any) -> float:
    if not _is_number(value) or not 0 < value <= 1:
        raise ClusterError(
            f"cluster field '{where}' must be a number in (0, 1], got {value!r}; fix that field"
        )
    return value


def _need_name(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ClusterError(
            f"cluster field '{where}' must be a non-empty string, got {value!r}; fix that field"
        )
    return value


def _need_mapping(where: str, d: Any) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise ClusterError(
            f"cluster field '{where}' must be a JSON object, got {type(d).__name__}; fix that field"
        )
    return d


def _check_keys(where: str, d: Mapping[str, Any], required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    prefix = f"{where}." if where else ""
    for key in required:
        if key not in d:
            raise ClusterError(
                f"cluster field '{prefix}{key}' is missing; add it (see Cluster.to_dict() of a preset for the schema)"
            )
    allowed = set(required) | set(optional)
    for key in d:
        if key not in allowed:
            raise ClusterError(
                f"cluster field '{prefix}{key}' is not known; allowed fields: {', '.join(required + optional)}"
            )


def alpha_beta_table(fits: Mapping[str, Any], where: str = "collectives"
                     ) -> tuple[tuple[str, float, float], ...]:
    """``{kind: {"latency": s, "bandwidth": bytes/s}}`` (a cluster file's
    ``collectives`` or ``redistribute``) as :class:`Link`'s
    ``(kind, latency, bandwidth)`` rows, checked."""
    per = _need_mapping(where, fits)
    return tuple(
        (k, _need_nonnegative(f"{where}.{k}.latency", _need_mapping(f"{where}.{k}", v).get("latency"),
                              "seconds"),
         _need_positive(f"{where}.{k}.bandwidth", v.get("bandwidth"), "bytes/s"))
        for k, v in per.items())


def backend_reduce_scatters_by_all_reduce(backend: str) -> bool:
    """Whether ``backend`` reduce-scatters by all-reducing each tensor whole
    (gloo), so that a ZeRO-1 step all-reduces its gradients in one coalesced
    call and each rank keeps its slice (:mod:`codegen.zero1`, which the cost
    model prices as it runs)."""
    return backend == "gloo"


@dataclass(frozen=True)
class Link:
    """One kind of connection between devices.

    Attributes:
        name: e.g. ``"nvlink"``, ``"infiniband"``, ``"loopback"``.
        bandwidth: bytes/s one device sends per direction (half of a
            bidirectional "aggregate" figure).
        latency: seconds per message step (the alpha of the alpha-beta model).
        per_collective: measured exceptions: ``(kind, latency s, bandwidth
            bytes/s)`` for collectives whose implementation does not follow the
            link's single alpha-beta (``planner profile`` fits one per kind).
        per_redistribute: the same collectives as DTensor's ``redistribute``
            issues them, ``(kind, latency s, bandwidth bytes/s)``: through
            functional collectives, with its host work and layout copies, the
            path a plan's reshards take (``planner profile`` fits one per
            kind; :meth:`for_redistribute`). Kinds not listed cost what
            ``per_collective`` says.
        local: for a mesh axis spanning nodes, ``(in-node link, devices per
            node in one group)``, so collectives may go hierarchically (not part
            of a cluster file; set by ``costmodel.collectives.axis_links``).
    """

    name: str
    bandwidth: float
    latency: float
    per_collective: tuple[tuple[str, float, float], ...] = ()
    per_redistribute: tuple[tuple[str, float, float], ...] = ()
    # Set by collectives.axis_links for a mesh axis whose groups span nodes with
    # several devices per node: (the in-node link, devices of a group per node).
    local: tuple["Link", int] | None = None

    def __post_init__(self) -> None:
        _need_name("link.name", self.name)
        _need_positive(f"{self.name}.bandwidth", self.bandwidth, "bytes/s")
        _need_nonnegative(f"{self.name}.latency", self.latency, "seconds")
        for field_name, table in (("collectives", self.per_collective),
                                  ("redistribute", self.per_redistribute)):
            for kind, latency, bandwidth in table:
                _need_name(f"{self.name}.{field_name}", kind)
                _need_nonnegative(f"{self.name}.{field_name}.{kind}.latency", latency, "seconds")
                _need_positive(f"{self.name}.{field_name}.{kind}.bandwidth", bandwidth, "bytes/s")
        object.__setattr__(self, "per_collective", tuple(sorted(self.per_collective)))
        object.__setattr__(self, "per_redistribute", tuple(sorted(self.per_redistribute)))

    def alpha_beta(self, kind: str) -> tuple[float, float]:
        """(latency s, bandwidth bytes/s) that collective ``kind`` sees on this link."""
        for k, latency, bandwidth in self.per_collective:
            if k == kind:
                return latency, bandwidth
        return self.latency, self.bandwidth

    def for_redistribute(self) -> "Link":
        """This link as DTensor's ``redistribute`` sees it: the
        ``per_redistribute`` fits in place of ``per_collective``'s for the kinds
        they cover (itself when there are none)."""
        if not self.per_redistribute:
            return self
        kinds = {k for k, _, _ in self.per_redistribute}
        merged = tuple(c for c in self.per_collective if c[0] not in kinds) + self.per_redistribute
        local = None if self.local is None else (self.local[0].for_redistribute(), self.local[1])
        return replace(self, per_collective=merged, per_redistribute=(), local=local)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, keys in a fixed order."""
        d: dict[str, Any] = {"name": self.name, "bandwidth": self.bandwidth, "latency": self.latency}
        if self.per_collective:
            d["collectives"] = {k: {"latency": a, "bandwidth": b} for k, a, b in self.per_collective}
        if self.per_redistribute:
            d["redistribute"] = {k: {"latency": a, "bandwidth": b} for k, a, b in self.per_redistribute}
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "link") -> "Link":
        """Build from :meth:`to_dict` output; ``where`` names the field in errors."""
        d = _need_mapping(where, d)
        _check_keys(where, d, ("name", "bandwidth", "latency"), ("collectives", "redistribute"))
        return cls(
            name=_need_name(f"{where}.name", d["name"]),
            bandwidth=_need_positive(f"{where}.bandwidth", d["bandwidth"], "bytes/s"),
            latency=_need_nonnegative(f"{where}.latency", d["latency"], "seconds"),
            per_collective=alpha_beta_table(d.get("collectives", {}), f"{where}.collectives"),
            per_redistribute=alpha_beta_table(d.get("redistribute", {}), f"{where}.redistribute"),
        )


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or one CPU rank).

    Attributes:
        name: e.g. ``"A100-SXM4-80GB"``.
        peak_flops: dtype name (``'float32'``, ``'bfloat16'``, ``'float16'``,
            optionally ``'tfloat32'``, ``'float8_e4m3fn'``) -> dense FLOP/s.
            Stored as a plain dict copied at construction; excluded from the
            hash (the dataclass is still hashable and comparable).
        memory: device memory, bytes.
        memory_bandwidth: device memory bandwidth, bytes/s.
        kernel_overhead: fixed seconds added to every kernel (launch + tail).
        flop_efficiency: fraction of ``peak_flops`` a large GEMM reaches.
        memory_efficiency: fraction of ``memory_bandwidth`` a streaming kernel reaches.
        half_saturation_flops: FLOPs at which a matmul reaches half of
            ``flop_efficiency`` (the efficiency curve by problem size,
            ``costmodel.compute.matmul_efficiency``); 0 = constant efficiency.
        dispatch_overhead: host seconds the distributed runtime (DTensor's
            sharding propagation and wrapping) adds to every op it runs, once in
            forward and once in backward. It decides step times on CPU ranks
            (hundreds of microseconds per op, measured by ``planner profile``);
            the GPU presets leave it 0, as the host runs ahead of a busy GPU.
        attention_efficiency: fraction of ``peak_flops`` the fused attention
            kernel (``F.scaled_dot_product_attention``: flash on CUDA and CPU)
            reaches over its forward and backward, counting the FLOPs it
            executes (half of the score matrix under a causal mask); measured
            by ``planner profile``. 0 = priced like a GEMM of the same FLOPs.
        attention_half_saturation_flops: forward-and-backward FLOPs at which
            the attention kernel reaches half of ``attention_efficiency``
            (shorter sequences fill the device less); 0 = constant.
        host_overhead: host seconds eager PyTorch spends issuing one op in a
            pass (dispatch, autograd bookkeeping, the launch) on a device the
            host runs ahead of (a GPU). The host queues kernels ahead of the
            device, so a step takes at least the host's time for all its ops
            (``costmodel.compute.host_seconds``), and otherwise the device's.
            Measured by ``planner profile`` on GPUs; 0 = the host is never the
            bottleneck (CPU ranks, where host and device are one, count
            ``kernel_overhead`` instead).
        unaligned_gemm_efficiency: throughput of a GEMM with a dimension that
            is not a multiple of 16 bytes (a vocabulary of 50257) over that of
            an aligned GEMM of the same FLOPs: tensor-core kernels need aligned
            rows, and the library falls back to slower ones. Measured by
            ``planner profile`` on GPUs; 1 = no penalty (CPUs, and the
            datasheet presets, which state no such figure).
        compiled_call_overhead: host seconds one call of a compiled region
            costs beyond its kernels, forward and backward together (dynamo's
            guards, AOTAutograd's wrappers, DTensor's unwrapping and
            wrapping of its inputs and outputs); charged per stage and
            micro-batch when the program runs compiled. Measured by
            ``planner profile``; 0 = not priced (the presets state no such figure).
        compiled_param_overhead: host seconds each parameter adds to such a
            call (its guard, and the eager accumulation of its gradient,
            which runs outside the graph). Measured with it; 0 = not priced.
        fused_element_rate: elements per second a compiled program's fused
            kernels apply their ops to (``costmodel.fusion.fused_seconds``): on
            a CPU rank their exp, sin and divides, not their bytes, bound them.
            Measured by ``planner profile`` on CPU ranks; 0 = not priced (GPUs).
        fsdp_call_overhead: seconds an FSDP2 unit's collective call costs
            beyond its bytes (hooks, copy set-up, latency; three a ZeRO-3 unit
            and micro-batch). pipeline_action_overhead: seconds the pipeline
            schedule adds to each forward or backward of a stage (bookkeeping,
            its sends' posting and waits); compiled_pipeline_action_overhead:
            the same where the stages run compiled (0: the eager figure);
            split_backward_group_overhead: seconds torch's split backward (the
            zero-bubble schedules' ``I`` and ``W`` actions) adds per parameter
            group of an eager stage and micro-batch (walking the autograd
            graph to group the weights, one ``autograd.grad`` call a group). All
            measured by ``planner profile`` (:mod:`costmodel.profiling.runtime_costs`,
            :mod:`codegen.pipeline_probe`); 0 = not measured.
        compiled: the plan's program runs through ``torch.compile``
            (inductor) on this device: memory-bound chains fuse into a few
            kernels (:mod:`costmodel.fusion`), and no op pays the eager
            runtime's ``dispatch_overhead`` or ``host_overhead``. Set from
            the request (``--compile``), never from a cluster file: the plan
            records it as ``training.compile``, so :meth:`to_dict` leaves it out.
    """

    name: str
    peak_flops: dict[str, float] = field(hash=False)
    memory: int
    memory_bandwidth: float
    kernel_overhead: float = DEFAULT_KERNEL_OVERHEAD
    flop_efficiency: float = DEFAULT_FLOP_EFFICIENCY
    memory_efficiency: float = DEFAULT_MEMORY_EFFICIENCY
    half_saturation_flops: float = 0.0
    dispatch_overhead: float = 0.0
    attention_efficiency: float = 0.0
    attention_half_saturation_flops: float = 0.0
    host_overhead: float = 0.0
    unaligned_gemm_efficiency: float = 1.0
    compiled_call_overhead: float = 0.0
    compiled_param_overhead: float = 0.0
    fsdp_call_overhead: float = 0.0
    pipeline_action_overhead: float = 0.0
    compiled_pipeline_action_overhead: float = 0.0
    split_backward_group_overhead: float = 0.0
    fused_element_rate: float = 0.0
    compiled: bool = False

    def __post_init__(self) -> None:
        _need_name("device.name", self.name)
        if self.attention_efficiency != 0.0:
            _need_fraction("device.attention_efficiency", self.attention_efficiency)
        for key in ("dispatch_overhead", "host_overhead", *_MEASURED_ONLY_KEYS):
            _need_nonnegative(f"device.{key}", getattr(self, key),
                              "elements/s" if key == "fused_element_rate" else "seconds")
        _need_fraction("device.unaligned_gemm_efficiency", self.unaligned_gemm_efficiency)
        _need_nonnegative("device.attention_half_saturation_flops",
                          self.attention_half_saturation_flops, "FLOPs")
        _need_nonnegative("device.half_saturation_flops", self.half_saturation_flops, "FLOPs")
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops:
            raise ClusterError(
                f"cluster field 'device.peak_flops' must be a non-empty object dtype -> FLOP/s, "
                f"got {self.peak_flops!r}; fix that field"
            )
        flops: dict[str, float] = {}
        for key in sorted(self.peak_flops):
            if not isinstance(key, str):
                raise ClusterError(f"cluster field 'device.peak_flops' has a non-string key {key!r}; use dtype names")
            flops[canonical_dtype(key)] = _need_positive(f"device.peak_flops.{key}", self.peak_flops[key], "FLOP/s")
        object.__setattr__(self, "peak_flops", dict(sorted(flops.items())))
        _need_positive_int("device.memory", self.memory, "bytes")
        _need_positive("device.memory_bandwidth", self.memory_bandwidth, "bytes/s")
        _need_nonnegative("device.kernel_overhead", self.kernel_overhead, "seconds")
        _need_fraction("device.flop_efficiency", self.flop_efficiency)
        _need_fraction("device.memory_efficiency", self.memory_efficiency)

    @property
    def streaming_bandwidth(self) -> float:
        """Bytes/s a streaming (memory-bound) kernel reaches: the memory
        bandwidth times its efficiency."""
        return self.memory_bandwidth * self.memory_efficiency

    def flops(self, dtype: Any) -> float:
        """Dense peak FLOP/s for ``dtype`` (a name like ``'bf16'`` or a ``torch.dtype``).

        Fallback (decided): a dtype not listed is priced at the ``float32``
        rate (e.g. bfloat16 on a V100, which has no bf16 units, or int64/float64
        index arithmetic). Raises :class:`ClusterError` only when neither the
        dtype nor ``float32`` is listed.
        """
        name = canonical_dtype(dtype)
        if name in self.peak_flops:
            return self.peak_flops[name]
        if "float32" in self.peak_flops:
            return self.peak_flops["float32"]
        raise ClusterError(
            f"device '{self.name}' lists no peak FLOP/s for dtype '{name}' and no float32 fallback; "
            f"add it to device.peak_flops (listed: {', '.join(self.peak_flops)})"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, keys in a fixed order; the host costs only ``planner
        profile`` measures (``_MEASURED_ONLY_KEYS``) only where non-zero."""
        measured_only = {key: getattr(self, key) for key in _MEASURED_ONLY_KEYS
                         if getattr(self, key)}
        return {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "memory": self.memory,
            "memory_bandwidth": self.memory_bandwidth,
            "kernel_overhead": self.kernel_overhead,
            "flop_efficiency": self.flop_efficiency,
            "memory_efficiency": self.memory_efficiency,
            "half_saturation_flops": self.half_saturation_flops,
            "dispatch_overhead": self.dispatch_overhead,
            "attention_efficiency": self.attention_efficiency,
            "attention_half_saturation_flops": self.attention_half_saturation_flops,
            "host_overhead": self.host_overhead,
            "unaligned_gemm_efficiency": self.unaligned_gemm_efficiency,
            **measured_only,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "device") -> "DeviceSpec":
        """Build from :meth:`to_dict` output; all but the first four fields are optional."""
        d = _need_mapping(where, d)
        _check_keys(where, d, ("name", "peak_flops", "memory", "memory_bandwidth"),
                    _OPTIONAL_DEVICE_KEYS)
        peak = _need_mapping(f"{where}.peak_flops", d["peak_flops"])
        kwargs = {key: d[key] for key in _OPTIONAL_DEVICE_KEYS if key in d}
        return cls(
            name=d["name"],
            peak_flops=dict(peak),
            memory=_need_positive_int(f"{where}.memory", _integral(d["memory"]), "bytes"),
            memory_bandwidth=d["memory_bandwidth"],
            **kwargs,
        )


@dataclass(frozen=True)
class Cluster:
    """``num_nodes`` x ``devices_per_node`` identical devices.

    Device ids are row-major: ``id = node * devices_per_node + local``.

    Attributes:
        name: e.g. ``"dgx-a100-80g:2"``.
        num_nodes: nodes (machines).
        devices_per_node: devices (GPUs, or CPU ranks) per node.
        device: the device every slot holds.
        intra_node: link between two devices of one node.
        inter_node: link between devices of different nodes; its bandwidth
            is per device (node NIC bandwidth / devices_per_node).
        backend: ``'nccl'`` or ``'gloo'``.
    """

    name: str
    num_nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: Link
    inter_node: Link
    backend: str

    def __post_init__(self) -> None:
        _need_name("name", self.name)
        _need_positive_int("num_nodes", self.num_nodes, "nodes")
        _need_positive_int("devices_per_node", self.devices_per_node, "devices")
        for fname, typ in (("device", DeviceSpec), ("intra_node", Link), ("inter_node", Link)):
            if not isinstance(getattr(self, fname), typ):
                raise ClusterError(f"cluster field '{fname}' must be a {typ.__name__}, got {type(getattr(self, fname)).__name__}")
        if self.backend not in BACKENDS:
            raise ClusterError(
                f"cluster field 'backend' must be one of {', '.join(BACKENDS)}, got {self.backend!r}; fix that field"
            )

    @property
    def num_devices(self) -> int:
        """Total devices: num_nodes * devices_per_node."""
        return self.num_nodes * self.devices_per_node

    @property
    def device_type(self) -> str:
        """The torch device type its ranks train on: ``"cpu"`` for a gloo
        cluster (CPU ranks), ``"cuda"`` for an NCCL one."""
        return "cpu" if self.backend == "gloo" else "cuda"

    def node_of(self, device_id: int) -> int:
        """Node index that holds ``device_id`` (row-major numbering)."""
        if not 0 <= device_id < self.num_devices:
            raise ClusterError(f"device id {device_id} is outside 0..{self.num_devices - 1} of cluster '{self.name}'")
        return device_id // self.devices_per_node

    def sub_cluster(self, num_nodes: int, devices_per_node: int) -> "Cluster":
        """The same hardware cut down to ``num_nodes`` x ``devices_per_node``.

        For pricing a pipeline stage's sub-mesh (Alpa's sub-meshes are either
        part of one node or whole nodes).
        """
        if not 1 <= num_nodes <= self.num_nodes:
            raise ClusterError(f"sub_cluster num_nodes must be in 1..{self.num_nodes}, got {num_nodes}")
        if not 1 <= devices_per_node <= self.devices_per_node:
            raise ClusterError(f"sub_cluster devices_per_node must be in 1..{self.devices_per_node}, got {devices_per_node}")
        return replace(self, num_nodes=num_nodes, devices_per_node=devices_per_node)

    @property
    def reduce_scatters_by_all_reduce(self) -> bool:
        """:func:`backend_reduce_scatters_by_all_reduce` of this cluster's backend."""
        return backend_reduce_scatters_by_all_reduce(self.backend)

    @property
    def overlaps_collectives(self) -> bool:
        """Whether a collective the runtime issues beside compute runs at the
        same time as it: NCCL on GPUs runs collectives on their own streams
        (FSDP2 prefetches the next unit's all-gather under the current one's
        compute); gloo on CPU ranks does not, as FSDP2 there waits for each
        collective where it issues it (no streams), and gloo's thread shares
        the rank's core."""
        return self.backend != "gloo"

    def running_compiled(self, compiled: bool = True) -> "Cluster":
        """The same cluster with its program run through ``torch.compile``
        (``compiled``) or eagerly (:attr:`DeviceSpec.compiled`)."""
        if self.device.compiled == compiled:
            return self
        return replace(self, device=replace(self.device, compiled=compiled))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form with a fixed key order; ``from_dict`` inverts it exactly."""
        return {
            "name": self.name,
            "num_nodes": self.num_nodes,
            "devices_per_node": self.devices_per_node,
            "backend": self.backend,
            "device": self.device.to_dict(),
            "intra_node": self.intra_node.to_dict(),
            "inter_node": self.inter_node.to_dict(),
        }

    def to_json(self) -> str:
        """``to_dict`` as indented JSON text."""
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: Any) -> "Cluster":
        """Validate and build; any bad field raises a one-line :class:`ClusterError`."""
        d = _need_mapping("<cluster>", d)
        _check_keys("", d, ("name", "num_nodes", "devices_per_node", "backend", "device", "intra_node", "inter_node"))
        return cls(
            name=d["name"],
            num_nodes=d["num_nodes"],
            devices_per_node=d["devices_per_node"],
            device=DeviceSpec.from_dict(d["device"], "device"),
            intra_node=Link.from_dict(d["intra_node"], "intra_node"),
            inter_node=Link.from_dict(d["inter_node"], "inter_node"),
            backend=d["backend"],
        )
