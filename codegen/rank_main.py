"""The per-rank program torchrun launches for a plan.

    torchrun --standalone --nproc_per_node N -m codegen.rank_main PLAN.json \\
        [--steps S] [--check] [--result-json PATH] [--record PATH]

Every rank builds the plan's model with seed 0 (so all ranks hold the same
weights and inputs), runs the plan with :class:`codegen.executor.PlanExecutor` on a
DeviceMesh of the plan's shape (gloo on CPU, NCCL on CUDA) and trains ``S`` steps
(forward, backward, optimizer). With ``--check`` the first step's loss and every
parameter gradient are compared with a single-process run on rank 0 (relative
error ``max|a-b| / max|b|`` at most ``--rtol``), and the placements each op
consumed and produced are compared with the plan's. ``--record`` writes the plan
with the observed placements filled in (follow-DTensor recording).

A plan with a ``pipeline`` section runs through :mod:`codegen.pipeline` instead:
every rank builds the model with the global batch, runs its stages under the
plan's torch schedule (``num_microbatches`` micro-batches), and rank 0 compares
the step loss (mean of the micro-batch losses) and the gathered full gradients
with the reference; the result also carries ``pipeline`` (schedule, pp,
num_microbatches, stages_per_rank, stage_mesh).

Rank 0 writes the result JSON and prints a short summary. Exit status: 0 passed,
1 check failed, 2 unusable plan or launch, 3 plan made for another program.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from codegen.parallel_model import backward_to_placements, peak_memory, runtime_device

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_PLAN, EXIT_MISMATCH = 0, 1, 2, 3


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m codegen.rank_main",
                                description="Run one rank of a plan (started by torchrun).")
    p.add_argument("plan", help="plan.json")
    p.add_argument("--steps", type=int, default=1, help="training steps (default 1)")
    p.add_argument("--check", action="store_true",
                   help="compare step 1 with a single-process run and the plan's placements")
    p.add_argument("--rtol", type=float, default=None,
                   help="relative tolerance of --check (default: by the plan's precision, "
                   "codegen.reference.check_tolerance)")
    p.add_argument("--result-json", default=None, help="where rank 0 writes the result")
    p.add_argument("--record", default=None,
                   help="where rank 0 writes the plan with the observed placements")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--lr", type=float, default=1e-3)
    return p.parse_args(argv)


def _say(rank: int, msg: str) -> None:
    print(f"[rank {rank}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _during(what: str) -> Iterator[None]:
    """An exception raised inside says that it arose during ``what`` (the
    innermost phase wins), for this rank's one-line error (:func:`error_line`)."""
    try:
        yield
    except Exception as err:
        if not hasattr(err, "rank_phase"):
            try:
                err.rank_phase = what
            except AttributeError:  # an exception type without a __dict__
                pass
        raise


def _backward_tracer(loss: Any) -> Callable[[], str | None]:
    """Pre-hooks on every autograd node of ``loss``'s graph; the returned call
    names the node the backward pass entered last (on a failure: the failing
    op's gradient, ``ViewBackward0``), or None."""
    last: list[str] = []
    fn = getattr(loss, "grad_fn", None)
    seen: set[int] = set()
    stack = [fn] if fn is not None else []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))

        def enter(grad_outputs: Any, name: str = node.name()) -> None:
            last[:] = [name]

        node.register_prehook(enter)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return lambda: last[0] if last else None


def error_line(err: BaseException) -> str:
    """This rank's one-line error: where it failed (:func:`_during`), the
    exception's type and the first line of its message."""
    text = str(err).strip().splitlines()
    phase = getattr(err, "rank_phase", None)
    return (f"{f'in {phase}: ' if phase else ''}{type(err).__name__}: "
            f"{text[0] if text else ''}")


