"""The `planner` command: summaries, files, and one-line errors with exit code 2."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from app.cli import main


def test_plan_writes_json_and_prints_summary(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:2", "--mesh", "2",
                 "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "predicted step" in text and "transformer.h.*.mlp.c_fc.weight" in text
    assert json.loads(out.read_text())["mesh"]["shape"] == [2]
    # its reader gone (``planner show plan.json | head``): no error, the status of SIGPIPE
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "show", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    assert proc.wait(timeout=120) == 141 and proc.stderr.read() == ""


def test_plan_with_pipeline_options_writes_a_pipeline_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:4", "--pp", "2",
                 "--schedule", "1f1b", "--microbatches", "2", "--zero", "3", "--quiet",
                 "-o", str(out)]) == 0
    assert "pipeline: 1f1b, pp=2" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["pipeline"]["schedule"] == "1f1b" and data["mesh"]["shape"][0] == 2
    assert {st["zero_stage"] for st in data["pipeline"]["stages"]} == {3}
    assert main(["show", str(out)]) == 0
    assert "transformer.h.1" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["plan", "--model", "no-such-model", "--cluster", "local-cpu:4"], "unknown model"),
    (["plan", "--model", "gpt-tiny", "--cluster", "no-such-preset:2"], "unknown cluster preset"),
    (["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:4", "--mesh", "3"], "has 4"),
    (["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:4", "--mesh", "2by2"], "2x2"),
    (["show", "missing-plan.json"], "no plan file"),
    (["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:4", "--schedule", "zigzag"],
     "unknown pipeline schedule"),
    (["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:4", "--pp", "two"], "--pp"),
    (["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:4", "--zero", "4"],
     "ZeRO stages must be 0"),
])
def test_user_errors_are_one_line_and_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.startswith("planner: error:")


def test_fp16_plans_are_priced_on_a_v100_but_not_run(tmp_path, capsys):
    """A V100 has no bf16 units: its default precision is fp16-mixed, which the
    runtime refuses in one line (fp16 training needs loss scaling)."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "p3.16xlarge:1", "--mesh", "8",
                 "--quiet", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["training"]["precision"] == "fp16-mixed"
    capsys.readouterr()
    assert main(["run", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "loss scaling" in err and len(err.splitlines()) == 1


def test_wrong_plan_version_exit_2(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format_version": 0}))
    assert main(["run", str(path)]) == 2
    assert "format_version 0" in capsys.readouterr().err


def test_user_model_file_factory(tmp_path, capsys):
    model_file = tmp_path / "my_model.py"
    model_file.write_text(textwrap.dedent('''
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.up = nn.Linear(16, 64)
                self.down = nn.Linear(64, 4)

            def forward(self, x, y):
                return nn.functional.mse_loss(self.down(torch.relu(self.up(x))), y)

        def make():
            return Net(), (torch.randn(32, 16), torch.randn(32, 4))
    '''))
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", f"{model_file}:make", "--cluster", "local-cpu:2",
                 "-o", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["model"]["source"] == f"{model_file}:make"
    assert set(d["parameters"]) == {"up.weight", "up.bias", "down.weight", "down.bias"}


def test_console_command_is_installed():
    proc = subprocess.run([sys.executable, "-m", "app.cli", "--help"], capture_output=True,
                          text=True)
    assert proc.returncode == 0 and "plan" in proc.stdout


@pytest.mark.multiprocess
def test_run_check_prints_the_verdict(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:2", "--mesh", "2",
                 "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["run", str(out), "--check", "--steps", "1"]) == 0
    text = capsys.readouterr().out
    assert "check PASSED" in text and "loss" in text


@pytest.mark.parametrize("argv, message", [
    (["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:2", "--batch-size", "0"],
     "--batch-size must be a positive integer"),
    (["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:2", "--seq-len", "-5"],
     "--seq-len must be a positive integer"),
    (["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:2", "--seq-len", "4096"],
     "sequence length must be in 1..32"),
    (["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:2", "-o", "a-file/plan.json"],
     "cannot write a-file/plan.json"),
    (["compare", "--model", "gpt-tiny", "--cluster", "local-cpu:2", "-o", "a-file/cmp"],
     "cannot write a-file/cmp"),
    (["plan", "--model", "my_model.py", "--cluster", "local-cpu:2"], "my_model.py:make_model"),
])
def test_bad_step_sizes_and_paths_are_refused_before_planning(argv, message, capsys, tmp_path,
                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")  # a file where a folder is asked for
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_plan_output_folder_is_made(tmp_path, capsys):
    out = tmp_path / "new" / "plan.json"
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:2", "--mesh", "2",
                 "--quiet", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["mesh"]["shape"] == [2]


def test_step_sizes_reach_a_factory_that_takes_them_and_are_refused_by_one_that_does_not(
        tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 8)

            def forward(self, x):
                return self.fc(x).pow(2).mean()

        def sized(batch_size=4):
            return Net(), (torch.randn(batch_size, 8),)

        def fixed():
            return Net(), (torch.randn(4, 8),)
    """))
    assert main(["plan", "--model", "models.py:sized", "--cluster", "local-cpu:2", "--mesh", "2",
                 "--batch-size", "6", "--quiet", "-o", "p.json"]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["training"]["input_shapes"] == [[6, 8]]
    capsys.readouterr()
    assert main(["plan", "--model", "models.py:fixed", "--cluster", "local-cpu:2",
                 "--batch-size", "6", "-o", "q.json"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--batch-size would be ignored" in err and len(err.splitlines()) == 1


def test_an_empty_example_batch_is_refused_before_tracing():
    import torch
    from torch import nn

    from planner.api import PlanningError, plan

    with pytest.raises(PlanningError, match="empty dimension"):
        plan(nn.Linear(8, 8), "local-cpu:2", example_inputs=(torch.empty(0, 8),))


def test_a_model_that_returns_no_scalar_loss_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logits.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def make():
            return nn.Linear(8, 8), (torch.randn(4, 8),)
    """))
    assert main(["plan", "--model", "logits.py:make", "--cluster", "local-cpu:2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not the scalar training loss" in err and len(err.splitlines()) == 1


def test_run_and_show_refuse_unreadable_placements(tmp_path, capsys):
    """`planner run` (before torchrun starts) and `planner show` read every
    placement: the plans the planner writes pass, a hand-edited "X" or a
    missing axis is one line, exit 2."""
    from plan.format import load_plan, placement_error

    single, pipe = tmp_path / "single.json", tmp_path / "pipe.json"
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:4", "--mesh", "2x2",
                 "--quiet", "-o", str(single)]) == 0
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:4", "--pp", "2",
                 "--schedule", "1f1b", "--microbatches", "2", "--zero", "3", "--quiet",
                 "-o", str(pipe)]) == 0
    assert placement_error(load_plan(single)) is None
    assert placement_error(load_plan(pipe)) is None
    data = json.loads(single.read_text())
    name = next(iter(data["parameters"]))
    for bad, message in ((["X", "R"], "has placement 'X'"), (["R"], "has 1 placements")):
        data["parameters"][name] = bad
        single.write_text(json.dumps(data))
        capsys.readouterr()
        for command in ("run", "show"):
            assert main([command, str(single)]) == 2
            err = capsys.readouterr().err.strip()
            assert message in err and len(err.splitlines()) == 1


@pytest.mark.multiprocess
def test_run_refuses_a_shard_dim_the_tensor_lacks_and_a_deleted_node(tmp_path, capsys):
    """Hand edits the placement grammar accepts but the program does not: S(99)
    of a 2-D weight, and an op deleted from `nodes` (which used to pass --check,
    running that op as DTensor chose). One line each, exit 2."""
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:2", "--mesh", "2",
                 "--quiet", "-o", str(plan)]) == 0
    good = json.loads(plan.read_text())
    weight = next(iter(good["parameters"]))
    gemm = next(k for k, v in good["nodes"].items() if v["op"] == "aten.addmm.default")
    sharded = json.loads(plan.read_text())
    sharded["parameters"][weight] = ["S(99)"]
    deleted = json.loads(plan.read_text())
    del deleted["nodes"][gemm]
    for data, message in ((sharded, f"parameter {weight} has placement S(99) but is a tensor "
                                    f"of 2 dimension(s)"),
                          (deleted, f"leave out node {gemm}")):
        plan.write_text(json.dumps(data))
        capsys.readouterr()
        assert main(["run", str(plan), "--steps", "1", "--check"]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1


def test_show_plot_draws_memory_and_the_schedule_of_an_interleaved_pipeline(tmp_path, capsys):
    """`planner show PLAN --plot DIR` of a pp=4 interleaved plan writes memory.png
    (a bar per pipeline rank), schedule.png (one step's timeline) and stages.png
    (each stage's time)."""
    from models.zoo import GPTConfig, build_from_config
    from planner.api import pipeline_plan

    model, inputs = build_from_config(GPTConfig(8, 64, 4, vocab_size=256, block_size=32),
                                      batch_size=8, device="meta")
    p = pipeline_plan(model, "local-cpu:4", example_inputs=inputs, pp=4, stage_mesh=(1,),
                      schedule="interleaved_1f1b", num_microbatches=4)
    path = tmp_path / "pp4.json"
    p.save(str(path))
    assert main(["show", str(path), "--plot", str(tmp_path / "pics")]) == 0
    out = capsys.readouterr().out
    for name in ("memory.png", "schedule.png", "stages.png"):
        picture = tmp_path / "pics" / name
        assert f"wrote {picture}" in out
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000


def _free_port() -> int:
    """A free TCP port below Linux's ephemeral range (32768-60999), so no
    port-0 bind or outgoing connection of a test running beside this one can
    take it between this check and torchrun's bind."""
    import random
    import socket

    for port in random.Random(os.getpid()).sample(range(20000, 32000), 200):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port in 20000-31999")


@pytest.mark.multiprocess
def test_a_plan_runs_over_two_loopback_nodes_and_passes_check(tmp_path):
    """`planner run --nnodes 2` on two "nodes" of this machine (two torchrun
    agents meeting at 127.0.0.1): the 2x2 plan's four ranks, two per node, pass
    --check; node 0 prints the verdict, node 1 that its ranks finished."""
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:4", "--mesh", "2x2",
                 "--quiet", "-o", str(plan)]) == 0
    port = str(_free_port())
    procs = [subprocess.Popen(
        [sys.executable, "-m", "app.cli", "run", str(plan), "--check", "--steps", "1",
         "--nnodes", "2", "--node-rank", str(r), "--master-addr", "127.0.0.1",
         "--master-port", port], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
        pytest.fail("two-node run hung; its output:\n" + "\n---\n".join(
            p.communicate()[0] for p in procs))
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "check PASSED" in outs[0]
    assert "node 1: its ranks finished" in outs[1]


@pytest.mark.parametrize("extra, message", [
    (["--nnodes", "3", "--master-addr", "h", "--master-port", "29500"],
     "4 ranks, which 3 nodes cannot share evenly"),
    (["--nnodes", "2"], "needs --master-addr"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--master-port", "29500"],
     "--node-rank must be in 0..1"),
    (["--node-rank", "1"], "go with --nnodes N"),
])
def test_bad_node_options_are_one_line_errors(extra, message, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:4", "--mesh", "4",
                 "--quiet", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["run", str(plan), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_warnings_while_planning_are_summarised_one_line_per_kind():
    """Issue 28: hundreds of ReplicateFallbackWarning lines per plan. They come
    out one line per op type, with its node count; other warnings once."""
    import warnings

    from app.cli import warning_summary
    from planner.ilp.strategies import ReplicateFallbackWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in ("squeeze", "squeeze_1", "squeeze_2"):
            warnings.warn(f"aten.squeeze.dims ({name}, module '') has no usable DTensor "
                          f"sharding strategy (x); planning it replicated", ReplicateFallbackWarning)
        warnings.warn("aten.foo.default (foo, module 'm') has no usable DTensor sharding "
                      "strategy (y); planning it replicated", ReplicateFallbackWarning)
        for _ in range(5):
            warnings.warn("something else", UserWarning)
    assert warning_summary(caught) == [
        "aten.foo.default has no usable DTensor sharding strategy: its 1 node(s) are planned "
        "replicated",
        "aten.squeeze.dims has no usable DTensor sharding strategy: its 3 node(s) are planned "
        "replicated",
        "UserWarning: something else"]


def test_the_summary_states_the_step_and_a_plan_without_parallelism(tmp_path):
    """The summary names the step planned, and says so when nothing is split
    over the devices (every parameter and input whole everywhere)."""
    from models import zoo
    from planner.api import plan
    from plan.format import load_plan
    from planner.report import format_plan

    model, inputs = zoo.build("gpt-tiny", device="meta", batch_size=8)
    p = plan(model, "local-cpu:2", example_inputs=inputs, mesh_shape=(2,))
    text = format_plan(p)
    assert "planned step: batch 8 x seq 32, fp32, adam" in text
    assert "no parallelism" not in text  # the batch is split
    path = tmp_path / "plan.json"
    p.save(str(path))
    data = json.loads(path.read_text())
    for section in ("parameters", "inputs"):
        data[section] = {k: ["R"] for k in data[section]}
    path.write_text(json.dumps(data))
    assert "no parallelism: every device holds every tensor whole" in format_plan(load_plan(path))


def test_warnings_of_a_forked_search_worker_are_printed_not_lost(capfd):
    """The search forks workers; what they warn cannot reach the parent's
    summary, so they print it (once), while the parent gathers its own."""
    import warnings

    from app.cli import _gathered_warnings

    with _gathered_warnings() as caught:
        warnings.warn("in the parent", UserWarning)
        pid = os.fork()
        if pid == 0:  # the worker
            for _ in range(3):
                warnings.warn("in the worker", UserWarning)
            os._exit(0)
        os.waitpid(pid, 0)
    assert [str(w.message) for w in caught] == ["in the parent"]
    err = capfd.readouterr().err
    assert err.count("UserWarning: in the worker") == 1 and "in the parent" not in err


def test_a_factory_whose_inputs_the_model_cannot_take_is_one_line(tmp_path, capfd):
    """Inputs of the wrong shape used to print hundreds of lines of torch's
    logs and advice about control flow; now one line names the inputs and the
    model's own error."""
    (tmp_path / "bad_inputs.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def make():
            model = nn.Sequential(nn.Linear(16, 8), nn.Flatten(0))
            return model, (torch.randn(4, 15),)
    """))
    out = subprocess.run([sys.executable, "-m", "app.cli", "plan", "--model",
                          "bad_inputs.py:make", "--cluster", "local-cpu:2", "--quiet",
                          "-o", "plan.json"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2
    err = out.stderr.strip().splitlines()
    assert len(err) == 1, out.stderr
    assert "Sequential's forward fails on the example inputs ([4, 15] float32)" in err[0]
    assert "control flow" not in err[0]


def test_a_pipeline_asked_for_but_impossible_is_refused_with_the_reason(tmp_path, capsys):
    """``--pp 4 --schedule interleaved_1f1b`` of gpt-tiny (4 pipeline layers, 8
    stages wanted) is refused in one line, not answered with a single stage."""
    out = tmp_path / "p.json"
    code = main(["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:4", "--pp", "4",
                 "--schedule", "interleaved_1f1b", "-o", str(out), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not out.exists()
    assert len(err) == 1 and "4 pipeline layer(s)" in err[0] and "8 stages" in err[0], err
