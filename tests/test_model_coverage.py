"""Models beyond decoder-only LMs (issue 41): the check's error scale, BERT's
zero key-bias gradient, BatchNorm's running statistics, and forwards the capture
cannot take. The models are in tests/coverage_models.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from training.reference import check_tolerance, gradient_errors
from ir.exported_graph import graph_from_exported
from ir.program_capture import capture, capture_in_one_pass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODELS = os.path.join(HERE, "coverage_models.py")
FP32_TOL = check_tolerance("fp32")


def _reference_grads() -> dict[str, torch.Tensor | None]:
    torch.manual_seed(0)
    return {"w": torch.randn(64, 64), "b": torch.randn(64) * 1e-2,
            "key_bias": torch.zeros(64), "frozen": None}


def test_a_zero_gradient_with_rounding_noise_passes():
    ref = _reference_grads()
    got = {k: (v.clone() if v is not None else None) for k, v in ref.items()}
    got["key_bias"] = torch.randn(64) * 1e-7  # both sides' rounding noise
    ref["key_bias"] = torch.randn(64) * 1e-7
    errors, missing = gradient_errors(got, ref)
    assert missing == [] and set(errors) == {"w", "b", "key_bias"}
    assert errors["key_bias"] < FP32_TOL
    assert errors["w"] == errors["b"] == 0.0


def test_one_entry_off_by_1e_3_of_the_largest_fails():
    ref = _reference_grads()
    largest = max(float(g.abs().max()) for g in ref.values() if g is not None)
    for name in ("w", "b", "key_bias"):
        got = {k: (v.clone() if v is not None else None) for k, v in ref.items()}
        got[name].view(-1)[3] += 1e-3 * largest
        errors, _ = gradient_errors(got, ref)
        worst = max(errors, key=errors.get)
        assert worst == name and errors[name] == pytest.approx(1e-3, rel=1e-3)
        assert errors[name] > FP32_TOL


def test_a_gradient_on_one_side_only_or_of_another_shape_is_reported():
    ref = _reference_grads()
    got = {k: (v.clone() if v is not None else None) for k, v in ref.items()}
    got["frozen"] = torch.zeros(3)
    got["b"] = None
    got["w"] = torch.zeros(64, 32)
    errors, missing = gradient_errors(got, ref)
    assert sorted(missing) == ["b", "frozen"] and errors["w"] == float("inf")


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=timeout)


@pytest.mark.multiprocess
def test_bert_with_a_zero_key_bias_gradient_plans_runs_and_checks(tmp_path):
    pytest.importorskip("transformers")
    plan_path = str(tmp_path / "bert.json")
    planned = _cli("plan", "--model", f"{MODELS}:bert_mlm", "--cluster", "local-cpu:2",
                   "--batch-size", "8", "--seq-len", "32", "--quiet", "-o", plan_path)
    assert planned.returncode == 0, planned.stderr
    run = _cli("run", plan_path, "--check")
    assert run.returncode == 0 and "check PASSED" in run.stdout, run.stdout + run.stderr


def _on_meta(factory: str):
    """``coverage_models.<factory>()``'s model (in training mode) and inputs, on meta."""
    sys.path.insert(0, HERE)
    try:
        import coverage_models
    finally:
        sys.path.remove(HERE)
    with torch.device("meta"):
        model, inputs = getattr(coverage_models, factory)()
    return model.train(), inputs


@pytest.mark.parametrize("capturer", [capture, capture_in_one_pass])
def test_batchnorm_statistics_are_buffer_updates_and_the_loss_the_only_output(capturer):
    model, inputs = _on_meta("bn_cnn")
    graph = graph_from_exported(capturer(model, inputs))
    assert len(graph.output_names) == 1 and graph[graph.output_names[0]].outputs[0].numel == 1
    assert sorted(graph.buffer_updates.values()) == sorted(
        f"bn{i}.{b}" for i in (1, 2) for b in ("num_batches_tracked", "running_mean",
                                                "running_var"))


def test_a_buffer_off_after_the_steps_fails_the_check():
    from training.run_check import _add_check_fields

    class Ref:
        losses, loss = [1.0], 1.0

    result = {"losses": [1.0], "observed_match": True}
    assert _add_check_fields(dict(result), Ref, {"w": 0.0}, [], {"bn1.running_mean": 0.0}, 1e-5)
    checked = dict(result)
    assert not _add_check_fields(checked, Ref, {"w": 0.0}, [], {"bn1.running_mean": 1.0}, 1e-5)
    assert checked["worst_buffer"] == "bn1.running_mean"


