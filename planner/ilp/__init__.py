"""The intra-op pass: DTensor strategies, their assignment ILP (OR-Tools) and its solve."""
