"""The one home of the private torch APIs this project uses, for torch 2.11 to 2.14.

Every import of a private torch module (a name starting with ``_``) and every
read of a torch setting that not all supported versions have goes through
this package, so that a torch upgrade is checked in one place. The supported
range is the one pyproject.toml declares. The capture's and DTensor's hooks
live here; fake tensors, fake process groups and meshes in
:mod:`ir.torch_compat.fake`; the fused attention kernels' aten ops in
:mod:`ir.torch_compat.kernels`; compile-cache keys stable across launches in
:mod:`ir.torch_compat.compile_cache`. Import them all from ``ir.torch_compat``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
import torch.fx.config
from torch.utils._pytree import tree_leaves, tree_map

from ir.torch_compat.compile_cache import compile_cache_counts, stable_mesh_cache_keys
from ir.torch_compat.fake import (fake_store_type, fake_tensor_mode_type, fake_tensor_on,
                                  mesh_without_groups, outside_fake_mode)
from ir.torch_compat.kernels import cpu_flash_attention_ops, cuda_attention_ops

__all__ = [
    "FUSED_ATTENTION_ORDER", "KEPT_FUSED_OPS", "KEPT_NATIVE_OPS", "OpOverload", "SDPA", "all_gather_autograd",
    "compile_cache_counts", "compile_counter",
    "aot_export_module",
    "autograd_redistribute",
    "capture_decompositions", "cuda_memory_history", "decomposition_registry_size", "dispatcher_input_reshards",
    "kept_fused_ops", "op_overload_name", "tree_leaves", "tree_map",
    "cpu_flash_attention_ops", "cuda_attention_ops", "dtensor_schema_types", "fake_store_type",
    "fake_tensor_mode_type", "fake_tensor_on", "from_local_with_grad_placements",
    "fx_without_stack_traces", "is_assertion_op", "is_mask_partial", "outside_fake_mode",
    "is_strided_shard", "local_tensor", "mesh_without_groups", "mask_partial_type", "op_schema_info",
    "op_strategy_functions", "register_dtensor_handler", "register_fused_attention_sharding",
    "register_sharding_rule", "register_zeros_like_input_sharding", "sharding_propagator",
    "single_dim_expansion", "stable_mesh_cache_keys", "strided_shard", "strided_shard_type",
    "without_dtensor_handler",
    "without_dtensor_redistribute_costs", "zero_masked_rows",
]

#: The type of an ATen op overload (``torch.ops.aten.mm.default``).
OpOverload: type = torch._ops.OpOverload

#: ``F.scaled_dot_product_attention``: captured as this one node and run as the
#: device's fused kernel (flash, memory-efficient or cuDNN on CUDA, flash on CPU).
SDPA = torch.ops.aten.scaled_dot_product_attention.default

#: Ops the capture keeps whole instead of decomposing them to core ATen: torch
#: runs them as one fused kernel, which is what the cost model must price.
KEPT_FUSED_OPS = (SDPA,)

#: Ops with a kernel of their own that the capture keeps whole although export's
#: table decomposes them: the decomposition computes a bf16 or fp16 input in
#: fp32 through whole fp32 tensors (a copy up, the math, a copy down), where
#: torch's kernel, which eager training runs, keeps fp32 per element only and
#: writes the input's dtype. SiLU (Llama's and the MoE experts' MLP) is one.
KEPT_NATIVE_OPS = (torch.ops.aten.silu.default,)


@contextlib.contextmanager
def fx_without_stack_traces() -> Iterator[None]:
    """torch.fx records the Python stack of every node it traces
    (``node.meta["stack_trace"]``); the planner never reads it and skipping it
    makes a capture a fifth faster. ``torch.fx.config.do_not_emit_stack_traces``
    exists from torch 2.12 on; on older torch this does nothing."""
    config = torch.fx.config
    if not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def is_assertion_op(op: Any) -> bool:
    """An ATen op that returns nothing and writes nothing: an assertion on its
    inputs (``_assert_tensor_metadata``, ``_assert_scalar``...), read from its
    schema (``op._schema``)."""
    schema = getattr(op, "_schema", None)
    if schema is None or len(schema.returns) != 0:
        return False
    return not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def capture_decompositions(table: dict) -> dict:
    """``table`` (export's decompositions, materialised) without the
    :data:`KEPT_FUSED_OPS` and :data:`KEPT_NATIVE_OPS`, which the capture keeps
    as one node each."""
    kept = set(KEPT_FUSED_OPS) | set(KEPT_NATIVE_OPS)
    return {op: fn for op, fn in table.items() if op not in kept}


def aot_export_module(*args: Any, **kwargs: Any) -> Any:
    """``torch._functorch.aot_autograd.aot_export_module``, with the
    :data:`KEPT_FUSED_OPS` kept whole as ``run_decompositions`` keeps them
    (their CompositeImplicitAutograd kernel swapped for export's "preserve"
    marker while tracing, and restored after)."""
    from torch._functorch.aot_autograd import aot_export_module as export

    with kept_fused_ops():
        return export(*args, **kwargs)


@contextlib.contextmanager
def kept_fused_ops() -> Iterator[None]:
    """While tracing or propagating fake tensors through a captured program,
    the :data:`KEPT_FUSED_OPS` stay one op each (their CompositeImplicitAutograd
    kernel swapped for export's "preserve" marker, restored after) with the
    fused kernels' output layout (:func:`fused_attention_layout`)."""
    from torch._export.utils import _special_op_to_preserve_cia
    from torch.export.exported_program import _override_composite_implicit_decomp

    from torch._dispatch.python import enable_python_dispatcher

    keep = {op: _special_op_to_preserve_cia for op in KEPT_FUSED_OPS}
    with fused_attention_layout(), _override_composite_implicit_decomp(keep), \
            enable_python_dispatcher():
        yield


#: dims of a fused attention's [batch, heads, seq, head dim] output in the
#: order its kernels lay them out in memory, outermost first
FUSED_ATTENTION_ORDER = (0, 2, 1, 3)


def _fused_attention_fake(fake_mode: Any, func: Any, query: Any, key: Any, value: Any,
                          *args: Any, **kwargs: Any) -> Any:
    """The fake (shape-only) result of the kept attention node, laid out as the
    fused kernels write it: [batch, seq, heads, head dim] in memory, returned
    transposed to [batch, heads, seq, head dim] (flash and memory-efficient,
    on CUDA and CPU). The math path's contiguous layout would make the
    capture differ from the program the device runs (a copy before the
    heads are merged back)."""
    with fake_mode:
        if query.dim() != 4:
            return torch.empty(*query.shape[:-1], value.shape[-1], dtype=query.dtype,
                               device=query.device)
        b, h, s, _ = query.shape
        return torch.empty(b, s, h, value.shape[-1], dtype=query.dtype,
                           device=query.device).permute(*FUSED_ATTENTION_ORDER)


@contextlib.contextmanager
def fused_attention_layout() -> Iterator[None]:
    """While capturing, the kept attention node's fake result has the fused
    kernels' memory layout (:func:`_fused_attention_fake`); the fake rule torch
    had before is restored after."""
    from torch._subclasses import fake_impls

    table = fake_impls.op_implementations_dict
    before = table.get(SDPA)
    table[SDPA] = _fused_attention_fake
    try:
        yield
    finally:
        if before is None:
            table.pop(SDPA, None)
        else:
            table[SDPA] = before


def sharding_propagator() -> Any:
    """DTensor's sharding propagator (its registered op strategies)."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator


def op_strategy_functions(op: Any) -> tuple[Any, Any]:
    """DTensor's registered strategies of ``op``: ``(single-dim strategy,
    strategy function)``, each None where it has none. Releases move ops
    from the second kind to the first (torch 2.14: ``aten.cat`` and the fused
    attention kernels); before torch 2.12 there is no first kind."""
    prop = sharding_propagator()
    single = getattr(prop, "op_single_dim_strategy_funcs", {}).get(op)
    return single, prop.op_strategy_funcs.get(op)


def op_schema_info(op: Any) -> Any:
    """The ``RuntimeSchemaInfo`` DTensor builds ``op``'s OpSchema with (which
    arguments are static, whether list arguments are flattened), looked up as
    DTensor's dispatcher does: ops with a single-dim strategy keep theirs in a
    table of their own (torch 2.12 on). Without it, a single-dim strategy of
    an op taking a tensor list (``aten.cat`` from torch 2.14) sees no inputs."""
    prop = sharding_propagator()
    info = prop.op_to_schema_info.get(op)
    if info is None:
        info = getattr(prop, "op_to_schema_info_for_single_dim_strategy", {}).get(op)
    return info


def dtensor_schema_types() -> tuple[type, type, type, type, type, type]:
    """DTensor's sharding-propagation records: ``(DTensorSpec, TensorMeta,
    OpSchema, OpSpec, OpStrategy, TupleStrategy)``."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy

    return DTensorSpec, TensorMeta, OpSchema, OpSpec, OpStrategy, TupleStrategy


