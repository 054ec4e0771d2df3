"""The ``planner`` command: ``plan``, ``show``, ``run``, ``data``, ``train``, ``compare`` and ``profile``.

Every user error (unknown model or preset, bad mesh, wrong plan version, model
mismatch) prints one line starting with ``planner: error:`` and exits with 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from typing import Any, Callable, Iterator, Sequence

from app.errors import EXIT_USAGE, run_command


def _parse_mesh(text: str | None) -> tuple[int, ...] | None:
    """``--mesh`` (``4``, ``2x2``) as a checked shape (:func:`planner.request.check_mesh`)."""
    from planner.request import PlanningError, check_mesh

    if text is None:
        return None
    try:
        shape = tuple(int(p) for p in text.lower().split("x"))
    except ValueError:
        raise PlanningError(f"mesh '{text}' is not like 4 or 2x2") from None
    return check_mesh(shape)


def _check_step_sizes(args: argparse.Namespace) -> None:
    """``--batch-size`` and ``--seq-len``, when given, are positive."""
    from planner.request import PlanningError

    for flag, value in (("--batch-size", getattr(args, "batch_size", None)),
                        ("--seq-len", getattr(args, "seq_len", None))):
        if value is not None and value < 1:
            raise PlanningError(f"{flag} must be a positive integer, got {value}")


def _output_folder(path: str) -> None:
    """Make the folder ``path`` is written into, before any work starts, so that
    a path that cannot be written fails at once rather than after planning."""
    from planner.request import PlanningError

    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise PlanningError(f"cannot write {path}: {err.strerror or err} at {folder}; give "
                            f"another -o") from None
    if not os.access(folder, os.W_OK):
        raise PlanningError(f"cannot write {path}: {folder} is not writable; give another -o")


def _int_list(text: str | None, what: str, least: int = 1) -> list[int] | None:
    from planner.request import PlanningError

    if text is None:
        return None
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise PlanningError(f"{what} '{text}' is not a comma-separated list of integers") from None
    if any(v < least for v in values):
        raise PlanningError(f"{what} '{text}' must be integers >= {least}")
    return values


@contextlib.contextmanager
def _progress(enabled: bool) -> Iterator[Callable[[str], None] | None]:
    """A spinner with the search's current step and elapsed time on a terminal;
    nothing when stderr is piped."""
    if not (enabled and sys.stderr.isatty()):
        yield None
        return
    import time

    from rich.console import Console

    start = time.perf_counter()
    with Console(stderr=True).status("planning ...") as status:
        yield lambda msg: status.update(f"[{time.perf_counter() - start:5.1f} s] {msg}")


def _precision(args: argparse.Namespace) -> Any:
    """``--precision`` with ``--reduce-dtype`` applied (None: the planner's default)."""
    if args.precision is None and args.reduce_dtype is None:
        return None
    from ir.precision import get_precision
    from planner.request import PlanningError

    if args.precision is None:
        raise PlanningError("--reduce-dtype needs --precision bf16-mixed")
    try:
        return get_precision(args.precision, args.reduce_dtype)
    except ValueError as err:
        raise PlanningError(str(err)) from None


def _recompute(args: argparse.Namespace) -> bool | None:
    return {"auto": None, "all": True, "none": False}[getattr(args, "recompute", "auto")]


def _add_precision(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", choices=["bf16-mixed", "fp16-mixed", "bf16", "fp32"],
                   help="training precision: bf16-mixed (fp32 master weights and optimizer "
                   "states, bf16 compute; default on GPU clusters), fp16-mixed (the same in "
                   "fp16, default on GPUs without bf16; planned, not run), bf16, or fp32 "
                   "(default on local-cpu)")
    p.add_argument("--reduce-dtype", choices=["fp32", "bf16", "fp16"],
                   help="dtype gradients are reduced in under a mixed precision (default fp32)")


def _plan_request(args: argparse.Namespace) -> Any:
    """The :class:`planner.request.PlanRequest` of ``planner plan``'s flags, checked."""
    from planner.request import PlanningError, PlanRequest

    zoo_kwargs = {k: v for k, v in (("batch_size", args.batch_size), ("seq_len", args.seq_len))
                  if v is not None}
    schedules = args.schedule.split(",") if args.schedule else None
    if schedules:
        from costmodel.schedules import canonical_schedule

        try:
            schedules = [canonical_schedule(x) for x in schedules]
        except ValueError as err:
            raise PlanningError(str(err)) from None
    return PlanRequest(
        mesh_shape=_parse_mesh(args.mesh), model_source=args.model,
        time_limit_s=args.time_limit, zoo_kwargs=zoo_kwargs, pipeline=not args.no_pipeline,
        pp=_int_list(args.pp, "--pp"), schedules=schedules,
        num_microbatches=_int_list(args.microbatches, "--microbatches"),
        zero_stages=_int_list(args.zero, "--zero", least=0), precision=_precision(args),
        recompute=_recompute(args),
        context_parallel=_int_list(args.context_parallel, "--context-parallel"),
        compile=args.compile)


def cmd_plan(args: argparse.Namespace) -> int:
    from models.source import build_model
    from planner.api import plan
    from planner.report import format_plan

    _check_step_sizes(args)
    request = _plan_request(args)
    _output_folder(args.output)
    model, inputs = build_model(args.model, device="meta", **request.zoo_kwargs)
    with _gathered_warnings() as caught, _progress(not args.quiet) as progress:
        result = plan(model, args.cluster, example_inputs=inputs, request=request,
                      progress=progress)
    for line in warning_summary(caught):
        print(f"planner: warning: {line}", file=sys.stderr)
    print(format_plan(result))
    _warn_near_memory_edge(result)
    existed = os.path.exists(args.output)
    result.save(args.output)
    print(f"{'replaced' if existed else 'wrote'} {args.output}")
    return 0


@contextlib.contextmanager
def _gathered_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Gather the warnings this process raises (for :func:`warning_summary`).
    A search worker forked meanwhile prints its own, once each, since what it
    gathered would die with it."""
    parent = os.getpid()
    caught: list[warnings.WarningMessage] = []
    said: set[str] = set()

    def keep(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
             line: Any = None) -> None:
        if os.getpid() == parent:
            caught.append(warnings.WarningMessage(message, category, filename, lineno))
            return
        text = warnings.formatwarning(message, category, filename, lineno, line)
        if text not in said:
            said.add(text)
            sys.stderr.write(text)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = keep
        yield caught


def warning_summary(caught: Sequence[warnings.WarningMessage]) -> list[str]:
    """One line per kind of warning raised while planning: ops planned
    replicated for want of a DTensor strategy, one line per op type with its
    count of nodes; any other warning once, however often it was raised."""
    from planner.ilp.strategies import ReplicateFallbackWarning

    fallbacks: dict[str, int] = {}
    others: dict[str, None] = {}
    for w in caught:
        text = str(w.message)
        if issubclass(w.category, ReplicateFallbackWarning):
            op = text.split(" ", 1)[0]
            fallbacks[op] = fallbacks.get(op, 0) + 1
        else:
            others.setdefault(f"{w.category.__name__}: {text.splitlines()[0] if text else ''}")
    lines = [f"{op} has no usable DTensor sharding strategy: its {n} node(s) are planned "
             f"replicated" for op, n in sorted(fallbacks.items())]
    return lines + list(others)


def _warn_near_memory_edge(plan: Any) -> None:
    """A warning on standard error when the plan's peak is close to its budget."""
    from planner.report import memory_edge_warning

    warning = memory_edge_warning(plan)
    if warning:
        print(f"planner: warning: {warning}", file=sys.stderr)


def cmd_show(args: argparse.Namespace) -> int:
    from plan.format import PlanError, load_plan, placement_error
    from planner.report import format_plan

    plan = load_plan(args.plan)
    wrong = placement_error(plan)
    if wrong:
        raise PlanError(f"plan {args.plan}: {wrong}; regenerate it with `planner plan`")
    if args.plot:
        from app.plot import PlotError, plot_plan

        try:
            paths = plot_plan(plan, args.plot)
        except PlotError as err:
            raise PlanError(str(err)) from err
        print(format_plan(plan))
        for path in paths:
            print(f"wrote {path}")
        return 0
    print(format_plan(plan, verbose=True))
    _warn_near_memory_edge(plan)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from plan.format import load_plan

    plan = load_plan(args.plan)  # validates before any process starts
    from training.launch import launch
    from training.torchrun import LaunchError, cpu_fallback_note, runnable_world

    try:
        runnable_world(plan, args.plan, None)
    except LaunchError as err:
        print(f"planner: error: {err.first_line or err}", file=sys.stderr)
        return EXIT_USAGE
    note = cpu_fallback_note(plan, args.plan)
    if note:
        print(f"note: {note}", file=sys.stderr)

    try:
        result = launch(args.plan, nproc=plan.world_size, steps=args.steps, check=args.check,
                        nodes=_nodes(args), compile=args.compile)
    except LaunchError as err:
        # the ranks refused the plan, or failed running it: one line (the op, the
        # reason, what to do, and the file with their whole output), exit 2
        print(f"planner: error: {err.first_line}", file=sys.stderr)
        return EXIT_USAGE
    if "node_rank" in result:  # not node 0: the result is printed there
        print(f"node {result['node_rank']}: its ranks finished (node 0 prints the result)")
        return 0
    print(result.get("output", "").rstrip())  # rank 0's summary
    return 0 if result.get("passed", True) else 1


def cmd_train(args: argparse.Namespace) -> int:
    from training.torchrun import LaunchError
    from planner.request import PlanningError
    from training.config import TrainConfig
    from training.launch import train

    if args.max_restarts < 0:
        raise PlanningError("--max-restarts must be 0 or more")
    try:
        outcome = train(TrainConfig.from_args(args), nodes=_nodes(args),
                        max_restarts=args.max_restarts)
    except LaunchError as err:  # refused before or by the ranks: one line
        print(f"planner: error: {err.first_line}", file=sys.stderr)
        return EXIT_USAGE
    if outcome.returncode == 0:
        from app.plot import loss_plot_line

        if args.result_json:
            print(f"wrote {args.result_json}")
        if args.log:  # loss.png beside it
            print(loss_plot_line(args.log))
        return 0
    if outcome.bad_input:  # a rank refused its input: its own line says what to change
        what = outcome.error or f"the ranks exited with status {outcome.returncode}"
        print(f"planner: error: {what} (the ranks' output: {outcome.log_path})", file=sys.stderr)
    else:
        from training.torchrun import rank_failure_line

        line = rank_failure_line(_log_tail(outcome.log_path), outcome.returncode,
                                 outcome.log_path)
        print(f"planner: error: {line}", file=sys.stderr)
    return EXIT_USAGE


def cmd_data(args: argparse.Namespace) -> int:
    from training.text_data import write_data_folder

    folder = write_data_folder(args.texts, args.output, tokenizer=args.tokenizer,
                               val_fraction=args.val_fraction)
    n = folder.tokens
    print(f"wrote {folder.train} ({n['train']:,} tokens), {folder.val} ({n['val']:,}) and "
          f"meta.json: {folder.dtype}, vocabulary {folder.vocab_size:,} ({folder.tokenizer})")
    return 0


def _log_tail(path: str, limit: int = 1 << 20) -> str:
    """The last ``limit`` bytes of the ranks' log (their errors and torchrun's
    record of how each ended)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _nodes(args: argparse.Namespace) -> Any:
    """This node's part of a run over ``--nnodes`` nodes, or None for one node."""
    from training.torchrun import Nodes
    from planner.request import PlanningError

    if args.nnodes == 1:
        if args.node_rank or args.master_addr or args.master_port:
            raise PlanningError("--node-rank, --master-addr and --master-port go with "
                                "--nnodes N (N > 1)")
        return None
    if not args.master_addr or not args.master_port:
        raise PlanningError(f"--nnodes {args.nnodes} needs --master-addr (node 0's host) and "
                            f"--master-port (a free port there), the same on every node")
    return Nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port)


