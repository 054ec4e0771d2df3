"""Run one aten op node of the captured program on DTensors, as the plan places it.

:class:`NodeRunner` is the per-node step of the executor's interpreter:

* values computed only from constants stay plain tensors and become replicated
  DTensors where they meet a DTensor op (or take the plan's placement at no cost);
* before the op, every DTensor argument is redistributed to the placement the
  plan gives for it (an *explicit reshard*);
* the op itself is dispatched by DTensor; the output placements it produced are
  recorded and, where they differ from the plan's, redistributed to the planned
  ones (a *mismatch*);
* an op DTensor cannot shard runs replicated (inputs gathered, local op, output
  wrapped back as ``Replicate``) with a warning that names the op.

What it sees goes into a :class:`codegen.placement_record.PlacementRecord`.

On a mesh of one device the program runs on plain tensors, and
:func:`public_binding` finds, for an op node, the public Python function
(``torch.mm``, ``Tensor.view``...) that dispatches exactly the node's aten
overload: calling it skips the boxed call of ``torch.ops.aten.*`` overloads,
which parses every argument against the op's schema in Python.
"""

from __future__ import annotations

import operator
import types
import warnings
from typing import Any, Callable, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from codegen.placement_record import PlacementRecord
from codegen.redistribution import (contiguous_strides, keep_layout, laid_out,
                                    permuted_strides, placements_of, reachable_target,
                                    redistribute, relaid, same_placements, unmask)
from ir.placements import parse_placement, parse_placements, placement_str
from ir.torch_compat import (FUSED_ATTENTION_ORDER, SDPA, dispatcher_input_reshards,
                             is_assertion_op, is_mask_partial, op_overload_name, tree_leaves,
                             tree_map)
from plan.format import OpPlacement, Plan

__all__ = ["DTensorResultError", "GRADIENT_RESHAPED", "NodeRunner", "attention_gradient_placements",
           "attention_mask", "contiguous_gradient", "fused_attention_layout",
           "has_fused_attention_layout", "public_binding", "tensor_leaves"]


class DTensorResultError(RuntimeError):
    """DTensor returned a value that cannot be right (wrong shape, impossible placement)."""


def tensor_leaves(value: Any) -> list[Any]:
    """Tensor outputs of an op, in the order ir.graph lists them (non-tensors skipped)."""
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return [value] if isinstance(value, torch.Tensor) else []


def _replace_leaves(out: Any, new: dict[int, Any]) -> Any:
    """``out`` with its tensor leaf ``k`` (:func:`tensor_leaves` order) replaced by ``new[k]``."""
    if not isinstance(out, (tuple, list)):
        return new.get(0, out)
    items, k = [], 0
    for v in out:
        if isinstance(v, torch.Tensor):
            items.append(new.get(k, v))
            k += 1
        else:
            items.append(v)
    return type(out)(items) if isinstance(out, tuple) else items


def _check_output(node: torch.fx.Node, out: Any) -> None:
    """Refuse DTensor results whose global shape or placements are impossible.

    Guards against sharding rules that mis-handle an argument form (for example
    ``sum.dim_IntList(x, [])``, which reduces every dim but whose DTensor rule reduces
    none and leaves a ``Shard`` on a 0-dim result).
    """
    expected = node.meta.get("val")
    got_leaves = tensor_leaves(out)
    want_leaves = tensor_leaves(expected) if expected is not None else [None] * len(got_leaves)
    for k, (got, want) in enumerate(zip(got_leaves, want_leaves)):
        if not isinstance(got, DTensor):
            continue
        if want is not None and tuple(got.shape) != tuple(want.shape):
            raise DTensorResultError(
                f"output {k} has global shape {tuple(got.shape)}, the program says {tuple(want.shape)}")
        for p in got.placements:
            if isinstance(p, Shard) and not 0 <= p.dim < got.ndim:
                raise DTensorResultError(
                    f"output {k} is {list(got.placements)} on a {got.ndim}-D tensor")