@contextlib.contextmanager
def without_dtensor_redistribute_costs() -> Iterator[None]:
    """While inside, DTensor's strategy functions price every input
    redistribution at zero (its ``redistribute_cost``, read by them at each
    call, is swapped out and restored after)."""
    from torch.distributed.tensor._ops import utils as op_utils

    original = op_utils.redistribute_cost
    op_utils.redistribute_cost = lambda *args, **kwargs: 0.0
    try:
        yield
    finally:
        op_utils.redistribute_cost = original


def single_dim_expansion() -> Any:
    """DTensor's ``_expand_single_dim_strategy_to_mesh`` (absent before torch 2.12:
    then None, and ops registered with single-dim strategies do not exist)."""
    try:
        from torch.distributed.tensor._ops.single_dim_strategy import (
            _expand_single_dim_strategy_to_mesh,
        )
    except ImportError:
        return None
    return _expand_single_dim_strategy_to_mesh


def mask_partial_type() -> type:
    """DTensor's masked partial placement (made inside embedding lookups).
    Looked up with ``getattr``, not a failing import: dynamo traces this (a
    lowered program's placement calls) and gives up the whole frame on an
    exception raised inside it."""
    from torch.distributed.tensor import placement_types

    return getattr(placement_types, "MaskPartial", None) or placement_types._MaskPartial


