"""Finalists solved and profiles refined on two cores (planner.search.forked_workers, through
planner.search.phase_runner's ForkedExecutor) give what doing it in order
(SerialExecutor) gives, and failures in the forked child are reported, not
lost."""

from __future__ import annotations

import os
import time

import dataclasses

import pytest

from costmodel.presets import local_cpu_cluster
from models.source import build_model
from models.zoo import GPTConfig, build_from_config
from ir.trace import trace
from planner.search import microbatch_programs
from planner.search import pipeline_search as ps
from planner.search import context as search_context
from planner.search import search_caches
from planner.search.settings import SearchSettings
from planner.search import phases as search_phases
from planner.search.finalists import solve_exact, solve_finalists
from planner.search.forked_workers import ForkedTaskError, can_fork, run_beside, run_forked
from planner.search.phase_runner import ForkedExecutor, Phase, PhaseTask, SerialExecutor

needs_fork = pytest.mark.skipif(not can_fork(), reason="needs os.fork and two CPUs")


def _settings() -> SearchSettings:
    """The settings of these tests' searches: 8 CPU devices, 2 GB each."""
    return SearchSettings(local_cpu_cluster(8), dtype="float32", optimizer="adam", budget=2e9,
                          time_limit_s=10)


class _Unpicklable(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


@needs_fork
def test_tasks_run_in_both_processes_and_shared_objects_come_back_as_themselves():
    shared = [object(), {"big": list(range(10))}]

    def task(k):
        time.sleep(0.2)  # long enough for the child to take some
        return k, os.getpid(), shared[k % 2]

    tasks = [lambda k=k: task(k) for k in range(6)]
    results = run_forked(tasks, shared)
    assert [k for k, _, _ in results] == list(range(6))
    assert all(obj is shared[k % 2] for k, _, obj in results)  # not copies
    assert {pid for _, pid, _ in results} - {os.getpid()}  # the child ran some


@needs_fork
def test_beside_runs_one_task_in_a_child_while_this_process_runs_the_other():
    shared = [object()]
    changed = []

    def here():
        changed.append("here")
        return os.getpid()

    def there():
        changed.append("there")  # the child's copy: not seen here
        return os.getpid(), shared[0]

    def then(k):
        time.sleep(0.3 if k == 0 else 0.05)  # the child, free first, takes some
        return k, os.getpid()

    here_pid, (there_pid, obj), after, _ = run_beside(
        here, there, shared, then=[lambda k=k: then(k) for k in range(4)])
    assert here_pid == os.getpid() != there_pid and obj is shared[0]
    assert changed == ["here"]
    assert [k for k, _ in after] == list(range(4))  # in task order, whoever ran them
    assert {pid for _, pid in after} == {os.getpid(), there_pid}
    with pytest.raises(ForkedTaskError, match="bad"):  # the child's error reaches the caller
        run_beside(lambda: None, lambda: (_ for _ in ()).throw(ForkedTaskError("bad")))


@needs_fork
def test_later_tasks_run_where_what_here_made_exists():
    """Tasks that need what ``here`` made run in this process while the
    first child works on ``then``, and the rest, once it is done, in this
    process and a child forked after ``here``: none in the first child."""
    made = []

    def here():
        made.append("program")
        return os.getpid()

    def there():
        return os.getpid()

    def then(k):
        time.sleep(0.2)
        return os.getpid()

    def after(k):
        time.sleep(0.1)
        assert made == ["program"]  # in whichever process runs it
        return k, os.getpid()

    here_pid, there_pid, then_pids, after_done = run_beside(
        here, there, then=[lambda k=k: then(k) for k in range(2)],
        later=[lambda k=k: after(k) for k in range(12)])
    assert [k for k, _ in after_done] == list(range(12))  # in task order
    after_pids = {pid for _, pid in after_done}
    assert there_pid not in after_pids
    assert os.getpid() in after_pids and after_pids - {os.getpid()}  # a second child ran some
    with pytest.raises(ValueError, match="after 3"):  # an error there reaches the caller
        run_beside(lambda: None, lambda: None, later=[
            lambda k=k: (_ for _ in ()).throw(ValueError(f"after {k}")) if k == 3 else k
            for k in range(6)])


@needs_fork
def test_a_task_error_is_raised_here_even_when_it_does_not_pickle():
    def fail():
        raise _Unpicklable(1, 2)  # cannot be rebuilt from its args

    # whichever process runs the failing task, its error reaches the caller
    with pytest.raises((_Unpicklable, ForkedTaskError), match="1 and 2"):
        run_forked([lambda: 1, fail, lambda: 3, fail])


class _Made(PhaseTask):
    """A task of a phase: its number and the process that ran it, filed in
    ``filed`` with how it came back."""

    def __init__(self, k, filed, made=None):
        self.k, self.filed, self.made = k, filed, made

    def run(self):
        time.sleep(0.1)
        if self.made is not None:  # a task after ``make``: in whichever process runs it
            assert self.made == ["program"]
        return self.k, os.getpid()

    def sent_back(self, result):
        return (*result, "sent")

    def file(self, result):
        self.filed.append(result)


def _phase_filed(executor):
    """What ``executor`` files of a phase of every part, in filing order."""
    made, filed = [], []
    phase = Phase([_Made(k, filed) for k in range(1, 3)], make=lambda: made.append("program"),
                  there=_Made(0, filed), after=[_Made(k, filed, made) for k in range(3, 11)])
    executor.run(phase, (), lambda: None)
    assert made == ["program"]
    return filed


@needs_fork
def test_the_forked_executor_files_what_the_serial_one_files_in_task_order():
    """Both executors file every task's result in task order (``there``,
    ``tasks``, ``after``); the forked one files what its child ran as that
    child sent it back (PhaseTask.sent_back), the rest as run here."""
    serial = _phase_filed(SerialExecutor())
    assert serial == [(k, os.getpid()) for k in range(11)]
    forked = _phase_filed(ForkedExecutor())
    assert [r[0] for r in forked] == list(range(11))
    assert forked[0][1] != os.getpid() and forked[0][2:] == ("sent",)  # ``there``: the child
    for r in forked:
        assert (r[1] == os.getpid()) == (len(r) == 2)  # sent back exactly where a child ran it
    assert any(len(r) == 3 for r in forked[3:])  # a second child took some of ``after``


def _gpt8_contexts():
    """A maker of fresh SearchContexts of the 8-block test GPT on 8 CPU ranks
    that share one programs dict (each micro-batch size is traced once);
    ``serial``: its phases run here, in task order."""
    model, inputs = build_model("tests/pipeline_model.py:gpt8", device="meta")
    programs: dict = {}

    def context(serial: bool = False) -> search_context.SearchContext:
        return search_context.SearchContext(model, inputs, _settings(), min_layers=2,
                                programs=programs,
                                executor=SerialExecutor() if serial else None)
    return context


@needs_fork
def test_finalists_solved_on_two_cores_equal_solving_them_in_order():
    """Three finalists on several meshes (chains of stages for both
    processes): every step time, stage memory and choice equals what
    solve_exact gives in this process, one finalist after another."""
    context = _gpt8_contexts()
    ctx = context()
    ranked = ps.search(ctx, ps.SearchOptions(pp=[2, 4], schedules=["1f1b"],
                                             num_microbatches=[4]))
    finalists = [c for c in ranked if c.pp > 1][:3]
    assert len({c.mesh.shape for c in finalists}) >= 2
    both = solve_finalists(ctx, finalists)
    alone = context()
    for cand, got in zip(finalists, both):
        want = solve_exact(alone, cand)
        assert got.step_time_s == want.step_time_s
        assert got.program is ctx.program(cand.num_microbatches)
        for r, w in zip(got.results, want.results):
            assert r.solution.objective_s == w.solution.objective_s
            assert r.memory == w.memory and r.checkpointed == w.checkpointed
            assert {k: (s.inputs, s.outputs) for k, s in r.chosen.items()} == {
                k: (s.inputs, s.outputs) for k, s in w.chosen.items()}


@needs_fork
def test_refined_profiles_on_two_cores_equal_refining_in_order():
    """refine() makes the profiles of its (mesh, micro-batches) pairs in this
    process and a forked one: the ranking, every profile and the order of the
    mesh families' references equal making them here one pair after another."""
    context = _gpt8_contexts()

    def refined(forked: bool):
        ctx = context(serial=not forked)
        ranked = ps.refine(ctx, ps.search(ctx, ps.SearchOptions(
            pp=[2, 4], schedules=["1f1b", "gpipe"], num_microbatches=[4])))
        return ctx, ranked

    ctx, ranked = refined(forked=True)
    alone, want = refined(forked=False)
    assert len({(c.mesh.shape, c.num_microbatches) for c in ranked[:ps.REFINE_CANDIDATES]}) >= 2
    assert [(c.label(), c.step_time_s, c.split.bounds) for c in ranked] == \
        [(c.label(), c.step_time_s, c.split.bounds) for c in want]
    profile = lambda p: (p.points, p.weights, p.exhausted, p.mesh)  # noqa: E731
    assert {k: profile(p) for k, p in ctx.caches.profiles.items()} == \
        {k: profile(p) for k, p in alone.caches.profiles.items()}
    assert {k: [profile(p) for p in refs] for k, refs in ctx.caches.references.items()} == \
        {k: [profile(p) for p in refs] for k, refs in alone.caches.references.items()}
    assert ctx.ilp_solves == alone.ilp_solves


@needs_fork
def test_search_on_two_cores_equals_searching_in_order():
    """search() and zero_variants() price one mesh family per task in this
    process and a forked one (and the single stages in the child while this
    process captures the micro-batch programs): every candidate, profile and
    reference equals pricing every configuration here in order, and the
    profiles the child made are filed here (the exact solves and refine()
    read them)."""
    model, inputs = build_model("tests/pipeline_model.py:gpt8", device="meta")
    whole_batch = trace(model, inputs)

    def searched(forked: bool):
        ctx = search_context.SearchContext(model, inputs, _settings(), min_layers=2,
                               whole_batch_graph=whole_batch,
                               executor=None if forked else SerialExecutor())
        beside = ctx.will_capture(4)
        # 8 micro-batches: size 1, which torch captures as another program
        opts = ps.SearchOptions(pp=[1, 2, 4], schedules=["1f1b", "gpipe"],
                                num_microbatches=[4, 8])
        ranked = ps.search(ctx, opts)
        # the best pipeline of each mesh family: ZeRO-3 variants for both processes
        leaders = list({c.mesh.family: c for c in reversed(ranked) if c.pp > 1}.values())
        variants, = ps.zero_variants(ctx, [leaders], opts)
        return ctx, ranked, variants, beside

    ctx, ranked, variants, beside = searched(forked=True)
    alone, want, want_variants, _ = searched(forked=False)
    assert beside  # the single stages were priced while capturing
    assert len({c.mesh.family for c in ranked}) >= 3  # tasks for both processes
    assert len({c.mesh.family for c in variants}) >= 2
    key = lambda c: (c.label(), c.step_time_s, c.split.bounds, c.split.levels)  # noqa: E731
    assert [key(c) for c in ranked] == [key(c) for c in want]
    assert [key(c) for c in variants] == [key(c) for c in want_variants]
    profile = lambda p: (p.points, p.weights, p.exhausted, p.mesh, p.origin)  # noqa: E731
    assert {k: profile(p) for k, p in ctx.caches.profiles.items()} == \
        {k: profile(p) for k, p in alone.caches.profiles.items()}
    assert {k: [profile(p) for p in refs] for k, refs in ctx.caches.references.items()} == \
        {k: [profile(p) for p in refs] for k, refs in alone.caches.references.items()}
    # a reference is the profile filed under its own key, not a copy of it
    for refs in ctx.caches.references.values():
        for ref in refs:
            mb, layer = ref.origin
            prog = ctx.program(ctx.global_batch // mb)
            assert ctx.caches.profiles[search_caches.profile_key(prog, layer, ref.mesh)] is ref
    assert ctx.ilp_solves == alone.ilp_solves


@needs_fork
def test_zero_variants_write_out_a_missing_program_once_here(monkeypatch, tmp_path):
    """ZeRO-3 variants at a micro-batch size whose program the search did not
    make: it is written out once, by this process, before either process
    prices the variants that need it, and the prices equal pricing in order."""
    model, inputs = build_from_config(GPTConfig(8, 64, 4, vocab_size=128, block_size=32),
                                      batch_size=16, seq_len=16)
    whole_batch = trace(model, inputs)
    writers = tmp_path / "writers"
    real_rescaled_trace = microbatch_programs.rescaled_trace

    def rescaled_trace(*args, **kwargs):
        with open(writers, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        return real_rescaled_trace(*args, **kwargs)

    def variants(forked: bool):
        monkeypatch.setattr(microbatch_programs, "rescaled_trace", rescaled_trace)
        said: list[str] = []
        ctx = search_context.SearchContext(model, inputs, _settings(), min_layers=2,
                               whole_batch_graph=whole_batch, progress=said.append)
        opts = ps.SearchOptions(pp=[2], schedules=["1f1b"], num_microbatches=[2, 4])
        ranked = ps.search(ctx, opts)  # captures 8 and 4 sequences: the rule is confirmed
        assert not ctx.has_traced(8)
        best = list({c.mesh.family: c for c in reversed(ranked)
                     if c.mesh.shape[0] > 1 and c.num_microbatches == 2}.values())
        # the same pipelines with micro-batches of 2 sequences: no program yet
        leaders = best + [dataclasses.replace(c, num_microbatches=8) for c in best]
        writers.write_text("")
        if not forked:
            ctx.executor = SerialExecutor()
        out, = ps.zero_variants(ctx, [leaders], opts)
        monkeypatch.undo()
        return out, said, writers.read_text().split()

    got, said, wrote = variants(forked=True)
    want, _, _ = variants(forked=False)
    assert wrote == [str(os.getpid())]  # once, here
    assert said.count("writing out micro-batch 2") == 1
    assert {c.num_microbatches for c in got} == {2, 8}
    key = lambda c: (c.label(), c.step_time_s, c.split.bounds, c.split.levels)  # noqa: E731
    assert [key(c) for c in got] == [key(c) for c in want]


def test_a_profile_sent_back_without_its_problem_is_extended_like_one_made_here():
    """A profile from the forked process has no priced problem: extending it
    prices its own layer at its own micro-batch size again, and gives the
    points a profile made here gives."""
    context = _gpt8_contexts()
    def own(ctx, levels):
        prog = ctx.program(4, traced=True)
        mesh = ps.stage_mesh_options(ctx.settings.cluster, 2)[-1]
        for layer in range(len(prog.layers)):
            ctx.profile(prog, layer, mesh)
        return prog, ctx.own_profiles(prog, mesh, levels)

    ctx = context()
    prog, made = own(ctx, levels=1)
    for layer, prof in made:
        ctx.file_own_profile(prog, layer, dataclasses.replace(prof, prepared=None))
    _, want = own(context(), levels=3)
    for (layer, prof), (_, w) in zip(made, want):
        sent = ctx.caches.profiles[(prog.signatures[layer], prof.mesh.shape, 8)]
        assert sent.prepared is None and sent.origin == (8, layer)
        ctx._extend(sent, 3)
        assert (sent.points, sent.weights, sent.exhausted) == (w.points, w.weights, w.exhausted)


@needs_fork
def test_schedule_orders_made_on_two_cores_are_filed_here():
    """The schedule shapes a search lacks, made as tasks on both cores (as
    price_all runs them while capturing), come back equal to what torch
    gives here and, filed, are held here; a shape torch rejects gives None,
    not an error."""
    from costmodel import schedules
    from costmodel.schedules.torch_orders import orders_from_torch

    shapes = [("1f1b", 3, 7, 1), ("interleaved_1f1b", 3, 9, 2), ("zbv", 3, 11, 2),
              ("gpipe", 5, 13, 1), ("interleaved_zero_bubble", 3, 15, 2)]
    rejected = ("dualpipev", 3, 5, 2)  # torch: DualPipeV needs m >= 2 pp
    configs = [(pp, v, None, s, m) for s, pp, m, v in [*shapes, rejected]]
    book = schedules.ScheduleBook()
    missing = search_phases.missing_schedule_shapes(configs, book)
    assert sorted(missing) == sorted([*shapes, rejected])
    tasks = [search_phases._ScheduleOrders(shape, book) for shape in missing]
    assert tasks[missing.index(rejected)].run() is None
    ForkedExecutor().run(Phase(tasks), (), lambda: None)
    for shape in shapes:
        assert book.holds(*shape)
        assert schedules.torch_orders(*shape, book=book) == orders_from_torch(*shape)
    assert not book.holds(*rejected)
    assert search_phases.missing_schedule_shapes(configs, book) == [rejected]


@needs_fork
def test_objects_are_out_of_the_collectors_sight_while_the_child_runs():
    """Long-lived objects are frozen (gc.freeze) across a forked phase, in
    both processes, and handed back after it; a freeze made by someone else
    before is left in place."""
    import gc

    assert gc.get_freeze_count() == 0
    seen = run_forked([gc.get_freeze_count, gc.get_freeze_count])
    assert all(count > 0 for count in seen)
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        run_forked([gc.get_freeze_count, gc.get_freeze_count])
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_a_forked_process_sends_back_the_strategies_its_parent_lacks():
    """SearchCaches.scope in a forked process carries the strategies and expansions
    made since the fork, once each; merged, the parent holds what the
    child holds."""
    context = _gpt8_contexts()
    parent, child = context(), context()
    prog = parent.program(4, traced=True)
    small = ps.stage_mesh_options(parent.settings.cluster, 4)[-1]
    big = ps.stage_mesh_options(parent.settings.cluster, 1)[-1]
    parent.profile(prog, 0, small)
    # the child starts as a copy of the parent (what a fork gives)
    for name in ("strategies", "expansions"):
        setattr(child.caches, name, {k: dict(v) if isinstance(v, dict) else v
                                     for k, v in getattr(parent.caches, name).items()})
    child._in_forked_child()
    child.profile(prog, 0, small)  # nothing new: all of it inherited
    child.profile(prog, 0, big)
    scopes = {search_caches.pricing_scope(m.key, prog.microbatch_size, parent.global_batch)
              for m in (small, big)}
    sent = child.caches.scope(scopes, child.global_batch)
    assert sent["strategies"].get(small.shape, {}) == {}
    assert sent["strategies"][big.shape] == child.caches.strategies[big.shape]
    assert sent["expansions"].keys() == \
        child.caches.expansions.keys() - parent.caches.expansions.keys()
    assert sent["expansions"]
    parent.caches.merge(sent)
    assert parent.caches.strategies.keys() == child.caches.strategies.keys()
    assert parent.caches.strategies[big.shape] == child.caches.strategies[big.shape]
    assert parent.caches.expansions.keys() == child.caches.expansions.keys()
    again = child.caches.scope(scopes, child.global_batch)
    assert not again["expansions"] and not any(again["strategies"].values())
