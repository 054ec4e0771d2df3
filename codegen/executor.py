"""Run a Plan with DTensor: an interpreter over the captured aten program.

:class:`PlanExecutor` captures the model exactly as the planner did
(:func:`ir.trace.trace`), refuses a plan made for a different program, distributes
every parameter with ``distribute_tensor`` as the plan says, and then executes the
exported graph one aten op at a time on DTensors:

* placeholders become the DTensor parameters, buffers and user inputs;
* values computed only from constants (``arange``/``full`` masks and the like) stay
  plain tensors and become replicated DTensors where they meet a DTensor op;
* before each op, every DTensor argument is ``redistribute()``-d to the placement
  the plan gives for that argument (an *explicit reshard*, recorded);
* the op itself is dispatched by DTensor (autograd flows through it); the output
  placements it produced are recorded and, where they differ from the plan's,
  redistributed to the planned ones (a *mismatch*, counted);
* an op DTensor cannot shard runs replicated (inputs gathered, local op, output
  wrapped back as ``Replicate``) with a warning that names the op.

Nodes the plan does not list run in *follow DTensor* mode: no redistribution, only
recording. Running a plan that lists only parameter and input placements therefore
records what DTensor does by itself; :meth:`PlanExecutor.recorded_plan` turns that
record into a complete Plan (used by the tests to make plans without the ILP).

Placement strings are the plan's: ``R``, ``S(d)``, ``P`` (sum), ``P(avg)``; a
strided shard is written ``S(d)[sf=k]``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import operator
import re
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement
from torch.export.graph_signature import ExportGraphSignature, InputKind, OutputKind

from ir.layers import find_layers
from ir.fast_trace import SynthesizedProgram
from ir.precision import Precision, cast_float, compute_copy, get_precision
from ir.torch_compat import (is_assertion_op, mask_partial_type, redistribute_function,
                             register_fused_attention_sharding, strided_shard_type)
from ir.trace import trace
from planner.plan_format import OpPlacement, Plan, Reshard

_MaskPartial = mask_partial_type()
_StridedShard = strided_shard_type()

__all__ = [
    "CapturedProgram", "PlanExecutor", "PlanMismatchError", "ReshardEvent", "WrittenOutProgram",
    "capture_program", "parse_placement", "placement_str", "placements_of", "record_plan",
    "redistribute",
]


class PlanMismatchError(ValueError):
    """The plan was made for another program, mesh or parameter set than the one given."""


# --------------------------------------------------------------------------- placements
#: How a plan writes the partial DTensor makes inside an embedding or gather
#: lookup: it may be recorded and checked against, not requested.
MASKED_PARTIAL = "P(mask)"
_SHARD_RE = re.compile(r"^S\((-?\d+)\)(?:\[sf=(\d+)\])?$")
_PARTIAL_RE = re.compile(r"^P(?:\((\w+)\))?$")


def parse_placement(text: str) -> Placement:
    """``"R"`` -> Replicate(), ``"S(d)"`` -> Shard(d), ``"P"``/``"P(op)"`` -> Partial(op)."""
    s = text.strip()
    if s == "R":
        return Replicate()
    m = _SHARD_RE.match(s)
    if m:
        dim = int(m.group(1))
        if m.group(2) is not None:
            return _StridedShard(dim, split_factor=int(m.group(2)))
        return Shard(dim)
    m = _PARTIAL_RE.match(s)
    if m and m.group(1) != "mask":
        return Partial(m.group(1) or "sum")
    if s == MASKED_PARTIAL:
        raise ValueError("P(mask) is made by DTensor inside embedding/gather; it cannot be "
                         "requested explicitly")
    raise ValueError(f"unknown placement {text!r}; expected R, S(d), P or P(avg)")


def parse_planned(text: str) -> Placement | None:
    """A placement as a plan may hold it: :func:`parse_placement`, or None for
    :data:`MASKED_PARTIAL` (recorded and checked against, never requested).

    Raises:
        ValueError: a string no plan holds.
    """
    return None if text.strip() == MASKED_PARTIAL else parse_placement(text)


def placement_str(p: Placement) -> str:
    """Inverse of :func:`parse_placement`.

    DTensor's masked partial (the indices of a lookup into a row-sharded table,
    masked to the local rows inside ``embedding``/``gather``) is written
    ``P(mask)``; it cannot be parsed back because only DTensor can create it.
    """
    if isinstance(p, _MaskPartial):
        return MASKED_PARTIAL
    if isinstance(p, _StridedShard):
        return f"S({p.dim})[sf={p.split_factor}]"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        op = getattr(p, "reduce_op", "sum")
        return "P" if op == "sum" else f"P({op})"
    return str(p)


def placements_of(value: Any) -> list[str]:
    """Placement strings of a DTensor; [] for anything else."""
    if isinstance(value, DTensor):
        return [placement_str(p) for p in value.placements]
    return []


def _parse_all(texts: Sequence[str]) -> list[Placement]:
    return [parse_placement(t) for t in texts]


@dataclass
class ReshardEvent:
    """One redistribution the executor performed (or saw DTensor perform)."""

    node: str
    arg: str          # producing node for inputs; "out<k>" for outputs
    kind: str         # "explicit" (plan input), "output" (mismatch), "implicit" (inside DTensor)
    src: list[str]
    dst: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "arg": self.arg, "kind": self.kind,
                "src": list(self.src), "dst": list(self.dst)}


# ------------------------------------------------------------------ DTensor inspection
def _dtensor_input_choice(op: Any, args: tuple, kwargs: dict) -> dict[int, list[str]] | None:
    """Placements DTensor will redistribute each DTensor argument to before running ``op``.

    Returns ``{id(dtensor_arg): placements}`` for the arguments DTensor reshards
    inside its dispatcher (empty when it reshards none), or None when the sharding
    propagator could not be asked. Raises what the propagator raises for ops it has
    no strategy for. This is the only use of DTensor's private dispatcher here.
    """
    try:
        disp = DTensor._op_dispatcher
        info = disp.unwrap_to_op_info(op, args, kwargs)
    except Exception:  # noqa: BLE001 - private API moved; just do not inspect
        return None
    result = disp.sharding_propagator.propagate_op_sharding(info.schema)
    if not getattr(result, "needs_redistribute", False) or result.redistribute_schema is None:
        return {}
    new_schema = result.redistribute_schema.args_schema
    leaves = pytree.tree_leaves(new_schema) if info.args_tree_spec is not None else list(new_schema)
    flat_args = pytree.tree_leaves(args) if info.args_tree_spec is not None else list(args)
    choice: dict[int, list[str]] = {}
    for obj, old, new in zip(flat_args, info.flat_args_schema, leaves):
        if isinstance(obj, DTensor) and hasattr(new, "placements") and old != new:
            choice[id(obj)] = [placement_str(p) for p in new.placements]
    return choice


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else ""


class DTensorResultError(RuntimeError):
    """DTensor returned a value that cannot be right (wrong shape, impossible placement)."""


def _check_output(node: torch.fx.Node, out: Any) -> None:
    """Refuse DTensor results whose global shape or placements are impossible.

    Guards against sharding rules that mis-handle an argument form (for example
    ``sum.dim_IntList(x, [])``, which reduces every dim but whose DTensor rule reduces
    none and leaves a ``Shard`` on a 0-dim result).
    """
    expected = node.meta.get("val")
    got_leaves = _tensor_leaves(out)
    want_leaves = _tensor_leaves(expected) if expected is not None else [None] * len(got_leaves)
    for k, (got, want) in enumerate(zip(got_leaves, want_leaves)):
        if not isinstance(got, DTensor):
            continue
        if want is not None and tuple(got.shape) != tuple(want.shape):
            raise DTensorResultError(
                f"output {k} has global shape {tuple(got.shape)}, the program says {tuple(want.shape)}")
        for p in got.placements:
            if isinstance(p, Shard) and not 0 <= p.dim < got.ndim:
                raise DTensorResultError(
                    f"output {k} is {placements_of(got)} on a {got.ndim}-D tensor")


def redistribute(value: DTensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """``value.redistribute(mesh, placements)``, also to ``Partial``.

    The public API refuses Replicate -> Partial, which DTensor itself does inside
    ops (a replicated bias added to a row-parallel matmul's partial sum); a plan
    that spells that reshard out goes through the same autograd function
    (``torch.distributed.tensor._redistribute.Redistribute``).
    """
    placements = tuple(placements)
    out = _redistribute(value, mesh, placements)
    # DTensor's backward of a redistribution out of a non-sum partial (P(avg) -> R)
    # asks to turn a P(sum) gradient into P(avg), which it cannot do; reducing such a
    # gradient on those mesh dims first gives the gradient DTensor expects.
    dims = [i for i, (p, q) in enumerate(zip(value.placements, placements))
            if p.is_partial() and getattr(p, "reduce_op", "sum") != "sum" and p != q]
    if dims and out.requires_grad:
        def _reduce_partial_grad(grad: Any) -> Any:
            if isinstance(grad, DTensor) and any(grad.placements[i].is_partial() for i in dims):
                fixed = [Replicate() if i in dims and p.is_partial() else p
                         for i, p in enumerate(grad.placements)]
                return grad.redistribute(grad.device_mesh, fixed)
            return grad
        out.register_hook(_reduce_partial_grad)
    return out


def _keep_layout(src: DTensor, out: DTensor) -> DTensor:
    """``out``, a resharding of ``src``, with ``src``'s local memory layout.

    Collectives return contiguous shards, but the program was captured with
    the producer's layout and may rely on it: the fused attention writes
    [batch, seq, heads, dim] memory under a [batch, heads, seq, dim] shape, so
    the capture has no copy between its transpose back and the ``view`` that
    merges the heads, which fails on a contiguous all-gathered output. A
    dense permuted layout is restored (one local copy); anything else, and
    partial sums, are left as they are."""
    a, b = src._local_tensor, out._local_tensor
    if a.ndim < 2 or a.ndim != b.ndim or a.is_contiguous() or any(
            p.is_partial() for p in out.placements):
        return out
    order = sorted(range(a.ndim), key=lambda d: -a.stride(d))
    if not a.permute(order).is_contiguous() or b.permute(order).is_contiguous():
        return out
    inverse = sorted(range(a.ndim), key=lambda d: order[d])
    local = out.to_local().permute(order).contiguous().permute(inverse)
    return DTensor.from_local(local, out.device_mesh, out.placements, run_check=False,
                              shape=out.shape, stride=out.stride())


def _redistribute(value: DTensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> DTensor:
    if not any(p.is_partial() and p != q for p, q in zip(placements, value.placements)):
        return value.redistribute(mesh, placements)
    import inspect

    Redistribute = redistribute_function()
    params = inspect.signature(Redistribute.forward).parameters
    placements = tuple(Shard(p.dim + value.ndim) if type(p) is Shard and p.dim < 0 else p
                       for p in placements)
    if "dtype_config" in params:
        dt = value._local_tensor.dtype
        cfg = {"op_dtype": dt, "out_dtype": dt,
               "backward_options": {"op_dtype": dt, "out_dtype": dt}}
        return Redistribute.apply(value, mesh, placements, False, cfg)
    return Redistribute.apply(value, mesh, placements, False)


def on_mesh(placements: Sequence[str], mesh_shape: Sequence[int]) -> list[str]:
    """``placements`` as they act on a mesh of ``mesh_shape``: on an axis of one
    device a shard or a partial sum is the whole tensor, as a replica is, so
    they are read as ``R`` (no redistribution is ever needed between them)."""
    return [("R" if int(size) == 1 else p) for p, size in zip(placements, mesh_shape)]


def plan_on_mesh(plan: Plan, mesh_shape: Sequence[int]) -> Plan:
    """``plan`` with every placement read by :func:`on_mesh` for a (stage) mesh of
    ``mesh_shape``; ``plan`` itself when no axis has one device."""
    shape = tuple(int(d) for d in mesh_shape)
    if all(d > 1 for d in shape):
        return plan

    def each(lists: Sequence[Sequence[str]]) -> list[list[str]]:
        return [on_mesh(p, shape) if p else list(p) for p in lists]

    nodes = {k: dataclasses.replace(op, inputs=each(op.inputs), outputs=each(op.outputs))
             for k, op in plan.nodes.items()}
    pipeline = plan.pipeline
    if pipeline is not None:
        pipeline = dataclasses.replace(pipeline, stages=[dataclasses.replace(
            st, inputs={k: on_mesh(v, shape) for k, v in st.inputs.items()},
            outputs={k: on_mesh(v, shape) for k, v in st.outputs.items()})
            for st in pipeline.stages])
    placed = {k: on_mesh(v, shape) for k, v in plan.parameters.items()}
    inputs = {k: on_mesh(v, shape) for k, v in plan.inputs.items()}
    return dataclasses.replace(plan, parameters=placed, inputs=inputs, nodes=nodes,
                               pipeline=pipeline)


def same_placements(have: Sequence[str], want: Sequence[str]) -> bool:
    """Whether placements ``have`` satisfy the plan's ``want`` (``P(mask)`` satisfies ``P``)."""
    if len(have) != len(want):
        return False
    return all(h == w or (h == MASKED_PARTIAL and w == "P") for h, w in zip(have, want))


def _reachable_target(value: DTensor, want: Sequence[str]) -> tuple[Placement, ...]:
    """The placements to redistribute ``value`` to for the plan's ``want``.

    A partial on an index tensor (``P(mask)``, or ``P`` on integers) is DTensor's
    masked lookup, which it makes itself inside the op without communication: that
    mesh dim is left as it is.
    """
    integer = not (value.dtype.is_floating_point or value.dtype.is_complex)
    target = []
    for have, w in zip(value.placements, want):
        if w == MASKED_PARTIAL or (integer and w.startswith("P")):
            target.append(have)
        else:
            target.append(parse_placement(w))
    return tuple(target)


def _unmask(value: DTensor) -> DTensor:
    """Turn DTensor's masked partial (an ``embedding``/``gather`` output) into ``Partial("sum")``.

    The masked partial holds garbage rows for lookups another rank owns until its
    one reduction zeroes them, and its mask can be used only once: a value read by
    two ops cannot stay masked. Zeroing the rows here (locally, no communication)
    gives an ordinary pending sum. The gradient passes straight through, exactly as
    through DTensor's own reduction of the masked partial.
    """
    placements = list(value.placements)
    local = value.to_local()
    with torch.no_grad():
        masked = local.clone()
        for i, p in enumerate(placements):
            if isinstance(p, _MaskPartial):
                p.mask_buffer.apply_mask(masked)
                p.mask_buffer.release_mask()
                placements[i] = Partial(p.reduce_op)
    local = local + (masked - local).detach()
    return DTensor.from_local(local, value.device_mesh, placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def _tensor_leaves(value: Any) -> list[Any]:
    """Tensor outputs of an op, in the order ir.graph lists them (non-tensors skipped)."""
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return [value] if isinstance(value, torch.Tensor) else []


# ---------------------------------------------------------------------------- executor
@dataclass
class WrittenOutProgram:
    """A fast trace's program (:class:`ir.fast_trace.SynthesizedProgram`) with
    the model's own parameters and buffers: the parts of an ``ExportedProgram``
    the executor reads."""

    graph: torch.fx.Graph
    graph_signature: ExportGraphSignature
    state_dict: dict[str, torch.Tensor]  # FQN -> the model's parameter or buffer
    constants: dict[str, torch.Tensor]


@dataclass
class CapturedProgram:
    """A model captured as the planner captures it: the program and its Graph."""

    ep: torch.export.ExportedProgram | WrittenOutProgram
    graph: Any  # ir.graph.Graph


def capture_program(model: torch.nn.Module, example_inputs: Any,
                    precision: Precision | str = "fp32") -> CapturedProgram:
    """Capture ``model(*example_inputs)`` exactly as the planner did
    (:func:`ir.trace.trace` of :func:`ir.precision.compute_copy`: floating
    tensors in the precision's compute dtype): a model of many identical
    blocks from two short probe captures with the rest written out (the same
    program, node for node, as the full capture; the 96-block gpt3-175b on
    meta, on the 2-core development machine: 4.3 s against 27.9 s for the
    full capture), any other with the full ``torch.export`` capture. The
    program's state is ``model``'s own parameters and buffers (the master
    copies; the executor casts them for each forward)."""
    captured_model, inputs = compute_copy(model, _as_tuple(example_inputs),
                                          get_precision(precision))
    graph = trace(captured_model, inputs)
    program = graph.exported
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    if isinstance(program, SynthesizedProgram):
        program = WrittenOutProgram(program.graph, program.graph_signature, state, {})
    elif captured_model is not model:  # captured on a meta copy: run on the model's tensors
        program = WrittenOutProgram(program.graph, program.graph_signature, state,
                                    dict(program.constants))
    return CapturedProgram(program, graph)


def _as_tuple(inputs: Any) -> tuple:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


class PlanExecutor:
    """Executes a captured program on DTensors as a Plan says.

    Args:
        plan: the Plan (``plan.nodes`` may be empty: follow-DTensor mode).
        model: the real, materialised model (same weights on every rank).
        example_inputs: inputs of the same shapes the plan was made for.
        mesh: the DeviceMesh, of shape ``plan.mesh_shape``.
        record_every_step: keep recording placements after the first forward
            (recording asks DTensor's sharding propagator about every op).
        program: the model already captured with these inputs (see
            :func:`capture_program`), to share one capture between executors.

    Subclasses run part of the program (a pipeline stage, ``codegen.pipeline``)
    by overriding :meth:`_program_calls`, :meth:`_kept_values`,
    :meth:`_wants_placeholder`, :meth:`_checkpoint_layers`,
    :meth:`_check_mesh` and :meth:`_planned_node_names`.

    Attributes:
        observed: node name -> {"inputs": [...], "outputs": [...]}, the placements
            each op consumed and produced (after the executor's own reshards).
        reshards: every :class:`ReshardEvent` of the last recorded forward.
        explicit_reshards: redistributions the plan asked for (last forward).
        mismatches: human-readable lines: outputs that came out of DTensor with a
            placement other than the plan's, and reshards DTensor did on its own.
        fallback_ops: aten ops that ran replicated because DTensor could not shard them.
    """

    def __init__(self, plan: Plan, model: torch.nn.Module, example_inputs: Any,
                 mesh: DeviceMesh, *, record_every_step: bool = False,
                 program: CapturedProgram | None = None):
        self.plan = plan
        self.mesh = mesh
        self.record_every_step = record_every_step
        self._check_mesh(mesh)
        self.plan = plan_on_mesh(plan, tuple(mesh.shape))
        # one device: every placement is the whole tensor, so the program runs on
        # plain tensors, without DTensor's per-op sharding propagation
        self.local = self._runs_locally()
        self.precision = plan.precision
        register_fused_attention_sharding()
        if program is None:
            program = capture_program(model, example_inputs, self.precision)
        self.ep, self.graph = program.ep, program.graph
        fingerprint = self.graph.fingerprint()
        expected = plan.model.get("fingerprint")
        if expected != fingerprint:
            raise PlanMismatchError(
                f"plan was made for program {expected} but model "
                f"'{plan.model.get('source', type(model).__name__)}' with these inputs captures "
                f"as {fingerprint}; re-plan this model (same batch size and sequence length)")
        self._replicate = [Replicate()] * mesh.ndim
        self._parsed_placements: dict[tuple[str, ...], Any] = {}
        self._fallback_nodes: set[str] = set()
        self.fallback_ops: list[str] = []
        self.observed: dict[str, dict[str, list[list[str]]]] = {}
        self.reshards: list[ReshardEvent] = []
        self.explicit_reshards = 0
        self.mismatches: list[str] = []
        self._recording = True
        self._forwards = 0
        self._placeholder_placements: dict[str, list[str]] = {}
        self._calls = self._program_calls()
        self._last_use = self._last_uses(self._calls, self._kept_values())
        self._segments = self._checkpoint_segments()
        self._setup_state()

    # ------------------------------------------------ what part of the program runs
    def _check_mesh(self, mesh: DeviceMesh) -> None:
        """Refuse a device mesh of another shape than the plan's."""
        if tuple(mesh.shape) != tuple(self.plan.mesh_shape):
            raise PlanMismatchError(
                f"plan is for a mesh of shape {list(self.plan.mesh_shape)} but the device mesh "
                f"has shape {list(mesh.shape)}; launch with {self.plan.world_size} ranks")

    def _runs_locally(self) -> bool:
        """Whether the program runs on plain tensors: a mesh of one device."""
        return self.mesh.size() == 1

    def _program_calls(self) -> list[torch.fx.Node]:
        """The op nodes this executor runs, in program order (here: all of them)."""
        return [n for n in self.ep.graph.nodes if n.op == "call_function"]

    def _kept_values(self) -> set[str]:
        """Values that must outlive their last reader (here: the program's outputs)."""
        out = next(n for n in self.ep.graph.nodes if n.op == "output")
        return {a.name for a in out.all_input_nodes}

    def _wants_placeholder(self, name: str) -> bool:
        """Whether the parameter/buffer/constant placeholder ``name`` is set up here."""
        return True

    def _checkpoint_layers(self) -> list[str]:
        """Module paths of the layers run under activation checkpointing."""
        return list(self.plan.checkpoint)

    def _planned_node_names(self) -> list[str]:
        """Nodes :meth:`compare_with_plan` checks."""
        return list(self.plan.nodes)

    @staticmethod
    def _last_uses(calls: Sequence[torch.fx.Node], kept: set[str]) -> dict[str, list[str]]:
        """Node name -> the values read for the last time by it (freed right after it runs)."""
        last_reader: dict[str, str] = {}
        for node in calls:
            for arg in node.all_input_nodes:
                last_reader[arg.name] = node.name
        last_use: dict[str, list[str]] = {}
        for value, reader in last_reader.items():
            if value not in kept:
                last_use.setdefault(reader, []).append(value)
        return last_use

    def _checkpoint_segments(self) -> dict[str, list[torch.fx.Node]]:
        """First node name -> the op nodes of each layer the plan checkpoints."""
        names = self._checkpoint_layers()
        if not names:
            return {}
        layers = {layer.name: set(layer.nodes) for layer in find_layers(self.graph)}
        calls = self._calls
        segments: dict[str, list[torch.fx.Node]] = {}
        for name in names:
            members = layers.get(name)
            if members is None:
                raise PlanMismatchError(f"plan checkpoints layer '{name}' but the model has no "
                                        f"such layer; re-plan this model")
            idx = [i for i, n in enumerate(calls) if n.name in members]
            if not idx or idx[-1] - idx[0] + 1 != len(idx):
                raise PlanMismatchError(f"plan checkpoints layer '{name}' but its ops are not "
                                        f"contiguous in the program; re-plan this model")
            segments[calls[idx[0]].name] = calls[idx[0]: idx[-1] + 1]
        return segments

    def _run_checkpointed(self, segment: list[torch.fx.Node], env: dict[str, Any]) -> None:
        """Run a layer under ``torch.utils.checkpoint``: its activations are not kept,
        backward re-runs the same nodes (same placements, same reshards)."""
        inside = {n.name for n in segment}
        external = list(dict.fromkeys(a.name for n in segment for a in n.all_input_nodes
                                      if a.name not in inside))
        outputs = [n.name for n in segment if any(u.name not in inside for u in n.users)]
        first_run = [True]

        def run(*values: Any) -> tuple:
            local = dict(zip(external, values))
            saved = (self._recording, self.explicit_reshards)
            if not first_run[0]:  # recomputation in backward: nothing new to record
                self._recording = False
            try:
                for n in segment:
                    local[n.name] = self._run_node(n, local)
            finally:
                if not first_run[0]:
                    self._recording, self.explicit_reshards = saved
                first_run[0] = False
            return tuple(local[o] for o in outputs)

        # Early stop would abort the recomputation with an exception mid-layer, which
        # the per-node DTensor fallback must not mistake for a sharding failure.
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            results = torch.utils.checkpoint.checkpoint(run, *[env[e] for e in external],
                                                        use_reentrant=False)
        env.update(zip(outputs, results))
        for n in segment:
            for name in self._last_use.get(n.name, ()):
                env.pop(name, None)

    # ----------------------------------------------------------------- state
    def _setup_state(self) -> None:
        sig = self.ep.graph_signature
        state = self.ep.state_dict
        consts = self.ep.constants
        self._params: dict[str, torch.nn.Parameter] = {}
        self._placeholders: dict[str, Any] = {}
        self.user_input_names: list[str] = []
        unknown = [f for f in self.plan.parameters if f not in sig.inputs_to_parameters.values()
                   and f not in sig.inputs_to_buffers.values()]
        if unknown:
            raise PlanMismatchError(
                f"plan places {len(unknown)} parameter(s) the model does not have "
                f"(first: {unknown[0]}); re-plan this model")
        for spec in sig.input_specs:
            name = spec.arg.name
            if spec.kind != InputKind.USER_INPUT and not self._wants_placeholder(name):
                continue
            if spec.kind == InputKind.PARAMETER:
                fqn = spec.target
                placements = self._planned(fqn, "parameter")
                value = cast_float(state[fqn], self.precision.master_dtype)
                dt = value.detach() if self.local else distribute_tensor(
                    value.detach(), self.mesh, _parse_all(placements), src_data_rank=None)
                param = torch.nn.Parameter(dt, requires_grad=value.requires_grad)
                self._params[fqn] = param
                self._placeholders[name] = param
                self._placeholder_placements[name] = placements
            elif spec.kind == InputKind.BUFFER:
                fqn = spec.target
                value = cast_float(state[fqn] if fqn in state else consts[fqn],
                                    self.precision.compute_dtype)
                if fqn in self.plan.parameters and not self.local:
                    placements = self.plan.parameters[fqn]
                    self._placeholders[name] = distribute_tensor(
                        value.detach(), self.mesh, _parse_all(placements), src_data_rank=None)
                    self._placeholder_placements[name] = placements
                else:  # a buffer the plan does not place is a constant: replicated
                    self._placeholders[name] = value
                    self._placeholder_placements[name] = ["R"] * self.mesh.ndim
            elif spec.kind == InputKind.CONSTANT_TENSOR:
                self._placeholders[name] = consts[spec.target]
                self._placeholder_placements[name] = ["R"] * self.mesh.ndim
            elif spec.kind == InputKind.USER_INPUT:
                self.user_input_names.append(name)
            else:
                raise NotImplementedError(f"input kind {spec.kind.name} of {name} is not supported")

    def _planned(self, fqn: str, what: str) -> list[str]:
        placements = self.plan.parameters.get(fqn)
        if placements is None:
            warnings.warn(f"plan gives no placement for {what} {fqn}; replicating it",
                          stacklevel=3)
            placements = ["R"] * self.mesh.ndim
        if len(placements) != self.mesh.ndim:
            raise PlanMismatchError(
                f"{what} {fqn} has {len(placements)} placements for a {self.mesh.ndim}-D mesh")
        return list(placements)

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(FQN, DTensor parameter) pairs, in capture order."""
        return iter(self._params.items())

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return iter(self._params.values())

    # ---------------------------------------------------------------- running
    def __call__(self, *inputs: Any) -> Any:
        return self.forward(*inputs)

    def forward(self, *inputs: Any) -> Any:
        """Run the program; returns its user outputs (one value, or a tuple)."""
        self._begin_forward()
        flat_inputs = pytree.tree_leaves(inputs)
        if len(flat_inputs) != len(self.user_input_names):
            raise ValueError(f"program takes {len(self.user_input_names)} inputs "
                             f"({', '.join(self.user_input_names)}), got {len(flat_inputs)}")
        env: dict[str, Any] = {}
        for name, value in zip(self.user_input_names, flat_inputs):
            env[name] = self._distribute_input(name, value)
        if self.local and not self._segments and not self._recording:
            self._forwards += 1
            return self._user_outputs(self._compiled(*[
                env[n.name] if n.name in env else self._placeholder_value(n.name)
                for n in self._compiled.graph.nodes if n.op == "placeholder"]))
        self._execute(env)
        out = next(n for n in self.ep.graph.nodes if n.op == "output")
        outputs = torch.fx.node.map_arg(out.args[0], lambda n: env[n.name])
        return self._user_outputs(outputs)

    @functools.cached_property
    def _compiled(self) -> torch.fx.GraphModule:
        """The captured program as Python code (``torch.fx.GraphModule``): on one
        device, after the recording forward and without checkpointed layers, it
        runs the same ops in the same order as :meth:`_execute` without
        interpreting each node."""
        return torch.fx.GraphModule(torch.nn.Module(), self.ep.graph)

    def _begin_forward(self) -> None:
        """Reset the per-forward records (recording only on the first forward)."""
        self._recording = self.record_every_step or self._forwards == 0
        if self._recording:
            self.observed = {}
            self.reshards = []
            self.mismatches = []
        self.explicit_reshards = 0

    def _placeholder_value(self, name: str) -> Any:
        """The value of a parameter/buffer/constant placeholder for this forward:
        under a mixed precision a parameter's compute-dtype copy (autograd
        brings its gradient back to the master parameter in the master dtype,
        so gradients are reduced in it)."""
        value = self._placeholders[name]
        if self.precision.mixed and isinstance(value, torch.nn.Parameter):
            return cast_float(value, self.precision.compute_dtype)
        return value

    def _execute(self, env: dict[str, Any]) -> None:
        """Run :meth:`_program_calls` on ``env`` (user inputs or boundary values in it).

        Values are dropped from ``env`` after their last reader (autograd keeps
        what backward needs), except :meth:`_kept_values`.
        """
        for node in self.ep.graph.nodes:
            if node.op == "placeholder" and node.name not in env and node.name in self._placeholders:
                env[node.name] = self._placeholder_value(node.name)
        skip: set[str] = set()
        for node in self._calls:
            if node.name in skip:
                continue
            if node.name in self._segments:
                segment = self._segments[node.name]
                self._run_checkpointed(segment, env)
                skip.update(n.name for n in segment)
                continue
            env[node.name] = self._run_node(node, env)
            for name in self._last_use.get(node.name, ()):
                env.pop(name, None)
        self._forwards += 1

    def _user_outputs(self, outputs: Any) -> Any:
        specs = self.ep.graph_signature.output_specs
        user = []
        for spec, value in zip(specs, outputs):
            if spec.kind in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT):
                user.append(value)
            elif spec.kind == OutputKind.BUFFER_MUTATION:
                name = next(s.arg.name for s in self.ep.graph_signature.input_specs
                            if s.kind == InputKind.BUFFER and s.target == spec.target)
                self._placeholders[name] = value.detach()
            else:
                raise NotImplementedError(f"program output kind {spec.kind.name} is not supported")
        return user[0] if len(user) == 1 else tuple(user)

    def _distribute_input(self, name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        value = cast_float(value, self.precision.compute_dtype)
        placements = self.plan.inputs.get(name)
        if placements is None:
            warnings.warn(f"plan gives no placement for input {name}; replicating it", stacklevel=3)
            placements = ["R"] * self.mesh.ndim
        self._placeholder_placements[name] = list(placements)
        if self.local:
            return value
        if isinstance(value, DTensor):
            return self._to(value, placements)
        return distribute_tensor(value, self.mesh, _parse_all(placements), src_data_rank=None)

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

    def _to(self, value: DTensor, placements: Sequence[str]) -> DTensor:
        return redistribute(value, self.mesh, _parse_all(placements))

    def _wrap_replicated(self, t: torch.Tensor) -> DTensor:
        return DTensor.from_local(t, self.mesh, self._replicate, run_check=False)

    def _run_node(self, node: torch.fx.Node, env: dict[str, Any]) -> Any:
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
            it = iter(values)
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda _: next(it))
            out = node.target(*args, **kwargs)
            in_obs = ([list(p) for p in entry.inputs] if entry else
                      [["R"] * self.mesh.ndim if isinstance(v, torch.Tensor) else [] for v in values])
            return self._finish(node, entry, out, in_obs, constant=True)

        # Bring every tensor argument to the plan's placement for it.
        new_values = []
        for i, (arg, v) in enumerate(zip(arg_nodes, values)):
            if isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
                v = self._wrap_replicated(v)
            want = entry.inputs[i] if entry is not None and i < len(entry.inputs) else None
            if isinstance(v, DTensor) and want and v.placements != self._parsed(want):
                have = placements_of(v)
                target = _reachable_target(v, want)
                if tuple(target) != tuple(v.placements):
                    v = _keep_layout(v, redistribute(v, self.mesh, target))
                    self.explicit_reshards += 1
                    if self._recording:
                        self.reshards.append(ReshardEvent(node.name, arg.name, "explicit",
                                                          have, list(want)))
            new_values.append(v)
        it = iter(new_values)
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda _: next(it))

        # the placements each input arrived in: recorded on the recording forward only
        in_obs = [placements_of(v) for v in new_values] if self._recording else []
        if is_assertion_op(node.target):
            return self._run_check(node, entry, args, kwargs, in_obs)
        if node.name in self._fallback_nodes:
            out = self._run_replicated(node, args, kwargs)
            in_obs = [["R"] * self.mesh.ndim if isinstance(v, DTensor) else [] for v in new_values]
            return self._finish(node, entry, out, in_obs, constant=False)

        if self._recording:
            try:
                choice = _dtensor_input_choice(node.target, args, kwargs)
            except Exception:  # noqa: BLE001 - no strategy; the call below decides
                choice = None
            if choice:
                for i, (arg, v) in enumerate(zip(arg_nodes, new_values)):
                    if isinstance(v, DTensor) and id(v) in choice:
                        want = entry.inputs[i] if entry is not None and i < len(entry.inputs) else None
                        planned = bool(want) and same_placements(choice[id(v)], want)
                        self.reshards.append(ReshardEvent(node.name, arg.name,
                                                          "inside" if planned else "implicit",
                                                          in_obs[i], choice[id(v)]))
                        if entry is not None and not planned:
                            self.mismatches.append(
                                f"{node.name} ({node.target}): DTensor resharded argument "
                                f"{arg.name} from {in_obs[i]} to {choice[id(v)]} by itself")
                        in_obs[i] = choice[id(v)]
        try:
            out = node.target(*args, **kwargs)
            _check_output(node, out)
        except Exception as err:  # noqa: BLE001 - DTensor could not run it: replicate
            return self._fall_back(node, entry, args, kwargs, new_values, err)
        return self._finish(node, entry, out, in_obs, constant=False)

    def _run_local(self, node: torch.fx.Node, env: dict[str, Any]) -> Any:
        """Run ``node`` on plain tensors (one device: every placement is ``R``)."""
        if node.target is operator.getitem:
            out = env[node.args[0].name][node.args[1]]
        else:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs),
                                                 lambda n: env[n.name])
            out = node.target(*args, **kwargs)
        if self._recording:
            entry = self.plan.nodes.get(node.name)
            replicated = ["R"] * self.mesh.ndim
            self.observed[node.name] = {
                "inputs": [replicated for _ in (entry.inputs if entry else ())],
                "outputs": [replicated for _ in _tensor_leaves(out)]}
        return out

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
                local_args, local_kwargs = pytree.tree_map(
                    lambda v: v.to_local() if isinstance(v, DTensor) else v, (args, kwargs))
                out = node.target(*local_args, **local_kwargs)
            except Exception:  # noqa: BLE001 - compares global metadata: gather
                out = self._run_replicated(node, args, kwargs)
        return self._finish(node, entry, out, in_obs, constant=False)

    def _fall_back(self, node, entry, args, kwargs, new_values, err) -> Any:
        op = str(node.target)
        warnings.warn(f"DTensor cannot shard {op} (node {node.name}: {type(err).__name__}: "
                      f"{_first_line(err)}); running it replicated", stacklevel=2)
        try:
            out = self._run_replicated(node, args, kwargs)
        except Exception as err2:  # noqa: BLE001
            raise RuntimeError(
                f"node {node.name} ({op}) failed on DTensor ({type(err).__name__}: "
                f"{_first_line(err)}) and replicated ({type(err2).__name__}: "
                f"{_first_line(err2)}); inputs {[placements_of(v) for v in new_values]}") from err
        self._fallback_nodes.add(node.name)
        if op not in self.fallback_ops:
            self.fallback_ops.append(op)
        in_obs = [["R"] * self.mesh.ndim if isinstance(v, DTensor) else [] for v in new_values]
        return self._finish(node, entry, out, in_obs, constant=False)

    def _run_replicated(self, node, args, kwargs) -> Any:
        def local(v):
            if isinstance(v, DTensor):
                return redistribute(v, self.mesh, self._replicate).to_local()
            return v
        args, kwargs = pytree.tree_map(local, (args, kwargs))
        out = node.target(*args, **kwargs)
        return pytree.tree_map(
            lambda t: self._wrap_replicated(t) if isinstance(t, torch.Tensor) else t, out)

    def _finish(self, node, entry, out, in_obs, *, constant: bool) -> Any:
        """Record output placements; bring outputs to the plan's placements."""
        leaves = _tensor_leaves(out)
        want_all = entry.outputs if entry is not None else []
        ndim = self.mesh.ndim
        if constant:
            # A constant is placed however the plan wants it at no cost (a local slice).
            out_obs = []
            new = {}
            for k, t in enumerate(leaves):
                want = want_all[k] if k < len(want_all) else None
                if want and any(p != "R" for p in want) and not isinstance(t, DTensor):
                    new[k] = self._to(self._wrap_replicated(t), want)
                    out_obs.append(list(want))
                else:
                    out_obs.append(placements_of(t) or ["R"] * ndim)
        else:
            new = {}
            for k, t in enumerate(leaves):
                if isinstance(t, DTensor) and any(isinstance(p, _MaskPartial) for p in t.placements):
                    new[k] = leaves[k] = _unmask(t)
            out_obs = [placements_of(t) for t in leaves] if self._recording else []
            for k, t in enumerate(leaves):
                want = want_all[k] if k < len(want_all) else None
                if (want and isinstance(t, DTensor) and t.placements != self._parsed(want)
                        and not same_placements(placements_of(t), want)):
                    new[k] = self._to(t, want)
                    if self._recording:
                        self.mismatches.append(
                            f"{node.name} ({node.target}): output {k} came out {out_obs[k]}, "
                            f"plan says {list(want)}")
                        self.reshards.append(ReshardEvent(node.name, f"out{k}", "output",
                                                          out_obs[k], list(want)))
        if new:
            out = self._replace_leaves(out, new)
        if self._recording:
            self.observed[node.name] = {"inputs": [list(p) for p in in_obs],
                                        "outputs": out_obs}
        return out

    @staticmethod
    def _replace_leaves(out: Any, new: dict[int, Any]) -> Any:
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

    # ------------------------------------------------------------- reporting
    def compare_with_plan(self) -> list[str]:
        """Differences between the recorded placements and the plan's, one line each."""
        diffs = []
        for name in self._planned_node_names():
            entry = self.plan.nodes.get(name)
            if entry is None:
                continue
            obs = self.observed.get(name)
            if obs is None:
                diffs.append(f"{name}: in the plan but not executed")
                continue
            for i, (want, got) in enumerate(zip(entry.inputs, obs["inputs"])):
                if want and got and not same_placements(got, want):
                    diffs.append(f"{name}: input {i} is {got}, plan says {list(want)}")
            for k, (want, got) in enumerate(zip(entry.outputs, obs["outputs"])):
                if want and got and not same_placements(got, want):
                    diffs.append(f"{name}: output {k} is {got}, plan says {list(want)}")
        return diffs

    @property
    def implicit_reshards(self) -> int:
        """Redistributions DTensor did inside its dispatcher in the last recorded forward."""
        return sum(1 for r in self.reshards if r.kind == "implicit")

    def recorded_plan(self) -> Plan:
        """A copy of the plan whose ``nodes`` and ``reshards`` are what was observed.

        Run a plan that lists only parameter and input placements once, then call
        this: the result, fed back, makes every reshard explicit.
        """
        if not self.observed:
            raise RuntimeError("run forward() once before asking for the recorded plan")
        plan = copy.deepcopy(self.plan)
        nodes: dict[str, OpPlacement] = {}
        produced: dict[str, list[list[str]]] = {
            n: [list(p)] for n, p in self._placeholder_placements.items()}
        reshards: list[Reshard] = []
        for gnode in self.graph.ops:
            obs = self.observed.get(gnode.name)
            if obs is None:
                continue
            nodes[gnode.name] = OpPlacement(op=gnode.target, module=gnode.module_path,
                                            inputs=[list(p) for p in obs["inputs"]],
                                            outputs=[list(p) for p in obs["outputs"]])
            if gnode.arg_index is None:
                for arg, dst in zip(gnode.args, obs["inputs"]):
                    src = produced.get(arg, [[]])[0] if produced.get(arg) else []
                    if dst and src and any(a != b and b != MASKED_PARTIAL for a, b in zip(src, dst)):
                        reshards.append(Reshard(node=gnode.name, arg=arg, module=gnode.module_path,
                                                src=list(src), dst=list(dst), time_s=0.0))
            produced[gnode.name] = [list(p) for p in obs["outputs"]]
        plan.nodes = nodes
        plan.reshards = reshards
        return plan


def record_plan(plan: Plan, model: torch.nn.Module, example_inputs: Any) -> Plan:
    """Run ``plan`` once in this process and return it with the observed placements.

    Where no process group exists, a fake one of the plan's world size is used
    (collectives do nothing; the placements DTensor chooses depend only on shapes
    and placements, so they are those a real run observes). The model must be
    materialised (CPU is fine); only the forward pass runs.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    own_group = not dist.is_initialized()
    if own_group:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    try:
        device_type = next((p.device.type for p in model.parameters()), "cpu")
        mesh = init_device_mesh(device_type, plan.mesh_shape)
        executor = PlanExecutor(plan, model, example_inputs, mesh)
        with torch.no_grad():
            executor(*(example_inputs if isinstance(example_inputs, (tuple, list))
                       else (example_inputs,)))
        return executor.recorded_plan()
    finally:
        if own_group:
            dist.destroy_process_group()
