"""Fast capture of models made of many identical blocks.

``torch.export`` followed by ``run_decompositions`` costs time in proportion to
the number of ops: a 96-block GPT-3 takes tens of seconds, almost all of it
re-tracing the same block 96 times. When a model keeps its blocks in an
``nn.ModuleList`` of structurally identical modules, :func:`fast_trace`

1. captures two truncated copies of the model, keeping only the first 2 and the
   first 3 blocks (shallow copies: the user's model is not touched and nothing
   is allocated), one by :func:`ir.trace.capture` and the other by
   :func:`ir.trace.capture_in_one_pass` (so the check of step 3 also vouches
   that the two agree; a later trace ``like`` this one captures its probes
   in one pass);
2. checks that the captured program is uniform: the blocks issue the same ops
   on the same shapes with the same wiring relative to their own index, the
   code before and after the blocks does not depend on how many there are, and
   node names advance by a fixed step per block;
3. writes out the program of the full model by replicating the last captured
   block, naming every node as the full capture names it, and checks the method
   on the probes themselves (the 3-block program rebuilt from the 2-block one
   must equal the 3-block capture exactly).

Node names: torch.fx numbers nodes per base name in creation order (``view``,
``view_1``, ...; a few bases such as ``any`` or ``sum`` start at ``_1``), and
nodes removed after naming (unused ``getitem`` outputs of ``native_layer_norm``)
leave gaps. Every block consumes the same numbers per base, so the name of a
node of block ``i`` is ``base_{n + (i - t) * step[base]}`` where ``n`` is the
number of the same node in captured block ``t``; nodes after the blocks shift
by the step measured between the two probes.

The result is a :class:`ir.graph.Graph` equal, node for node, to the one
:func:`ir.trace.graph_from_exported` builds from the full capture (same names,
targets, wiring, shapes, FLOPs, bytes, parameters, module paths), so its
``fingerprint()`` is the same. Its ``exported`` is a :class:`SynthesizedProgram`:
a real ``torch.fx.Graph`` of the whole program (nodes share the ``meta["val"]``
of the captured block they copy) and an ``ExportGraphSignature``, enough for
``planner.strategies``, and with the model's own tensors enough for code
generation to run (``codegen.executor.WrittenOutProgram``).

Anything that does not fit (no such ModuleList, blocks that differ in shapes,
attributes or hooks, ops between blocks, blocks called out of order, names
that do not advance uniformly, a probe capture that fails) makes
:func:`fast_trace` return ``None``, with the reason logged at debug level;
:func:`ir.trace.trace` then captures the full model.
"""

from __future__ import annotations

import copy
import logging
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import nn
from torch.export.graph_signature import (
    ExportGraphSignature, InputKind, InputSpec, OutputKind, OutputSpec, TensorArgument,
)

from ir.graph import Graph
from ir.probe_rescale import RescaleError, rescale_program
from ir.trace import _as_tuple, _module_path, capture, capture_in_one_pass, graph_from_exported
from ir.torch_compat import OpOverload

log = logging.getLogger(__name__)

# Below this many blocks two probe captures cost about as much as the full one
# (8-block gpt-tiny on meta, this 2-core machine: 3.3 s for the two probes against
# 3.7 s for the full capture; a later trace at another batch size, one probe,
# 1.8 s against 4.8 s).
MIN_BLOCKS = 8
# Blocks kept by the two probe captures.
_PROBES = (2, 3)
# Attributes every nn.Module has; the rest of an instance's __dict__ is compared.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
_FORWARD_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                  "_backward_pre_hooks")
_NAME_RE = re.compile(r"(.*)_(\d+)")
_PLACEHOLDER_PREFIX = {InputKind.PARAMETER: "p_", InputKind.BUFFER: "b_"}


class _Unsupported(Exception):
    """The fast path cannot vouch for this model; the full capture is used."""


