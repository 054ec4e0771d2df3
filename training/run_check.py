"""``planner run``'s report on the training job: the ``--check`` hook and the run's result.

The job (:func:`training.job.run`) trains with :class:`RunCheck` as its hook
when its config's ``report`` is ``"run"``. The hook records the warnings the
build and the steps raise; before the first step it trains the one-process
reference on rank 0 (:func:`training.reference.train_one_process`, with
``--check``); after step 1's backward it gathers every whole gradient
(:meth:`codegen.parallel_model.ParallelModel.full_grads`), after step 1 it
writes the recorded plan (``--record``); at the end it compares step 1's loss,
every gradient, the buffers forward updates and the placements each op met
with the reference and the plan, and rank 0 writes the result JSON and prints
the summary. Exit status: 0 passed, 1 check failed (the job's 2 and 3 are
refusals, :func:`refuse`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist

__all__ = ["EXIT_CHECK_FAILED", "RunCheck", "refuse"]

EXIT_OK, EXIT_CHECK_FAILED = 0, 1


def _write_json(path: str, value: Any, indent: int | None = None) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=indent)
    os.replace(tmp, path)


def refuse(result_json: str | None, rank: int, code: int, message: str) -> int:
    """Say why the plan cannot run here (one line), and on rank 0 write it as the
    result (``{"refused": message, "exit_status": code}``) for the launcher."""
    print(f"[rank {rank}] error: {message}", file=sys.stderr, flush=True)
    if rank == 0 and result_json:
        _write_json(result_json, {"refused": message, "exit_status": code, "passed": False})
    return code


class RunCheck:
    """The hook of one ``planner run`` job (see the module docstring)."""

    def __init__(self, config: Any, plan: Any, batches: Any):
        from plan.format import PlanError
        from training.reference import check_tolerance

        if plan.pipeline is not None and config.record:
            raise PlanError("--record writes single-stage plans; this plan is pipelined")
        self.config = config
        self.plan = plan
        self.batches = batches
        self.rtol = config.rtol if config.rtol is not None else check_tolerance(plan.precision)
        self.rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        self.caught: list[Any] = []
        self.reference: Any = None
        self.grads: dict[str, Any] = {}
        self.setup_s = 0.0

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Keep every warning raised inside (repeats too) for the result."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield
            finally:
                self.caught.extend(caught)

    def before_steps(self, model: Any, setup_s: float) -> None:
        """After the build: the reference run (rank 0, with --check)."""
        from codegen.step_phases import during
        from training.reference import train_one_process

        self.rank = model.rank
        self.setup_s = setup_s
        if self.config.check and self.rank == 0:
            with during("the check's one-process reference run"):
                self.reference = train_one_process(
                    self.plan, self.batches, steps=self.config.steps,
                    optimizer=self.config.optimizer, lr=self.config.lr,
                    min_lr_ratio=self.config.min_lr_ratio, device=str(model.device))
        if model.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(model.device)

    def after_backward(self, step: int, model: Any) -> None:
        """Step 1's whole gradients, before the optimizer (every rank joins)."""
        if step == 0 and self.config.check:
            grads = model.full_grads()
            if model.reports_for_stage:
                self.grads = {k: (v.detach().cpu() if v is not None else None)
                              for k, v in grads.items()}

    def after_step(self, step: int, model: Any) -> None:
        if step == 0 and self.config.record and self.rank == 0:
            model.recorded_plan().save(self.config.record)

    def finish(self, model: Any, losses: list[float], step_times: list[float]) -> int:
        """Gather what every stage saw, compare it (rank 0), write the result
        and print the summary; the exit status every rank agrees on."""
        from codegen.rank_process import peak_memory

        buffers = model.updated_buffers() if self.config.check else {}
        report = _stage_report(model, self.grads) if model.reports_for_stage else None
        reports: list[Any] = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(report, reports, dst=0)
        passed = True
        if self.rank == 0:
            peak, kind = peak_memory(model.device)
            result = self._result(model, [r for r in reports if r is not None], losses,
                                  step_times, peak, kind)
            passed = self._compare(result, [r for r in reports if r is not None], buffers)
            if self.config.result_json:
                _write_json(self.config.result_json, result, indent=1)
            print(summary(result, self.config.check), flush=True)
        # every rank must agree on the exit status: rank 0 alone knows the verdict
        verdict = torch.tensor([0 if passed else 1], device=model.device)
        dist.broadcast(verdict, src=0)
        return EXIT_OK if int(verdict.item()) == 0 else EXIT_CHECK_FAILED

    def _result(self, model: Any, reports: list[dict[str, Any]], losses: list[float],
                step_times: list[float], peak: int, kind: str) -> dict[str, Any]:
        """The result dict (before the --check fields and ``passed``)."""
        plan = self.plan
        diffs = [d for r in reports for d in r["diffs"]]
        mismatches = [m for r in reports for m in r["mismatches"]]
        fallback = [op for r in reports for op in r["fallback"]]
        result = {
            "world_size": plan.world_size, "mesh_shape": list(plan.mesh_shape),
            "device": model.device.type, "optimizer": self.config.optimizer,
            "loss": losses[0] if losses else None, "losses": losses,
            "plan_nodes": len(plan.nodes),
            "nodes_executed": sum(r["executed"] for r in reports),
            "observed_match": not diffs and not mismatches,
            "placement_diffs": diffs[:50], "mismatches": mismatches[:50],
            "num_mismatches": len(mismatches),
            "explicit_reshards": sum(r["explicit"] for r in reports),
            "implicit_reshards": sum(r["implicit"] for r in reports),
            "grad_reductions": sum(r["grad_reductions"] for r in reports),
            "fallback_ops": sorted(set(fallback)) if plan.pipeline is not None else fallback,
            "warnings": sorted({str(w.message).splitlines()[0][:300]
                                for w in self.caught})[:20],
            "setup_s": self.setup_s, "step_times_s": step_times,
            "peak_memory_bytes": peak, "peak_memory_kind": kind,
        }
        if plan.pipeline is not None:
            pipe = plan.pipeline
            result["pipeline"] = {"schedule": pipe.schedule, "pp": pipe.pp,
                                  "num_microbatches": pipe.num_microbatches,
                                  "stages_per_rank": pipe.stages_per_rank,
                                  "stage_mesh": list(pipe.stage_mesh["shape"])}
        return result

    def _compare(self, result: dict[str, Any], reports: list[dict[str, Any]],
                 buffers: dict[str, Any]) -> bool:
        """Add ``passed`` and, with --check, the check's fields to ``result``."""
        from training.reference import gradient_errors, relative_error

        passed = True
        ref = self.reference
        if self.config.check:
            grads = {k: v for r in reports for k, v in r["grads"].items()}
            grad_errors, missing = gradient_errors(grads, ref.grads)
            missing += [fqn for fqn, g in ref.grads.items() if g is not None and fqn not in grads]
            buffer_errors = {fqn: relative_error(v, ref.buffers[fqn]) if fqn in ref.buffers
                             else float("inf") for fqn, v in buffers.items()}
            passed = _add_check_fields(result, ref, grad_errors, missing, buffer_errors,
                                       self.rtol)
        result["passed"] = passed
        return passed


