"""Training precision: which dtype each part of a training step is kept and computed in.

One definition, read by every package: the capture (the program runs in the
compute dtype), the memory model (bytes per parameter of each training state),
the compute model (the matmul rate of the compute dtype, and the casts), and the
executor (fp32 master parameters cast to the compute dtype for each forward).

=============  ===============  ============  ============  ======================
precision      master params,   compute and   gradients     what runs it
               optimizer        activations   reduced in
=============  ===============  ============  ============  ======================
``bf16-mixed`` fp32             bf16          fp32 (bf16)   Megatron-LM, torchtitan
``fp16-mixed`` fp32             fp16          fp32 (fp16)   Megatron-LM on V100 (and
                                                            A100 in 2021), with loss
                                                            scaling; planned, not run
``bf16``       bf16             bf16          bf16          a model cast to bf16
``fp32``       fp32             fp32          fp32          a model left in fp32
=============  ===============  ============  ============  ======================

Under ``bf16-mixed`` the program the planner captures and the executor runs is
the model with its floating parameters, buffers and inputs in bf16: what
FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` all-gathers and what
Megatron's bf16 module runs. The fp32 parameters are the optimizer's; each
forward reads a bf16 working copy of them, which autograd keeps for the
backward of the matmul that reads it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ir.torch_compat import tree_map

__all__ = ["Precision", "PRECISIONS", "get_precision", "compute_copy", "cast_float", "cast_floats",
           "forward_in", "precision_of_dtype", "prepare_model"]


@dataclass(frozen=True)
class Precision:
    """How one training step keeps and computes its tensors.

    Attributes:
        name: ``bf16-mixed``, ``bf16`` or ``fp32``.
        master_dtype: dtype of the parameters the optimizer updates, of their
            gradients and of the optimizer states.
        compute_dtype: dtype the forward and backward run in (parameters are
            cast to it before use; activations are kept in it).
        reduce_dtype: dtype gradients are reduced in across ranks.
    """

    name: str
    master_dtype: torch.dtype
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype

    @property
    def mixed(self) -> bool:
        """Whether the master parameters and the compute differ in dtype (a cast each step)."""
        return self.master_dtype != self.compute_dtype

    @property
    def compute_dtype_name(self) -> str:
        """``bfloat16`` / ``float32``: the key of ``DeviceSpec.flops``."""
        return str(self.compute_dtype).replace("torch.", "")

    @property
    def master_bytes(self) -> int:
        """Bytes per element of a master parameter, its gradient and each optimizer state."""
        return self.master_dtype.itemsize

    @property
    def working_copy_bytes(self) -> int:
        """Bytes per element of the compute-dtype copy of a parameter a mixed step
        reads (0 when the parameter itself is in the compute dtype)."""
        return self.compute_dtype.itemsize if self.mixed else 0

    def with_reduce_dtype(self, dtype: torch.dtype) -> "Precision":
        """This precision with gradients reduced in ``dtype``."""
        return Precision(self.name, self.master_dtype, self.compute_dtype, dtype)

    def to_json(self) -> dict[str, str]:
        return {"name": self.name,
                "master_dtype": str(self.master_dtype).replace("torch.", ""),
                "compute_dtype": self.compute_dtype_name,
                "reduce_dtype": str(self.reduce_dtype).replace("torch.", "")}


PRECISIONS: Mapping[str, Precision] = {
    "bf16-mixed": Precision("bf16-mixed", torch.float32, torch.bfloat16, torch.float32),
    "fp16-mixed": Precision("fp16-mixed", torch.float32, torch.float16, torch.float32),
    "bf16": Precision("bf16", torch.bfloat16, torch.bfloat16, torch.bfloat16),
    "fp32": Precision("fp32", torch.float32, torch.float32, torch.float32),
}

# dtype names plans of format version 2 recorded; each means that dtype throughout
_LEGACY = {"float32": "fp32", "bfloat16": "bf16"}
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def get_precision(name: "str | Precision", reduce_dtype: str | None = None) -> Precision:
    """The :class:`Precision` called ``name`` (``bf16-mixed``, ``bf16``, ``fp32``; the
    dtype names ``float32`` and ``bfloat16`` of older plans are read as ``fp32`` and
    ``bf16``). ``reduce_dtype`` (``fp32`` or ``bf16``) overrides the gradient
    reduction dtype.

    Raises:
        ValueError: an unknown name, saying which are known.
    """
    if isinstance(name, Precision):
        p = name
    else:
        key = _LEGACY.get(name, name)
        if key not in PRECISIONS:
            raise ValueError(f"unknown precision {name!r}; choose one of "
                             f"{', '.join(PRECISIONS)}")
        p = PRECISIONS[key]
    if reduce_dtype is not None:
        if reduce_dtype not in _DTYPES:
            raise ValueError(f"unknown gradient reduction dtype {reduce_dtype!r}; "
                             f"choose fp32, bf16 or fp16")
        p = p.with_reduce_dtype(_DTYPES[reduce_dtype])
    return p


def precision_of_dtype(dtype: torch.dtype) -> Precision:
    """The precision of a model whose floating parameters are all ``dtype``
    (what it trains in when nobody asks for another)."""
    return PRECISIONS["bf16" if dtype == torch.bfloat16 else "fp32"]


def cast_float(t: Any, dtype: torch.dtype) -> Any:
    """``t`` in ``dtype`` if it is a floating tensor of another dtype, else ``t``."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
        return t.to(dtype)
    return t