def _dtensor_input_choice(op: Any, args: tuple, kwargs: dict) -> dict[int, list[str]] | None:
    """Placements DTensor will redistribute each DTensor argument to before running ``op``.

    Returns ``{id(dtensor_arg): placements}`` for the arguments DTensor reshards
    inside its dispatcher (empty when it reshards none), or None when the sharding
    propagator could not be asked or has no strategy for ``op``
    (:func:`ir.torch_compat.dispatcher_input_reshards`).
    """
    try:
        reshards = dispatcher_input_reshards(op, args, kwargs)
    except Exception:  # noqa: BLE001 - no strategy; running the op decides
        return None
    if reshards is None:
        return None
    return {id(arg): [placement_str(p) for p in placements] for arg, placements in reshards}


def attention_mask(args: tuple, kwargs: dict) -> Any:
    """The ``attn_mask`` of a ``scaled_dot_product_attention`` call, or None."""
    return kwargs.get("attn_mask", args[3] if len(args) > 3 else None)


def _captured_attention_layout(node: torch.fx.Node, out: Any) -> Any:
    """Attention output ``out`` in the memory layout the capture gave it.

    The capture lays the fused attention's output out as the fused kernels write
    it, [batch, seq, heads, dim] under a [batch, heads, seq, dim] shape
    (:func:`ir.torch_compat.fused_attention_layout`), and the program's view
    merging the heads relies on it. Where the device's kernel writes it
    contiguous instead (a CPU rank's math path, with some masks or
    cross-attention), it is laid out as captured: one local copy, through
    autograd, and a DTensor's global strides say so."""
    if not has_fused_attention_layout(node):
        return out
    return fused_attention_layout(out)


def fused_attention_layout(out: Any) -> Any:
    """Attention output ``out`` laid out as the fused kernels write it (see
    :func:`_captured_attention_layout`): itself where it is, else one local copy."""
    local = out.to_local() if isinstance(out, DTensor) else out
    if not local.is_contiguous() or local.permute(*FUSED_ATTENTION_ORDER).is_contiguous():
        return out
    if not isinstance(out, DTensor):
        return relaid(local, FUSED_ATTENTION_ORDER)
    return laid_out(local, out.device_mesh, out.placements, out.shape, FUSED_ATTENTION_ORDER)