@dataclass
class SynthesizedProgram:
    """Stand-in for the ``ExportedProgram`` of a fast trace.

    Attributes:
        graph: ``torch.fx.Graph`` of the full program, node names as in the full
            capture; replicated nodes share ``meta["val"]`` with the captured
            block they copy.
        graph_signature: parameters, buffers and user inputs of the full program.
        source: the decomposed capture of the truncated model it was built from.
        block_path: FQN of the ``nn.ModuleList`` of repeated blocks.
        num_blocks: number of blocks of the full model.
        suffix_steps: how far node numbers after the blocks move per block.
        probe: the short probe's program without its values and literals
            (:func:`_structure`); a later trace of the same model at other
            shapes whose short probe has this structure is written out from
            that probe alone (see :func:`fast_trace`'s ``like``).
        short_probe: the short probe's program itself (captured, or written out
            by :func:`rescaled_trace`).
        batch: dim 0 of the user inputs it was traced at (None when they differ).
    """

    graph: torch.fx.Graph
    graph_signature: ExportGraphSignature
    source: Any
    block_path: str
    num_blocks: int
    suffix_steps: dict[str, int] = field(default_factory=dict)
    probe: tuple = ()
    short_probe: Any = None
    batch: int | None = None


# Runs two functions at once, the second in another process: ``beside(here,
# there)`` returns ``(here(), there())`` (the second's result must pickle).
Beside = Callable[[Callable[[], Any], Callable[[], Any]], tuple[Any, Any]]


def fast_trace(model: nn.Module, example_inputs: Any, *,
               min_blocks: int | None = None,
               like: SynthesizedProgram | None = None,
               beside: Beside | None = None) -> Graph | None:
    """The :class:`Graph` of ``model(*example_inputs)`` from two short probe captures.

    ``like``: the program of an earlier fast trace of the same model (say, at
    another batch size). When this trace's short probe is that trace's short
    probe up to values and literal sizes (same nodes, names, targets, wiring
    and module paths), the method checked there (names advancing by the same
    steps, the longer probe rebuilt exactly) holds here too, and the program
    is written out from the short probe alone: one probe capture instead of two.

    ``beside``: when given, the longer probe is captured by its other process
    while this one captures the short probe, and only the facts the checks
    read of it come back (:class:`_ProbeFacts`); should that fail, it is
    captured here after the short one.

    Returns None when the model has no ``nn.ModuleList`` of at least
    ``min_blocks`` (default :data:`MIN_BLOCKS`, at least 4) identical blocks or
    when anything in the probes leaves doubt that the result equals the full
    capture (the reason is logged at debug level).
    """
    name = type(model).__name__
    if min_blocks is None:
        min_blocks = MIN_BLOCKS
    try:
        path, num_blocks = _find_block_list(model, min_blocks)
        args = _as_tuple(example_inputs)
        if like is not None and like.probe and (like.block_path, like.num_blocks) == (
                path, num_blocks):
            short = _probe(model, path, _PROBES[0], args, one_pass=True)
            # where it is not, the method is checked anew on a long probe,
            # also in one pass: the one pass was checked against torch.export
            # on the first trace's probes
            long = None if _structure(short) == like.probe else _probe_facts(
                model, path, _PROBES[1], args, one_pass=True)
        else:
            short, long = _probe_pair(model, path, args, beside)
        if long is None:  # the method was checked on ``like``'s probes
            steps = like.suffix_steps
        else:
            steps = _suffix_steps(_facts(short), long)
            # The method, checked on the probes: the 3-block program from the 2-block one.
            _require_same(_synthesize(short, long.k, steps), long)
        program = _synthesize(short, num_blocks, steps)
        program = replace(program, suffix_steps=dict(steps), probe=_structure(short),
                          short_probe=short.ep, batch=_batch_of(args))
        _check_state(program, model)
        graph = graph_from_exported(program, model_name=name)
    except _Unsupported as err:
        log.debug("fast trace not used for %s: %s", name, err)
        return None
    except Exception:  # noqa: BLE001 - any surprise: the full capture is always right
        log.debug("fast trace failed for %s", name, exc_info=True)
        return None
    log.debug("fast trace of %s: %d blocks of %s, %d nodes", name, num_blocks, path, len(graph))
    return graph


