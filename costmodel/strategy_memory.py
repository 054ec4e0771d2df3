"""Per-strategy memory: the bytes one node holds on one device under a strategy.

:class:`MemoryPricing` is the part of :class:`costmodel.strategy_cost.IntraOpCost`
that prices memory: a parameter's training states (parameters, gradients,
optimizer states, laid out as the ZeRO stage shards them), a user input's local
batch, the outputs autograd keeps for an op's backward, the transient gradients
of the backward's largest op, and the backward's timeline over the saved
activations (:meth:`MemoryPricing.backward_excess`).

Units: bytes per device.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Mapping, Sequence

from torch.distributed.tensor.placement_types import Replicate, Shard

from costmodel.memory import backward_timeline_excess, step_copy_bytes, training_state_bytes
from costmodel.resharding import reshard_staging_bytes, reshard_steps
from costmodel.saved_tensors import extra_saved_bytes, release_points, savers_of
from costmodel.strategy_settings import StrategySettings
from ir.graph import INPUT, OP, PARAM, Node
from ir.strategy import Strategy, local_numel, moved_arguments

__all__ = ["MemoryPricing"]


class MemoryPricing(StrategySettings):
    """Bytes per device of a node under a strategy; a part of
    :class:`costmodel.strategy_cost.IntraOpCost`."""

    def memory_breakdown(self, node: Node, s: Strategy) -> dict[str, float]:
        """Bytes per device that ``node`` holds under ``s`` during a training step.

        Parameters bring their gradient and optimizer states (sharded like the
        parameter); a user input its local batch; an op the outputs that
        autograd keeps for some op's backward (:mod:`costmodel.saved_tensors`).

        With n ranks on mesh axis 0, for a parameter replicated on it: under
        ZeRO-1 the optimizer states count ``1/n`` (under a mixed precision
        with the fp32 master parameters, the model's parameters in the
        compute dtype: Megatron's distributed optimizer); under ZeRO-2 and ZeRO-3
        (FSDP2 with the whole stage as one unit, :attr:`params_sharded`)
        parameters, gradients and optimizer states are kept 1/n each, and on
        top the stage's parameters are all-gathered whole for the step and its
        gradients stay whole until they are reduce-scattered: params and grads
        count ``1 + 1/n`` times, optimizer states ``1/n`` (in fp32; see
        :func:`costmodel.memory.training_state_bytes` for the dtypes).
        """
        if node.kind == PARAM:
            numel, zero, n = self._state_layout(node, s)
            state = training_state_bytes(numel, precision=self.precision,
                                         optimizer=self.optimizer, zero_stage=zero, dp_size=n,
                                         params_sharded=self.params_sharded,
                                         gathered=self._gathered(node))
            return {k: float(v) for k, v in state.items() if k != "total"}
        if node.kind == INPUT:
            return {"activations": local_numel(node.output, s.outputs[0], self.mesh_shape)
                    * node.output.itemsize}
        out: dict[str, float] = {}
        kept = self.saved.get(node.name)
        if node.kind == OP and kept:
            f = self.shard_factor(s)
            out["activations"] = sum(local_numel(o, p, self.mesh_shape) * o.itemsize
                                     for i, (o, p) in enumerate(zip(node.outputs, s.outputs))
                                     if i in kept) + extra_saved_bytes(node) / f
        if node.name == self.transient_node:
            out["backward_transient"] = self.backward_transient(node, s)
        return out

    def memory(self, node: Node, s: Strategy) -> float:
        """Bytes per device of :meth:`memory_breakdown`, activations counted once per
        micro-batch in flight (``activation_copies``)."""
        return float(sum(v * (self.activation_copies if k == "activations" else 1.0)
                         for k, v in self.memory_breakdown(node, s).items()))

    def gathered_parameter_bytes(self, chosen: Mapping[str, Strategy],
                                 checkpointed: Sequence[str] = ()) -> float:
        """Bytes per device of the parameter copies the forward's redistributes
        gather and the backward keeps, under the assignment ``chosen`` (node
        name -> strategy): :meth:`parameter_gathers` of every parameter. An
        edge term: it depends on a parameter's and its readers' strategies
        both, which the ILP's per-node memory cannot see; the solver checks
        its answer against it (:func:`planner.ilp.intra_op.solve_prepared`)."""
        recomputed = self._recomputed_layer_of(checkpointed)
        return float(sum(self._gathered_copies(n, chosen[n.name], chosen, recomputed)
                         for n in self.graph.nodes if n.kind == PARAM))

    def parameter_gathers(self, node: Node, stored: Strategy, chosen: Mapping[str, Strategy],
                          checkpointed: Sequence[str] = ()) -> float:
        """Bytes per device of parameter ``node``'s gathered copies, stored
        under ``stored``, with its readers' strategies from ``chosen``.

        An op that reads a parameter stored sharded on a mesh axis where it
        takes it replicated (a weight DTensor shards over the data axis, read
        whole by a batch-sharded matmul) gets a gathered copy, and when an
        op's backward keeps the parameter (a matmul its weight, through views
        too) it keeps that copy, from the forward to its backward, once per
        micro-batch. Under a mixed precision the local compute-dtype cast it
        was gathered from is then freed, and counted once less. None where
        every op that keeps the parameter is in a ``checkpointed`` layer (the
        recomputation gathers it again) or FSDP2 gathers the parameters
        (:func:`costmodel.memory.training_state_bytes` counts those)."""
        return self._gathered_copies(node, stored, chosen, self._recomputed_layer_of(checkpointed))

    def _gathered_copies(self, node: Node, stored: Strategy, chosen: Mapping[str, Strategy],
                         recomputed: Mapping[str, str]) -> float:
        """:meth:`parameter_gathers`, the recomputed ops given (op -> its
        checkpointed layer, :meth:`_recomputed_layer_of`)."""
        if self.params_sharded:
            return 0.0
        readers, keepers = self._parameter_uses.get(node.name, ((), {}))
        kept_through = {reader for op, reader in keepers.items() if op not in recomputed}
        gathered = []
        for reader, position in readers:
            if reader not in kept_through:
                continue
            wanted = chosen[reader].inputs[position]
            if any(isinstance(a, Shard) and isinstance(b, Replicate) and size > 1
                   for a, b, size in zip(stored.outputs[0], wanted, self.mesh_shape)):
                gathered.append(local_numel(node.output, wanted, self.mesh_shape)
                                * self.precision.compute_dtype.itemsize)
        total = float(sum(gathered))
        if gathered and len(gathered) == len(readers) and self.precision.mixed:
            total -= self.step_copy(node, stored)
        return total

    @functools.cached_property
    def _parameter_uses(self) -> dict[str, tuple[list[tuple[str, int]], dict[str, str]]]:
        """Parameter name -> ((reader, the argument position it reads it at),
        {op whose backward keeps it: the reader it keeps it through}): an op
        keeps a parameter through a chain of views, whose first is the reader."""
        graph = self.graph
        out: dict[str, tuple[list[tuple[str, int]], dict[str, str]]] = {}
        for name, readers in graph.users().items():
            if graph[name].kind == PARAM:
                out[name] = ([(r, graph[r].args.index(name)) for r in readers], {})
        for base, keepers in savers_of(graph, self.requires_grad).items():
            if base not in out:
                continue
            for keeper in keepers:
                for arg in graph[keeper].args:
                    reader = keeper
                    while arg != base and graph[arg].kind == OP and graph[arg].is_view and graph[arg].args:
                        reader, arg = arg, graph[arg].args[0]
                    if arg == base:
                        out[base][1][keeper] = reader
        return out

    def unit_gradient_bytes(self, chosen: Mapping[str, Strategy]) -> float:
        """Under ZeRO-3, bytes per device of the whole gradients of the units
        gathered at the peak (part of their ``grads``, under the assignment
        ``chosen``): each unit's backward makes them and reduce-scatters them
        into its shards before the next unit's (:mod:`codegen.zero3_units`), so
        across micro-batches only the shards accumulate. 0 otherwise; also 0
        where the largest transient's backward (:attr:`transient_node`) runs
        after a gradient of a parameter is made, and may hold it."""
        if self.zero_stage != 3 or not self._transient_before_parameter_gradients():
            return 0.0
        total = 0.0
        for node in self.graph.nodes:
            if node.kind != PARAM or not self._gathered(node):
                continue
            numel, zero, n = self._state_layout(node, chosen[node.name])
            grads = [training_state_bytes(numel, precision=self.precision, optimizer=self.optimizer,
                                          zero_stage=zero, dp_size=n, params_sharded=self.params_sharded,
                                          gathered=gathered)["grads"] for gathered in (True, False)]
            total += grads[0] - grads[1]
        return float(total)

    def _transient_before_parameter_gradients(self) -> bool:
        """Whether the backward of the largest transient runs before any
        parameter's gradient is made: it comes after every op that reads a
        parameter (the loss after the vocabulary projection)."""
        if self.transient_node is None:
            return False
        order = {n.name: i for i, n in enumerate(self.graph.nodes)}
        readers = [order[n.name] for n in self.graph.nodes if n.kind == OP
                   and any(a in self.param_derived for a in n.args)]
        return all(i < order[self.transient_node] for i in readers)

    def _gathered(self, node: Node) -> bool:
        """Whether parameter ``node``'s whole copy and gradient count toward the
        peak when it is sharded (:attr:`gathered_params`)."""
        return self.gathered_params is None or node.name in self.gathered_params

    def _state_layout(self, node: Node, s: Strategy) -> tuple[int, int, int]:
        """(parameters this device holds, ZeRO stage, ZeRO group size) of
        parameter ``node`` under strategy ``s``."""
        numel = int(math.ceil(local_numel(node.output, s.outputs[0], self.mesh_shape)))
        # ZeRO shards the states over axis 0 where the parameter is replicated;
        # a parameter sharded there already holds the states of its shard alone
        n = self.state_shards if isinstance(s.outputs[0][0], Replicate) else 1
        # ZeRO-1 under a mixed precision keeps the distributed optimizer's layout
        # (working params in the compute dtype, the master copy with the states)
        # for a parameter sharded on axis 0 too, its states then split over 1
        zero = self.zero_stage if n > 1 or self.zero_stage == 1 else 0
        return numel, zero, n

    def step_copy(self, node: Node, s: Strategy) -> float:
        """Bytes of parameter ``node``'s ``params`` under ``s`` that the step frees
        before the optimizer step (:func:`costmodel.memory.step_copy_bytes`);
        none at stage 1 under a mixed precision, which stores the compute-dtype
        parameters."""
        numel, zero, n = self._state_layout(node, s)
        if zero == 1 and self.precision.mixed and not self.params_sharded:
            return 0.0
        if n > 1 and not self._gathered(node):
            return 0.0
        return float(step_copy_bytes(numel, precision=self.precision, dp_size=n,
                                     params_sharded=self.params_sharded))

    def _largest_transient(self) -> str | None:
        """The op whose backward holds the most transient gradient bytes,
        unsharded (in a language model the vocabulary projection and the
        loss, at the start of the backward, while every activation is alive).
        Its :meth:`backward_transient` under its chosen strategy counts
        toward the step's peak memory; a linear term, so the ILP's memory
        budget covers it exactly (other ops' transients are assumed smaller)."""
        best, name = 0.0, None
        for n in self.graph.nodes:
            if n.kind != OP or n.is_view or n.name not in self.requires_grad:
                continue
            nbytes = sum(o.nbytes for o in n.outputs if o.is_float) + sum(
                t.nbytes for a, t in zip(n.args, n.inputs)
                if t.is_float and a in self.requires_grad and a not in self.param_derived)
            if nbytes > best:
                best, name = nbytes, n.name
        return name

    def backward_transient(self, node: Node, s: Strategy) -> float:
        """Bytes per device the backward of ``node`` holds on top of the saved
        activations while it runs: the gradient of its outputs and the
        gradients it writes for its activation inputs (the largest of these, at
        the loss, is what lifts the step's peak above the states and saved
        activations). 0 off the gradient path and for views."""
        if node.kind != OP or node.is_view or node.name not in self.requires_grad:
            return 0.0
        out = sum(local_numel(o, p, self.mesh_shape) * o.itemsize
                  for o, p in zip(node.outputs, s.outputs) if o.is_float)
        ins = sum(local_numel(t, p, self.mesh_shape) * t.itemsize
                  for a, t, p in zip(node.args, node.inputs, s.inputs)
                  if t.is_float and a in self.requires_grad and a not in self.param_derived)
        return float(out + ins)

    def forward_reshard_excess(self, chosen: Mapping[str, Strategy]) -> float:
        """Bytes per device the forward's worst redistribute holds beyond the
        saved activations: what it allocates while it runs
        (:func:`costmodel.resharding.reshard_staging_bytes`) and its input,
        where no backward keeps that. Counted beside every saved activation
        (the loss head's reshard of the logits runs when nearly all are);
        parameters' gathers are :meth:`parameter_gathers`."""
        graph, best = self.graph, 0.0
        for n in graph.nodes:
            if n.kind != OP:
                continue
            for _, arg, idx, src, dst in moved_arguments(n, chosen[n.name], chosen):
                if graph[arg].kind == PARAM:
                    continue
                info = graph[arg].outputs[idx]
                staging = reshard_staging_bytes(
                    reshard_steps(src, dst, info.shape, info.itemsize, self.mesh_shape),
                    self.mesh_shape, self.cluster.backend)
                kept = idx in self.saved.get(arg, ())
                held = 0.0 if kept else local_numel(info, src, self.mesh_shape) * info.itemsize
                best = max(best, staging + held)
        return float(best)

    def backward_excess(self, chosen: Mapping[str, Strategy] | None = None,
                        checkpointed: Sequence[str] = ()) -> float:
        """Bytes per device, at the worst op of the backward, that the backward
        holds beyond the saved activations (the backward's timeline,
        :func:`costmodel.memory.backward_timeline_excess`): the gradients made so
        far, that op's :meth:`backward_transient`, less the activations freed by
        the ops that ran before it. The backward runs the ops in the reverse of
        the forward's order; an op makes the gradient of a parameter it is the
        last reader of, and frees the saved tensors it is the first keeper of
        (:func:`costmodel.saved_tensors.release_points`), the parameter copies
        gathered for it too (:meth:`parameter_gathers`). At the loss it is the
        loss's transient; at a mixture-of-experts layer near the end of the model
        its experts' gradients, made at once while the earlier layers'
        activations are alive, can lift it far above that (DeepSeek-V3's MoE
        layer: 22 GB of bf16 gradients). Under the ``chosen`` strategies (None:
        every value whole, as captured). A ``checkpointed`` layer (names of the
        graph's layers) kept none of its saved tensors in the forward: its
        recompute makes them again just before its first op in the backward
        (its last in the forward) runs, and its ops free them as they run, on
        top of the gradients made so far.

        Gradients count as :meth:`memory_breakdown` has them, less the fp32
        main-gradient slice of ZeRO-1 under a mixed precision, which exists at
        the optimizer step only; the compute-dtype copy of a parameter
        (:meth:`step_copy`) is freed by the first op in the forward that reads
        it, the last of its readers to run backward. Under a mixed precision
        with whole parameters a last reader makes the copy's gradient, and the
        master gradients come after the last op, each beside its copy's."""
        def strategy(node: Node) -> Strategy:
            if chosen is not None:
                return chosen[node.name]
            whole = tuple(Replicate() for _ in self.mesh_shape)
            return Strategy(inputs=tuple(whole for _ in node.args),
                            outputs=tuple(whole for _ in node.outputs))

        ops = [n for n in self.graph.nodes
               if n.kind == OP and not n.is_view and n.name in self.requires_grad]
        first_reader, last_reader = self._parameter_readers(ops)
        # the compute-dtype copy the step made of each parameter (a mixed
        # precision's cast, FSDP2's gathered parameters)
        copies = {param: self.step_copy(self.graph[param], strategy(self.graph[param]))
                  for param in first_reader}
        layer_of = self._recomputed_layer_of(checkpointed)
        released = release_points(self.graph, self.requires_grad)
        freed = self._copies_freed(first_reader, copies, chosen, layer_of, released)
        # under a mixed precision with whole parameters the step casts each
        # parameter before the forward, so autograd runs the casts' backward,
        # which makes the master gradients, after every other op (the lowest
        # sequence numbers run last): a last reader makes the copy's gradient
        cast_first = self.precision.mixed and not self.params_sharded
        made: dict[str, float] = {}
        converted = []  # (master gradient, copy's gradient), in the order the casts' backward runs
        for param, op in last_reader.items():
            master = self._gradient_made(self.graph[param], strategy)
            copy = copies.get(param, 0.0) if cast_first else 0.0
            made[op] = made.get(op, 0.0) + (copy or master)
            if copy:
                converted.append((master, copy))
        entry = {layer_of[n.name]: n.name for n in ops if n.name in layer_of}  # its last op
        remade: dict[str, float] = {}
        for base, op in released.items():
            node = self.graph[base]
            if node.kind != OP:
                continue
            layer = layer_of.get(base)
            if layer is not None and layer_of.get(op) != layer:
                continue  # kept past its layer: the next layer's checkpoint input
            kept = self.memory_breakdown(node, strategy(node)).get("activations", 0.0)
            freed[op] = freed.get(op, 0.0) + kept
            if layer is not None:
                remade[entry[layer]] = remade.get(entry[layer], 0.0) + kept
        steps = [(made.get(n.name, 0.0), self.backward_transient(n, strategy(n)),
                  freed.get(n.name, 0.0), remade.get(n.name, 0.0)) for n in reversed(ops)]
        # each cast's backward makes the master gradient while the copy's is alive
        steps += [(master - copy, copy, 0.0) for master, copy in reversed(converted)]
        return backward_timeline_excess(steps)

    def _copies_freed(self, first_reader: Mapping[str, str], copies: Mapping[str, float],
                      chosen: Mapping[str, Strategy] | None, recomputed: Mapping[str, str],
                      released: Mapping[str, str]) -> dict[str, float]:
        """Op -> bytes of parameter copies its backward frees (see
        :meth:`backward_excess`): a compute-dtype copy once the last op that
        reads it has run (its first reader in the forward), the copies
        gathered for its readers (counted with the activations) once its
        first keeper (``released``) has; ``recomputed`` as
        :meth:`_recomputed_layer_of` gives it."""
        freed: dict[str, float] = {}
        for param, op in first_reader.items():
            if copies[param]:
                freed[op] = freed.get(op, 0.0) + copies[param]
        if chosen is not None:
            for param in first_reader:
                gathered = self._gathered_copies(self.graph[param], chosen[param], chosen, recomputed)
                if gathered:
                    freed[released[param]] = freed.get(released[param], 0.0) + gathered
        return freed

    def _recomputed_layer_of(self, checkpointed: Sequence[str]) -> dict[str, str]:
        """Op name -> the name of the ``checkpointed`` layer it belongs to."""
        wanted = set(checkpointed)
        return {op: layer.name for layer in self.graph.layers if layer.name in wanted
                for op in layer.nodes}

    def _parameter_readers(self, ops: Sequence[Node]) -> tuple[dict[str, str], dict[str, str]]:
        """(parameter -> the first of ``ops`` that reads it, parameter -> the
        last), a read of a view of a parameter being a read of the parameter."""
        root: dict[str, str] = {}
        for n in self.graph.nodes:
            if n.kind == PARAM:
                root[n.name] = n.name
            elif n.name in self.param_derived and n.args and n.args[0] in root:
                root[n.name] = root[n.args[0]]
        last_reader: dict[str, str] = {}
        first_reader: dict[str, str] = {}
        for n in ops:
            for a in n.args:
                if a in root:
                    last_reader[root[a]] = n.name
                    first_reader.setdefault(root[a], n.name)
        return first_reader, last_reader

    def _gradient_made(self, node: Node, strategy: Callable[[Node], Strategy]) -> float:
        """Bytes of parameter ``node``'s master gradient, under
        ``strategy(node)`` (see :meth:`backward_excess`)."""
        s = strategy(node)
        grads = self.memory_breakdown(node, s).get("grads", 0.0)
        numel, zero, _ = self._state_layout(node, s)
        p = self.precision
        if zero == 1 and p.mixed and not self.params_sharded:
            grads = float(p.reduce_dtype.itemsize * numel)  # the main-grad slice: at the step
        return grads
