"""Cost model: cluster description, communication, compute and memory costs.

* the cluster: :mod:`costmodel.cluster` (devices and links),
  :mod:`costmodel.presets` (published hardware, :func:`load_cluster`);
* prices of one thing: :mod:`costmodel.collectives`, :mod:`costmodel.resharding`,
  :mod:`costmodel.compute`, :mod:`costmodel.memory`, :mod:`costmodel.saved_tensors`;
* prices of a sharding strategy of an op on a mesh:
  :class:`costmodel.strategy_cost.IntraOpCost` (its settings
  :mod:`costmodel.strategy_settings`, its parts :mod:`costmodel.strategy_compute`,
  :mod:`costmodel.strategy_sync` and :mod:`costmodel.strategy_memory`);
* :mod:`costmodel.schedules`: pipeline schedule models;
* :mod:`costmodel.profiling`: ``planner profile``, measuring this machine.

Units everywhere: seconds, bytes, FLOPs, bytes/s, FLOP/s. This package never
imports ``planner`` or ``codegen``.
"""

from .cluster import (
    BACKENDS,
    DEFAULT_FLOP_EFFICIENCY,
    DEFAULT_KERNEL_OVERHEAD,
    DEFAULT_MEMORY_EFFICIENCY,
    Cluster,
    ClusterError,
    DeviceSpec,
    Link,
    canonical_dtype,
)
from .collectives import COLLECTIVES, axis_links, collective_time
from .compute import DEFAULT_HALF_SATURATION_FLOPS, matmul_efficiency, op_time
from .memory import OPTIMIZER_STATES, gpt_activation_bytes_per_layer, reserve_bytes, training_state_bytes
from .presets import PRESETS, load_cluster, local_cpu_cluster, preset
from .resharding import ReshardStep, reshard_steps, reshard_time
from .schedules.specs import ScheduleSpec, schedule_spec
from .schedules import SCHEDULES, ScheduleBook, ScheduleResult, rank_orders, simulate, simulate_orders

__all__ = [
    "BACKENDS",
    "COLLECTIVES",
    "DEFAULT_FLOP_EFFICIENCY",
    "DEFAULT_HALF_SATURATION_FLOPS",
    "DEFAULT_KERNEL_OVERHEAD",
    "DEFAULT_MEMORY_EFFICIENCY",
    "OPTIMIZER_STATES",
    "PRESETS",
    "Cluster",
    "ClusterError",
    "DeviceSpec",
    "Link",
    "ReshardStep",
    "SCHEDULES",
    "ScheduleBook",
    "ScheduleResult",
    "ScheduleSpec",
    "axis_links",
    "canonical_dtype",
    "collective_time",
    "gpt_activation_bytes_per_layer",
    "load_cluster",
    "local_cpu_cluster",
    "matmul_efficiency",
    "op_time",
    "preset",
    "rank_orders",
    "schedule_spec",
    "simulate",
    "simulate_orders",
    "reserve_bytes",
    "reshard_steps",
    "reshard_time",
    "training_state_bytes",
]