def rescaled_trace(model: nn.Module, example_inputs: Any, a: SynthesizedProgram,
                   b: SynthesizedProgram) -> Graph | None:
    """The :class:`Graph` of ``model(*example_inputs)`` written out, without a
    capture, from the short probes of two fast traces ``a`` and ``b`` of the
    same model at other batch sizes (:func:`ir.probe_rescale.rescale_program`
    for the probe, then the method of ``a``).

    Two traces cannot tell a batch-affine literal from every other rule, so
    the caller checks the result against one confirmed on a third capture
    (:class:`ir.rescale.BatchRule`). Returns None when the traces do not
    carry the method and probe of one model at two batch sizes, or the probe
    does not rescale (the reason is logged at debug level).
    """
    name = type(model).__name__
    try:
        args = _as_tuple(example_inputs)
        batch = _batch_of(args)
        same = (a.block_path, a.num_blocks, a.probe, a.suffix_steps) == \
            (b.block_path, b.num_blocks, b.probe, b.suffix_steps)
        if not same or a.short_probe is None or b.short_probe is None or None in (
                a.batch, b.batch, batch):
            raise _Unsupported("the two traces are not of one model at known batch sizes")
        probe = rescale_program(a.short_probe, a.batch, b.short_probe, b.batch, batch, args)
        short = _Layout(probe, a.block_path, _PROBES[0])
        if _structure(short) != a.probe:
            raise _Unsupported("the rescaled probe has another structure")
        program = replace(_synthesize(short, a.num_blocks, a.suffix_steps),
                          suffix_steps=dict(a.suffix_steps), probe=a.probe,
                          short_probe=probe, batch=batch)
        _check_state(program, model)
        graph = graph_from_exported(program, model_name=name)
    except (_Unsupported, RescaleError) as err:
        log.debug("rescaled trace not used for %s: %s", name, err)
        return None
    except Exception:  # noqa: BLE001 - any surprise: a capture is always right
        log.debug("rescaled trace failed for %s", name, exc_info=True)
        return None
    return graph


def _batch_of(args: tuple) -> int | None:
    """Dim 0 shared by every tensor input, or None."""
    sizes = {int(t.shape[0]) for t in args if isinstance(t, torch.Tensor) and t.ndim > 0}
    return sizes.pop() if len(sizes) == 1 else None


def _probe(model: nn.Module, path: str, k: int, args: tuple, one_pass: bool) -> "_Layout":
    """The capture of ``model`` truncated to its first ``k`` blocks, laid out:
    by :func:`ir.trace.capture_in_one_pass` with ``one_pass``, else by
    :func:`ir.trace.capture`. Where a model's first trace checks the method
    on two probes, they are captured one each way, so the check also vouches
    that the two captures agree (the one pass is ~2.5x faster)."""
    try:
        ep = (capture_in_one_pass if one_pass else capture)(_truncated(model, path, k), args)
    except Exception as err:  # noqa: BLE001 - the full capture reports it
        raise _Unsupported(f"capture of the first {k} blocks failed: {err}") from err
    return _Layout(ep, path, k)


def _probe_facts(model: nn.Module, path: str, k: int, args: tuple,
                 one_pass: bool) -> "_ProbeFacts":
    """The facts of the capture of ``model`` truncated to its first ``k`` blocks."""
    return _facts(_probe(model, path, k, args, one_pass))


def _probe_pair(model: nn.Module, path: str, args: tuple,
                beside: Beside | None) -> tuple["_Layout", "_ProbeFacts"]:
    """The short probe, and the facts of the long one: captured by
    ``beside``'s other process at the same time when given and it works,
    else here after the short one."""
    def short() -> _Layout:
        return _probe(model, path, _PROBES[0], args, one_pass=False)

    def long() -> _ProbeFacts:
        return _probe_facts(model, path, _PROBES[1], args, one_pass=True)

    if beside is not None:
        try:
            return beside(short, long)
        except _Unsupported:
            raise
        except Exception:  # noqa: BLE001 - the other process failed: capture here
            log.debug("probe capture beside failed; capturing here", exc_info=True)
    return short(), long()


def _structure(lay: "_Layout") -> tuple:
    """A probe's program without values and literal arguments
    (:func:`_node_record` with ``literals=False`` of every node)."""
    return tuple(_node_record(n, literals=False) for n in lay.ep.graph.nodes)


# -- finding the blocks ------------------------------------------------------------------

def _find_block_list(model: nn.Module, min_blocks: int) -> tuple[str, int]:
    """FQN and length of the largest ModuleList of >= ``min_blocks`` identical blocks."""
    best: tuple[str, int, int] | None = None
    reasons = []
    for path, mod in model.named_modules():
        if not path or not isinstance(mod, nn.ModuleList) or len(mod) < max(min_blocks, 4):
            continue
        why = _why_not_identical(list(mod))
        if why:
            reasons.append(f"{path}: {why}")
            continue
        size = sum(p.numel() for p in mod.parameters())
        if best is None or size > best[2]:
            best = (path, len(mod), size)
    if best is None:
        raise _Unsupported("no nn.ModuleList of at least %d identical blocks%s" % (
            min_blocks, (" (" + "; ".join(reasons) + ")") if reasons else ""))
    path, n, _ = best
    _check_reachable(model, path)
    return path, n


