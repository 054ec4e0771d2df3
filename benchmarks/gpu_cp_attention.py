"""One-GPU check of context parallelism's blocked attention on the CUDA kernels.

A cp group's attention (:func:`codegen.context_parallel.emulated_attention`: each
rank's load-balanced chunks through ``_BlockedAttention`` over the group's K/V
blocks, the partial outputs merged by their log-sum-exp) is emulated in one
process on one CUDA device for cp = 2, 4 and 8, and compared, forward (the
output) and backward (dq, dk, dv), with whole-sequence causal attention:

* fp32 (the memory-efficient kernel) and bf16 / fp16 (FlashAttention-2 on
  sm80+), with grouped-query attention, a head dim FlashAttention-2 does not
  take in bf16 (264: the memory-efficient kernel), and a head dim with a
  padded log-sum-exp (sequences not a multiple of 32 per block);
* the error of a result is ``max |x - ref| / max |ref|`` against
  ``F.scaled_dot_product_attention`` in float64 (the math path); the
  whole-sequence ``F.scaled_dot_product_attention`` in the case's dtype is
  measured so too, and a case passes when the cp result's error is at most
  ``max(floor, 2 x`` that ``)`` for each of out, dq, dk, dv (floor: 1e-5 for
  fp32, 2e-2 for bf16, 4e-3 for fp16), and its kernel is the one
  :func:`codegen.cp_kernels.choose_kernel` gives.

Writes ``OUT/gpu_cp_attention.json`` (default OUT: benchmarks/results/gpu) with
the machine, every case's kernel, errors and tolerance. Exit status: 0 all
within tolerance, 1 some case failed, 2 no CUDA device (one line). About a
minute on an H100; needs only torch (2.11 or later) and this repository::

    python3 benchmarks/gpu_cp_attention.py --out $OUT

To try its logic on a CPU (the CPU flash kernel, short sequences, < 1 min)::

    OMP_NUM_THREADS=1 python benchmarks/gpu_cp_attention.py --device cpu --tokens 128 --out /tmp/g
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

FLOOR = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}

#: (name, dtype, heads, kv heads, head dim, tokens): tokens divide by 2 x 8
#: (fp64 reference scores: 2 x heads x tokens^2 x 8 bytes, 0.5 GiB at most)
CASES = [
    ("fp32", torch.float32, 8, 8, 128, 2048),
    ("fp32-gqa-hd64", torch.float32, 8, 2, 64, 2048),
    ("fp32-padded-lse", torch.float32, 4, 4, 64, 16 * 50),  # blocks of 50/100 queries
    ("bf16", torch.bfloat16, 8, 8, 128, 2048),
    ("bf16-gqa", torch.bfloat16, 8, 2, 128, 2048),
    ("fp16-hd64", torch.float16, 8, 8, 64, 2048),
    ("bf16-hd264-efficient", torch.bfloat16, 4, 4, 264, 16 * 50),
]


def _error(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _attention_and_grads(fn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         grad: torch.Tensor) -> list[torch.Tensor]:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), grad)]


def _whole(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    repeats = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(repeats, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(name: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
             tokens: int, cps: tuple[int, ...], device: torch.device) -> dict[str, Any]:
    from codegen.context_parallel import emulated_attention
    from codegen.cp_kernels import block_kernel, choose_kernel

    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(2, heads, tokens, head_dim, device=device, generator=gen)
    k, v = (torch.randn(2, kv_heads, tokens, head_dim, device=device, generator=gen)
            for _ in range(2))
    grad = torch.randn(2, heads, tokens, head_dim, device=device, generator=gen)
    q, k, v, grad = (t.to(dtype) for t in (q, k, v, grad))
    ref = _attention_and_grads(_whole, *(t.double() for t in (q, k, v, grad)))
    whole = _attention_and_grads(_whole, q, k, v, grad)
    names = ("out", "dq", "dk", "dv")
    whole_err = {n: _error(x, r) for n, x, r in zip(names, whole, ref)}
    tolerance = {n: max(FLOOR[dtype], 2 * e) for n, e in whole_err.items()}
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    expected = choose_kernel(device.type, dtype, head_dim, capability)
    kernel = block_kernel(q, v).name
    record: dict[str, Any] = {
        "case": name, "dtype": str(dtype).removeprefix("torch."), "heads": heads,
        "kv_heads": kv_heads, "head_dim": head_dim, "tokens": tokens, "batch": 2,
        "kernel": kernel, "kernel_expected": expected,
        "whole_sequence_error": whole_err, "tolerance": tolerance, "cp": {}}
    ok = kernel == expected and kernel is not None
    for cp in cps:
        _synchronize(device)
        start = time.perf_counter()
        got = _attention_and_grads(lambda a, b, c: emulated_attention(a, b, c, cp), q, k, v, grad)
        _synchronize(device)
        errors = {n: _error(x, r) for n, x, r in zip(names, got, ref)}
        passed = all(errors[n] <= tolerance[n] for n in names)
        ok = ok and passed
        record["cp"][str(cp)] = {"error": errors, "passed": passed,
                                 "seconds": time.perf_counter() - start}
        print(f"{name:22s} cp={cp}  kernel {kernel:14s} "
              + "  ".join(f"{n} {errors[n]:.2e}/{tolerance[n]:.1e}" for n in names)
              + ("  ok" if passed else "  FAILED"), flush=True)
    record["passed"] = ok
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "benchmarks", "results", "gpu"),
                        help="folder for gpu_cp_attention.json")
    parser.add_argument("--cp", default="2,4,8", help="cp sizes (comma-separated)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a dry run of the script on the CPU flash kernel")
    parser.add_argument("--tokens", type=int, default=0,
                        help="tokens per sequence for every case (a multiple of 2 x each cp)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_cp_attention: no CUDA device here; run it on a machine with one")
        return 2
    cps = tuple(int(c) for c in args.cp.split(","))
    result: dict[str, Any] = {
        "benchmark": "gpu_cp_attention",
        "machine": {"device": args.device, "torch": torch.__version__,
                    "cuda": torch.version.cuda, **({
                        "gpu": torch.cuda.get_device_name(0),
                        "capability": list(torch.cuda.get_device_capability(0))}
                        if args.device == "cuda" else {})},
        "error": "max |x - ref| / max |ref| against float64 whole-sequence attention",
        "rule": "passed: error <= max(floor, 2 x the whole-sequence kernel's error), "
                "for out, dq, dk and dv, and the kernel is choose_kernel's",
        "floor": {str(d).removeprefix("torch."): f for d, f in FLOOR.items()},
        "cases": []}
    failed = 0
    for case in CASES:
        try:
            tokens = args.tokens or case[-1]
            record = run_case(*case[:-1], tokens, cps, torch.device(args.device))
        except Exception as e:  # one line per failing case; go on
            traceback.print_exc()
            record = {"case": case[0], "passed": False,
                      "error_message": f"{type(e).__name__}: {e}".splitlines()[0]}
            print(f"{case[0]:22s} FAILED: {record['error_message']}", flush=True)
        failed += not record["passed"]
        result["cases"].append(record)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    result["passed"] = failed == 0
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_cp_attention.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{len(CASES) - failed}/{len(CASES)} cases within tolerance; wrote {path}")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
