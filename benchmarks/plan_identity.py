"""Plan identity: the plan.json files a restructuring must leave byte-identical.

Writes, into one folder, the plan.json of

* every ``benchmarks/plan_quality.py`` case: its automatic plan (the case's
  restrictions, ILP limit 10 s per solve) and its best Megatron-LM
  configuration as recorded in ``benchmarks/results/plan_quality.json``;
* the README's ``planner plan`` examples (``h100.json``: one GPU of the
  ``dgx-h100`` preset, written into the folder),

and ``manifest.json``: each file's sha256 and the seconds it took to plan
(entries of earlier runs into the same folder that this run did not redo
are kept).
``--against DIR`` compares the new folder with an older one and exits 1 when
any plan differs. Side-by-side use, code before and after a change:

    git stash; python -m benchmarks.plan_identity --out /tmp/before; git stash pop
    python -m benchmarks.plan_identity --out /tmp/after --against /tmp/before

``--cases`` keeps the cases whose name contains one of its words (``cli``
names the README examples). The verdict of the last comparison is written to
``benchmarks/results/plan_identity.json``; ``benchmarks/plan_time_ab.py``
compares planning times, in alternating runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
import warnings
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine_info, read_results, write_results  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "plan_identity.json")
QUALITY = os.path.join(HERE, "results", "plan_quality.json")

#: The README's ``planner plan`` examples, as argument lists (the output path is added).
CLI_EXAMPLES: dict[str, list[str]] = {
    "cli-gpt-tiny-mesh": ["--model", "gpt-tiny", "--cluster", "local-cpu:4", "--mesh", "2x2"],
    "cli-gpt-tiny-pp": ["--model", "gpt-tiny", "--cluster", "local-cpu:4", "--pp", "2",
                        "--schedule", "1f1b"],
    "cli-gpt3-175b": ["--model", "gpt3-175b", "--cluster", "dgx-a100-80g:16"],
    "cli-gpt2-h100": ["--model", "gpt2", "--cluster", "{out}/h100.json", "--mesh", "1",
                      "--precision", "bf16-mixed", "--recompute", "none"],
}


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _quality_plans(case: Any, best_label: str | None) -> dict[str, Callable[[], Any]]:
    """Plan makers for one plan_quality case: ``auto`` and its best Megatron configuration."""
    from benchmarks.plan_quality import build_case_model, build_cluster, megatron_grid
    from ir.layers import block_count, pipeline_layers
    from ir.precision import compute_copy, get_precision
    from ir.trace import trace
    from planner.api import plan
    from planner.baselines.megatron import megatron_plan

    cluster = build_cluster(case.cluster)
    model, inputs = build_case_model(case)
    graph = trace(*compute_copy(model, inputs, get_precision(case.precision)))
    zoo = {"batch_size": case.batch, "seq_len": case.seq}
    makers: dict[str, Callable[[], Any]] = {
        f"{case.name}-auto": lambda: plan(model, cluster, example_inputs=inputs,
                                          model_source=case.model, time_limit_s=10.0,
                                          zoo_kwargs=zoo, precision=case.precision,
                                          **case.auto)}
    grid = megatron_grid(cluster, case.batch, block_count(pipeline_layers(graph)),
                         case.megatron)
    best = next((c for c in grid if c.label() == best_label), None)
    if best is not None:
        makers[f"{case.name}-megatron"] = lambda: megatron_plan(
            model, cluster, best, example_inputs=inputs, model_source=case.model,
            zoo_kwargs=zoo, time_limit_s=10.0, graph=graph, precision=case.precision)
    return makers


def _write_quality(out: str, words: list[str] | None) -> dict[str, dict[str, Any]]:
    from benchmarks.plan_quality import _cases

    best = {r["case"]: (r["best_megatron"] or {}).get("config")
            for r in read_results(QUALITY).get("cases", [])}
    written: dict[str, dict[str, Any]] = {}
    for case in _cases():
        if words and not any(w in case.name for w in words):
            continue
        for name, make in _quality_plans(case, best.get(case.name)).items():
            t0 = time.perf_counter()
            make().save(os.path.join(out, f"{name}.json"))
            written[name] = {"plan_s": round(time.perf_counter() - t0, 2)}
            print(f"{name}: {written[name]['plan_s']} s", flush=True)
    return written


def _write_cli(out: str, words: list[str] | None) -> dict[str, dict[str, Any]]:
    from app.cli import main as cli_main

    from costmodel.presets import preset

    one_gpu = dataclasses.replace(preset("dgx-h100", 1), name="h100", devices_per_node=1)
    with open(os.path.join(out, "h100.json"), "w") as f:
        f.write(one_gpu.to_json())
    written: dict[str, dict[str, Any]] = {}
    for name, args in CLI_EXAMPLES.items():
        if words and not any(w in name for w in words):
            continue
        args = [a.replace("{out}", out) for a in args]
        path = os.path.join(out, f"{name}.json")
        if os.path.exists(path):
            os.remove(path)
        t0 = time.perf_counter()
        rc = cli_main(["plan", *args, "-o", path, "--quiet"])
        if rc != 0:
            raise SystemExit(f"{name}: planner plan exited {rc}")
        written[name] = {"plan_s": round(time.perf_counter() - t0, 2)}
        print(f"{name}: {written[name]['plan_s']} s", flush=True)
    return written


def compare_folders(new: dict[str, Any], old_dir: str) -> dict[str, list[str]]:
    """Names identical, different, and missing from ``old_dir``'s manifest."""
    with open(os.path.join(old_dir, "manifest.json")) as f:
        old = json.load(f)["plans"]
    out: dict[str, list[str]] = {"identical": [], "different": [], "missing_before": []}
    for name, rec in sorted(new.items()):
        if name not in old:
            out["missing_before"].append(name)
        elif old[name]["sha256"] == rec["sha256"]:
            out["identical"].append(name)
        else:
            out["different"].append(name)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the plan.json files")
    ap.add_argument("--against", help="an older --out folder to compare with")
    ap.add_argument("--cases", nargs="*", help="only names containing one of these")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    warnings.simplefilter("ignore")
    written = _write_quality(args.out, args.cases)
    written.update(_write_cli(args.out, args.cases))
    for name, rec in written.items():
        rec["sha256"] = _sha256(os.path.join(args.out, f"{name}.json"))
    manifest = os.path.join(args.out, "manifest.json")
    kept = read_results(manifest).get("plans", {})  # plans of earlier runs into this folder
    with open(manifest, "w") as f:
        json.dump({"plans": {**kept, **written}}, f, indent=1, sort_keys=True)
    if not args.against:
        return 0
    verdict = compare_folders(written, args.against)
    # planning seconds are not compared here: the two folders were made at other
    # times, under other loads (benchmarks/plan_time_ab.py alternates the runs)
    write_results(RESULTS, {"machine": machine_info(brief=True), **verdict})
    for key in ("different", "missing_before"):
        if verdict[key]:
            print(f"{key}: {', '.join(verdict[key])}")
    print(f"{len(verdict['identical'])} of {len(written)} plans byte-identical")
    return 1 if verdict["different"] or verdict["missing_before"] else 0


if __name__ == "__main__":
    sys.exit(main())
