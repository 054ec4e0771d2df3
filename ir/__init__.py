"""Capture of PyTorch programs as planner graphs (no cluster or cost knowledge)."""

from ir.graph import Graph, Node, TensorInfo
from ir.trace import TraceError, capture, graph_from_exported, trace

__all__ = ["Graph", "Node", "TensorInfo", "TraceError", "capture", "graph_from_exported", "trace"]
