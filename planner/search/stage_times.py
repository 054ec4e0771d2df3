"""What one pipeline stage (or one layer of it) costs: :class:`StageTimes`.

Units: seconds (times), bytes (memory).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StageTimes", "ZERO_TIMES"]


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one stage: per micro-batch ``forward_s``, ``backward_input_s``
    (input gradients, activation-gradient collectives, recomputation) and
    ``backward_weight_s``; per step ``grad_sync_s`` (parameter-gradient
    reduction) and ``update_s`` (the optimizer's update and the mixed-precision
    casts of the parameters); ``accumulate_s``, per micro-batch after a step's
    first: adding its parameter gradients into those of the micro-batches
    before it (:meth:`costmodel.strategy_compute.ComputePricing.accumulate_time`).
    ``state_bytes`` (parameters, gradients, optimizer states),
    ``activation_bytes`` (one micro-batch's saved activations) and
    ``transient_bytes`` (the largest gradient its backward holds beside them,
    :meth:`costmodel.strategy_memory.MemoryPricing.backward_transient`) per
    device. ``weight_groups``: its parameter groups under a split backward
    (:attr:`ir.graph.Graph.weight_groups`), each of which costs an eager
    zero-bubble schedule's weight pass a call. Layers add up into a stage,
    but for their transients: the stage holds one at a time, its largest, as
    its own intra-op solve counts it."""

    forward_s: float
    backward_input_s: float
    backward_weight_s: float
    grad_sync_s: float
    state_bytes: float
    activation_bytes: float
    update_s: float = 0.0
    accumulate_s: float = 0.0
    transient_bytes: float = 0.0
    weight_groups: int = 0

    @property
    def microbatch_s(self) -> float:
        return self.forward_s + self.backward_input_s + self.backward_weight_s

    @property
    def step_end_s(self) -> float:
        """What the stage does once per step after its last backward."""
        return self.grad_sync_s + self.update_s

    def accumulation_s(self, microbatches: int) -> float:
        """Seconds a step of ``microbatches`` micro-batches spends adding the
        gradients of each one after the first into the step's."""
        return (microbatches - 1) * self.accumulate_s

    @property
    def total_s(self) -> float:
        """One micro-batch and the once-per-step work: the intra-op ILP's objective."""
        return self.microbatch_s + self.step_end_s

    def memory(self, copies: float) -> float:
        """Bytes per device with ``copies`` micro-batches in flight."""
        return self.state_bytes + copies * self.activation_bytes + self.transient_bytes

    def __add__(self, other: "StageTimes") -> "StageTimes":
        return StageTimes(*(a + b for a, b in zip(self._values(), other._values())),
                          transient_bytes=max(self.transient_bytes, other.transient_bytes),
                          weight_groups=self.weight_groups + other.weight_groups)

    def __sub__(self, other: "StageTimes") -> "StageTimes":
        """The layers of ``self`` that ``other`` (its first layers) leaves; the
        transient is ``self``'s (the caller knows the remaining layers')."""
        return StageTimes(*(a - b for a, b in zip(self._values(), other._values())),
                          transient_bytes=self.transient_bytes,
                          weight_groups=self.weight_groups - other.weight_groups)

    def _values(self) -> tuple[float, ...]:
        """The fields that add up over layers, in field order."""
        return (self.forward_s, self.backward_input_s, self.backward_weight_s, self.grad_sync_s,
                self.state_bytes, self.activation_bytes, self.update_s, self.accumulate_s)


ZERO_TIMES = StageTimes(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
