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

Rank 0 writes the result JSON and prints a short summary. Exit status: 0 passed,
1 check failed, 2 unusable plan or launch, 3 plan made for another program.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_PLAN, EXIT_MISMATCH = 0, 1, 2, 3


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m codegen.rank_main",
                                description="Run one rank of a plan (started by torchrun).")
    p.add_argument("plan", help="plan.json")
    p.add_argument("--steps", type=int, default=1, help="training steps (default 1)")
    p.add_argument("--check", action="store_true",
                   help="compare step 1 with a single-process run and the plan's placements")
    p.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance of --check")
    p.add_argument("--result-json", default=None, help="where rank 0 writes the result")
    p.add_argument("--record", default=None,
                   help="where rank 0 writes the plan with the observed placements")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--lr", type=float, default=1e-3)
    return p.parse_args(argv)


def _say(rank: int, msg: str) -> None:
    print(f"[rank {rank}] {msg}", file=sys.stderr, flush=True)


def _peak_memory(device: torch.device) -> tuple[int | None, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    # ru_maxrss is in KiB on Linux: peak resident set of the whole rank process.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "cpu_peak_rss"


def run(args: argparse.Namespace) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from codegen.executor import PlanExecutor, PlanMismatchError, redistribute
    from codegen.reference import (loss_of, make_optimizer, reference_step, relative_error,
                                   zoo_kwargs)
    from ir.source import build_model
    from planner.plan_format import PlanError, load_plan

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        plan = load_plan(args.plan)
    except PlanError as err:
        _say(rank, f"error: {err}")
        return EXIT_BAD_PLAN
    if plan.world_size != world:
        _say(rank, f"error: plan {args.plan} is for {plan.world_size} devices (mesh "
                   f"{list(plan.mesh_shape)}) but {world} ranks were started")
        return EXIT_BAD_PLAN

    if torch.cuda.is_available():
        device_type, backend = "cuda", "nccl"
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device_type, backend = "cpu", "gloo"
        device = torch.device("cpu")
    t_setup = time.perf_counter()
    dist.init_process_group(backend)
    try:
        names = plan.mesh.get("axis_names")
        names = tuple(names) if names and len(names) == len(plan.mesh_shape) else None
        mesh = init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=names)
        kw = zoo_kwargs(plan.training)
        source = plan.model["source"]
        model, inputs = build_model(source, device=str(device), seed=0, **kw)
        model.train()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                executor = PlanExecutor(plan, model, inputs, mesh)
            except PlanMismatchError as err:
                _say(rank, f"error: {err}")
                return EXIT_MISMATCH
        del model  # the executor holds the distributed parameters
        params = dict(executor.named_parameters())
        opt = make_optimizer(params.values(), args.optimizer, args.lr)
        setup_s = time.perf_counter() - t_setup

        ref = None
        if args.check and rank == 0:
            ref = reference_step(source, seed=0, device=str(device), steps=args.steps,
                                 optimizer=args.optimizer, lr=args.lr, **kw)
        replicate = [Replicate()] * mesh.ndim
        losses: list[float] = []
        step_times: list[float] = []
        grad_errors: dict[str, float] = {}
        missing_grads: list[str] = []
        grad_reductions = 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for step in range(args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as step_warnings:
                warnings.simplefilter("always")
                loss = loss_of(executor(*inputs))
            caught.extend(step_warnings)
            if isinstance(loss, DTensor) and any(not p.is_replicate() for p in loss.placements):
                loss = loss.redistribute(mesh, replicate)
            loss.backward()
            # Gradients take their parameter's placement (the data-parallel reduction).
            grad_reductions = 0
            for p in params.values():
                if isinstance(p.grad, DTensor) and tuple(p.grad.placements) != tuple(p.placements):
                    p.grad = redistribute(p.grad, mesh, p.placements)
                    grad_reductions += 1
            if step == 0 and args.check:
                for fqn, p in params.items():
                    g = p.grad
                    full = g.full_tensor() if isinstance(g, DTensor) else g
                    if rank == 0:
                        want = ref.grads.get(fqn)
                        if full is None or want is None:
                            if (full is None) != (want is None):
                                missing_grads.append(fqn)
                            continue
                        grad_errors[fqn] = relative_error(full, want)
            opt.step()
            opt.zero_grad(set_to_none=True)
            local = loss.to_local() if isinstance(loss, DTensor) else loss
            losses.append(float(local.detach()))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_times.append(time.perf_counter() - t0)
            if step == 0 and args.record and rank == 0:
                executor.recorded_plan().save(args.record)
        peak, peak_kind = _peak_memory(device)

        diffs = executor.compare_with_plan()
        observed_match = not diffs and not executor.mismatches
        result: dict[str, Any] = {
            "world_size": world,
            "mesh_shape": list(plan.mesh_shape),
            "device": device_type,
            "optimizer": args.optimizer,
            "loss": losses[0] if losses else None,
            "losses": losses,
            "plan_nodes": len(plan.nodes),
            "nodes_executed": len(executor.observed),
            "observed_match": observed_match,
            "placement_diffs": diffs[:50],
            "mismatches": executor.mismatches[:50],
            "num_mismatches": len(executor.mismatches),
            "explicit_reshards": executor.explicit_reshards,
            "implicit_reshards": executor.implicit_reshards,
            "grad_reductions": grad_reductions,
            "fallback_ops": list(executor.fallback_ops),
            "warnings": sorted({str(w.message).splitlines()[0][:300] for w in caught})[:20],
            "setup_s": setup_s,
            "step_times_s": step_times,
            "peak_memory_bytes": peak,
            "peak_memory_kind": peak_kind,
        }
        passed = True
        if args.check and rank == 0:
            loss_errs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref.losses)]
            worst = max(grad_errors, key=grad_errors.get) if grad_errors else None
            max_err = grad_errors[worst] if worst else 0.0
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
                      and len(grad_errors) > 0 and observed_match)
        result["passed"] = passed
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
            f"{len(r['losses'])} steps {r['max_loss_rel_err']:.2e}), max rel grad err "
            f"{r['max_rel_grad_err']:.2e} ({r['worst_param']}) over "
            f"{r['num_params_checked']} params, placements "
            f"{'match' if r['observed_match'] else 'DIFFER'} the plan")
        for line in (r["placement_diffs"] + r["mismatches"])[:5]:
            lines.append(f"  {line}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        return run(args)
    except Exception as err:  # noqa: BLE001 - one line per rank, then non-zero exit
        _say(rank, f"error: {type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}")
        if os.environ.get("CODEGEN_TRACEBACK"):
            raise
        import traceback
        traceback.print_exc(file=sys.stderr)
        return EXIT_BAD_PLAN


if __name__ == "__main__":
    sys.exit(main())
