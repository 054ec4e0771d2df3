"""A hand-written Megatron tensor-parallel GPT training step with DTensor (one rank).

    torchrun --standalone --nproc_per_node 2 benchmarks/handwritten_tp.py --model gpt-tiny \\
        --batch-size 8 --steps 10 --result-json out.json [--check]

What a PyTorch user would write by hand for Megatron-LM tensor parallelism over
all ranks (tp = world size, no data parallelism), with
``torch.distributed.tensor.parallel.parallelize_module``:

* token embedding ``transformer.wte``: vocabulary parallel,
  ``RowwiseParallel(input_layouts=Replicate())`` (output all-reduced);
* attention ``c_attn``: ``ColwiseParallel``; its fused q|k|v rows are permuted
  first so that each rank's contiguous shard holds q, k and v of its own heads
  (as Megatron-LM lays out its fused QKV), and the attention runs on the local
  heads with no communication; ``c_proj``: ``RowwiseParallel`` (all-reduce);
* MLP ``c_fc``: ``ColwiseParallel``, ``c_proj``: ``RowwiseParallel``;
* output head ``lm_head``: ``ColwiseParallel(output_layouts=Shard(-1))`` and a
  vocabulary-parallel cross entropy (``loss_parallel()``), as Megatron-LM;
* LayerNorms and the position embedding stay ordinary replicated tensors.

Same model (zoo name, seed 0, same batch), same SGD optimizer and the same timed
loop (forward, backward, optimizer step, zero_grad, loss read back) as
``training.job``, so its step times compare with a launched plan's.
``--check`` compares the step-1 loss with one process on rank 0.
Rank 0 writes the result JSON (``step_times_s``, ``losses``, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _attention_forward(self, x: torch.Tensor) -> torch.Tensor:
    """CausalSelfAttention.forward on this rank's heads (after the q|k|v permutation)."""
    B, T, _ = x.shape
    q, k, v = self.c_attn(x).split(self.local_embd, dim=2)
    q = q.view(B, T, self.local_heads, self.head_dim).transpose(1, 2)
    k = k.view(B, T, self.local_heads, self.head_dim).transpose(1, 2)
    v = v.view(B, T, self.local_heads, self.head_dim).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(1, 2).contiguous().view(B, T, self.local_embd)
    return self.c_proj(y)


@torch.no_grad()
def _permute_qkv(linear: torch.nn.Linear, n_embd: int, tp: int) -> None:
    """Rows [q | k | v] -> [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: shard r of a
    ColwiseParallel split holds the q, k and v rows of head group r."""
    c = n_embd // tp
    order = torch.cat([torch.arange(part * n_embd + r * c, part * n_embd + (r + 1) * c)
                       for r in range(tp) for part in range(3)])
    linear.weight.copy_(linear.weight[order])
    if linear.bias is not None:
        linear.bias.copy_(linear.bias[order])


def parallelize_gpt(model: torch.nn.Module, mesh) -> torch.nn.Module:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh.size()
    cfg = model.config
    if cfg.n_head % tp:
        raise ValueError(f"{cfg.n_head} heads do not split over {tp} ranks")
    plan = {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i, block in enumerate(model.transformer.h):
        attn = block.attn
        _permute_qkv(attn.c_attn, cfg.n_embd, tp)
        attn.local_heads = cfg.n_head // tp
        attn.local_embd = cfg.n_embd // tp
        attn.head_dim = cfg.n_embd // cfg.n_head
        attn.forward = types.MethodType(_attention_forward, attn)
        plan.update({
            f"transformer.h.{i}.attn.c_attn": ColwiseParallel(),
            f"transformer.h.{i}.attn.c_proj": RowwiseParallel(),
            f"transformer.h.{i}.mlp.c_fc": ColwiseParallel(),
            f"transformer.h.{i}.mlp.c_proj": RowwiseParallel(),
        })
    return parallelize_module(model, mesh, plan)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-tiny", help="a GPT zoo model (default gpt-tiny)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--check", action="store_true", help="compare the step-1 loss with one process")
    ap.add_argument("--result-json")
    args = ap.parse_args(argv)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from training.reference import make_optimizer, train_one_process
    from models.source import build_model
    from models.zoo import GPT

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device_type, backend = "cuda", "nccl"
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device_type, backend = "cpu", "gloo"
        device = torch.device("cpu")
    t_setup = time.perf_counter()
    dist.init_process_group(backend)
    try:
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("tp",))
        kw = {"batch_size": args.batch_size}
        model, inputs = build_model(args.model, device=str(device), seed=0, **kw)
        if type(model) is not GPT:
            raise SystemExit(f"handwritten_tp: {args.model} is not a plain GPT zoo model")
        model.train()
        model = parallelize_gpt(model, mesh)
        opt = make_optimizer(model.parameters(), "sgd", args.lr)
        setup_s = time.perf_counter() - t_setup
        ref = None
        if args.check and rank == 0:
            step_of = types.SimpleNamespace(model={"source": args.model}, training=kw,
                                            precision="fp32", pipeline=None)
            ref = train_one_process(step_of, steps=args.steps, optimizer="sgd", lr=args.lr,
                                    min_lr_ratio=1.0, device=str(device))
        losses, step_times = [], []
        for _ in range(args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with loss_parallel():
                loss = model(*inputs)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            local = loss.to_local() if isinstance(loss, DTensor) else loss
            losses.append(float(local.detach()))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_times.append(time.perf_counter() - t0)
        result = {"program": "handwritten_tp", "model": args.model, "batch_size": args.batch_size,
                  "world_size": world, "device": device_type, "setup_s": setup_s,
                  "step_times_s": step_times, "losses": losses,
                  "parameters": {n: (str(tuple(p.placements)) if isinstance(p, DTensor) else "plain")
                                 for n, p in model.named_parameters()}}
        if ref is not None:
            errs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref.losses)]
            result.update({"reference_losses": ref.losses, "max_loss_rel_err": max(errs),
                           "passed": max(errs) <= 1e-4})
        if rank == 0:
            if args.result_json:
                with open(args.result_json, "w") as f:
                    json.dump(result, f, indent=1)
            print(f"handwritten tp={world}: loss {losses[0]:.6g}, median step "
                  f"{sorted(step_times[1:] or step_times)[len(step_times[1:] or step_times) // 2] * 1e3:.1f} ms",
                  flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