def cmd_compare(args: argparse.Namespace) -> int:
    from planner.baselines.compare import compare, format_comparison, write_outputs

    _check_step_sizes(args)
    _output_folder(args.output)
    zoo_kwargs = {k: v for k, v in (("batch_size", args.batch_size), ("seq_len", args.seq_len))
                  if v is not None}
    result = compare(args.model, args.cluster, zoo_kwargs=zoo_kwargs,
                     time_limit_s=args.time_limit, micro_batch_sizes=args.micro_batch_sizes,
                     virtual_stages=[None, 2] if args.interleaved else [None],
                     sequence_parallel=[False, True] if args.sequence_parallel else [False],
                     pipeline=not args.no_pipeline,
                     megatron_deadline_s=args.megatron_deadline, precision=_precision(args))
    print(format_comparison(result))
    for path in write_outputs(result, args.output):
        print(f"wrote {path}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from codegen.runtime_probe import profile_with_runtime
    from costmodel.profiling import ProfileError, load_profile, profile_path, summary_rows

    if args.ranks < 1:
        print(f"planner: error: --ranks must be >= 1, got {args.ranks}", file=sys.stderr)
        return EXIT_USAGE
    _output_folder(args.output)
    try:
        cluster = profile_with_runtime(args.ranks, args.output, quick=args.quick, progress=True)
    except ProfileError as err:
        print(f"planner: error: {err}", file=sys.stderr)
        return 1
    profile = load_profile(profile_path(args.output))
    print(f"{cluster.name}: {profile['device']} ranks, {profile['backend']}, measured in {profile['wall_s']:.1f} s")
    rows = summary_rows(profile)
    width = max(len(r[0]) for r in rows)
    vwidth = max(len(r[1]) for r in rows)
    for what, value, detail in rows:
        print(f"  {what:<{width}}  {value:>{vwidth}}  {detail}")
    print(f"wrote {args.output} (cluster; use --cluster {args.output}) and {profile_path(args.output)} "
          f"(fits and raw timings)")
    return 0


def _add_nodes(p: argparse.ArgumentParser) -> None:
    """The flags of a job over several nodes (:func:`_nodes`)."""
    p.add_argument("--nnodes", type=int, default=1,
                   help="nodes the plan's ranks are spread over, evenly; run the same "
                   "command on each node with its own --node-rank")
    p.add_argument("--node-rank", type=int, default=0, help="this node, 0..nnodes-1")
    p.add_argument("--master-addr", help="node 0's host name or address (with --nnodes)")
    p.add_argument("--master-port", type=int, help="a free TCP port on node 0 (with --nnodes)")


def _add_plan_command(sub: Any) -> None:
    """``planner plan``: search a plan and write plan.json."""
    p = sub.add_parser("plan", help="find a parallelization plan and write plan.json")
    p.add_argument("--model", required=True,
                   help="zoo name (gpt-tiny, gpt3-175b, llama3-8b, ...) or path.py:factory")
    p.add_argument("--cluster", required=True,
                   help="preset[:count] (dgx-a100-80g:2, local-cpu:4) or cluster JSON path")
    p.add_argument("--mesh", help="logical mesh such as 4 or 2x2: one stage on exactly this "
                   "mesh (default: meshes and pipelines are searched)")
    p.add_argument("--pp", help="pipeline degrees to try, e.g. 2,4 (default: every divisor)")
    p.add_argument("--schedule", help="pipeline schedules to try, e.g. 1f1b,interleaved_1f1b "
                   "(default: gpipe, 1f1b, interleaved_1f1b, interleaved_zero_bubble, zbv, dualpipev)")
    p.add_argument("--microbatches", help="micro-batch counts to try, e.g. 4,8: of pipelines, "
                   "and of a single stage (--mesh, --no-pipeline or --pp 1), which accumulates "
                   "their gradients; default: micro-batches of 1, 4 and 16 sequences in "
                   "pipelines, 1, 2, 8 or 32 on one stage searched, 1 with --mesh or "
                   "--no-pipeline")
    p.add_argument("--zero", help="ZeRO stages to try, of pipeline stages and of a single stage "
                   "(--mesh, --no-pipeline or --pp 1) alike: 0 (none), 1 (optimizer states "
                   "sharded over the stage mesh's first axis), 2 (FSDP2 over it, no resharding "
                   "after forward), 3 (FSDP2); default 0,1,2,3 searched, 0 with --mesh or "
                   "--no-pipeline")
    p.add_argument("--context-parallel", "--cp", dest="context_parallel",
                   help="context-parallel sizes to try, e.g. 1,2,4 (powers of two dividing the "
                   "devices; 1 = without); default: cp > 1 for sequences of 32,768 tokens or "
                   "more, or when nothing fits without it")
    p.add_argument("--no-pipeline", action="store_true", help="plan a single stage only")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument("-o", "--output", default="plan.json", help="where to write the plan")
    p.add_argument("--batch-size", type=int, help="global batch size of the example step")
    p.add_argument("--seq-len", type=int, help="sequence length of the example step")
    p.add_argument("--time-limit", type=float, default=60.0, help="ILP time limit, seconds")
    _add_precision(p)
    p.add_argument("--recompute", choices=["auto", "all", "none"], default="auto",
                   help="activation checkpointing of single-stage plans (--mesh or "
                   "--no-pipeline): auto (only where it is the fastest plan that fits), all "
                   "layers, none")
    p.add_argument("--compile", action="store_true",
                   help="record that the plan's per-rank program runs through torch.compile "
                   "(inductor); `planner run`/`train` then compile it")
    p.set_defaults(func=cmd_plan)


def _add_plan_readers(sub: Any) -> None:
    """``planner show`` (print and plot a plan) and ``planner run`` (the training
    job on a plan, with --check): the commands that read a plan.json."""
    readers = {}
    for name, help_text, func in (
            ("show", "print a plan.json as tables", cmd_show),
            ("run", "run a plan's ranks (torch's elastic agent, as torchrun), on this "
                    "node or several", cmd_run)):
        readers[name] = sub.add_parser(name, help=help_text)
        readers[name].add_argument("plan")
        readers[name].set_defaults(func=func)
    readers["show"].add_argument(
        "--plot", metavar="DIR", help="also draw memory.png (bytes per device by kind) and, "
        "for a pipeline, schedule.png (one step's timeline per rank) and stages.png (each "
        "stage's time) into DIR")
    run = readers["run"]
    run.add_argument("--steps", type=int, default=2, help="training steps to run")
    run.add_argument("--check", action="store_true",
                     help="compare loss and gradients with a single-process run")
    _add_compile_choice(run)
    _add_nodes(run)


def _add_compile_choice(p: argparse.ArgumentParser) -> None:
    """``--compile``/``--eager``: run the plan's program compiled or eager
    (default: as the plan's ``training.compile`` says)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--compile", dest="compile", action="store_true", default=None,
                       help="run the per-rank program through torch.compile (inductor)")
    group.add_argument("--eager", dest="compile", action="store_false",
                       help="run it eager, whatever the plan records")


def _add_data_command(sub: Any) -> None:
    """``planner data``: text files to a token folder for ``planner train --data``."""
    d = sub.add_parser("data", help="tokenize text files into train.bin, val.bin and meta.json "
                       "(for planner train --data DIR)")
    d.add_argument("texts", nargs="+", metavar="TEXT_FILE", help="text files, joined in order")
    d.add_argument("-o", "--output", required=True,
                   help="the folder to write (new, empty, or an earlier planner data output)")
    d.add_argument("--tokenizer", metavar="HF_FOLDER", help="a local Hugging Face tokenizer "
                   "folder (never downloaded); default: bytes, a vocabulary of 256")
    d.add_argument("--val-fraction", type=float, default=0.1,
                   help="the fraction of the tokens (the last ones) in val.bin (default 0.1)")
    d.set_defaults(func=cmd_data)


def _add_train_command(sub: Any) -> None:
    """``planner train``: a training job."""
    t = sub.add_parser("train", help="train a model with a plan: data, LR schedule, "
                       "checkpoints, resume, export (on this node or several)")
    from training.config import add_train_arguments

    add_train_arguments(t)
    _add_compile_choice(t)
    t.add_argument("--max-restarts", type=int, default=0,
                   help="after a rank fails, restart all ranks this many times; they resume "
                   "from the newest finished checkpoint in --checkpoint-dir")
    _add_nodes(t)
    t.set_defaults(func=cmd_train)


def _add_compare_command(sub: Any) -> None:
    """``planner compare``: the automatic plan against Megatron's."""
    c = sub.add_parser("compare", help="automatic plan vs every Megatron configuration")
    c.add_argument("--model", required=True, help="zoo name or path.py:factory")
    c.add_argument("--cluster", required=True, help="preset[:count] or cluster JSON path")
    c.add_argument("--batch-size", type=int, help="global batch size of the example step")
    c.add_argument("--seq-len", type=int, help="sequence length of the example step")
    c.add_argument("--time-limit", type=float, default=60.0, help="ILP time limit, seconds")
    c.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4],
                   help="Megatron micro_batch_size values tried with a pipeline (default 1 2 4)")
    c.add_argument("--no-interleaved", dest="interleaved", action="store_false",
                   help="leave out the interleaved (virtual pipeline size 2) Megatron configs")
    c.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                   help="leave out the Megatron configs with --sequence-parallel (tried for "
                        "every tp > 1 by default)")
    c.add_argument("--no-pipeline", action="store_true",
                   help="Megatron configs without pipeline parallelism only (pp=1)")
    c.add_argument("--megatron-deadline", type=float, default=None,
                   help="seconds of Megatron planning; later configurations are skipped")
    c.add_argument("-o", "--output", default="compare",
                   help="output prefix: writes PREFIX.json and PREFIX.png")
    _add_precision(c)
    c.set_defaults(func=cmd_compare)


def _add_profile_command(sub: Any) -> None:
    """``planner profile``: measure this machine."""
    pr = sub.add_parser("profile", help="measure this machine (GEMMs, memory, collectives) into a cluster JSON")
    pr.add_argument("--ranks", type=int, default=4, help="local ranks to profile (default 4)")
    pr.add_argument("-o", "--output", default="local-cpu.json",
                    help="cluster JSON to write (default local-cpu.json; fits go next to it as *.profile.json)")
    pr.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (seconds, less accurate)")
    pr.set_defaults(func=cmd_profile)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="planner", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_plan_command, _add_plan_readers, _add_data_command, _add_train_command,
                _add_compare_command, _add_profile_command):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
