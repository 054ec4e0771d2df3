"""Hugging Face causal LMs, unedited, planned and run with ``--check`` on CPU ranks.

Each model is a tiny config of a ``transformers`` family with the library's
defaults (dropout off where the family has it, since ``--check`` cannot compare
random programs): planned for ``local-cpu:N`` by ``planner plan`` (on fake CPU
tensors), run on N ranks by ``planner run --check``. Records per model: the
plan's mesh, predicted step and fallbacks, and the check's loss and gradient
errors, the number of parameters checked and the ops that ran replicated.

    OMP_NUM_THREADS=1 python -m benchmarks.hf_models [--ranks 4] [--models gpt2 qwen2]

Writes ``benchmarks/results/hf_models.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from typing import Any

from benchmarks.common import check_fields, git_commit, machine_info, write_results

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_DECODER = ("num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
            "num_key_value_heads=2,vocab_size=256")
#: family -> the hf: spec of its tiny config
MODELS = {
    "gpt2": "hf:gpt2,n_layer=2,n_embd=64,n_head=4,vocab_size=256,n_positions=64,"
            "resid_pdrop=0,embd_pdrop=0,attn_pdrop=0",
    "llama": f"hf:llama,{_DECODER}",
    "mistral": f"hf:mistral,{_DECODER}",
    "qwen2": f"hf:qwen2,{_DECODER}",
    "mixtral": f"hf:mixtral,{_DECODER},num_local_experts=4",
    # MoE families beside Mixtral: a shared expert with its gate; DeepSeek-V3's
    # multi-head latent attention, group-limited sigmoid routing, a shared expert
    # and a dense first layer (the experts are transformers' grouped matmul)
    "qwen2_moe": f"hf:qwen2_moe,{_DECODER},moe_intermediate_size=128,"
                 "shared_expert_intermediate_size=128,num_experts=4,num_experts_per_tok=2",
    "deepseek_v3": "hf:deepseek_v3,num_hidden_layers=2,hidden_size=64,intermediate_size=128,"
                   "moe_intermediate_size=64,num_attention_heads=4,num_key_value_heads=4,"
                   "vocab_size=256,n_routed_experts=4,n_shared_experts=1,num_experts_per_tok=2,"
                   "n_group=1,topk_group=1,first_k_dense_replace=1,q_lora_rank=32,"
                   "kv_lora_rank=16,qk_rope_head_dim=8,qk_nope_head_dim=8,v_head_dim=16",
}
SEQ_LEN = 32


def run_model(spec: str, ranks: int, workdir: str) -> dict[str, Any]:
    """Plan and check one model; a failure is recorded, not raised."""
    from training.launch import launch
    from training.torchrun import LaunchError
    from models.source import build_model
    from planner.api import plan

    row: dict[str, Any] = {"spec": spec, "ranks": ranks, "passed": False}
    t0 = time.perf_counter()
    model, inputs = build_model(spec, device="meta", seq_len=SEQ_LEN)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = plan(model, f"local-cpu:{ranks}", example_inputs=inputs, model_source=spec,
                      zoo_kwargs={"seq_len": SEQ_LEN})
    row.update(plan_s=round(time.perf_counter() - t0, 1), mesh=list(result.mesh_shape),
               predicted_step_s=result.predicted.get("step_time_s"),
               plan_warnings=sorted({str(w.message).splitlines()[0][:160] for w in caught}))
    path = os.path.join(workdir, "plan.json")
    result.save(path)
    t1 = time.perf_counter()
    try:
        r = launch(path, steps=2, check=True)  # the first step warms up
    except LaunchError as err:
        row.update(error=str(err).splitlines()[0], run_s=round(time.perf_counter() - t1, 1))
        return row
    row.update(run_s=round(time.perf_counter() - t1, 1), loadavg=os.getloadavg()[0],
               **check_fields(r))
    return row


def main(argv: list[str] | None = None) -> int:
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--out", default=os.path.join(RESULTS, "hf_models.json"))
    args = ap.parse_args(argv)
    results: dict[str, Any] = {"machine": machine_info(brief=True), "git_commit": git_commit(),
                               "transformers": transformers.__version__, "models": {}}
    with tempfile.TemporaryDirectory(prefix="hf-models-") as tmp:
        for name in args.models:
            row = run_model(MODELS[name], args.ranks, tmp)
            results["models"][name] = row
            print(f"{name}: {'passed' if row['passed'] else 'FAILED'} "
                  f"({row.get('error') or row.get('max_rel_grad_err')})", flush=True)
    results["passed"] = sum(r["passed"] for r in results["models"].values())
    write_results(args.out, results)
    print(f"wrote {args.out}: {results['passed']}/{len(args.models)} passed")
    return 0 if results["passed"] == len(args.models) else 1


if __name__ == "__main__":
    sys.exit(main())
