"""`planner profile`: alpha-beta and GEMM fits, the profile JSON, and the command end to end."""

import json
import math

import numpy as np
import pytest

from costmodel.cluster import Link
from costmodel.presets import load_cluster
from costmodel.collectives import collective_time
from costmodel.compute import matmul_efficiency, op_time
from costmodel.profiling import (
    COLLECTIVE_SIZES,
    ProfileError,
    alpha_beta_terms,
    build_profile,
    fit_alpha_beta,
    fit_gemm,
    group_sizes,
    load_profile,
    profile_path,
    summary_rows,
    write_profile,
)
from costmodel.profiling.runtime_costs import runtime_pipeline_action
from costmodel.profiling.worker import COLLECTIVE_KINDS, REDISTRIBUTIONS, count_steps
from app.cli import main

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


def _synthetic(link, kinds=KINDS, sizes=COLLECTIVE_SIZES, groups=(2, 4, 8), noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for kind in kinds:
        for n in groups:
            for b in sizes:
                t = collective_time(kind, b, n, link) * (1.0 + noise * rng.uniform(-1, 1))
                out.append((kind, b, n, t))
    return out


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "p2p"])
def test_terms_match_collective_time(kind):
    link = Link("x", 3e9, 40e-6)
    for n in (2, 3, 4, 8):
        for b in (1e3, 1e5, 1e8):
            branches = alpha_beta_terms(kind, b, n)
            t = min(ca * link.latency + cb / link.bandwidth for ca, cb in branches)
            assert t == pytest.approx(collective_time(kind, b, n, link), rel=1e-12)


@pytest.mark.parametrize("loss", ["l1", "l2"])
@pytest.mark.parametrize("alpha, bw", [(50e-6, 2e9), (1e-3, 5e8), (2e-6, 150e9)])
def test_fit_recovers_alpha_beta_exactly(alpha, bw, loss):
    fit = fit_alpha_beta(_synthetic(Link("x", bw, alpha)), loss=loss)
    assert fit["latency"] == pytest.approx(alpha, rel=1e-4)
    assert fit["bandwidth"] == pytest.approx(bw, rel=1e-4)
    assert fit["median_abs_pct_error"] < 1e-3 and not fit["bandwidth_bound"]


def test_l1_fit_shrugs_off_spikes():
    alpha, bw = 200e-6, 1e9
    samples = _synthetic(Link("x", bw, alpha), groups=(4,), noise=0.02, seed=3)
    spiked = [(k, b, n, t * (6.0 if i % 9 == 0 else 1.0)) for i, (k, b, n, t) in enumerate(samples)]
    l1 = fit_alpha_beta(spiked, loss="l1")
    assert l1["latency"] == pytest.approx(alpha, rel=0.05)
    assert l1["bandwidth"] == pytest.approx(bw, rel=0.05)
    l2 = fit_alpha_beta(spiked, loss="l2")
    assert l2["median_abs_pct_error"] > l1["median_abs_pct_error"]


def test_latency_bound_data_gives_finite_bandwidth():
    samples = [("all_gather", b, 2, 1e-3) for b in (1024, 4096, 16384)]
    fit = fit_alpha_beta(samples)
    assert fit["bandwidth_bound"] and math.isfinite(fit["bandwidth"])
    assert fit["latency"] == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize("kind", ["all_reduce", "broadcast", "all_gather"])
def test_fit_recovers_one_kind_with_noise(kind):
    # all_reduce and broadcast switch between tree (small) and ring (large) inside the range
    alpha, bw = 80e-6, 1.5e9
    fit = fit_alpha_beta(_synthetic(Link("x", bw, alpha), kinds=(kind,), groups=(4,), noise=0.05, seed=1))
    assert fit["latency"] == pytest.approx(alpha, rel=0.1)
    assert fit["bandwidth"] == pytest.approx(bw, rel=0.1)
    assert fit["median_abs_pct_error"] < 5.0


def test_fit_rejects_too_little_data():
    with pytest.raises(ProfileError):
        fit_alpha_beta([("all_reduce", 1024, 4, 1e-4)])
    with pytest.raises(ProfileError):
        fit_alpha_beta([("all_reduce", 1024, 1, 1e-4), ("all_reduce", 4096, 1, 1e-4)])


