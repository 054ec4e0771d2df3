"""Capture of models made of many identical blocks from two truncated probes (:mod:`ir.block_capture.trace`)."""