def is_mask_partial(placement: Any) -> bool:
    """Whether ``placement`` is DTensor's masked partial (:func:`mask_partial_type`)."""
    return isinstance(placement, mask_partial_type())


def zero_masked_rows(placement: Any, local: torch.Tensor) -> None:
    """Zero, in ``local`` (in place), the rows of an embedding or gather lookup
    that DTensor's masked partial ``placement`` marks as another rank's, and
    release its mask (DTensor's mask serves one reduction only)."""
    placement.mask_buffer.apply_mask(local)
    placement.mask_buffer.release_mask()


def strided_shard_type() -> type:
    """DTensor's strided shard placement (a subclass of ``Shard`` in some torch
    releases, not in 2.13: ask :func:`is_strided_shard` before ``isinstance(p, Shard)``)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard


def is_strided_shard(placement: Any) -> bool:
    """Whether ``placement`` is DTensor's strided shard (:func:`strided_shard_type`)."""
    return isinstance(placement, strided_shard_type())


def strided_shard(dim: int, split_factor: int) -> Any:
    """DTensor's strided shard of tensor dim ``dim`` with ``split_factor``."""
    return strided_shard_type()(dim, split_factor=split_factor)


def local_tensor(value: Any) -> torch.Tensor:
    """The local shard a DTensor ``value`` holds, itself: unlike ``to_local()``
    no autograd node is made (for reading its memory layout)."""
    return value._local_tensor


def autograd_redistribute(value: Any, mesh: Any, placements: tuple) -> Any:
    """``value`` redistributed to ``placements`` on ``mesh`` by DTensor's own
    autograd function, which unlike ``DTensor.redistribute`` also goes to
    ``Partial``. Negative shard dims are normalized first, as
    ``DTensor.redistribute`` does; the collectives run in ``value``'s dtype
    (the ``dtype_config`` argument newer torch takes)."""
    import inspect

    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._redistribute import Redistribute

    placements = tuple(Shard(p.dim + value.ndim) if type(p) is Shard and p.dim < 0 else p
                       for p in placements)
    if "dtype_config" not in inspect.signature(Redistribute.forward).parameters:
        return Redistribute.apply(value, mesh, placements, False)
    dt = value.dtype
    cfg = {"op_dtype": dt, "out_dtype": dt, "backward_options": {"op_dtype": dt, "out_dtype": dt}}
    return Redistribute.apply(value, mesh, placements, False, cfg)


