"""The plain eager training step the benchmarks measure plans against
(benchmarks/plain_loop.py): precisions, checkpointing and its memory count."""

from __future__ import annotations

import pytest
import torch

from benchmarks.plain_loop import PlainLoop, tracked_peak_memory

BLOCKS = ["transformer.h.0", "transformer.h.1"]


def _tiny(precision: str, checkpoint: list[str] = (), batch_size: int = 4) -> PlainLoop:
    return PlainLoop.from_zoo("gpt-tiny", precision=precision, checkpoint=list(checkpoint),
                              batch_size=batch_size, seq_len=32)


@pytest.mark.parametrize("checkpoint", [[], BLOCKS])
def test_bf16_mixed_keeps_fp32_master_and_bf16_activations(checkpoint):
    loop = _tiny("bf16-mixed", checkpoint)
    seen: list[torch.dtype] = []
    block = loop.model.get_submodule("transformer.h.0")
    block.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    loss = loop.forward()
    assert loss.dtype == torch.bfloat16
    loss.backward()
    assert seen and set(seen) == {torch.bfloat16}  # forward and, checkpointed, its recompute
    for name, p in loop.model.named_parameters():
        assert p.dtype == torch.float32, name
        assert p.grad is not None and p.grad.dtype == torch.float32, name
    loop.optimizer.step()
    states = [t for s in loop.optimizer.state.values() for k, t in s.items() if k != "step"]
    assert states and all(t.dtype == torch.float32 for t in states)
    assert all(p.dtype == torch.float32 for p in loop.model.parameters())


def test_bf16_casts_the_model_once():
    loop = _tiny("bf16")
    assert {p.dtype for p in loop.model.parameters()} == {torch.bfloat16}
    assert loop.step().dtype == torch.bfloat16


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_checkpointing_keeps_the_step_and_lowers_the_peak(precision):
    # 8 x 32: the activations, not the optimizer step, make the peak
    plain, ckpt = _tiny(precision, batch_size=8), _tiny(precision, BLOCKS, batch_size=8)
    for loop in (plain, ckpt):
        loop.forward().backward()
    for (name, a), (_, b) in zip(plain.model.named_parameters(), ckpt.model.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
        a.grad = b.grad = None
    peak = tracked_peak_memory(plain)
    peak_ckpt = tracked_peak_memory(ckpt)
    assert peak_ckpt["before_step_bytes"] == peak["before_step_bytes"]
    assert peak_ckpt["peak_bytes"] < peak["peak_bytes"]
    # the steady state holds parameters and both AdamW states
    params = sum(p.numel() * p.element_size() for p in plain.model.parameters())
    assert peak["before_step_bytes"] >= 3 * params


def test_unknown_checkpoint_path():
    with pytest.raises(ValueError, match="no module 'transformer.h.9'"):
        _tiny("fp32", ["transformer.h.9"])
