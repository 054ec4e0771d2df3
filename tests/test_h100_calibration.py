"""The planner's predictions against training steps measured on one H100.

Measured: ``benchmarks/results/h100_measured_2026-11-26.json`` (from
shared/measurements/h100-2026-11-26.md: a plain eager bf16 loop, bf16 parameters
and AdamW states, fused attention). Priced on the H100's own ``planner profile``
(``benchmarks/results/gpu/h100_profile_2026-11-27.json``, made by
``benchmarks/gpu_single.py`` on that GPU type with torch 2.11).

Step time must be within 20 %, peak memory within 10 %, and the checkpointing
choice the faster plan that fits (for gpt3-350m at 8 x 2048: no recompute)."""

import json
import os

import pytest

from costmodel.presets import load_cluster
from models import zoo
from planner.api import plan

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "..", "benchmarks", "results")
MEASURED = os.path.join(RESULTS, "h100_measured_2026-11-26.json")
PROFILE = os.path.join(RESULTS, "gpu", "h100_profile_2026-11-27.json")


def _steps() -> list[dict]:
    with open(MEASURED) as f:
        return json.load(f)["steps"]


@pytest.mark.parametrize("case", _steps(), ids=lambda c: f"{c['model']}-recompute-{c['recompute']}")
def test_h100_step_prediction(case):
    model, inputs = zoo.build(case["model"], batch_size=case["batch_size"],
                              seq_len=case["seq_len"], device="meta")
    p = plan(model, load_cluster(PROFILE), example_inputs=inputs, mesh_shape=(1,),
             precision="bf16", recompute=case["recompute"])
    peak = p.predicted["memory_bytes_per_device"]["peak"]
    step = p.predicted["step_time_s"]
    print(f"{case['model']} recompute={case['recompute']}: step {step:.4f} s vs "
          f"{case['step_s']} s measured; peak {peak / 1e9:.2f} GB vs "
          f"{case['peak_bytes'] / 1e9:.2f} GB")
    assert peak == pytest.approx(case["peak_bytes"], rel=0.10)
    assert step == pytest.approx(case["step_s"], rel=0.20)
    if case["recompute"] is None:  # the plan's own choice: the fastest that fits
        assert p.checkpoint == []


def test_h100_gpt3_350m_does_not_recompute_when_it_fits():
    """The step without recomputation fits (21.6 GB of 80) and is faster: the
    search must not checkpoint."""
    model, inputs = zoo.build("gpt3-350m", batch_size=8, seq_len=2048, device="meta")
    p = plan(model, load_cluster(PROFILE), example_inputs=inputs, mesh_shape=(1,),
             precision="bf16")
    assert p.checkpoint == []


def test_a_tiny_model_on_the_h100_waits_for_the_host():
    """gpt-tiny's kernels are far shorter than the host's time to issue them:
    its step is the host's (predicted.host_s), above the device's sum."""
    model, inputs = zoo.build("gpt-tiny", device="meta")
    p = plan(model, load_cluster(PROFILE), example_inputs=inputs, mesh_shape=(1,),
             precision="bf16")
    assert p.predicted["host_s"] > p.solver.objective_s
    assert p.predicted["step_time_s"] == p.predicted["host_s"]
