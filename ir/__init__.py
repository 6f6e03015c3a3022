"""titanc IR: op set, typed nodes over networkx, builder, printer, verifier, interpreter."""
from titanc.ir import elementwise  # registers the elementwise ops in OpGroup
from titanc.ir import attention  # registers the attention pattern ops' shape and reference rules
from titanc.ir import adamw  # registers the multi-tensor AdamW pattern op's rules
from titanc.ir import linear_cross_entropy  # registers the fused LM-head cross-entropy pattern ops' rules
from titanc.ir.builder import Builder, Value
from titanc.ir.interpret import Interpreter, interpret
from titanc.ir.ops import SCAN_ROLES, Op, OpGroup
from titanc.ir.graph import Graph, Node, format_graph, format_node
from titanc.ir.stats import graph_stats, largest_tensor_bytes
from titanc.ir.types import TensorType, dtype_name
from titanc.ir.verify import IRError, verify
from titanc.ir.dot import to_dot

__all__ = ["Builder", "Value", "Graph", "Node", "Interpreter", "interpret", "Op", "OpGroup", "SCAN_ROLES",
           "format_graph", "format_node", "graph_stats", "largest_tensor_bytes", "TensorType",
           "dtype_name", "IRError", "verify", "to_dot"]
