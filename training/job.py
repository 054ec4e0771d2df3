"""The rank program of ``planner train`` and ``planner run``: a training job on a plan.

    torchrun --nproc_per_node N [--max-restarts R] -m training.job PLAN.json \\
        --data train.bin --steps 200 [--lr --warmup --grad-clip --checkpoint-dir DIR ...]

(``planner train`` passes the settings in the environment instead, as JSON in
``PLANNER_TRAIN_CONFIG``: torchrun would read ``--log`` as its own ``--log-dir``.)

Every rank builds its part of the plan (:func:`codegen.parallel_model.parallelize`:
the model on meta, only this rank's shards allocated), takes its first weights
from the model's own initialisation, a checkpoint or a Hugging Face folder, and
trains: the batch of step ``k`` is a function of ``k`` (:mod:`training.data`),
so a resumed job sees the data an uninterrupted one would. Checkpoints are DCP
saves (:mod:`training.checkpoint`); after a failure torchrun restarts the ranks
(``--max-restarts``) and they resume from the newest finished save by
themselves. Every ``--eval-every`` steps and after the last, the ranks measure
the held-out loss forward only (:mod:`training.evaluation`; ``--data DIR`` of
``planner data`` is :mod:`training.text_data`'s). Rank 0 logs
(:mod:`training.progress_log`), exports and writes the result JSON, with every
rank's peak memory.

``planner run`` is this job too (its config's ``report`` is ``"run"``,
:func:`training.launch.launch`): a constant learning rate on the example
batch, with :class:`training.run_check.RunCheck` as the loop's hook (the
``--check`` against one process, ``--record``, the run's summary and result).

What the job needs is checked first (:func:`prepare`, also run by the command
line before it starts any rank): bad input is one line and exit status 2.

Test hook: ``PLANNER_TRAIN_FAULT=RANK:STEP`` makes rank RANK kill itself
(SIGKILL) when it reaches step STEP in the job's first attempt, to show a crash
and the resume after it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from training.config import CONFIG_ENV, TrainConfig, add_train_arguments

__all__ = ["JobInputs", "main", "prepare", "run"]

EXIT_OK, EXIT_BAD_INPUT, EXIT_MISMATCH = 0, 2, 3
FAULT_ENV = "PLANNER_TRAIN_FAULT"


@dataclass
class JobInputs:
    """What :func:`prepare` found: the plan, the data, where the weights come from."""

    plan: Any  # plan.format.Plan
    batches: Callable[[int], tuple]  # step -> the global batch
    tokens_per_step: int
    shapes: dict[str, list[int]]  # every parameter's FQN -> global shape
    init_hf: str | None  # a Hugging Face folder to read the first weights from
    init_checkpoint: Any  # training.checkpoint.SavedCheckpoint of the first weights
    resume_from: Any  # SavedCheckpoint to continue from (weights, optimizer, step)
    held_out: Callable[[int], tuple] | None = None  # k -> the k-th validation batch


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    from codegen.capture import PlanMismatchError
    from codegen.parallel_model import BatchShapeError
    from codegen.pipeline_validation import PipelinePlanError
    from models.source import ModelSourceError
    from plan.format import PlanError
    from training.checkpoint import CheckpointError
    from training.data import DataError

    return (DataError, CheckpointError, BatchShapeError, ModelSourceError, PlanError,
            PlanMismatchError, PipelinePlanError)


def _vocab_size(model: nn.Module) -> int | None:
    """The number of token ids the model embeds (its first embedding's rows)."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return int(module.num_embeddings)
    return None


def _token_batches(path: str, dtype: str, flag: str, plan: Any, model: nn.Module,
                   inputs: tuple) -> Any:
    """The token file ``path`` (named ``flag`` in messages) as the plan's
    (tokens, targets) batches."""
    from training.data import DataError, TokenFile

    specs = [(list(t.shape), t.dtype) for t in inputs if isinstance(t, torch.Tensor)]
    if (len(inputs) != 2 or len(specs) != 2 or specs[0] != specs[1]
            or specs[0][1] != torch.int64 or len(specs[0][0]) != 2):
        given = ", ".join(f"{s} {d}" for s, d in specs) or "no tensors"
        raise DataError(f"{flag} gives (tokens, targets) batches of int64 "
                        f"[batch, sequence], but the plan's model takes {given}; give "
                        f"--data FILE.py:FUNCTION returning the batch of a step")
    batch_size, seq_len = specs[0][0]
    targets = "same" if plan.model["source"].startswith("hf:") else "shifted"
    return TokenFile(path, batch_size=batch_size, seq_len=seq_len,
                     dtype=dtype, vocab_size=_vocab_size(model), targets=targets)


def _held_out(source: Any, plan: Any, model: nn.Module, inputs: tuple) -> Any:
    """The validation batches (k -> batch k), or None without validation."""
    from training.data import DataError

    if source.vocab_size is not None and _vocab_size(model) is not None \
            and source.vocab_size > _vocab_size(model):
        raise DataError(f"the data was tokenized with a vocabulary of {source.vocab_size:,} "
                        f"ids, more than the model's {_vocab_size(model):,}; tokenize it with "
                        f"the model's tokenizer (planner data --tokenizer) or plan a model "
                        f"whose vocabulary holds it")
    if source.held_out is None:
        return None
    try:
        return _token_batches(source.held_out, source.held_out_dtype, source.held_out_flag,
                              plan, model, inputs).batch
    except DataError as err:
        raise DataError(f"validation data ({source.held_out_flag}): {err}") from None


def _example_batches(plan: Any) -> Callable[[int], tuple]:
    """Without ``--data``: the factory's example batch at every step, with the
    values a one-process build on the CPU gives it (the model itself stays on
    meta: :mod:`codegen.deferred_init`)."""
    from codegen.deferred_init import record_build
    from codegen.plan_model import build_plan_model

    (_, inputs), record = record_build(lambda: build_plan_model(plan, "meta"),
                                       torch.device("cpu"))
    batch = tuple(record.materialize(t) if isinstance(t, torch.Tensor) and t.is_meta else t
                  for t in inputs)
    return lambda step: batch


def _initial_weights(config: TrainConfig, plan: Any, shapes: dict[str, list[int]]
                     ) -> tuple[str | None, Any]:
    """(Hugging Face folder, DCP save) the first weights come from; (None, None)
    for the model's own initialisation."""
    from training import checkpoint
    from training.hf_checkpoint import is_hf_folder

    source = plan.model["source"]
    path = config.init
    if path is None and source.startswith("hf:") and is_hf_folder(source[3:]):
        return source[3:], None  # fine-tuning the folder the model was planned from
    if path is None:
        return None, None
    if is_hf_folder(path):
        return path, None
    saved = checkpoint.find_checkpoint(path)
    checkpoint.check_compatible(saved, shapes)
    return None, saved


def _resume_point(config: TrainConfig, shapes: dict[str, list[int]], restarted: bool) -> Any:
    """The save to continue from: the newest finished one in the checkpoint
    directory with ``--resume`` (which must exist) or after torchrun restarted
    the job (if any)."""
    from training import checkpoint

    if not (config.resume or restarted):
        return None
    if config.checkpoint_dir is None:
        raise checkpoint.CheckpointError("--resume needs --checkpoint-dir, the directory the "
                                         "job saved to")
    if not config.resume and not checkpoint.newest_complete(config.checkpoint_dir)[0]:
        return None  # restarted before its first save: start again
    saved = checkpoint.find_checkpoint(config.checkpoint_dir)
    checkpoint.check_compatible(saved, shapes)
    return saved


def _check_config(config: TrainConfig) -> None:
    from training.data import DataError

    for name in ("steps", "log_every", "eval_batches"):
        if getattr(config, name) < 1:
            raise DataError(f"--{name.replace('_', '-')} must be at least 1")
    if config.save_every is not None and (config.save_every < 1 or not config.checkpoint_dir):
        raise DataError("--save-every needs --checkpoint-dir and a value of at least 1")
    if config.grad_clip is not None and config.grad_clip <= 0:
        raise DataError("--grad-clip must be positive")
    if config.eval_every is not None and config.eval_every < 1:
        raise DataError("--eval-every must be at least 1")


def prepare(config: TrainConfig, *, restarted: bool = False) -> JobInputs:
    """Check everything the job needs before any model is built: the plan, the
    data (length, token ids within the vocabulary, batch shapes), the first
    weights and the checkpoint to resume, the export folder. Raises one of
    :func:`_bad_input_errors` with a one-line message."""
    from codegen.parallel_model import InputSpec, check_batch
    from codegen.plan_model import build_plan_model
    from plan.format import load_plan
    from training.data import load_user_batches
    from training.hf_checkpoint import check_export_target
    from training.text_data import data_source

    _check_config(config)
    source = data_source(config.data, config.data_dtype, config.eval_data, config.eval_every)
    plan = load_plan(config.plan)
    model, inputs = build_plan_model(plan, "meta")
    shapes = {fqn: list(p.shape) for fqn, p in model.named_parameters()}
    held_out = _held_out(source, plan, model, inputs)
    if source.train is None:
        batches = _example_batches(plan)
    elif ":" in os.path.basename(source.train) or source.train.endswith(".py"):
        batches = load_user_batches(source.train)
    else:
        batches = _token_batches(source.train, source.dtype, f"--data {config.data}", plan,
                                 model, inputs).batch
    check_batch(batches(0), [InputSpec.of(t) for t in inputs])
    if held_out is not None:
        check_batch(held_out(0), [InputSpec.of(t) for t in inputs])
    tokens = next((t.numel() for t in inputs if isinstance(t, torch.Tensor)
                   and not t.is_floating_point()), 0)
    if config.export:
        check_export_target(config.export)
    init_hf, init_checkpoint = _initial_weights(config, plan, shapes)
    resume_from = _resume_point(config, shapes, restarted)
    return JobInputs(plan, batches, tokens, shapes, init_hf, init_checkpoint, resume_from,
                     held_out)


def _fault_step(rank: int, restart_count: int) -> int | None:
    """The step at which this rank kills itself (the test hook), or None."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or restart_count:
        return None
    fault_rank, _, step = spec.partition(":")
    return int(step) if int(fault_rank) == rank else None


def _make_optimizer(config: TrainConfig, model: Any) -> torch.optim.Optimizer:
    from training.reference import make_optimizer

    return model.optimizer(make_optimizer, name=config.optimizer, lr=config.lr,
                           weight_decay=config.weight_decay)


def _model_flops(model: Any) -> float:
    """Model FLOPs of one training step: 3x the captured forward's (the
    backward computes two products per forward one), the MFU convention."""
    return 3.0 * model.forward_flops()


def _peak_flops(plan: Any) -> float | None:
    """The cluster's peak FLOP/s in the plan's compute dtype, all devices."""
    peak = plan.cluster.get("device", {}).get("peak_flops", {})
    per_device = peak.get(plan.precision.compute_dtype_name) or peak.get("float32")
    return per_device * plan.world_size if per_device else None


def _first_weights(job: JobInputs, model: Any, opt: Any, schedule: Any) -> int:
    """Load the weights (and optimizer and schedule, when resuming) the job
    starts from; the step it starts at."""
    from training import checkpoint
    from training.hf_checkpoint import load_hf_weights

    if job.resume_from is not None:
        checkpoint.load(job.resume_from, model, opt)
        schedule.load_state_dict(job.resume_from.meta["scheduler"])
        return job.resume_from.step
    if job.init_checkpoint is not None:
        checkpoint.load(job.init_checkpoint, model, None)
    elif job.init_hf is not None:
        load_hf_weights(job.init_hf, model.state_dict())
    return 0


def _export(config: TrainConfig, plan: Any, model: Any, rank: int) -> None:
    """Write the trained weights to ``--export`` (every rank joins the gathers)."""
    from training.hf_checkpoint import export_hf, export_plain

    tensors = model.full_tensors()
    if rank != 0:
        for _ in tensors:
            pass
        return
    source = plan.model["source"]
    if source.startswith("hf:"):
        export_hf(config.export, tensors, config_source=source[3:])
    else:
        export_plain(config.export, tensors)


def _steps(config: TrainConfig, job: JobInputs, model: Any, opt: Any, schedule: Any,
           start: int, hook: Any, validation: Any = None
           ) -> tuple[list[dict[str, Any]], list[float]]:
    """The one step loop: ``config.steps - start`` steps from ``start``, with
    logging, saves, validation (:class:`training.evaluation.Validation`, or
    None; its time is no step's) and the test hook's fault; ``hook``
    (``planner run``'s :class:`training.run_check.RunCheck`, or None) sees each
    step. Returns the losses by step and this attempt's seconds per step."""
    from training import checkpoint
    from training.progress_log import StepClock, TrainingLog

    plan, rank = job.plan, model.rank
    fault = _fault_step(rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    losses: list[dict[str, Any]] = []  # the loss a 0-d tensor until the end
    saved_at = job.resume_from.step if job.resume_from is not None else None

    def save(done: int) -> None:
        nonlocal saved_at
        checkpoint.save(config.checkpoint_dir, done, model, opt, {
            "scheduler": schedule.state_dict(), "model": plan.model["source"],
            "plan": os.path.abspath(config.plan), "mesh": list(plan.mesh_shape)})
        saved_at = done

    console = rank == 0 and config.report == "train"
    with TrainingLog(config.log if rank == 0 else None, log_every=config.log_every,
                     total_steps=config.steps, start_step=start,
                     tokens_per_step=job.tokens_per_step, flops_per_step=_model_flops(model),
                     peak_flops=_peak_flops(plan), console=console) as log:
        # the host reads the loss only on logged steps, so it issues the next
        # steps while the device runs this one
        clock = StepClock(model.device)
        compile_regions_shown = 0
        for step in range(start, config.steps):
            if step == fault:
                os.kill(os.getpid(), signal.SIGKILL)
            issued = time.perf_counter()
            loss = model.step(*job.batches(step))
            if rank == 0:  # regions compile in their first call: say so once each
                new = model.compile_regions()[compile_regions_shown:]
                compile_regions_shown += len(new)
                for region in new:
                    print(region.line(), flush=True)
                if any(region.compiled for region in new):
                    print(f"compile: step {step + 1}'s forward and backward took "
                          f"{time.perf_counter() - issued:.1f} s, compiling included", flush=True)
            if hook is not None:
                hook.after_backward(step, model)
            norm = model.clip_grad_norm_(config.grad_clip) if config.grad_clip else None
            lr = opt.param_groups[0]["lr"]
            opt.step()
            schedule.step()
            opt.zero_grad(set_to_none=True)
            clock.tick()
            if hook is not None:
                hook.after_step(step, model)
            validated = validation is not None and validation.due(step)
            val_loss = validation.run(model, step) if validated else None
            log.log(step, loss, lr, clock.seconds()[-1] if log.should_log(step) or validated
                    else 0.0, grad_norm=norm, val_loss=val_loss)
            losses.append({"step": step, "loss": loss})
            paused = validated
            if config.save_every and (step + 1) % config.save_every == 0:
                save(step + 1)
                paused = True
            if paused:
                clock.restart()  # the save and the validation are no step's time
    if config.checkpoint_dir and saved_at != config.steps and start < config.steps:
        save(config.steps)
    return [{"step": e["step"], "loss": float(e["loss"])} for e in losses], clock.seconds()


def _use_compile_cache(config: TrainConfig, plan: Any, rank: int) -> None:
    """Keep inductor's compiled artifacts in the checkpoint directory, so that
    a restart (``--max-restarts``) or a resumed job reuses them; rank 0 says
    where, and whether an earlier run left some there."""
    from codegen.compiled_program import compile_cache_dir

    compiles = plan.compiles if config.compile is None else config.compile
    if not (compiles and config.checkpoint_dir):
        return
    folder = compile_cache_dir(config.checkpoint_dir)
    reused = os.path.isdir(folder) and any(os.scandir(folder))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    if rank == 0:
        print(f"compile: inductor's cache is {folder}"
              + (" (reusing an earlier run's artifacts)" if reused else ""), flush=True)


def run(config: TrainConfig) -> int:
    """Train as ``config`` says, on this rank (under torchrun); the exit status."""
    from codegen.parallel_model import parallelize
    from codegen.rank_process import peak_memory, resident_bytes
    from training.evaluation import Validation
    from training.lr_schedule import warmup_cosine
    from training.run_check import RunCheck

    rank = int(os.environ.get("RANK", "0"))
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    baseline = resident_bytes()
    job = prepare(config, restarted=restarts > 0)
    plan = job.plan
    hook = RunCheck(config, plan, job.batches) if config.report == "run" else None
    with hook.watching() if hook is not None else contextlib.nullcontext():
        t_setup = time.perf_counter()
        loading = job.init_hf or job.init_checkpoint or job.resume_from
        _use_compile_cache(config, plan, rank)
        model = parallelize(plan, init="empty" if loading else "fresh", compile=config.compile)
        opt = _make_optimizer(config, model)
        schedule = warmup_cosine(opt, warmup_steps=config.warmup, total_steps=config.steps,
                                 min_lr_ratio=config.min_lr_ratio)
        start = _first_weights(job, model, opt, schedule)
        if hook is not None:
            hook.before_steps(model, time.perf_counter() - t_setup)
        validation = None
        if job.held_out is not None:
            validation = Validation(job.held_out, count=config.eval_batches,
                                    every=config.eval_every, total_steps=config.steps)
        losses, step_times = _steps(config, job, model, opt, schedule, start, hook, validation)
    if hook is not None:
        return hook.finish(model, [e["loss"] for e in losses], step_times)
    if config.export:
        _export(config, plan, model, rank)
    peak, kind = peak_memory(model.device)
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"rank": rank, "peak_bytes": peak, "baseline_bytes": baseline,
                                   "peak_kind": kind})
    if rank == 0 and config.result_json:
        _write_result(config, plan, losses, step_times, start, restarts, ranks, job,
                      validation.losses if validation is not None else [])
    return EXIT_OK


def _write_result(config: TrainConfig, plan: Any, losses: list[dict[str, float]],
                  step_times: list[float], start: int, restarts: int, ranks: list[Any],
                  job: JobInputs, val_losses: list[dict[str, float]]) -> None:
    """Rank 0's result JSON: losses, validation losses (``val_losses``, this
    attempt's), per-step seconds (``step_times_s``, this attempt's steps),
    tokens per step, peak bytes per rank, the prediction."""
    memory = plan.predicted.get("memory_bytes_per_device", {})
    result = {
        "plan": os.path.abspath(config.plan), "model": plan.model["source"],
        "mesh": list(plan.mesh_shape), "world_size": plan.world_size,
        "start_step": start, "final_step": config.steps, "steps_run": len(losses),
        "final_loss": losses[-1]["loss"] if losses else None, "losses": losses,
        "final_val_loss": val_losses[-1]["loss"] if val_losses else None,
        "val_losses": val_losses,
        "step_times_s": step_times, "tokens_per_step": job.tokens_per_step,
        "restarts": restarts,
        "resumed_from": job.resume_from.path if job.resume_from is not None else None,
        "predicted_peak_bytes_per_device": memory.get("peak"),
        "predicted_total_bytes_per_device": memory.get("total"),
        "ranks": ranks, "config": config.as_dict(),
    }
    tmp = config.result_json + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, config.result_json)


