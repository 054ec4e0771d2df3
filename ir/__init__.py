"""Capture of PyTorch programs as planner graphs (no cluster or cost knowledge)."""

from ir.exported_graph import graph_from_exported
from ir.graph import Graph, Node, TensorInfo
from ir.program_capture import TraceError, capture
from ir.trace import trace

__all__ = ["Graph", "Node", "TensorInfo", "TraceError", "capture", "graph_from_exported", "trace"]
