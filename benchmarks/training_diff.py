"""How far apart two training runs end: their weights and their losses
(:mod:`benchmarks.train_checks`' verdicts).

* :func:`weight_diff`: the largest ``max |a - b|`` of any tensor over the
  model's largest ``|b|`` (the verdict), with per-tensor relative differences
  for diagnosis;
* :func:`loss_diff`: the largest relative loss difference over the steps both
  runs have.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GPT_TINY_N_EMBD", "key_bias_slice", "loss_diff", "weight_diff"]

#: gpt-tiny's attention key bias: elements [n_embd, 2 n_embd) of the fused
#: ``c_attn.bias`` (q | k | v). Its gradient is zero in exact arithmetic (it
#: adds ``q_i . b_k`` to every score of row i, which softmax cancels), so its
#: value is AdamW stepping on rounding noise (|g| ~ 1e-10 against eps 1e-8):
#: two correct runs that sum in another order disagree there by far more than
#: in any other weight. Reported beside the verdict, never left out of it.
GPT_TINY_N_EMBD = 64


def key_bias_slice(name: str) -> slice | None:
    """The elements of parameter ``name`` without a gradient in exact
    arithmetic (gpt-tiny's key bias), or None."""
    if name.endswith(".attn.c_attn.bias") and name.startswith("transformer."):
        return slice(GPT_TINY_N_EMBD, 2 * GPT_TINY_N_EMBD)
    return None


def weight_diff(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    """``max_diff_of_model_scale``, the verdict: the largest ``max |a - b|`` of any
    tensor over the largest ``|b|`` of the whole model
    (:func:`training.reference.gradient_errors`, the rule ``--check`` applies to
    gradients, so that a tensor of near-zero values, such as the attention key
    bias with its zero true gradient, is not judged on its own tiny scale).
    Beside it, for diagnosis: max |a - b| / max |b| of every tensor (float64),
    the worst one, the five worst, and the names only one side has; also that
    maximum with gpt-tiny's key bias elements left out (:func:`key_bias_slice`),
    each tensor still scaled by its whole max |b|."""
    import torch

    from training.reference import gradient_errors

    without_kb = (0.0, None)
    rows = []  # (rel, name, abs diff, max |b|)
    for name in sorted(set(got) & set(want)):
        a, b = got[name].double(), want[name].double()
        if a.shape != b.shape:
            rows.append((float("inf"), name, float("inf"), 0.0, []))
            continue
        delta = (a - b).abs()
        diff = float(delta.max()) if a.numel() else 0.0
        scale = float(b.abs().max()) if b.numel() else 0.0
        rows.append((diff / max(scale, 1e-30), name, diff, scale,
                     [int(i) for i in torch.unravel_index(delta.argmax(), delta.shape)]
                     if a.numel() else []))
        cut = key_bias_slice(name)
        if cut is not None and a.ndim == 1:
            keep = torch.ones(a.shape[0], dtype=torch.bool)
            keep[cut] = False
            diff = float((a[keep] - b[keep]).abs().max())
        if diff / max(scale, 1e-30) > without_kb[0] or without_kb[1] is None:
            without_kb = (diff / max(scale, 1e-30), name)
    rows.sort(key=lambda r: -r[0])
    worst = rows[0] if rows else (0.0, None, 0.0, 0.0, [])
    # the verdict's scale: the model's largest entry, as --check scales gradients
    model_scale, _ = gradient_errors(got, want)
    return {"max_diff_of_model_scale": max(model_scale.values(), default=0.0),
            "max_rel_diff": worst[0], "worst_tensor": worst[1], "worst_abs_diff": worst[2],
            "worst_max_abs": worst[3], "worst_index": worst[4],
            "worst_5": [{"tensor": n, "rel": r, "abs": d, "max_abs": m, "index": i}
                        for r, n, d, m, i in rows[:5]],
            "max_rel_diff_without_key_bias": without_kb[0],
            "worst_tensor_without_key_bias": without_kb[1],
            "tensors_compared": len(rows),
            "only_in_run": sorted(set(got) - set(want)),
            "only_in_reference": sorted(set(want) - set(got))}


def loss_diff(got: dict[int, float], want: dict[int, float]) -> dict[str, Any]:
    """The largest |a - b| / |b| over the steps both have, and where."""
    steps = sorted(set(got) & set(want))
    errs = {s: abs(got[s] - want[s]) / max(abs(want[s]), 1e-30) for s in steps}
    worst = max(errs, key=errs.get) if errs else None
    return {"steps_compared": len(steps), "max_rel_err": errs[worst] if errs else None,
            "worst_step": worst, "run_loss_at_worst": got.get(worst),
            "reference_loss_at_worst": want.get(worst),
            "missing_steps": sorted(set(want) - set(got))}