@pytest.mark.parametrize("loss", ["l1", "l2"])
def test_fit_gemm_recovers_peak_and_half_saturation(loss):
    peak, half, overhead = 40e9, 2e6, 3e-6
    flops = [2 * s**3 for s in (32, 64, 128, 256, 512, 1024)]
    times = [(f + half) / peak + overhead for f in flops]
    fit = fit_gemm(zip(flops, times), overhead, loss=loss)
    assert fit["peak_flops"] == pytest.approx(peak, rel=1e-5)
    assert fit["half_saturation_flops"] == pytest.approx(half, rel=1e-3)
    # ... and that is exactly the cost model's op_time with matmul_efficiency
    from costmodel.cluster import DeviceSpec

    dev = DeviceSpec("cpu", {"float32": fit["peak_flops"]}, 2**30, 1e12, overhead, 1.0, 1.0)
    for f, t in zip(flops, times):
        eff = matmul_efficiency(f, fit["max_efficiency"], fit["half_saturation_flops"])
        assert op_time(f, 0, dev, "float32", efficiency=eff) == pytest.approx(t, rel=1e-4)


def test_fit_gemm_tolerates_a_time_below_the_overhead():
    # a loaded machine can time a tiny GEMM below the separately measured op overhead
    flops = [2 * s**3 for s in (32, 256, 1024)]
    times = [2e-6, 2 * 256**3 / 30e9 + 4e-6, 2 * 1024**3 / 30e9 + 4e-6]
    fit = fit_gemm(zip(flops, times), 4e-6)
    assert fit["peak_flops"] == pytest.approx(30e9, rel=0.01) and fit["half_saturation_flops"] >= 1.0


def test_fit_gemm_keeps_a_peak_when_the_overhead_was_timed_above_a_gemm():
    # a CI run: the op overhead was timed during a burst of load (30 us), above the
    # 64^3 GEMM (17.6 us); pinning the fixed cost to >= overhead forced the slope to 0
    samples = [(524288, 1.76e-05), (33554432, 5.20e-3), (268435456, 2.15e-2)]
    fit = fit_gemm(samples, 3.05e-5)
    assert 5e9 < fit["peak_flops"] < 3e10 and fit["half_saturation_flops"] >= 1.0
    with pytest.raises(ProfileError, match="do not grow with FLOPs"):
        fit_gemm([(524288, 1e-3), (33554432, 1e-3), (268435456, 1e-3)], 1e-6)


def test_group_sizes():
    assert group_sizes(1) == []
    assert group_sizes(2) == [2]
    assert group_sizes(4) == [4, 2]
    assert group_sizes(6) == [6, 2]
    assert group_sizes(8) == [8, 4, 2]


def _records(link, kinds, groups, ranks):
    return [{"kind": k, "nbytes": b, "group_size": n, "groups": ranks // n, "seconds": t, "reps": [t],
             "calls_per_rep": 1}
            for k, b, n, t in _synthetic(link, kinds=kinds, groups=groups, noise=0.02)]


def _raw(link, ranks=4, unsupported=None, redistribute=None):
    kinds = [k for k in COLLECTIVE_KINDS if k not in (unsupported or {})]
    coll = _records(link, kinds, group_sizes(ranks), ranks)
    gemms = [{"m": s, "k": s, "n": s, "dtype": "float32", "flops": 2 * s**3, "bytes": 12 * s * s,
              "seconds": (2 * s**3 + 1e5) / 30e9 + 4e-6} for s in (64, 256, 1024)]
    return {
        "overhead": {"seconds": 4e-6, "reps": [4e-6], "calls_per_rep": 100},
        "memory": [{"bytes": 2 * 2**26, "size": 2**26, "seconds": 0.02, "reps": [0.02], "calls_per_rep": 1}],
        "gemms": gemms,
        "collectives": coll,
        # each redistribute timed after a 5 ms burst of compute, and the burst alone
        "redistribute": ([{**rec, "seconds": rec["seconds"] + 5e-3} for rec in
                          _records(redistribute, list(REDISTRIBUTIONS), [ranks], ranks)]
                         if redistribute else []),
        "redistribute_burst": {"gemm": 384, "seconds": 5e-3},
        # a compiled region's call: 150 us, and 20 us per parameter
        "compiled_call": [{"params": k, "seconds": 1.5e-4 + k * 2e-5} for k in (1, 32)],
        # DTensor's chain of 17 tiny ops: 10 us an op pass; the runtime's step: 50 us
        "dispatch": {"ops": 17, "plain": {"seconds": 1e-4}, "dtensor": {"seconds": 1e-4 + 34 * 1e-5}},
        "runtime": {"model": "gpt-tiny", "passes": 100, "plain": {"seconds": 4e-3},
                    "runtime": {"seconds": 9e-3}},
        "unsupported": dict(unsupported or {}),
    }