def test_a_pipeline_of_a_batchnorm_model_is_refused_in_one_line(tmp_path):
    proc = _cli("plan", "--model", f"{MODELS}:bn_cnn", "--cluster", "local-cpu:2", "--pp", "2",
                "--quiet", "-o", str(tmp_path / "pp.json"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "forward updates buffers" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.multiprocess
def test_a_batchnorm_cnn_plans_runs_and_checks_with_its_running_statistics(tmp_path):
    """BatchNorm in training mode: DTensor shards it over channels only, so its
    statistics are the global batch's (SyncBatchNorm's) on any mesh, and the
    running statistics after two steps match one process's."""
    plan_path = str(tmp_path / "bn.json")
    planned = _cli("plan", "--model", f"{MODELS}:bn_cnn", "--cluster", "local-cpu:2",
                   "--batch-size", "64", "--quiet", "-o", plan_path)
    assert planned.returncode == 0, planned.stderr
    assert "single-stage plans on the whole batch only" in planned.stderr
    run = _cli("run", plan_path, "--check")
    assert run.returncode == 0 and "check PASSED" in run.stdout, run.stdout + run.stderr
    assert "buffers forward updates: max rel err" in run.stdout and "over 6" in run.stdout


@pytest.mark.parametrize("factory, words, code", [
    ("branch_on_value", "branches on a tensor's value", "`if h.mean() > 0:`"),
    ("item_in_forward", "reads a tensor's value as a Python number (.item())",
     "`scale = h.abs().max().item()`"),
])
@pytest.mark.parametrize("cluster", ["local-cpu:2", "dgx-a100-80g:1"])  # fake CPU, meta
def test_a_forward_that_reads_a_tensors_value_is_one_line_naming_it_and_its_line(
        tmp_path, factory, words, code, cluster):
    proc = _cli("plan", "--model", f"{MODELS}:{factory}", "--cluster", cluster, "--quiet",
                "-o", str(tmp_path / "p.json"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and proc.stdout == "", proc.stderr
    line = lines[0]
    assert line.startswith("planner: error: ") and words in line and code in line
    assert "coverage_models.py:" in line and "Traceback" not in line
    assert "torch.cond" in line or "out of forward" in line
    if "torch's output: " in line:  # torch's program dumps went to the log, not the terminal
        log = line.rsplit("torch's output: ", 1)[1].rstrip(")")
        assert os.path.isfile(log)


RANK_CRASH = """[rank 1] error: in the forward of step 1: RuntimeError: Connection closed by peer [127.0.0.1]:5
[rank 0] error: in the backward of step 1, at ViewBackward0: RuntimeError: view size is not compatible with input tensor's size and stride
Traceback (most recent call last):
  File "/work/main/codegen/rank_main.py", line 525, in main
"""


def test_the_ranks_failure_is_one_line_with_the_cause_what_to_do_and_the_log():
    from training.torchrun import first_error_line, rank_failure_line

    assert first_error_line(RANK_CRASH).startswith("in the backward of step 1, at ViewBackward0")
    line = rank_failure_line(RANK_CRASH, 1, "/tmp/x.log")
    assert "\n" not in line and "ViewBackward0" in line and "view size" in line
    assert "re-plan" in line and line.endswith("the ranks' whole output: /tmp/x.log")
    killed = "[rank 1] error: RuntimeError: Connection reset by peer\n  exitcode  : -9 (pid: 7)\n"
    line = rank_failure_line(killed, 1, "/tmp/y.log")
    assert "SIGKILL" in line and "out of memory" in line and "Connection" not in line
    assert "without saying why" in rank_failure_line("torchrun's dump only", 1, None)


def test_the_views_of_the_attention_output_follow_it_unresharded():
    """A reshard between the attention output and the view merging its heads
    makes that view fail in the ranks (BART's 'Cannot view a tensor with shape
    [8, 16, 4, 16] and strides (1024, 16, 256, 1)', Phi-3's view of the
    heads gathered on one mesh axis). The ILP may not choose it: the edges of
    that chain of views follow their producer; the projection after it takes
    its input resharded, priced as usual."""
    from costmodel.presets import load_cluster
    from costmodel.strategy_cost import IntraOpCost
    from ir import trace
    from planner.ilp.intra_op import _edge_matrix
    from planner.ilp.strategies import build_strategies

    model, inputs = _on_meta("attention")
    graph = trace(model, inputs)
    chain = [n for n in graph.nodes if n.layout_bound]
    sdpa = next(n.name for n in graph.nodes if "scaled_dot_product" in n.target)
    # the attention output, its transpose and the views merging the heads
    assert [n.args[0] for n in chain] == [sdpa] + [n.name for n in chain[:-1]]
    assert chain[0].target in ("aten.transpose.int", "aten.permute.default")
    assert [n.target for n in chain[1:]] == ["aten.view.default"] * (len(chain) - 1)
    strategies = {ns.node.name: ns for ns in build_strategies(graph, (2, 2))}
    cost = IntraOpCost(graph, load_cluster("local-cpu:4"), (2, 2), "float32")
    for consumer in chain:
        producer = consumer.args[0]
        follows = _edge_matrix(cost, strategies[producer], strategies[consumer.name], 0)
        outs = [s.outputs[0] for s in strategies[producer].strategies]
        ins = [s.inputs[0] for s in strategies[consumer.name].strategies]
        assert len(set(outs)) > 1
        for i, row in enumerate(follows):
            for j, seconds in enumerate(row):
                assert (seconds == 0.0) if outs[i] == ins[j] else seconds == float("inf")
    # the projection after the views may take the heads resharded, as priced
    projection = next(n for n in graph.nodes if n.target == "aten.addmm.default"
                      and chain[-1].name in n.args)
    k = projection.args.index(chain[-1].name)
    priced = _edge_matrix(cost, strategies[chain[-1].name], strategies[projection.name], k)
    assert 0 < max(x for row in priced for x in row) < float("inf")


def _one_line_exit_2(proc: subprocess.CompletedProcess, *words: str) -> str:
    """The failure's one ``planner: error:`` line (exit 2, no traceback, no
    other line on stderr), which holds ``words``."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("planner: error: "), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def bn_cnn_plan(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("coverage") / "bn_cnn.json")
    planned = _cli("plan", "--model", f"{MODELS}:bn_cnn", "--cluster", "local-cpu:2", "--mesh",
                   "2", "--quiet", "-o", path)
    assert planned.returncode == 0, planned.stderr
    return path


@pytest.mark.parametrize("argv, words", [
    (["plan", "--model", f"{MODELS}:no_such_factory", "--cluster", "local-cpu:2"],
     ["no_such_factory"]),
    (["plan", "--model", f"{MODELS}:bn_cnn", "--cluster", "local-cpu:2", "--mesh", "4"],
     ["mesh"]),
    (["plan", "--model", f"{MODELS}:bn_cnn", "--cluster", "local-cpu:2", "--pp", "2"],
     ["forward updates buffers"]),
    (["show", "{missing}"], ["missing.json"]),
    (["show", "{garbage}"], ["garbage.json"]),
    (["run", "{missing}"], ["missing.json"]),
    (["run", "{garbage}"], ["garbage.json"]),
    (["run", "{stale}", "--check"], ["made for program feedfacefeedface", "re-plan"]),
])
def test_each_failure_of_plan_show_and_run_is_one_line_and_exit_2(tmp_path, bn_cnn_plan, argv,
                                                                  words):
    """A table model (the BatchNorm CNN), each way plan, show and run refuse."""
    import json

    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    stale = tmp_path / "stale.json"
    with open(bn_cnn_plan) as f:
        plan = json.load(f)
    plan["model"]["fingerprint"] = "feedfacefeedface"
    stale.write_text(json.dumps(plan))
    paths = {"missing": str(tmp_path / "missing.json"), "garbage": str(garbage),
             "stale": str(stale)}
    argv = [a.format(**paths) for a in argv]
    if argv[0] == "plan":
        argv += ["--quiet", "-o", str(tmp_path / "p.json")]
    _one_line_exit_2(_cli(*argv), *words)


def test_an_error_of_the_planner_itself_is_one_line_with_its_traceback_in_a_file(
        monkeypatch, capsys):
    from app import cli

    def broken(args):
        raise KeyError("a bug")

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser._subparsers._group_actions[0].choices["show"].set_defaults(func=broken)
    assert cli.main(["show", "any.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "internal error KeyError: 'a bug'" in err[0], err
    path = err[0].rsplit("traceback in ", 1)[1].rstrip(")")
    with open(path) as f:
        assert "KeyError: 'a bug'" in f.read()


@pytest.mark.multiprocess
def test_a_failure_in_the_ranks_is_one_line_naming_where_and_the_log(tmp_path):
    """A model that plans but fails in every rank: one line, exit 2, saying where
    the ranks were (building the model), the error, and the file with the ranks'
    whole output, which holds their tracebacks."""
    path = tmp_path / "fails.json"
    planned = _cli("plan", "--model", f"{MODELS}:fails_on_ranks", "--cluster", "local-cpu:2",
                   "--mesh", "2", "--quiet", "-o", str(path))
    assert planned.returncode == 0, planned.stderr
    line = _one_line_exit_2(_cli("run", str(path)), "building the plan's model",
                            "refuses to run in the ranks", "the ranks' whole output: ")
    log = line.rsplit("the ranks' whole output: ", 1)[1]
    with open(log) as f:
        assert "Traceback" in f.read()  # the ranks' tracebacks are there, not on the terminal
    os.remove(log)