def has_fused_attention_layout(node: torch.fx.Node) -> bool:
    """Whether the capture gave attention op ``node``'s output the fused
    kernels' memory layout (:data:`ir.torch_compat.FUSED_ATTENTION_ORDER`).
    Read from its shape and strides alone: an op on the captured fake value
    would run under whatever dispatch mode the step runs in (torch's
    MemTracker counts the fake value's bytes as allocated, once per
    attention op)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 4 or val.is_contiguous():
        return False
    dense = permuted_strides(val.shape, FUSED_ATTENTION_ORDER)
    return all(size == 1 or stride == want
               for size, stride, want in zip(val.shape, val.stride(), dense))


#: views whose backward reshapes the gradient to the input's shape
GRADIENT_RESHAPED = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


class _ContiguousGradient(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous, shard and whole.

    A view's backward reshapes its output's gradient, and for a DTensor the
    reshape picks ``view`` or a copy from the global strides while ``view``
    runs on the local shard: a gradient whose shard is laid out otherwise
    than its global strides say (an attention's, kept in the layout the
    capture gave it) fails there."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if not isinstance(grad, DTensor):
            return grad.contiguous()
        local = grad.to_local()
        if local.is_contiguous() and grad.is_contiguous():
            return grad
        return DTensor.from_local(local.contiguous(), grad.device_mesh, grad.placements,
                                  run_check=False, shape=grad.shape,
                                  stride=contiguous_strides(grad.shape))


def contiguous_gradient(out: Any) -> Any:
    """A view's output whose gradient arrives contiguous (:class:`_ContiguousGradient`),
    for a DTensor that requires grad; anything else as it is."""
    if isinstance(out, DTensor) and out.requires_grad:
        return _ContiguousGradient.apply(out)
    return out


def attention_gradient_placements(out: Any) -> Any:
    """``out`` (an attention's output) whose gradient arrives in its own
    placements (:func:`_keep_gradient_placements`)."""
    _keep_gradient_placements(out)
    return out


def _keep_gradient_placements(out: Any) -> None:
    """Make the gradient reaching attention output ``out`` take ``out``'s own
    placements. The CPU flash kernel's backward takes the mask as a keyword
    argument, which DTensor does not redistribute: were the gradient to arrive
    in other placements (a partial sum, say), DTensor would shard the backward
    otherwise than the forward and hand the kernel a mask of the wrong shard."""
    if not (isinstance(out, DTensor) and out.requires_grad):
        return
    mesh, placements = out.device_mesh, tuple(out.placements)
    out.register_hook(lambda grad: grad if not isinstance(grad, DTensor)
                      or tuple(grad.placements) == placements
                      else grad.redistribute(mesh, placements))


def public_binding(node: torch.fx.Node, memo: dict[Any, Callable | None]) -> Callable | None:
    """A public torch function that dispatches exactly op ``node``'s aten overload.

    Candidates are the builtins of the same name in ``torch`` and
    ``torch.nn.functional`` and the ``Tensor`` method. Python's argument parser
    picks an overload from the arguments' types, so a candidate is taken only
    when tracing it (``make_fx``, on meta tensors of the node's argument
    shapes) dispatches the same aten ops with the same arguments as tracing
    the node's own overload. Returns None when no candidate does, for ops
    without tensor arguments (factories) and for random ops.

    ``memo`` maps an op and its arguments' types to the answer, so the layers
    of a repeated block are traced once.
    """
    op_name = op_overload_name(node.target)
    if op_name is None or torch.Tag.nondeterministic_seeded in node.target.tags:
        return None
    args = _meta_arguments(node)
    if args is None:
        return None
    key = (node.target, _type_signature(args))
    if key not in memo:
        name = op_name[0].split("::")[-1]
        memo[key] = next((fn for fn in _candidates(name)
                          if _same_dispatch(node.target, fn, args)), None)
    return memo[key]


def _candidates(name: str) -> list[Callable]:
    """Public C++ bindings named ``name``: ``torch.<name>``,
    ``torch.nn.functional.<name>`` (builtins only: their Python functions take
    other arguments) and the ``Tensor.<name>`` method."""
    found = [getattr(torch, name, None), getattr(torch.nn.functional, name, None)]
    fns = [f for f in found if isinstance(f, types.BuiltinFunctionType)]
    method = getattr(torch.Tensor, name, None)
    if isinstance(method, types.MethodDescriptorType):
        fns.append(method)
    return fns


class _NoMeta(Exception):
    """An argument of the node has no value a meta tensor can stand for."""


def _meta_of(arg: torch.fx.Node) -> Any:
    """A meta tensor of argument ``arg``'s shape, strides and dtype (its
    ``meta["val"]``); the value itself for a Python number."""
    val = arg.meta.get("val")
    if isinstance(val, torch.Tensor):
        try:
            return torch.empty_strided(tuple(int(d) for d in val.shape),
                                       tuple(int(d) for d in val.stride()),
                                       dtype=val.dtype, device="meta")
        except (TypeError, RuntimeError) as err:  # symbolic sizes
            raise _NoMeta from err
    if isinstance(val, (bool, int, float)):
        return val
    raise _NoMeta


def _meta_arguments(node: torch.fx.Node) -> tuple[tuple, dict] | None:
    """``node``'s (args, kwargs) with meta tensors for its argument nodes; None
    when one has no known value or no argument is a tensor."""
    try:
        args = torch.fx.node.map_arg((node.args, node.kwargs), _meta_of)
    except _NoMeta:
        return None
    if not any(isinstance(v, torch.Tensor) for v in tree_leaves(args)):
        return None
    return args


def _type_signature(value: Any) -> Any:
    """What Python's argument parser reads of ``value`` to pick an overload:
    the nesting, the types, and of a tensor its dtype and whether it is 0-D."""
    if isinstance(value, (list, tuple)):
        return type(value), tuple(_type_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _type_signature(v)) for k, v in value.items())
    if isinstance(value, torch.Tensor):
        return torch.Tensor, value.dtype, value.dim() == 0
    return type(value)


def _same_dispatch(op: Any, fn: Callable, args: tuple[tuple, dict]) -> bool:
    """Whether ``fn`` and ``op`` on meta arguments ``args`` dispatch the same ops."""
    try:
        return _dispatched(fn, args) == _dispatched(op, args)
    except Exception:  # noqa: BLE001 - the candidate does not take these arguments
        return False


def _dispatched(fn: Callable, args: tuple[tuple, dict]) -> list[tuple]:
    """The aten ops ``fn(*args[0], **args[1])`` dispatches, with their
    arguments (graph values as positions), traced by ``make_fx``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def call(*tensors: torch.Tensor) -> Any:
        it = iter(tensors)
        a, kw = tree_map(lambda v: next(it) if isinstance(v, torch.Tensor) else v, args)
        return fn(*a, **kw)

    tensors = [v for v in tree_leaves(args) if isinstance(v, torch.Tensor)]
    traced = make_fx(call)(*tensors).graph
    position = {n: i for i, n in enumerate(traced.nodes)}
    as_positions = lambda v: torch.fx.node.map_arg(v, lambda n: position[n])  # noqa: E731
    return [(n.op, n.target, as_positions(n.args), as_positions(n.kwargs))
            for n in traced.nodes if n.op != "placeholder"]


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else ""