def _spec(ranks=4):
    return {"device": "cpu", "backend": "gloo", "threads": 1, "reps": 1, "collectives": list(COLLECTIVE_KINDS),
            "sizes": list(COLLECTIVE_SIZES), "group_sizes": group_sizes(ranks)}


def test_profile_json_round_trips_into_cluster(tmp_path):
    link = Link("loopback", 6e8, 1e-3)
    via_dtensor = Link("loopback", 3e8, 2e-3)
    raw = _raw(link, redistribute=via_dtensor)
    # the memory-bound chain: 10 launches, and its bytes at half the copy's bandwidth
    raw["memory_chain"] = {"bytes": 2**26, "kernels": 10, "seconds": 0.02 + 10 * 4e-6}
    # the same chain compiled: 2 launches, 2e8 elements made in 0.1 s
    raw["fused_chain"] = {"bytes": 2**24, "kernels": 2, "elements": 2e8, "seconds": 0.1 + 2 * 4e-6}
    cluster, profile = build_profile(raw, _spec(), 4, wall_s=1.0)
    out = tmp_path / "local-cpu.json"
    write_profile(cluster, profile, out)
    loaded = load_cluster(str(out))
    assert loaded == cluster and loaded.to_dict() == cluster.to_dict()
    assert loaded.name == "local-cpu:4" and loaded.backend == "gloo" and loaded.num_devices == 4
    assert loaded.intra_node.latency == pytest.approx(1e-3, rel=0.05)
    assert loaded.intra_node.bandwidth == pytest.approx(6e8, rel=0.05)
    assert loaded.device.peak_flops["float32"] == pytest.approx(30e9, rel=1e-6)
    assert loaded.device.memory_bandwidth == pytest.approx(2 * 2**26 / 0.02)
    assert loaded.device.kernel_overhead == pytest.approx(4e-6)
    assert loaded.device.memory_efficiency == pytest.approx(0.5)
    assert loaded.device.fused_element_rate == pytest.approx(2e9)
    assert loaded.device.compiled_call_overhead == pytest.approx(1.5e-4)
    assert loaded.device.compiled_param_overhead == pytest.approx(2e-5)
    # the runtime's cost per op pass, its own step measured (not DTensor's tiny chain)
    assert loaded.device.dispatch_overhead == pytest.approx((9e-3 - 4e-3) / 100)
    # the reshards' own fits: what DTensor's redistribute took, kind by kind
    redistribute = {k: (a, b) for k, a, b in loaded.intra_node.per_redistribute}
    assert set(redistribute) == set(REDISTRIBUTIONS)
    for latency, bandwidth in redistribute.values():
        assert latency == pytest.approx(2e-3, rel=0.1) and bandwidth == pytest.approx(3e8, rel=0.1)

    prof = load_profile(profile_path(out))
    assert prof == load_profile(out)  # the cluster path finds its sibling
    assert prof["cluster"] == cluster.to_dict() and prof["cluster_path"] == str(out)
    assert set(prof["fits"]["collectives"]) == set(COLLECTIVE_KINDS)
    assert prof["fits"]["gemm"]["half_saturation_flops"] == pytest.approx(1e5, rel=1e-3)
    assert len(prof["measurements"]["collectives"]) == len(COLLECTIVE_KINDS) * len(COLLECTIVE_SIZES) * 2
    assert json.loads(json.dumps(prof)) == prof
    assert prof["machine"]["cpus"] >= 1 and "torch" in prof["machine"]


def test_unsupported_collective_is_recorded(tmp_path):
    raw = _raw(Link("loopback", 1e9, 1e-4), unsupported={"all_to_all": "RuntimeError: not supported"})
    cluster, profile = build_profile(raw, _spec(), 4)
    assert "all_to_all" not in profile["fits"]["collectives"]
    assert any("all_to_all not supported" in n for n in profile["notes"])
    assert any(r[0] == "all_to_all" and r[1] == "skipped" for r in summary_rows(profile))


def test_load_profile_rejects_other_json(tmp_path):
    path = tmp_path / "x.profile.json"
    path.write_text(json.dumps({"name": "not a profile"}))
    with pytest.raises(ProfileError):
        load_profile(path)


def test_count_steps():
    spec = {"reps": 2, "overhead": True, "memory_bytes": [1], "gemms": [[1, 1, 1, "float32"]] * 3,
            "collectives": ["all_reduce", "broadcast"], "sizes": [1, 2, 3], "group_sizes": [4, 2]}
    assert count_steps(spec) == (1 + 1 + 3 + 2 * 3 * 2) * 3