def main(argv: list[str] | None = None) -> int:
    from codegen.capture import PlanMismatchError
    from codegen.step_phases import error_line
    from training.run_check import refuse

    p = argparse.ArgumentParser(prog="python -m training.job",
                                description="One rank of `planner train` (started by torchrun).")
    add_train_arguments(p)
    given = os.environ.get(CONFIG_ENV)
    if given and not (argv if argv is not None else sys.argv[1:]):
        config = TrainConfig.from_dict(json.loads(given))  # from `planner train` or `run`
    else:
        config = TrainConfig.from_args(p.parse_args(argv))
    rank = int(os.environ.get("RANK", "0"))
    finished = False
    try:
        code = run(config)
        finished = True
        return code
    except _bad_input_errors() as err:
        if config.report == "run":  # planner run: the launcher reads the refusal
            code = EXIT_MISMATCH if isinstance(err, PlanMismatchError) else EXIT_BAD_INPUT
            return refuse(config.result_json, rank, code, str(err))
        print(f"[rank {rank}] error: {str(err).splitlines()[0]}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except Exception as err:  # noqa: BLE001 - one line for the launcher, the traceback after it
        print(f"[rank {rank}] error: {error_line(err)}", file=sys.stderr, flush=True)
        raise
    finally:
        if dist.is_initialized():
            if finished:  # no rank tears its process group down under a peer still using it
                dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
