"""Pictures of a plan.json, drawn with matplotlib (``planner show PLAN --plot DIR``).

* ``memory.png``: predicted bytes per device by kind (parameters, gradients,
  optimizer states, saved activations, the backward's transient, ...) for each
  pipeline rank (one bar for a single-stage plan), against the device's memory.
* ``stages.png`` (pipeline plans): each stage's predicted seconds per
  micro-batch (forward, input-gradient and weight-gradient backward) and once
  per step (gradient synchronisation, optimizer update), stacked.
* ``schedule.png`` (pipeline plans): one training step as the cost model times
  it (:func:`costmodel.schedules.simulate` with the plan's per-stage seconds):
  a row per pipeline rank, a box per forward (F), backward (B, or I for the
  input gradient and W for the weight gradient in zero-bubble schedules) of
  each micro-batch, coloured by stage and labelled with the micro-batch.

And of a training job: ``loss.png`` beside ``planner train --log FILE``
(:func:`plot_loss`): the training loss and the validation loss against the step.

Units: bytes are shown in GiB (MiB for small models), times in ms, losses in
the model's own unit (nats per token for the zoo's language models).
"""

from __future__ import annotations

import json
import os
from typing import Any

from plan.format import Plan

__all__ = ["loss_plot_line", "plot_loss", "plot_plan", "PlotError"]

#: memory kinds that are not parts of the sum (plan.json reports them beside it)
_NOT_PARTS = ("total", "peak")


class PlotError(RuntimeError):
    """The pictures cannot be drawn (matplotlib is missing)."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:
        raise PlotError("--plot needs matplotlib: pip install -e '.[plots]' "
                        "(or pip install 'matplotlib>=3.8')") from err
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _stacked_bars(ax: Any, labels: list[str], series: list[tuple[str, list[float]]]) -> None:
    """One bar per label, the ``(name, heights)`` series stacked in order, and
    their legend beside the axes."""
    bottom = [0.0] * len(labels)
    for name, heights in series:
        ax.bar(labels, heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _save(plt: Any, fig: Any, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _rank_memory(plan: Plan) -> dict[str, dict[str, float]]:
    """Label -> {kind: bytes} of each device group the plan predicts for."""
    if plan.pipeline is None:
        return {"every device": dict(plan.predicted["memory_bytes_per_device"])}
    out: dict[str, dict[str, float]] = {}
    for st in plan.pipeline.stages:
        acc = out.setdefault(f"pp rank {st.pp_rank}", {})
        for kind, value in st.predicted["memory_bytes_per_device"].items():
            acc[kind] = acc.get(kind, 0.0) + float(value)
    return dict(sorted(out.items()))


def plot_memory(plan: Plan, path: str) -> str:
    plt = _pyplot()
    groups = _rank_memory(plan)
    kinds = sorted({k for parts in groups.values() for k in parts if k not in _NOT_PARTS})
    labels = list(groups)
    tallest = max(sum(v for k, v in groups[g].items() if k not in _NOT_PARTS) for g in labels)
    unit, scale = ("GiB", 2**30) if tallest >= 2**30 else ("MiB", 2**20)
    capacity = float(plan.cluster["device"]["memory"])
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(labels) + 3), 4.5))
    _stacked_bars(ax, labels, [(kind, [groups[g].get(kind, 0.0) / scale for g in labels])
                               for kind in kinds])
    if capacity <= 3 * tallest:  # the device's memory, where it does not flatten the bars
        ax.axhline(capacity / scale, color="black", linestyle="--", linewidth=1)
    ax.set_ylabel(f"{unit} per device")
    ax.set_title(f"{plan.model['name']}: predicted memory per device "
                 f"(the device has {capacity / 2**30:.0f} GiB)")
    return _save(plt, fig, path)


def _pipeline_stages(plan: Plan) -> tuple[Any, list[Any]]:
    """A pipeline plan's pipeline section and its stages in order."""
    pipe = plan.pipeline
    assert pipe is not None
    return pipe, sorted(pipe.stages, key=lambda st: st.index)