def test_profile_bad_ranks_exit_2(capsys, tmp_path):
    assert main(["profile", "--ranks", "0", "-o", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("planner: error:") and len(err.splitlines()) == 1


@pytest.mark.multiprocess
def test_planner_profile_quick_end_to_end(tmp_path, capsys):
    out = tmp_path / "local-cpu.json"
    assert main(["profile", "--quick", "--ranks", "2", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "GFLOP/s" in text and "GB/s" in text and "all_reduce" in text
    cluster = load_cluster(str(out))
    assert cluster.name == "local-cpu:2" and cluster.num_devices == 2 and cluster.backend == "gloo"
    prof = load_profile(profile_path(out))
    assert prof["cluster"] == cluster.to_dict() and prof["quick"] is True
    measured = {(c["kind"], c["group_size"]) for c in prof["measurements"]["collectives"]}
    assert {k for k, _ in measured} | set(prof["unsupported"]) == set(COLLECTIVE_KINDS)
    assert all(c["seconds"] > 0 for c in prof["measurements"]["collectives"])
    assert {c["kind"] for c in prof["measurements"]["redistribute"]} == set(REDISTRIBUTIONS)
    assert {k for k, _, _ in cluster.intra_node.per_redistribute} == set(REDISTRIBUTIONS)
    assert math.isfinite(cluster.intra_node.bandwidth) and cluster.intra_node.bandwidth > 0
    # a compiled region's host cost, measured by compiling one
    assert cluster.device.compiled_call_overhead > 0 and "compiled call" in text
    # the memory-bound chain compiled: its fused kernels' elements per second
    assert cluster.device.fused_element_rate > 0 and "fused kernels" in text
    # the runtime's cost per op: its own step against the plain one
    run = prof["measurements"]["runtime"]
    assert run["passes"] > 0 and run["runtime"]["seconds"] > run["plain"]["seconds"] > 0
    assert cluster.device.dispatch_overhead == pytest.approx(
        (run["runtime"]["seconds"] - run["plain"]["seconds"]) / run["passes"])
    assert "the planner's runtime, per op and pass" in text
    # an FSDP2 unit's collective calls and the pipeline schedule's actions
    assert cluster.device.fsdp_call_overhead > 0 and "FSDP2 unit call" in text
    assert prof["fits"]["pipeline_action_overhead"] >= 0 and "pipeline action" in text
    # the pipeline's action fitted on the planner's own pipelined step (eager when quick)
    pipe = prof["measurements"]["runtime_pipeline"]
    assert set(pipe) >= {"eager"} and "compiled" not in pipe
    assert pipe["eager"]["pipelined"]["seconds"] > pipe["eager"]["forward"]["seconds"] > 0
    assert prof["fits"]["pipeline_action_overhead"] == runtime_pipeline_action(
        prof["measurements"], cluster.intra_node, "eager")
    assert "the planner's runtime, per forward or backward" in text
    # torch's split backward (zero-bubble schedules): its cost per parameter group
    split = prof["measurements"]["split_backward"]
    assert split["split"]["seconds"] > split["whole"]["seconds"] > 0
    assert cluster.device.split_backward_group_overhead == pytest.approx(
        (split["split"]["seconds"] - split["whole"]["seconds"]) / split["groups"])
    assert "split backward" in text


def test_the_runtime_pipeline_action_is_fitted_per_runtime():
    """The planner's pipelined step timed as the schedule model gives it, each
    action its stage's time alone plus 200 us: the fit finds the 200 us; a
    compiled runtime of which a region ran eager gives no figure."""
    from costmodel.profiling.build import pipeline_actions
    from costmodel.schedules.timing import simulate

    link = Link("loopback", 1e9, 1e-4)
    m, nbytes, forward, backward = 8, 4096, 1e-3, 2e-3
    p2p = link.latency + nbytes / link.bandwidth
    step = simulate("1f1b", 2, m, forward + 2e-4, backward + 2e-4, 0.0, p2p, timeline=False).step_time
    timed = {"forward": {"seconds": m * forward}, "stage": {"seconds": m * (forward + backward)},
             "pipelined": {"seconds": step}}
    raw = {"runtime_pipeline": {"schedule": "1f1b", "stages": 2, "microbatches": m,
                                "activation_bytes": nbytes, "eager": timed,
                                "compiled": {**timed, "eager_regions": ["stage 0 runs eager: why"]}}}
    assert runtime_pipeline_action(raw, link, "eager") == pytest.approx(2e-4, rel=1e-6)
    assert runtime_pipeline_action(raw, link, "compiled") is None
    raw["runtime_pipeline"]["compiled"]["eager_regions"] = []
    actions = pipeline_actions(raw, link)
    assert actions.pop("split_backward_group_overhead") is None  # not measured here
    assert actions == pytest.approx(
        {"pipeline_action_overhead": 2e-4, "compiled_pipeline_action_overhead": 2e-4}, rel=1e-6)


def test_pipeline_action_overhead_is_recovered_through_the_schedule_model():
    """A 1F1B step of 4 stages timed as the schedule model gives it with 300
    us added to each action: the fit finds the 300 us; a step no slower than
    the model without it gives 0."""
    from costmodel.profiling.runtime_costs import pipeline_action_overhead
    from costmodel.schedules.timing import simulate

    link = Link("loopback", 1e9, 1e-4)
    stages, m, nbytes, plain = 4, 8, 128, 8 * 2 * 20e-6
    p2p = link.latency + nbytes / link.bandwidth
    step = simulate("1f1b", stages, m, 20e-6 + 3e-4, 20e-6 + 3e-4, 0.0, p2p, timeline=False).step_time
    raw = {"pipeline": {"schedule": "1f1b", "stages": stages, "microbatches": m,
                        "activation_bytes": nbytes, "plain": {"seconds": plain},
                        "pipelined": {"seconds": step}}}
    assert pipeline_action_overhead(raw, link) == pytest.approx(3e-4, rel=1e-6)
    raw["pipeline"]["pipelined"]["seconds"] = 1e-4
    assert pipeline_action_overhead(raw, link) == 0.0
    assert pipeline_action_overhead({}, link) is None


def test_the_memory_bound_chain_is_timed_beside_its_price():
    """``planner profile``'s memory-bound chain (eager on GPUs, compiled on CPU
    ranks; here both, small, on one CPU rank): timed beside the bytes and
    launches the cost model charges it, and fitted to the share of the copy's
    bandwidth it reached; compiled, beside the elements its fused kernels
    make, and fitted to their rate."""
    from costmodel.profiling.memory_probe import chain_efficiency, fused_element_rate
    from costmodel.profiling.run import measure

    raw = measure({"device": "cpu", "backend": "gloo", "threads": 1, "reps": 1,
                   "compute_min_rep_s": 0.001, "memory_chain": [256, 512, "float32"],
                   "fused_chain": [256, 512, "float32"]}, 1, progress=False)
    fused = raw["fused_chain"]
    # fewer launches and bytes than eager; each of the four ops makes [256, 512] forward
    assert fused["seconds"] > 0 and 0 < fused["kernels"] < raw["memory_chain"]["kernels"]
    assert 0 < fused["bytes"] < raw["memory_chain"]["bytes"]
    assert fused["elements"] >= 2 * 4 * 256 * 512
    assert fused_element_rate(fused, 1e-6) == pytest.approx(
        fused["elements"] / (fused["seconds"] - fused["kernels"] * 1e-6))
    assert fused_element_rate({}, 1e-6) is None
    chain = raw["memory_chain"]
    assert chain["seconds"] > 0 and chain["kernels"] >= 6
    # every pass reads or writes a [256, 512] fp32 tensor at least once
    assert chain["bytes"] >= 6 * 256 * 512 * 4
    efficiency = chain_efficiency(chain, 1e10, 1e-6)
    assert 0 < efficiency <= 1
    # the bytes' time over the time left after the launches
    assert chain_efficiency({"bytes": 4e9, "kernels": 10, "seconds": 2.01}, 4e9, 1e-3) == \
        pytest.approx(0.5)
    assert chain_efficiency({}, 4e9, 1e-3) is None


def test_a_compile_that_fails_here_leaves_its_figure_unmeasured():
    """A compiled measurement whose compile fails (no C++ compiler) is recorded
    as unsupported, with the error's first line, and its progress steps are
    reported as done."""
    from costmodel.profiling.compiled_call import compiles

    def fail() -> None:
        raise RuntimeError("no C++ compiler\nthe rest of the message")

    out, reported = {}, []
    assert not compiles(fail, out, "fused_chain", 3, reported.append)
    assert out == {"unsupported": {"fused_chain": "RuntimeError: no C++ compiler"}}
    assert reported == ["fused chain unsupported"] * 3
    assert compiles(lambda: None, out, "compiled_call", 3, reported.append) and len(reported) == 3
