"""DTensor strategies for some calls of an op, DTensor's own for the others
(private torch APIs; part of :mod:`ir.torch_compat`)."""

from __future__ import annotations

from typing import Any, Callable

from ir.torch_compat import op_strategy_functions, register_sharding_rule, sharding_propagator

__all__ = ["register_sharding_rule_where"]


def register_sharding_rule_where(op: Any, rule: Any, applies: Callable[..., bool],
                                 keep: Any = None) -> None:
    """:func:`ir.torch_compat.register_sharding_rule` for the calls of ``op``
    where ``applies(*args, **kwargs)`` is true, DTensor's own strategy
    function for the others (where it has one). ``applies`` gets each tensor
    argument as its number of dims, the other arguments as they are."""
    from torch.distributed.tensor._op_schema import OpStrategy

    _, own = op_strategy_functions(op)
    register_sharding_rule(op, rule, keep=keep)
    if own is None:
        return
    ours = sharding_propagator().op_strategy_funcs[op]

    def rank(arg: Any) -> Any:
        return arg.ndim if isinstance(arg, OpStrategy) else arg

    def strategy(schema: Any) -> Any:
        chosen = applies(*map(rank, schema.args_schema),
                         **{k: rank(v) for k, v in schema.kwargs_schema.items()})
        return (ours if chosen else own)(schema)

    sharding_propagator().op_strategy_funcs[op] = strategy
