"""benchmarks.op_breakdown: the cost model's price of a step, by op and kind, laid
beside torch.profiler's names for the same kernels."""

import pytest

from benchmarks.op_breakdown import CATEGORIES, category, predict_case


@pytest.mark.parametrize("name, kind", [
    ("aten::mm", "matmul"), ("aten.addmm.default", "matmul"),
    ("aten::_cudnn_attention_backward", "attention"),
    ("aten.scaled_dot_product_attention.default", "attention"),
    ("aten::native_layer_norm_backward", "norm"), ("aten::_log_softmax", "loss"),
    ("aten::_foreach_addcdiv_", "optimizer"), ("aten::_to_copy", "copy"),
    ("aten::embedding_dense_backward", "embedding"), ("aten::gelu_backward", "elementwise"),
])
def test_profiler_and_captured_names_share_categories(name, kind):
    assert category(name) == kind


def test_predicted_step_adds_up_by_category():
    """Every captured op, parameter cast and optimizer update is priced once, and
    the categories sum to the whole."""
    rec = predict_case("gpt-tiny", 2, 16, "bf16-mixed", "local-cpu:1")
    assert set(rec["by_category"]) == set(CATEGORIES)
    assert sum(rec["by_category"].values()) == pytest.approx(rec["total_s"])
    assert rec["by_category"]["matmul"] > 0 and rec["by_category"]["optimizer"] > 0
    assert rec["by_category"]["copy"] > 0  # bf16-mixed casts its parameters