def _check_reachable(model: nn.Module, path: str) -> None:
    """The list is registered once, under ``path``, and owns its parameters alone."""
    mod = model
    for part in path.split("."):
        mod = mod._modules.get(part)
        if mod is None:
            raise _Unsupported(f"{path} is not reachable through registered submodules")
    blocks = list(mod)
    owned = {id(m) for b in blocks for m in b.modules()} | {id(mod)}
    seen = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    if any(seen[i] != 1 for i in owned):
        raise _Unsupported(f"modules of {path} are registered more than once")
    tensors = Counter(id(t) for _, t in model.named_parameters(remove_duplicate=False))
    tensors.update(id(t) for _, t in model.named_buffers(remove_duplicate=False))
    for b in blocks:
        for t in list(b.parameters()) + list(b.buffers()):
            if tensors[id(t)] != 1:
                raise _Unsupported(f"a tensor of {path} is shared with another module")


def _why_not_identical(blocks: list[nn.Module]) -> str | None:
    ref_entries, ref_attrs = _describe(blocks[0])
    for i, b in enumerate(blocks[1:], start=1):
        entries, attrs = _describe(b)
        if entries != ref_entries:
            return f"block {i} differs from block 0 in structure, shapes or hooks"
        for (where, a), (_, b_) in zip(ref_attrs, attrs):
            for key in a:
                if not _same_value(a[key], b_[key]):
                    return f"attribute {where or '<block>'}.{key} of block {i} differs"
    return None


def _describe(block: nn.Module) -> tuple[list, list]:
    entries: list = []
    attrs: list = []
    for name, m in block.named_modules(remove_duplicate=False):
        hooks = tuple(len(getattr(m, h, {})) for h in _FORWARD_HOOKS)
        entries.append(("module", name, type(m), m.training, hooks))
        for pn, p in m._parameters.items():
            entries.append(("param", name, pn, None if p is None else (
                type(p), tuple(p.shape), p.dtype, p.device.type, p.requires_grad)))
        for bn, b in m._buffers.items():
            entries.append(("buffer", name, bn, None if b is None else (
                type(b), tuple(b.shape), b.dtype, b.device.type),
                bn in m._non_persistent_buffers_set))
        extra = {k: v for k, v in vars(m).items() if k not in _MODULE_INTERNALS}
        entries.append(("attrs", name, tuple(sorted(extra))))
        attrs.append((name, extra))
    if any(h for e in entries if e[0] == "module" for h in e[4]):
        entries.append(("hooks",))  # blocks with hooks are never treated as identical
        entries.append(object())
    return entries, attrs


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b) or isinstance(a, (torch.Tensor, nn.Module)):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    try:
        return (a == b) is True
    except Exception:  # noqa: BLE001
        return False


def _truncated(model: nn.Module, path: str, k: int) -> nn.Module:
    """A shallow copy of ``model`` whose ModuleList at ``path`` keeps its first ``k`` blocks."""

    def shallow(m: nn.Module) -> nn.Module:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            c = copy.copy(m)
        c._modules = dict(m._modules)
        return c

    parts = path.split(".")
    root = shallow(model)
    new, old = root, model
    for part in parts[:-1]:
        child = shallow(old._modules[part])
        new._modules[part] = child
        new, old = child, old._modules[part]
    blocks = old._modules[parts[-1]]
    short = shallow(blocks)
    short._modules = dict(list(blocks._modules.items())[:k])
    new._modules[parts[-1]] = short
    return root


# -- reading a probe capture --------------------------------------------------------------

def _split_name(name: str) -> tuple[str, int]:
    m = _NAME_RE.fullmatch(name)
    base, num = (m.group(1), int(m.group(2))) if m else (name, 0)
    if _join_name(base, num) != name:
        raise _Unsupported(f"node name {name!r} does not follow base_<n> numbering")
    return base, num


def _join_name(base: str, num: int) -> str:
    return f"{base}_{num}" if num else base


def _sanitize(fqn: str) -> str:
    return re.sub(r"[^a-zA-Z0-9]", "_", fqn).lower()


def _val_sig(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), tuple(v.stride()), v.dtype, v.device.type)
    if isinstance(v, (list, tuple)):
        return tuple(_val_sig(x) for x in v)
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise _Unsupported("symbolic values in the captured program")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return type(v).__name__


