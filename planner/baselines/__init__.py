"""Hand-made baselines in the Plan format: Megatron-LM, published layouts, and the comparison."""