def plot_schedule(plan: Plan, path: str) -> str:
    from costmodel.schedules import simulate

    plt = _pyplot()
    pipe, stages = _pipeline_stages(plan)
    pp = len({st.pp_rank for st in stages})
    f = [st.predicted["forward_s"] for st in stages]
    b = [st.predicted["backward_input_s"] for st in stages]
    w = [st.predicted["backward_weight_s"] for st in stages]
    # plan.json keeps the sends' total: spread evenly over the boundaries
    p2p = plan.predicted.get("p2p_s", 0.0) / max(1, len(stages) - 1)
    result = simulate(pipe.schedule, pp, pipe.num_microbatches, f, b, w, p2p,
                      stages_per_rank=pipe.stages_per_rank, timeline=True)
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.7 * pp))
    for a in result.timeline:
        width = (a.end - a.start) * 1e3
        shade = {"F": 1.0, "W": 0.45}.get(a.kind[:1], 0.7)
        ax.barh(a.rank, width, left=a.start * 1e3, height=0.8, color=colours(a.stage % 10),
                alpha=shade, edgecolor="white", linewidth=0.5)
        if width > result.step_time * 1e3 / 80:
            ax.text(a.start * 1e3 + width / 2, a.rank, f"{a.kind[:1]}{a.microbatch}",
                    ha="center", va="center", fontsize=6)
    ax.set_yticks(range(pp), [f"pp rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the start of the step")
    ax.set_title(f"{pipe.schedule}, {len(stages)} stages on {pp} ranks, "
                 f"{pipe.num_microbatches} micro-batches: {result.step_time * 1e3:.1f} ms, "
                 f"bubble {result.bubble_fraction:.0%} (colour: stage; F forward, "
                 f"B/I backward, W weight gradient)", fontsize=9)
    return _save(plt, fig, path)


def plot_stage_times(plan: Plan, path: str) -> str:
    plt = _pyplot()
    pipe, stages = _pipeline_stages(plan)
    parts = (("forward_s", "forward"), ("backward_input_s", "backward (input gradients)"),
             ("backward_weight_s", "backward (weight gradients)"),
             ("grad_sync_s", "gradient sync, once a step"), ("update_s", "optimizer, once a step"),
             ("accumulate_s", "gradient accumulation, a step"))
    labels = [f"stage {st.index}\n(rank {st.pp_rank})" for st in stages]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(stages) + 3), 4.5))
    _stacked_bars(ax, labels, [(name, [float(st.predicted.get(key, 0.0)) * 1e3
                                       for st in stages]) for key, name in parts])
    ax.set_ylabel("ms (a micro-batch's passes; the step's sync and update)")
    ax.set_title(f"{plan.model['name']}: predicted time per stage, "
                 f"{pipe.num_microbatches} micro-batches a step", fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    return _save(plt, fig, path)


def plot_plan(plan: Plan, out_dir: str) -> list[str]:
    """Draw the plan's pictures into ``out_dir`` (made if missing); their paths."""
    _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    paths = [plot_memory(plan, os.path.join(out_dir, "memory.png"))]
    if plan.pipeline is not None:
        paths.append(plot_schedule(plan, os.path.join(out_dir, "schedule.png")))
        paths.append(plot_stage_times(plan, os.path.join(out_dir, "stages.png")))
    return paths


def _log_curves(log_path: str) -> tuple[dict[int, float], dict[int, float]]:
    """(step -> training loss, step -> validation loss) of a ``planner train``
    JSON-lines log, steps counted from 1 (steps done); where a resumed job
    logged a step again, its last record counts."""
    train: dict[int, float] = {}
    val: dict[int, float] = {}
    with open(log_path) as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            step = int(record["step"]) + 1
            if record.get("loss") is not None:
                train[step] = float(record["loss"])
            if record.get("val_loss") is not None:
                val[step] = float(record["val_loss"])
    return dict(sorted(train.items())), dict(sorted(val.items()))


def plot_loss(log_path: str, path: str | None = None) -> str:
    """Draw ``loss.png`` (or ``path``) from a ``planner train --log`` file:
    the logged training loss (one global batch's, each logged step) and the
    validation loss (the held-out mean) against the step; returns its path.

    Raises:
        PlotError: matplotlib is missing, or the log holds no loss.
    """
    train, val = _log_curves(log_path)
    if not train and not val:
        raise PlotError(f"{log_path} holds no loss to draw")
    plt = _pyplot()
    path = path or os.path.join(os.path.dirname(log_path), "loss.png")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if train:
        ax.plot(list(train), list(train.values()), label="training (one batch)", linewidth=1)
    if val:
        ax.plot(list(val), list(val.values()), "o-", label="validation (held out)",
                linewidth=1.5, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    title = os.path.basename(log_path)
    if val:
        last = list(val)[-1]
        title += f": validation loss {val[last]:.4f} at step {last}"
    ax.set_title(title, fontsize=10)
    return _save(plt, fig, path)


def loss_plot_line(log_path: str) -> str:
    """Draw ``loss.png`` beside a ``planner train --log`` file; the line to
    show: ``wrote PATH``, or why it was not drawn (the log is on another node,
    matplotlib is missing)."""
    if not os.path.exists(log_path):
        return f"note: no loss.png: {log_path} is not on this node"
    try:
        return f"wrote {plot_loss(log_path)}"
    except PlotError as err:
        return f"note: no loss.png: {err}"