class _Exit(Exception):
    """Stop this rank with ``code`` after printing ``message`` (one line)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def run(args: argparse.Namespace) -> int:
    from plan.format import PlanError, load_plan

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        plan = load_plan(args.plan)
    except PlanError as err:
        return _refuse(args, rank, EXIT_BAD_PLAN, str(err))
    if plan.world_size != world:
        return _refuse(args, rank, EXIT_BAD_PLAN,
                       f"plan {args.plan} is for {plan.world_size} devices (mesh "
                       f"{list(plan.mesh_shape)}) but {world} ranks were started")
    if plan.pipeline is not None and args.record:
        return _refuse(args, rank, EXIT_BAD_PLAN,
                       "--record writes single-stage plans; this plan is pipelined")
    if args.rtol is None:
        from codegen.reference import check_tolerance

        args.rtol = check_tolerance(plan.precision)

    try:
        backend, device = runtime_device(plan.cluster, local_rank)
    except ValueError as err:
        return _refuse(args, rank, EXIT_BAD_PLAN, str(err))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    try:
        try:
            if plan.pipeline is not None:
                result, passed = _run_pipelined(args, plan, rank, world, device)
            else:
                result, passed = _run_single_stage(args, plan, rank, world, device)
        except _Exit as err:
            return _refuse(args, rank, err.code, str(err))
        if rank == 0:
            if args.result_json:
                tmp = args.result_json + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(result, f, indent=1)
                os.replace(tmp, args.result_json)
            print(_summary(result, args.check), flush=True)
        # Every rank must agree on the exit status: rank 0 alone knows the verdict.
        verdict = torch.tensor([0 if passed else 1], device=device)
        dist.broadcast(verdict, src=0)
        return EXIT_OK if int(verdict.item()) == 0 else EXIT_CHECK_FAILED
    finally:
        dist.destroy_process_group()


def _refuse(args: argparse.Namespace, rank: int, code: int, message: str) -> int:
    """Say why the plan cannot run here (one line), and on rank 0 write it as the
    result (``{"refused": message, "exit_status": code}``) for the launcher."""
    _say(rank, f"error: {message}")
    if rank == 0 and args.result_json:
        tmp = args.result_json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"refused": message, "exit_status": code, "passed": False}, f)
        os.replace(tmp, args.result_json)
    return code


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _recording_warnings(into: list[Any]) -> Iterator[None]:
    """Append every warning raised inside the block (repeats too) to ``into``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    into.extend(caught)


@dataclass
class _Steps:
    """What :func:`_train_steps` measured on this rank."""

    losses: list[float]  # one per step that had a loss on this rank
    times: list[float]  # seconds per step, synchronised before and after
    peak_memory: int | None
    peak_memory_kind: str


def _train_steps(args: argparse.Namespace, device: torch.device,
                 step_fn: Callable[[int], float | None],
                 after_step: Callable[[int], None] | None = None) -> _Steps:
    """Train ``args.steps`` steps: the loop the single-stage and pipeline runs share.

    ``step_fn(step)`` does one whole step (forward, backward, gradient
    reductions, optimizer) and returns its loss, or None where this rank has
    none (a pipeline rank without the last stage). Each step is timed between
    device synchronisations; ``after_step(step)`` runs after the timing. Peak
    memory is measured over the steps (CUDA: from a reset before the first).
    """
    losses: list[float] = []
    times: list[float] = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.steps):
        _synchronize(device)
        t0 = time.perf_counter()
        loss = step_fn(step)
        if loss is not None:
            losses.append(loss)
        _synchronize(device)
        times.append(time.perf_counter() - t0)
        if after_step is not None:
            after_step(step)
    peak, peak_kind = peak_memory(device)
    return _Steps(losses, times, peak, peak_kind)


