"""titanc IR: op set, typed nodes over networkx, builder, printer, verifier, interpreter."""
from . import elementwise  # registers the elementwise ops in OpGroup
from . import attention  # registers the attention pattern ops' shape and reference rules
from . import adamw  # registers the multi-tensor AdamW pattern op's rules
from . import linear_cross_entropy  # registers the fused LM-head cross-entropy pattern ops' rules
from .builder import Builder, Value
from .graph import Graph, Node
from .interpret import Interpreter, interpret
from .ops import SCAN_ROLES, Op, OpGroup
from .printer import format_graph, format_node
from .stats import graph_stats, largest_tensor_bytes
from .types import TensorType, dtype_name
from .verify import IRError, verify
from .dot import to_dot

__all__ = ["Builder", "Value", "Graph", "Node", "Interpreter", "interpret", "Op", "OpGroup", "SCAN_ROLES",
           "format_graph", "format_node", "graph_stats", "largest_tensor_bytes", "TensorType",
           "dtype_name", "IRError", "verify", "to_dot"]