def cast_floats(values: Any, dtype: torch.dtype) -> Any:
    """``values`` (a tensor or a tuple/list/dict of them) with every floating
    tensor cast to ``dtype``; integer tensors and other values unchanged."""
    return tree_map(lambda v: cast_float(v, dtype), values)


def compute_copy(model: torch.nn.Module, example_inputs: Sequence[Any],
                 precision: Precision) -> tuple[torch.nn.Module, tuple]:
    """The model and inputs as the step's program sees them: floating
    parameters, buffers and inputs in ``precision.compute_dtype``.

    ``model`` is never changed. When nothing needs a cast it is returned
    itself; otherwise a copy: on the meta device for a model on meta (no
    weights are allocated), else with its tensors cast (constants the
    forward computes from them then have real values in the capture).
    """
    dtype = precision.compute_dtype
    inputs = tuple(example_inputs)
    tensors = list(model.parameters()) + list(model.buffers())
    if all(not t.is_floating_point() or t.dtype == dtype for t in tensors):
        return model, cast_floats(inputs, dtype)

    def copied(t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:
            return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype,
                               device="meta")
        return cast_float(t.detach(), dtype).clone()

    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(copied(p), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = copied(b)
    return copy.deepcopy(model, memo), cast_floats(inputs, dtype)


def prepare_model(model: torch.nn.Module, precision: Precision) -> torch.nn.Module:
    """``model`` (just built, floating tensors in fp32) kept as ``precision``
    keeps it: its floating parameters and buffers in the master dtype (cast in
    place; a no-op for fp32 and bf16-mixed)."""
    dtype = precision.master_dtype
    if any(t.is_floating_point() and t.dtype != dtype
           for t in list(model.parameters()) + list(model.buffers())):
        model.to(dtype)
    return model


def forward_in(model: torch.nn.Module, inputs: Sequence[Any], precision: Precision) -> Any:
    """``model(*inputs)`` run as the precision runs it: floating inputs in the
    compute dtype, and, when mixed, each floating parameter and buffer read
    through a compute-dtype copy (autograd carries the gradient back to the
    master parameter in its own dtype: fp32 gradients under bf16-mixed)."""
    dtype = precision.compute_dtype
    inputs = cast_floats(tuple(inputs), dtype)
    if not precision.mixed:
        return model(*inputs)
    from torch.func import functional_call

    state = {name: cast_float(t, dtype) for name, t in
             list(model.named_parameters()) + list(model.named_buffers())}
    return functional_call(model, state, inputs)