class _Layout:
    """A probe capture cut into placeholders, prefix ops, ``k`` blocks and suffix ops."""

    def __init__(self, ep: Any, path: str, k: int) -> None:
        self.ep, self.path, self.k = ep, path, k
        sig = ep.graph_signature
        for spec in sig.input_specs:
            if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.USER_INPUT):
                raise _Unsupported(f"input of kind {spec.kind.name} in the captured program")
        for spec in sig.output_specs:
            if spec.kind != OutputKind.USER_OUTPUT:
                raise _Unsupported(f"output of kind {spec.kind.name} in the captured program")
        self.specs = {spec.arg.name: spec for spec in sig.input_specs}
        self.out_specs = list(sig.output_specs)
        nodes = list(ep.graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.ph_map = {n.name: n for n in self.placeholders}
        ops = [n for n in nodes if n.op == "call_function"]
        if not nodes or nodes[-1].op != "output" or \
                len(self.placeholders) + len(ops) + 1 != len(nodes):
            raise _Unsupported("captured program has nodes other than placeholders, "
                               "calls and one output")
        self.output = nodes[-1]
        self._read_placeholders()
        self._read_ops(ops)
        self.block_steps = self._block_steps()

    def _block_of(self, fqn_or_path: str) -> tuple[int, str] | None:
        head = self.path + "."
        if not fqn_or_path.startswith(head):
            return None
        idx, _, rest = fqn_or_path[len(head):].partition(".")
        if not idx.isdigit() or str(int(idx)) != idx:
            raise _Unsupported(f"unexpected name {fqn_or_path!r} under {self.path}")
        j = int(idx)
        if j >= self.k:
            raise _Unsupported(f"block {j} of {self.path} appears in a {self.k}-block capture")
        return j, rest

    def _read_placeholders(self) -> None:
        # name -> (block, relative FQN) for block parameters and buffers
        self.ph_block: dict[str, tuple[int, str]] = {}
        runs: list[tuple[int | None, list[torch.fx.Node]]] = []
        for n in self.placeholders:
            spec = self.specs[n.name]
            where = self._block_of(spec.target) if spec.kind != InputKind.USER_INPUT else None
            j = None
            if where is not None:
                j, rel = where
                if not rel:
                    raise _Unsupported(f"placeholder {n.name} is a whole block")
                prefix = _PLACEHOLDER_PREFIX[spec.kind]
                if n.name != prefix + _sanitize(spec.target):
                    raise _Unsupported(f"placeholder {n.name} is not named after {spec.target}")
                self.ph_block[n.name] = (j, rel)
            if runs and runs[-1][0] == j:
                runs[-1][1].append(n)
            else:
                runs.append((j, [n]))
        # Placeholders: outer ones, and groups of runs for blocks 0..k-1 in order.
        self.ph_items: list[tuple[str, Any]] = []
        i = 0
        while i < len(runs):
            j, nodes = runs[i]
            if j is None:
                self.ph_items.extend(("outer", n) for n in nodes)
                i += 1
                continue
            group = [r[1] for r in runs[i:i + self.k]]
            if [r[0] for r in runs[i:i + self.k]] != list(range(self.k)):
                raise _Unsupported("parameters of the blocks are not listed block by block")
            rels = [[(self.specs[n.name].kind, self.ph_block[n.name][1]) for n in g]
                    for g in group]
            if any(r != rels[0] for r in rels):
                raise _Unsupported("blocks have different parameters in the capture")
            self.ph_items.append(("blocks", group))
            i += self.k
        # (block, relative FQN) -> placeholder
        self.ph_by_block = {where: self.ph_map[name] for name, where in self.ph_block.items()}

    def _read_ops(self, ops: list[torch.fx.Node]) -> None:
        self.prefix: list[torch.fx.Node] = []
        self.blocks: list[list[torch.fx.Node]] = [[] for _ in range(self.k)]
        self.suffix: list[torch.fx.Node] = []
        self.op_pos: dict[str, tuple[int, int]] = {}  # block op name -> (block, position)
        state = -1  # -1: prefix, 0..k-1: block, k: suffix
        for n in ops:
            where = self._block_of(_module_path(n) + ".")
            j = where[0] if where is not None else None
            if j is None:
                if state == -1:
                    self.prefix.append(n)
                    continue
                if state != self.k - 1 and state != self.k:
                    raise _Unsupported(f"{n.name} ({n.target}) runs between blocks {state} and "
                                       f"{state + 1}")
                state = self.k
                self.suffix.append(n)
                continue
            if j != state and j != state + 1:
                raise _Unsupported(f"blocks of {self.path} do not run once each, in order "
                                   f"({n.name} of block {j} after block {state})")
            state = j
            self.op_pos[n.name] = (j, len(self.blocks[j]))
            self.blocks[j].append(n)
        if state < self.k - 1 or any(not b for b in self.blocks):
            raise _Unsupported(f"the {self.k} blocks of {self.path} are not all followed by "
                               f"the rest of the program")
        if any(len(b) != len(self.blocks[0]) for b in self.blocks):
            raise _Unsupported("blocks issue different numbers of ops")
        self.prefix_set = set(self.prefix)
        self.suffix_index = {n.name: i for i, n in enumerate(self.suffix)}

    def _node_sig(self, n: torch.fx.Node, j: int | None) -> tuple:
        """What must agree between blocks: op, arguments (block references relative
        to ``j``), value shapes and module path relative to the block."""

        def enc(a: torch.fx.Node) -> tuple:
            if a.name in self.op_pos:
                jb, p = self.op_pos[a.name]
                return ("op", j - jb, p) if j is not None else ("op_end", self.k - jb, p)
            if a.name in self.ph_block:
                jb, rel = self.ph_block[a.name]
                return ("ph", j - jb, rel) if j is not None else ("ph_end", self.k - jb, rel)
            return ("name", a.name) if j is not None or a.op == "placeholder" or \
                a in self.prefix_set else ("suffix", self.suffix_index[a.name])

        mp = _module_path(n)
        if j is not None:
            mp = mp[len(f"{self.path}.{j}"):]
        return (n.op, _target_name(n.target), _split_name(n.name)[0],
                torch.fx.node.map_arg((n.args, n.kwargs), enc),
                _val_sig(n.meta.get("val")), mp)

    def _block_steps(self) -> dict[str, int]:
        """Per base name, how far node numbers advance from one block to the next."""
        steps: dict[str, int] = {}
        for j in range(1, self.k):
            for a, b in zip(self.blocks[j - 1], self.blocks[j]):
                base_a, num_a = _split_name(a.name)
                base_b, num_b = _split_name(b.name)
                if base_a != base_b or a.target != b.target:
                    raise _Unsupported(f"blocks {j - 1} and {j} differ at {a.name} / {b.name}")
                step = num_b - num_a
                if step < 1 or steps.setdefault(base_a, step) != step:
                    raise _Unsupported(f"names of {base_a} nodes do not advance uniformly")
        # Blocks after the first must agree exactly (block 0 reads the prefix instead).
        for j in range(2, self.k):
            for a, b in zip(self.blocks[j - 1], self.blocks[j]):
                if self._node_sig(a, j - 1) != self._node_sig(b, j):
                    raise _Unsupported(f"blocks {j - 1} and {j} differ at {a.name} / {b.name}")
        return steps


@dataclass(frozen=True)
class _ProbeFacts:
    """What the method's checks read of a probe capture, as plain values
    that pickle (op targets by qualified name: :func:`_target_name`), so
    that a probe captured in another process is checked here.

    Attributes:
        k: blocks kept by the probe.
        prefix: ``(name, signature)`` of each op before the blocks
            (:meth:`_Layout._node_sig`); ``suffix`` the same after them.
        block_steps: per base name, how far node numbers advance per block.
        records: :func:`_node_record` of every node.
        inputs: ``(kind, name, target, persistent)`` of every input.
    """

    k: int
    prefix: tuple[tuple[str, tuple], ...]
    suffix: tuple[tuple[str, tuple], ...]
    block_steps: dict[str, int]
    records: tuple[tuple, ...]
    inputs: tuple[tuple, ...]


def _facts(lay: _Layout) -> _ProbeFacts:
    return _ProbeFacts(
        k=lay.k, prefix=tuple((n.name, lay._node_sig(n, None)) for n in lay.prefix),
        suffix=tuple((n.name, lay._node_sig(n, None)) for n in lay.suffix),
        block_steps=dict(lay.block_steps),
        records=tuple(_node_record(n) for n in lay.ep.graph.nodes),
        inputs=_input_records(lay.ep.graph_signature))


def _input_records(signature: ExportGraphSignature) -> tuple[tuple, ...]:
    return tuple((s.kind, s.arg.name, s.target, s.persistent) for s in signature.input_specs)


def _suffix_steps(short: _ProbeFacts, long: _ProbeFacts) -> dict[str, int]:
    """How far the numbers of the nodes after the blocks move per extra block."""
    if len(short.suffix) != len(long.suffix) or len(short.prefix) != len(long.prefix):
        raise _Unsupported("the code around the blocks depends on the number of blocks")
    for a, b in zip(short.prefix, long.prefix):
        if a != b:
            raise _Unsupported(f"the code before the blocks changes with their number ({b[0]})")
    steps: dict[str, int] = {}
    per_block = long.k - short.k
    for (name_a, sig_a), (name_b, sig_b) in zip(short.suffix, long.suffix):
        if sig_a != sig_b:
            raise _Unsupported(f"the code after the blocks changes with their number ({name_b})")
        base, num_a = _split_name(name_a)
        _, num_b = _split_name(name_b)
        diff = num_b - num_a
        if diff < 0 or diff % per_block or steps.setdefault(base, diff // per_block) != \
                diff // per_block:
            raise _Unsupported(f"names of {base} nodes after the blocks do not advance uniformly")
    for facts in (short, long):
        for base, step in facts.block_steps.items():
            if steps.get(base, step) != step:
                raise _Unsupported(f"{base} nodes after the blocks move by {steps[base]} per "
                                   f"block, inside them by {step}")
    if short.block_steps != long.block_steps:
        raise _Unsupported("block name steps differ between the probe captures")
    return steps


# -- writing the full program -------------------------------------------------------------

def _remap_stack(meta: dict, old: str, new: str) -> dict:
    out = dict(meta)
    stack = meta.get("nn_module_stack")
    if stack:
        def swap(s: Any) -> Any:
            if not isinstance(s, str):
                return s
            if s == old or s.startswith(old + "."):
                return new + s[len(old):]
            if s.endswith(old):
                return s[:len(s) - len(old)] + new
            return s.replace(old + ".", new + ".", 1)

        out["nn_module_stack"] = {swap(k): (swap(v[0]),) + tuple(v[1:])
                                  for k, v in stack.items()}
    return out


def _synthesize(lay: _Layout, num_blocks: int, suffix_steps: dict[str, int]) -> SynthesizedProgram:
    """The program of the model with ``num_blocks`` blocks, from probe ``lay``."""
    if num_blocks < lay.k:
        raise _Unsupported("fewer blocks than the probe")
    k, t, path = lay.k, lay.k - 1, lay.path
    shift = num_blocks - k
    g = torch.fx.Graph()
    made: dict[str, torch.fx.Node] = {}

    def op_name(j: int, p: int) -> str:
        if j < k:
            return lay.blocks[j][p].name
        base, num = _split_name(lay.blocks[t][p].name)
        return _join_name(base, num + (j - t) * lay.block_steps[base])

    def ph_name(j: int, rel: str) -> str:
        src = lay.ph_by_block[(min(j, t), rel)]
        if j < k:
            return src.name
        spec = lay.specs[src.name]
        return _PLACEHOLDER_PREFIX[spec.kind] + _sanitize(f"{path}.{j}.{rel}")

    suffix_names = {}
    for n in lay.suffix:
        base, num = _split_name(n.name)
        suffix_names[n.name] = _join_name(base, num + shift * suffix_steps[base])

    def mapper(block: int | None) -> Callable[[torch.fx.Node], torch.fx.Node]:
        """Argument map for a node copied into ``block`` (None: after the blocks)."""

        def f(a: torch.fx.Node) -> torch.fx.Node:
            if a.name in lay.op_pos:
                jb, p = lay.op_pos[a.name]
                name = op_name(block - (t - jb) if block is not None else jb + shift, p)
            elif a.name in lay.ph_block:
                jb, rel = lay.ph_block[a.name]
                name = ph_name(block - (t - jb) if block is not None else jb + shift, rel)
            else:
                name = suffix_names.get(a.name, a.name)
            return made[name]

        return f

    def add(op: str, target: Any, args: tuple, kwargs: dict, name: str, meta: dict) -> None:
        node = g.create_node(op, target, args, kwargs, name=name)
        if node.name != name:
            raise _Unsupported(f"node name {name} would collide")
        node.meta = meta
        made[name] = node

    # Placeholders.
    input_specs = []
    for kind, item in lay.ph_items:
        if kind == "outer":
            add("placeholder", item.name, (), {}, item.name, dict(item.meta))
            input_specs.append(lay.specs[item.name])
            continue
        for j in range(num_blocks):
            for src in item[min(j, t)]:
                rel = lay.ph_block[src.name][1]
                name = ph_name(j, rel)
                add("placeholder", name, (), {}, name, dict(src.meta))
                spec = lay.specs[src.name]
                input_specs.append(InputSpec(spec.kind, TensorArgument(name),
                                             f"{path}.{j}.{rel}", spec.persistent))
    # Ops before, inside and after the blocks.
    same = mapper(None)
    for n in lay.prefix:
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: made[a.name])
        add(n.op, n.target, args, kwargs, n.name, dict(n.meta))
    for j in range(num_blocks):
        src_block = j if j < k else t
        for p, n in enumerate(lay.blocks[src_block]):
            if j < k:
                args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: made[a.name])
                meta = dict(n.meta)
            else:
                args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), mapper(j))
                meta = _remap_stack(n.meta, f"{path}.{t}", f"{path}.{j}")
            add(n.op, n.target, args, kwargs, op_name(j, p), meta)
    for n in lay.suffix:
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), same)
        add(n.op, n.target, args, kwargs, suffix_names[n.name], dict(n.meta))
    if len(lay.output.args) != 1 or lay.output.kwargs:
        raise _Unsupported("unexpected output node")
    out = g.output(torch.fx.node.map_arg(lay.output.args[0], same))
    out.meta = dict(lay.output.meta)
    if out.name != lay.output.name:
        raise _Unsupported("output node name would collide")
    by_name = {n.name: n for n in lay.ep.graph.nodes}
    output_specs = []
    for s in lay.out_specs:
        if isinstance(s.arg, TensorArgument):
            s = OutputSpec(s.kind, TensorArgument(same(by_name[s.arg.name]).name), s.target)
        output_specs.append(s)
    signature = ExportGraphSignature(input_specs=input_specs, output_specs=output_specs)
    return SynthesizedProgram(graph=g, graph_signature=signature, source=lay.ep,
                              block_path=path, num_blocks=num_blocks)