def _result(args: argparse.Namespace, plan: Any, world: int, device: torch.device, *,
            losses: list[float], nodes_executed: int, diffs: list[str], mismatches: list[str],
            explicit_reshards: int, implicit_reshards: int, grad_reductions: int,
            fallback_ops: list[str], caught: list[Any], setup_s: float,
            steps: _Steps) -> dict[str, Any]:
    """The result dict both runs write (before the --check fields and ``passed``)."""
    return {
        "world_size": world,
        "mesh_shape": list(plan.mesh_shape),
        "device": device.type,
        "optimizer": args.optimizer,
        "loss": losses[0] if losses else None,
        "losses": losses,
        "plan_nodes": len(plan.nodes),
        "nodes_executed": nodes_executed,
        "observed_match": not diffs and not mismatches,
        "placement_diffs": diffs[:50],
        "mismatches": mismatches[:50],
        "num_mismatches": len(mismatches),
        "explicit_reshards": explicit_reshards,
        "implicit_reshards": implicit_reshards,
        "grad_reductions": grad_reductions,
        "fallback_ops": fallback_ops,
        "warnings": _warning_lines(caught),
        "setup_s": setup_s,
        "step_times_s": steps.times,
        "peak_memory_bytes": steps.peak_memory,
        "peak_memory_kind": steps.peak_memory_kind,
    }


def _finish(args: argparse.Namespace, result: dict[str, Any], check: bool, ref: Any,
            grad_errors: dict[str, float], missing_grads: list[str],
            buffer_errors: dict[str, float] | None = None) -> tuple[dict[str, Any], bool]:
    """Add ``passed`` and, when ``check`` (rank 0 with --check), the check's fields
    to ``result``; return it and whether the check passed. ``buffer_errors``:
    :func:`_compare_buffers` of the buffers forward updates, held to the same
    tolerance."""
    passed = True
    if check:
        loss_errs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(result["losses"], ref.losses)]
        worst = max(grad_errors, key=grad_errors.get) if grad_errors else None
        max_err = grad_errors[worst] if worst else 0.0
        buffer_errors = buffer_errors or {}
        worst_buffer = max(buffer_errors, key=buffer_errors.get) if buffer_errors else None
        max_buffer_err = buffer_errors[worst_buffer] if worst_buffer else 0.0
        if buffer_errors:
            result.update({"max_buffer_err": max_buffer_err, "worst_buffer": worst_buffer,
                           "num_buffers_checked": len(buffer_errors)})
        result.update({
            "reference_loss": ref.loss,
            "reference_losses": ref.losses,
            "loss_rel_err": loss_errs[0],
            "max_loss_rel_err": max(loss_errs),
            "max_rel_grad_err": max_err,
            "worst_param": worst,
            "num_params_checked": len(grad_errors),
            "missing_grads": missing_grads,
            "rtol": args.rtol,
        })
        passed = (max(loss_errs) <= args.rtol and max_err <= args.rtol and not missing_grads
                  and len(grad_errors) > 0 and result["observed_match"]
                  and max_buffer_err <= args.rtol)
    result["passed"] = passed
    return result, passed


def _compare_grads(grads: dict[str, Any], ref: Any, grad_errors: dict[str, float],
                   missing_grads: list[str]) -> None:
    """Every gradient's error against the reference's (rank 0), scaled by the
    model's largest reference gradient entry (:func:`codegen.reference.gradient_errors`)."""
    from codegen.reference import gradient_errors

    errors, missing = gradient_errors(grads, ref.grads)
    grad_errors.update(errors)
    missing_grads.extend(missing)


def _reference(args: argparse.Namespace, plan: Any, rank: int, device: torch.device) -> Any:
    """The one-process reference run (rank 0, with --check), else None: the
    plan's precision and, for a pipeline plan, its micro-batches accumulated."""
    from codegen.reference import reference_step, zoo_kwargs

    if not (args.check and rank == 0):
        return None
    # a pipeline plan's step accumulates its micro-batches: the reference does too
    m = plan.pipeline.num_microbatches if plan.pipeline is not None else 1
    return reference_step(plan.model["source"], seed=0, device=str(device), steps=args.steps,
                          precision=plan.precision, num_microbatches=m,
                          optimizer=args.optimizer, lr=args.lr, **zoo_kwargs(plan.training))