def from_local_with_grad_placements(local: torch.Tensor, mesh: Any, placements: Any, *,
                                    shape: Any, stride: Any, grad_placements: Any) -> Any:
    """``DTensor.from_local(local, mesh, placements)`` whose gradient leaves as
    the local shard of ``grad_placements`` (for example a partial sum, which
    FSDP2 then reduce-scatters) instead of being redistributed to
    ``placements``. torch 2.12 takes ``grad_placements`` itself; on torch
    2.11 a function of the same forward and backward does it."""
    import inspect

    from torch.distributed.tensor import DTensor

    if "grad_placements" in inspect.signature(DTensor.from_local).parameters:
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                                  stride=stride, grad_placements=grad_placements)
    return _FromLocalGradPlacements.apply(local, mesh, tuple(placements), shape, stride,
                                          tuple(grad_placements))


class _FromLocalGradPlacements(torch.autograd.Function):
    """``DTensor.from_local`` with ``grad_placements``, for torch 2.11."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, mesh: Any, placements: tuple, shape: Any,
                stride: Any, grad_placements: tuple) -> Any:
        from torch.distributed.tensor import DTensor

        ctx.mesh, ctx.grad_placements = mesh, grad_placements
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                                  stride=stride)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._dtensor_spec import DTensorSpec
        from torch.distributed.tensor._redistribute import redistribute_local_tensor

        if isinstance(grad, DTensor):
            target = DTensorSpec(ctx.mesh, ctx.grad_placements, tensor_meta=grad._spec.tensor_meta)
            grad = redistribute_local_tensor(grad._local_tensor, grad._spec, target)
        return grad, None, None, None, None, None


def dispatcher_input_reshards(op: Any, args: tuple, kwargs: dict) -> list[tuple[Any, tuple]] | None:
    """The DTensor arguments DTensor's dispatcher redistributes before it runs
    ``op`` on ``args`` and ``kwargs``, each as ``(argument, placements it is
    redistributed to)``: empty when it reshards none, None when the dispatcher
    cannot be asked (its private API moved).

    Raises:
        What DTensor's sharding propagator raises for an op it has no strategy for.
    """
    import torch.utils._pytree as pytree
    from torch.distributed.tensor import DTensor

    try:
        info = DTensor._op_dispatcher.unwrap_to_op_info(op, args, kwargs)
    except Exception:  # noqa: BLE001 - private API moved; the caller does without
        return None
    result = sharding_propagator().propagate_op_sharding(info.schema)
    if not getattr(result, "needs_redistribute", False) or result.redistribute_schema is None:
        return []
    new_schema = result.redistribute_schema.args_schema
    flattened = info.args_tree_spec is not None
    new_specs = pytree.tree_leaves(new_schema) if flattened else list(new_schema)
    flat_args = pytree.tree_leaves(args) if flattened else list(args)
    return [(arg, tuple(new.placements))
            for arg, old, new in zip(flat_args, info.flat_args_schema, new_specs)
            if isinstance(arg, DTensor) and hasattr(new, "placements") and old != new]


def all_gather_autograd(tensor: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """``tensor`` of every rank of process group ``group`` concatenated along
    ``dim``, through autograd: the backward reduce-scatters (sums) the
    gradient back to each rank's part (torch's functional collective)."""
    from torch.distributed._functional_collectives import all_gather_tensor_autograd

    return all_gather_tensor_autograd(tensor, gather_dim=dim, group=group)


def register_sharding_rule(op: Any, rule: Any, keep: Any = None) -> None:
    """Give DTensor ``op``'s sharding as its public ``register_sharding`` does
    (``rule(*args, **kwargs)`` of the arguments' specs and values returns
    ``(output placements, input placements)`` pairs for one mesh axis;
    ``keep(inputs' placements)`` drops combinations), with every non-tensor
    argument (not only ``int`` ones: a ``new_zeros`` ``size``) in the key
    DTensor caches its decisions under."""
    from torch.distributed.tensor._op_schema import OpStrategy, RuntimeSchemaInfo, TupleStrategy
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    def spec(arg: Any) -> Any:
        if isinstance(arg, OpStrategy):
            return arg.strategies[0].output_spec
        return tuple(spec(c) for c in arg.children) if isinstance(arg, TupleStrategy) else arg

    def strategy(schema: Any) -> Any:
        pairs = rule(*map(spec, schema.args_schema),
                     **{k: spec(v) for k, v in schema.kwargs_schema.items()})
        result = expand_to_full_mesh_op_strategy(
            schema.get_mesh_from_args(), schema, [list(o) + list(i) for o, i in pairs],
            input_index=len(op._schema.returns), inplace_op=schema.is_inplace_op())
        if keep is not None:
            result.strategies = [s for s in result.strategies
                                 if keep([tuple(i.placements) for i in s.input_specs])]
        return result

    arguments = op._schema.arguments
    plain = [(i, a) for i, a in enumerate(arguments) if "Tensor" not in str(a.type)]
    static = min((i for i, a in plain if not a.kwarg_only), default=100)
    keys = [a.name for _, a in plain if a.kwarg_only]
    sharding_propagator().register_op_strategy(
        op, strategy, RuntimeSchemaInfo(static, keys or None, needs_pytree=True))


def register_dtensor_handler(op: Any, handler: Any) -> None:
    """Run ``op`` on DTensors by ``handler(op, args, kwargs)`` (called below
    autograd, returning DTensors) instead of DTensor's sharding propagation
    and a local call (DTensor's table of custom op handlers)."""
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher._custom_op_handlers[op] = handler


@contextlib.contextmanager
def without_dtensor_handler(op: Any) -> Iterator[None]:
    """Inside, DTensor runs ``op`` by its own sharding propagation, not by the
    handler :func:`register_dtensor_handler` gave it (which may call ``op``)."""
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    handler = handlers.pop(op, None)
    try:
        yield
    finally:
        if handler is not None:
            handlers[op] = handler


@functools.lru_cache(maxsize=1)
def register_fused_attention_sharding() -> None:
    """Give DTensor the sharding of the CPU flash-attention kernel, which it
    lacks (it has those of the CUDA kernels): the same as its CUDA flash
    kernel's, batch (dim 0) or heads (dim 1) sharded, or all replicated.
    Registered once per process (:func:`register_sharding_rule`)."""
    from torch.distributed.tensor import Replicate, Shard

    forward, backward = cpu_flash_attention_ops()
    if forward in sharding_propagator().op_strategy_funcs:
        return

    def _forward(query, key, value, *args, **kwargs):  # noqa: ARG001 - op signature
        # outputs: (attention output, log-sum-exp); inputs: q, k, v (+ attn_mask)
        mask = lambda p: [p] if kwargs.get("attn_mask") is not None else []  # noqa: E731
        return [([p, p], [p] * 3 + mask(p)) for p in (Replicate(), Shard(0), Shard(1))]

    def _backward(grad_out, query, key, value, out, logsumexp, *args, **kwargs):  # noqa: ARG001
        mask = lambda p: [p] if kwargs.get("attn_mask") is not None else []  # noqa: E731
        return [([p] * 3, [p] * 6 + mask(p)) for p in (Replicate(), Shard(0), Shard(1))]

    register_sharding_rule(forward, _forward)
    register_sharding_rule(backward, _backward)


@functools.lru_cache(maxsize=1)
def register_zeros_like_input_sharding() -> None:
    """Let DTensor's ``new_zeros`` shard its zeros as its input is sharded on
    every mesh axis where the two have the same size on the input's shard dim.
    DTensor's own rule follows the input only when the whole shapes are
    equal and otherwise replicates: autograd's backward of ``gather``
    (``grad.new_zeros(input's shape).scatter_add(...)``, the loss's pick of
    the target logits) then allocates the zeros of the whole global
    ``[tokens, vocabulary]`` on every rank, mesh-size times the rank's own.
    Zeros are zeros in any placement, so sharding them is exact. Registered
    once per process (:func:`register_sharding_rule`: ``size`` is in the key
    of DTensor's decisions)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    def _new_zeros(self, size, *args, **kwargs):  # noqa: ARG001 - op signature
        same = [d for d in range(min(self.ndim, len(size))) if int(size[d]) == self.shape[d]]
        return ([([Shard(d)], [Shard(d)]) for d in same]
                + [([Replicate()], [p]) for p in (Replicate(), Partial())]
                + [([Replicate()], [Shard(d)]) for d in range(self.ndim) if d not in same])

    register_sharding_rule(torch.ops.aten.new_zeros.default, _new_zeros)


def decomposition_registry_size() -> tuple[int, int]:
    """How many ops have a CompositeImplicitAutograd kernel and how many entries
    torch's decomposition table holds: both grow when an op is registered
    anew, so together they key a materialised copy of export's decompositions."""
    from torch._decomp import decomposition_table

    composite = torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")
    return len(composite), len(decomposition_table)


def op_overload_name(obj: Any) -> tuple[str, str] | None:
    """``("namespace::name", overload)`` of a torch op overload (``OpOverload``,
    e.g. ``aten.mm.default``); None for anything else."""
    if isinstance(obj, OpOverload):
        return obj._schema.name, obj._overloadname
    return None


def local_shape_and_global_offset(value: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(shape, offset)`` of the block of the full tensor a DTensor ``value``
    holds on this rank: its local shape and the full tensor's index of its
    first element, per dim (torch's ``compute_local_shape_and_global_offset``,
    read from the rank's mesh coordinate; what DCP reads a shard with). Exact
    for ``Shard`` and ``Replicate`` placements only: a strided shard's rows
    are no one block."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(value.shape, value.device_mesh,
                                                 value.placements)


def dispatch_mode_type() -> type:
    """torch's ``TorchDispatchMode`` (``torch.utils._python_dispatch``): while
    a subclass is entered, its ``__torch_dispatch__`` sees every ATen op below
    autograd (factory ops included), and runs the op itself."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def tree_flatten(tree: Any) -> tuple[list, Any]:
    """``(leaves, spec)`` of a pytree (``torch.utils._pytree.tree_flatten``)."""
    from torch.utils._pytree import tree_flatten as flatten

    return flatten(tree)


def tree_unflatten(leaves: list, spec: Any) -> Any:
    """The pytree of ``spec`` holding ``leaves`` (``torch.utils._pytree.tree_unflatten``)."""
    from torch.utils._pytree import tree_unflatten as unflatten

    return unflatten(leaves, spec)


def storage_key(tensor: torch.Tensor) -> int:
    """An integer naming the storage ``tensor`` views, the same for every
    tensor sharing it (a ``Parameter`` and the tensor it wraps, ``.data``,
    views), meta tensors included: the address of its C++ ``StorageImpl``,
    unique while the storage is alive."""
    return tensor.untyped_storage()._cdata


def written_arguments(op: Any) -> tuple[tuple[int, str, bool], ...]:
    """The arguments ATen op ``op`` writes (``Tensor(a!)`` in its schema:
    in-place ``self``, ``out=``), each as ``(position, name, keyword only)``."""
    return tuple((i, a.name, a.kwarg_only) for i, a in enumerate(op._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def takes_generator(op: Any) -> bool:
    """Whether ATen op ``op``'s schema has a ``Generator?`` argument (it draws
    random numbers)."""
    return any(a.name == "generator" for a in op._schema.arguments)


@contextlib.contextmanager
def cuda_memory_history(max_entries: int) -> Iterator[dict[str, Any]]:
    """Record the CUDA caching allocator's history (each allocation and free, with
    its stack) inside; the dict yielded gets the allocator's snapshot (its
    ``device_traces``, ``segments``) under ``"snapshot"`` on a normal exit."""
    out: dict[str, Any] = {}
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        yield out
        out["snapshot"] = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


@contextlib.contextmanager
def without_local_backward_handoff(stages: Any) -> Any:
    """A forward-only pass (``schedule.eval``) of a V-shaped schedule (ZBV,
    DualPipeV): torch 2.13 still hands backward gradients between the rank's
    two stages (``get_local_bwd_output``), which fails; inside, it does nothing."""
    for stage in stages:
        stage.get_local_bwd_output, stage.set_local_bwd_input = lambda i: (), lambda o, i: None
    try:
        yield
    finally:
        for stage in stages:
            del stage.get_local_bwd_output
            del stage.set_local_bwd_input


def compile_counter(section: str, key: str) -> int:
    """One of ``torch.compile``'s process-wide counters so far (dynamo's
    ``counters[section][key]``: ``("stats", "unique_graphs")`` the graphs made,
    ``("inductor", "fxgraph_cache_hit")`` graphs taken from inductor's cache)."""
    from torch._dynamo.utils import counters

    return int(counters[section].get(key, 0))
