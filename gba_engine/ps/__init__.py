"""Parameter server for GBA: dedicated server ranks in the same launch, gloo point-to-point, TCPStore control plane.

Example::

    rt = init_runtime(GBAConfig(num_servers=1))           # every rank, after init_process_group
    specs = [ServerTableSpec("user", 10_000, 16)]
    if rt.is_server:
        ParameterServer(rt, cfg, n, specs, OptimizerSpec.of("sgd", lr=0.1)).serve(until_version=100)
    else:
        client = PSClient(rt, n, specs)
        got = client.pull({"user": ids})
        client.push(dense_grad, {"user": ids}, {"user": row_grads}, got.token, num_samples=len(ids))
        client.close()
    rt.close()
"""
from .client import PSClient, PSStalledError, Pulled, Token
from .optim import LazyAdagrad, LazySGD, LazyTorchAdam, OptimizerSpec, RowOptimizer
from .channel import PeerChannel
from .errors import PSConnectionError, ServerLostError
from .roles import Layout, layout
from .liveness import Liveness
from .rendezvous import init_runtime, join_runtime, read_layout
from .runtime import PSRuntime
from .server import ParameterServer, ServeStats, ShardState
from .sharding import DenseSharding, RowRoute, ServerTableSpec
from .wire import Header, Kind, ProtocolError

__all__ = [
    "DenseSharding", "Header", "Kind", "LazyAdagrad", "LazySGD", "LazyTorchAdam", "Layout",
    "Liveness", "OptimizerSpec", "PSClient", "PSConnectionError", "PSRuntime", "PSStalledError",
    "ParameterServer", "PeerChannel", "ProtocolError", "Pulled", "RowOptimizer", "RowRoute", "ServeStats", "ServerLostError",
    "ServerTableSpec",
    "ShardState", "Token", "init_runtime", "join_runtime", "layout", "read_layout",
]