def _build_model(plan: Any, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """The plan's model and inputs, built with seed 0 on ``device``, in training mode."""
    from codegen.reference import zoo_kwargs
    from models.source import build_model

    model, inputs = build_model(plan.model["source"], device=str(device), seed=0,
                                **zoo_kwargs(plan.training))
    model.train()
    return model, inputs


@contextlib.contextmanager
def _building(caught: list[Any], *bad_plan: type[BaseException]) -> Iterator[None]:
    """Build the plan's runtime inside: warnings go to ``caught``; a plan of
    another program stops the rank with ``EXIT_MISMATCH``, one of the errors
    ``bad_plan`` with ``EXIT_BAD_PLAN``."""
    from codegen.capture import PlanMismatchError

    with _recording_warnings(caught):
        try:
            yield
        except PlanMismatchError as err:
            raise _Exit(EXIT_MISMATCH, str(err)) from None
        except bad_plan as err:
            raise _Exit(EXIT_BAD_PLAN, str(err)) from None


def _run_single_stage(args: argparse.Namespace, plan: Any, rank: int, world: int,
                      device: torch.device) -> tuple[dict[str, Any], bool]:
    """Run a plan without a pipeline section with :class:`PlanExecutor`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from codegen.executor import PlanExecutor
    from codegen.reference import loss_of, make_optimizer

    t_setup = time.perf_counter()
    names = plan.mesh.get("axis_names")
    names = tuple(names) if names and len(names) == len(plan.mesh_shape) else None
    mesh = init_device_mesh(device.type, plan.mesh_shape, mesh_dim_names=names)
    model, inputs = _build_model(plan, device)
    caught: list[Any] = []
    with _during("building the plan's model"), _building(caught):
        executor = PlanExecutor(plan, model, inputs, mesh)
    del model  # the executor holds the distributed parameters
    params = dict(executor.named_parameters())
    opt = make_optimizer(params.values(), args.optimizer, args.lr)
    setup_s = time.perf_counter() - t_setup

    with _during("the check's one-process reference run"):
        ref = _reference(args, plan, rank, device)
    grad_errors: dict[str, float] = {}
    missing_grads: list[str] = []
    grad_reductions = 0

    def step_fn(step: int) -> float:
        nonlocal grad_reductions
        with _during(f"the forward of step {step + 1}"), _recording_warnings(caught):
            loss = loss_of(executor(*inputs))
        # the first step names the op whose gradient fails, if one does
        entered = _backward_tracer(loss) if step == 0 else lambda: None
        try:
            # gradients take their parameter's placement (the data-parallel reduction)
            loss, grad_reductions = backward_to_placements(executor, loss)
        except Exception as err:
            op = entered()
            err.rank_phase = f"the backward of step {step + 1}" + (f", at {op}" if op else "")
            raise
        if step == 0 and args.check:
            grads = {fqn: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                     for fqn, p in params.items()}
            if rank == 0:
                _compare_grads(grads, ref, grad_errors, missing_grads)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    def after_step(step: int) -> None:
        if step == 0 and args.record and rank == 0:
            executor.recorded_plan().save(args.record)

    steps = _train_steps(args, device, step_fn, after_step)
    buffer_errors = _compare_buffers(executor, ref, rank) if args.check else {}

    record = executor.record
    result = _result(args, plan, world, device, losses=steps.losses,
                     nodes_executed=len(record.observed),
                     diffs=executor.compare_with_plan(), mismatches=record.mismatches,
                     explicit_reshards=record.explicit_reshards,
                     implicit_reshards=record.implicit_reshards,
                     grad_reductions=grad_reductions, fallback_ops=list(record.fallback_ops),
                     caught=caught, setup_s=setup_s, steps=steps)
    return _finish(args, result, args.check and rank == 0, ref, grad_errors, missing_grads,
                   buffer_errors)


def _compare_buffers(executor: Any, ref: Any, rank: int) -> dict[str, float]:
    """The relative error (:func:`codegen.reference.relative_error`: ``max|a-b| /
    max|b|`` of each buffer) after the run's last step of every buffer forward
    updates (BatchNorm's running statistics) against the reference's, on rank 0
    (empty elsewhere); every rank joins the gathers of sharded buffers."""
    from torch.distributed.tensor import DTensor

    from codegen.reference import relative_error

    updated = set(executor.graph.buffer_updates.values())
    full = {fqn: (v.full_tensor() if isinstance(v, DTensor) else v)
            for fqn, v in executor.named_buffers() if fqn in updated}
    if rank != 0:
        return {}
    return {fqn: relative_error(v, ref.buffers[fqn]) if fqn in ref.buffers else float("inf")
            for fqn, v in full.items()}


def _warning_lines(caught: list[Any]) -> list[str]:
    return sorted({str(w.message).splitlines()[0][:300] for w in caught})[:20]


def _run_pipelined(args: argparse.Namespace, plan: Any, rank: int, world: int,
                   device: torch.device) -> tuple[dict[str, Any], bool]:
    """Run a pipeline plan: this rank's stages under the plan's torch schedule.

    The model is built with the global batch (the reference's weights and
    inputs); the schedule splits it into micro-batches. The step loss is the
    mean of the micro-batch losses. Rank 0 gathers the losses, every stage's
    full gradients and placement records from the first rank of each stage mesh.
    """
    from codegen.pipeline import PipelineRuntime
    from codegen.pipeline_validation import PipelinePlanError
    from codegen.reference import make_optimizer

    t_setup = time.perf_counter()
    model, inputs = _build_model(plan, device)
    caught: list[Any] = []
    with _during("building the plan's pipeline stages"), _building(caught, PipelinePlanError):
        runtime = PipelineRuntime.build(plan, model, inputs, device)
    del model
    opt = runtime.make_optimizer(lambda params: make_optimizer(params, args.optimizer, args.lr))
    setup_s = time.perf_counter() - t_setup

    with _during("the check's one-process reference run"):
        ref = _reference(args, plan, rank, device)
    grads: dict[str, Any] = {}
    grad_reductions = 0

    def step_fn(step: int) -> float | None:
        nonlocal grads, grad_reductions
        with _during(f"the pipelined step {step + 1}"), _recording_warnings(caught):
            mb_losses = runtime.step(inputs)
        grad_reductions = runtime.sync_grads()
        if step == 0 and args.check:
            grads = runtime.full_grads()
        grad_reductions += opt.step()  # a ZeRO-1 stage reduces its gradients here
        opt.zero_grad(set_to_none=True)
        if not mb_losses:
            return None
        return sum(float(x.detach()) for x in mb_losses) / len(mb_losses)

    steps = _train_steps(args, device, step_fn)

    report = None
    if runtime.is_stage_leader:
        report = _stage_report(runtime, grads, steps, grad_reductions)
    reports: list[Any] = [None] * world if rank == 0 else None
    dist.gather_object(report, reports, dst=0)
    if rank != 0:
        return {}, True
    return _pipelined_result(args, plan, world, device, [r for r in reports if r is not None],
                             ref, caught=caught, setup_s=setup_s, steps=steps)


def _stage_report(runtime: Any, grads: dict[str, Any], steps: _Steps,
                  grad_reductions: int) -> dict[str, Any]:
    """What the first rank of a stage mesh sends rank 0 about its stages: their
    gradients (on the CPU), losses (last stage only) and placement records."""
    records = [e.record for e in runtime.executors]
    return {"grads": {k: (v.detach().cpu() if v is not None else None) for k, v in grads.items()},
            "losses": steps.losses if runtime.has_last else None,
            "diffs": [d for e in runtime.executors for d in e.compare_with_plan()],
            "mismatches": [m for r in records for m in r.mismatches],
            "explicit": sum(r.explicit_reshards for r in records),
            "implicit": sum(r.implicit_reshards for r in records),
            "executed": sum(len(r.observed) for r in records),
            "fallback": [op for r in records for op in r.fallback_ops],
            "grad_reductions": grad_reductions}


def _pipelined_result(args: argparse.Namespace, plan: Any, world: int, device: torch.device,
                      reports: list[dict[str, Any]], ref: Any, *, caught: list[Any],
                      setup_s: float, steps: _Steps) -> tuple[dict[str, Any], bool]:
    """The result of a pipelined run (rank 0) from every stage's
    :func:`_stage_report`, with its ``pipeline`` section, checked against the
    reference ``ref`` with --check; and whether it passed."""
    losses = next(r["losses"] for r in reports if r["losses"] is not None)
    result = _result(args, plan, world, device, losses=losses,
                     nodes_executed=sum(r["executed"] for r in reports),
                     diffs=[d for r in reports for d in r["diffs"]],
                     mismatches=[m for r in reports for m in r["mismatches"]],
                     explicit_reshards=sum(r["explicit"] for r in reports),
                     implicit_reshards=sum(r["implicit"] for r in reports),
                     grad_reductions=sum(r["grad_reductions"] for r in reports),
                     fallback_ops=sorted({op for r in reports for op in r["fallback"]}),
                     caught=caught, setup_s=setup_s, steps=steps)
    pipe = plan.pipeline
    result["pipeline"] = {"schedule": pipe.schedule, "pp": pipe.pp,
                          "num_microbatches": pipe.num_microbatches,
                          "stages_per_rank": pipe.stages_per_rank,
                          "stage_mesh": list(pipe.stage_mesh["shape"])}
    grad_errors: dict[str, float] = {}
    missing_grads: list[str] = []
    if args.check:
        all_grads = {k: v for r in reports for k, v in r["grads"].items()}
        _compare_grads(all_grads, ref, grad_errors, missing_grads)
        missing_grads += [fqn for fqn, g in ref.grads.items()
                          if g is not None and fqn not in all_grads]
    return _finish(args, result, args.check, ref, grad_errors, missing_grads)


def _summary(r: dict[str, Any], check: bool) -> str:
    times = r["step_times_s"]
    lines = [f"plan on mesh {r['mesh_shape']} ({r['world_size']} ranks, {r['device']}): "
             f"loss {r['loss']:.6g}, step {times[-1] * 1e3:.1f} ms (last of {len(times)}), "
             f"{r['explicit_reshards']} explicit reshards, {r['num_mismatches']} mismatches"]
    if r["fallback_ops"]:
        lines.append(f"ran replicated (no DTensor strategy): {', '.join(r['fallback_ops'])}")
    if check:
        lines.append(
            f"check {'PASSED' if r['passed'] else 'FAILED'}: reference loss "
            f"{r['reference_loss']:.6g} (rel err {r['loss_rel_err']:.2e}, worst over "
            f"{len(r['losses'])} steps {r['max_loss_rel_err']:.2e}), max grad err "
            f"{r['max_rel_grad_err']:.2e} of the largest gradient ({r['worst_param']}) over "
            f"{r['num_params_checked']} params, placements "
            f"{'match' if r['observed_match'] else 'DIFFER'} the plan")
        if r.get("num_buffers_checked"):
            lines.append(f"  buffers forward updates: max rel err {r['max_buffer_err']:.2e} "
                         f"({r['worst_buffer']}) over {r['num_buffers_checked']} after the "
                         f"last step")
        if r["missing_grads"]:
            lines.append(f"  {len(r['missing_grads'])} parameter(s) got a gradient on one side "
                         f"only (the run or the reference): {', '.join(r['missing_grads'][:5])}")
        for line in (r["placement_diffs"] + r["mismatches"])[:5]:
            lines.append(f"  {line}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        return run(args)
    except Exception as err:  # noqa: BLE001 - one line per rank, then non-zero exit
        _say(rank, f"error: {error_line(err)}")
        if os.environ.get("CODEGEN_TRACEBACK"):
            raise
        import traceback
        traceback.print_exc(file=sys.stderr)  # into the log the launcher keeps
        return EXIT_BAD_PLAN


if __name__ == "__main__":
    sys.exit(main())