def _node_record(n: torch.fx.Node, literals: bool = True) -> tuple:
    """Kind, name, target, wiring, value and module path of a node; without
    ``literals``, literal arguments are replaced by their type and the value
    is left out (what stays the same when only the input shapes change)."""
    if literals:
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: ("node", a.name))
        value = _val_sig(n.meta.get("val"))
    else:
        args = torch.fx.node.map_aggregate((n.args, n.kwargs), lambda a: (
            ("node", a.name) if isinstance(a, torch.fx.Node) else type(a).__name__))
        value = None
    return (n.op, n.name, _target_name(n.target), args, value,
            _module_path(n) if n.op == "call_function" else "")


def _target_name(target: Any) -> str:
    """A node's target by name: an ATen overload's qualified name
    (``aten.mm.default``, unique among registered ops), a placeholder's
    string, or a Python function's module and qualified name."""
    if isinstance(target, str):
        return target
    if isinstance(target, OpOverload):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"


def _require_same(program: SynthesizedProgram, want: _ProbeFacts) -> None:
    """The synthesized program equals the captured probe ``want`` node for node."""
    got = list(program.graph.nodes)
    if len(got) != len(want.records):
        raise _Unsupported(f"rebuilt probe has {len(got)} nodes, the capture "
                           f"{len(want.records)}")
    for a, b in zip(got, want.records):
        if _node_record(a) != b:
            raise _Unsupported(f"rebuilt probe differs from the capture at {b[1]}")
    if _input_records(program.graph_signature) != want.inputs:
        raise _Unsupported("rebuilt probe has different inputs than the capture")


def _check_state(program: SynthesizedProgram, model: nn.Module) -> None:
    """Parameters and buffers of the program are exactly those of the model."""
    sig = program.graph_signature
    params = [s.target for s in sig.input_specs if s.kind == InputKind.PARAMETER]
    buffers = [s.target for s in sig.input_specs if s.kind == InputKind.BUFFER]
    if params != [n for n, _ in model.named_parameters()]:
        raise _Unsupported("parameters of the rebuilt program differ from the model's")
    if sorted(buffers) != sorted(n for n, _ in model.named_buffers()):
        raise _Unsupported("buffers of the rebuilt program differ from the model's")