def _stage_report(model: Any, grads: dict[str, Any]) -> dict[str, Any]:
    """What the first rank of a stage mesh sends rank 0 about its stages: step
    1's whole gradients (with --check) and the placements they recorded."""
    records = [e.record for e in model.executors]
    return {"grads": grads,
            "diffs": [d for e in model.executors for d in e.compare_with_plan()],
            "mismatches": [m for r in records for m in r.mismatches],
            "explicit": sum(r.explicit_reshards for r in records),
            "implicit": sum(r.implicit_reshards for r in records),
            "executed": sum(len(r.observed) for r in records),
            "fallback": [op for r in records for op in r.fallback_ops],
            "grad_reductions": model.grad_reductions}


def _add_check_fields(result: dict[str, Any], ref: Any, grad_errors: dict[str, float],
                      missing: list[str], buffer_errors: dict[str, float],
                      rtol: float) -> bool:
    """The check's fields in ``result``; whether the check passed."""
    loss_errs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(result["losses"], ref.losses)]
    worst = max(grad_errors, key=grad_errors.get) if grad_errors else None
    max_err = grad_errors[worst] if worst else 0.0
    worst_buffer = max(buffer_errors, key=buffer_errors.get) if buffer_errors else None
    max_buffer_err = buffer_errors[worst_buffer] if worst_buffer else 0.0
    if buffer_errors:
        result.update({"max_buffer_err": max_buffer_err, "worst_buffer": worst_buffer,
                       "num_buffers_checked": len(buffer_errors)})
    result.update({
        "reference_loss": ref.loss, "reference_losses": ref.losses,
        "loss_rel_err": loss_errs[0], "max_loss_rel_err": max(loss_errs),
        "max_rel_grad_err": max_err, "worst_param": worst,
        "num_params_checked": len(grad_errors), "missing_grads": missing, "rtol": rtol,
    })
    return (max(loss_errs) <= rtol and max_err <= rtol and not missing
            and len(grad_errors) > 0 and result["observed_match"] and max_buffer_err <= rtol)


def summary(r: dict[str, Any], check: bool) -> str:
    """Rank 0's printed summary of a run's result ``r``."""
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