def _with_values(node: torch.fx.Node, values: Sequence[Any]) -> tuple[tuple, dict]:
    """``node``'s args and kwargs with its argument nodes replaced by ``values``, in order."""
    it = iter(values)
    return torch.fx.node.map_arg((node.args, node.kwargs), lambda _: next(it))


def _planned_input(entry: OpPlacement | None, i: int) -> list[str] | None:
    """The plan's placements for argument ``i`` of a node (None: not planned)."""
    return entry.inputs[i] if entry is not None and i < len(entry.inputs) else None


class NodeRunner:
    """Runs op nodes one at a time as ``plan`` places them on ``mesh``.

    Args:
        plan: the Plan, read on the mesh (:func:`codegen.redistribution.plan_on_mesh`).
        mesh: the DeviceMesh the DTensors live on.
        record: where the placements met are recorded.
        local: the mesh has one device: run on plain tensors, every placement ``R``.
        context_parallel: the plan's context parallelism at run time
            (:class:`codegen.context_parallel.ContextParallelRuntime`): its token
            positions and attention across a cp group; None without.
    """

    def __init__(self, plan: Plan, mesh: DeviceMesh, record: PlacementRecord, *, local: bool,
                 context_parallel: Any = None):
        self.plan = plan
        self.mesh = mesh
        self.record = record
        self.local = local
        self.context_parallel = context_parallel
        self._replicate = [Replicate()] * mesh.ndim
        self._parsed_placements: dict[tuple[str, ...], Any] = {}
        self._fallback_nodes: set[str] = set()

    def wrap_replicated(self, t: torch.Tensor) -> DTensor:
        """A plain tensor (the same on every rank) as a replicated DTensor."""
        return DTensor.from_local(t, self.mesh, self._replicate, run_check=False)

    def run(self, node: torch.fx.Node, env: dict[str, Any]) -> Any:
        """Run op ``node`` on the values of ``env``; returns its output, placed as planned."""
        if self.local:
            return self._run_local(node, env)
        entry = self.plan.nodes.get(node.name)
        if node.target is operator.getitem:
            value = env[node.args[0].name][node.args[1]]
            return self._finish(node, entry, value, [], constant=not isinstance(value, DTensor))
        arg_nodes: list[torch.fx.Node] = []
        torch.fx.node.map_arg((node.args, node.kwargs), arg_nodes.append)
        values = [env[n.name] for n in arg_nodes]
        if not any(isinstance(v, DTensor) for v in values):
            return self._run_constant(node, entry, values)

        values = self._placed_arguments(node, entry, arg_nodes, values)
        args, kwargs = _with_values(node, values)
        # the placements each input arrived in: recorded on the recording forward only
        in_obs = [placements_of(v) for v in values] if self.record.recording else []
        if is_assertion_op(node.target):
            return self._run_check(node, entry, args, kwargs, in_obs)
        if node.name in self._fallback_nodes:
            out = self._run_replicated(node, args, kwargs)
            return self._finish(node, entry, out, self._replicated_obs(values), constant=False)
        if self.record.recording:
            self._record_dtensor_choice(node, entry, arg_nodes, values, args, kwargs, in_obs)
        cp = self.context_parallel
        if cp is not None and (node.target is SDPA or node.name in cp.position_values):
            out = (cp.attention(node, args, kwargs) if node.target is SDPA
                   else cp.run_positions(node, args, kwargs))
            return self._finish(node, entry, out, in_obs, constant=False)
        try:
            out = node.target(*args, **kwargs)
            _check_output(node, out)
        except Exception as err:  # noqa: BLE001 - DTensor could not run it: replicate
            return self._fall_back(node, entry, args, kwargs, values, err)
        if node.target is SDPA:
            out = _captured_attention_layout(node, out)
            if attention_mask(args, kwargs) is not None:
                _keep_gradient_placements(out)
        elif node.target in GRADIENT_RESHAPED:
            out = contiguous_gradient(out)
        return self._finish(node, entry, out, in_obs, constant=False)

    # ------------------------------------------------------------ the arguments
    def _parsed(self, placements: Sequence[str]) -> tuple[Placement, ...] | None:
        """``placements`` as DTensor placements, parsed once per distinct list
        (None for one only DTensor makes, ``P(mask)``)."""
        key = tuple(placements)
        found = self._parsed_placements.get(key, False)
        if found is False:
            try:
                found = tuple(parse_placement(p) for p in key)
            except ValueError:
                found = None
            self._parsed_placements[key] = found
        return found

    def _placed_arguments(self, node: torch.fx.Node, entry: OpPlacement | None,
                          arg_nodes: list[torch.fx.Node], values: list[Any]) -> list[Any]:
        """Every tensor argument brought to the plan's placement for it."""
        placed = []
        for i, (arg, v) in enumerate(zip(arg_nodes, values)):
            if isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
                v = self.wrap_replicated(v)
            want = _planned_input(entry, i)
            if isinstance(v, DTensor) and want and v.placements != self._parsed(want):
                have = placements_of(v)
                target = reachable_target(v, want)
                if tuple(target) != tuple(v.placements):
                    v = keep_layout(v, redistribute(v, self.mesh, target))
                    self.record.explicit(node.name, arg.name, have, want)
            placed.append(v)
        return placed

    def _record_dtensor_choice(self, node: torch.fx.Node, entry: OpPlacement | None,
                               arg_nodes: list[torch.fx.Node], values: list[Any], args: tuple,
                               kwargs: dict, in_obs: list[list[str]]) -> None:
        """Record the reshards DTensor will do inside its dispatcher; ``in_obs``
        then holds the placements the op really consumes."""
        choice = _dtensor_input_choice(node.target, args, kwargs)
        if not choice:
            return
        for i, (arg, v) in enumerate(zip(arg_nodes, values)):
            if isinstance(v, DTensor) and id(v) in choice:
                self.record.dtensor_reshard(node, arg.name, in_obs[i], choice[id(v)],
                                            _planned_input(entry, i), entry is not None)
                in_obs[i] = choice[id(v)]

    def _replicated_obs(self, values: list[Any]) -> list[list[str]]:
        """The input placements of an op run replicated."""
        return [["R"] * self.mesh.ndim if isinstance(v, DTensor) else [] for v in values]

    # ------------------------------------------------------------ ways to run
    def _run_local(self, node: torch.fx.Node, env: dict[str, Any]) -> Any:
        """Run ``node`` on plain tensors (one device: every placement is ``R``)."""
        if node.target is operator.getitem:
            out = env[node.args[0].name][node.args[1]]
        else:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs),
                                                 lambda n: env[n.name])
            out = node.target(*args, **kwargs)
        if self.record.recording:
            entry = self.plan.nodes.get(node.name)
            replicated = ["R"] * self.mesh.ndim
            self.record.observe(node.name, [replicated for _ in (entry.inputs if entry else ())],
                                [replicated for _ in tensor_leaves(out)])
        return out

    def _run_constant(self, node: torch.fx.Node, entry: OpPlacement | None,
                      values: list[Any]) -> Any:
        """Run an op none of whose arguments is a DTensor, on plain tensors."""
        args, kwargs = _with_values(node, values)
        out = node.target(*args, **kwargs)
        if self.context_parallel is not None:
            out = self.context_parallel.constant(node, out)
        in_obs = ([list(p) for p in entry.inputs] if entry else
                  [["R"] * self.mesh.ndim if isinstance(v, torch.Tensor) else [] for v in values])
        return self._finish(node, entry, out, in_obs, constant=True)

    def _run_check(self, node, entry, args, kwargs, in_obs) -> Any:
        """Run an output-less assertion op (``_assert_tensor_metadata``...) without moving data.

        DTensor has no sharding rule for most of them; they only look at metadata,
        so they run on the local shards. Should one compare a global size with a
        local shard, it is run on the gathered tensors instead.
        """
        try:
            out = node.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - no DTensor rule: check the local shards
            try:
                local_args, local_kwargs = tree_map(
                    lambda v: v.to_local() if isinstance(v, DTensor) else v, (args, kwargs))
                out = node.target(*local_args, **local_kwargs)
            except Exception:  # noqa: BLE001 - compares global metadata: gather
                out = self._run_replicated(node, args, kwargs)
        return self._finish(node, entry, out, in_obs, constant=False)

    def _fall_back(self, node, entry, args, kwargs, values, err) -> Any:
        """Run ``node``, which DTensor failed with ``err``, replicated from now on."""
        op = str(node.target)
        warnings.warn(f"DTensor cannot shard {op} (node {node.name}: {type(err).__name__}: "
                      f"{_first_line(err)}); running it replicated", stacklevel=2)
        try:
            out = self._run_replicated(node, args, kwargs)
            if node.target is SDPA:
                out = _captured_attention_layout(node, out)
        except Exception as err2:  # noqa: BLE001
            raise RuntimeError(
                f"node {node.name} ({op}) failed on DTensor ({type(err).__name__}: "
                f"{_first_line(err)}) and replicated ({type(err2).__name__}: "
                f"{_first_line(err2)}); inputs {[placements_of(v) for v in values]}") from err
        self._fallback_nodes.add(node.name)
        self.record.fallback(op)
        return self._finish(node, entry, out, self._replicated_obs(values), constant=False)

    def _run_replicated(self, node, args, kwargs) -> Any:
        """Run ``node`` on the gathered tensors; its outputs wrapped back as replicas."""
        def local(v):
            if isinstance(v, DTensor):
                return redistribute(v, self.mesh, self._replicate).to_local()
            return v
        args, kwargs = tree_map(local, (args, kwargs))
        out = node.target(*args, **kwargs)
        return tree_map(
            lambda t: self.wrap_replicated(t) if isinstance(t, torch.Tensor) else t, out)

    # ------------------------------------------------------------ the outputs
    def _finish(self, node, entry, out, in_obs, *, constant: bool) -> Any:
        """Record output placements; bring outputs to the plan's placements."""
        leaves = tensor_leaves(out)
        want_all = entry.outputs if entry is not None else []
        place = self._place_constant_outputs if constant else self._place_computed_outputs
        new, out_obs = place(node, leaves, want_all)
        if new:
            out = _replace_leaves(out, new)
        if self.record.recording:
            self.record.observe(node.name, in_obs, out_obs)
        return out

    def _place_constant_outputs(self, node, leaves, want_all) -> tuple[dict[int, Any], list]:
        """A constant is placed however the plan wants it at no cost (a local slice).
        Returns the replaced leaves and every output's placements."""
        out_obs, new = [], {}
        for k, t in enumerate(leaves):
            want = want_all[k] if k < len(want_all) else None
            if want and any(p != "R" for p in want) and not isinstance(t, DTensor):
                new[k] = redistribute(self.wrap_replicated(t), self.mesh, parse_placements(want))
                out_obs.append(list(want))
            else:
                out_obs.append(placements_of(t) or ["R"] * self.mesh.ndim)
        return new, out_obs

    def _place_computed_outputs(self, node, leaves, want_all) -> tuple[dict[int, Any], list]:
        """DTensor's outputs unmasked and, where they differ from the plan's,
        redistributed (a mismatch). Returns the replaced leaves and, when
        recording, the placements the outputs came out in."""
        new = {}
        for k, t in enumerate(leaves):
            if isinstance(t, DTensor) and any(is_mask_partial(p) for p in t.placements):
                new[k] = leaves[k] = unmask(t)
        out_obs = [placements_of(t) for t in leaves] if self.record.recording else []
        for k, t in enumerate(leaves):
            want = want_all[k] if k < len(want_all) else None
            if (want and isinstance(t, DTensor) and t.placements != self._parsed(want)
                    and not same_placements(placements_of(t), want)):
                new[k] = redistribute(t, self.mesh, parse_placements(want))
                if self.record.recording:
                    self.record.output_mismatch(node, k, out_obs[k], want)
        return new, out_obs
