"""moe_proto's C++ CPU ops, one library: the expert FFN loop and the layer's other heavy steps.

* ``csrc/expert_ffn.cpp``: the expert FFN loop with the activation and its derivative in one pass;
* ``csrc/combine_grad.cpp``: both gradients of the combine in one pass (``moe_proto.dispatch``);
* ``csrc/router_grad.cpp``: the router's input gradient and the dispatch's in one pass (``moe_proto.layer``);
* ``csrc/route_slots.cpp``: the top-1 choice and the capacity slots (``moe_proto.routing``).

They are JIT-built once (``torch.utils.cpp_extension`` through
:mod:`sparse_core.jit_build`: a cache folder per CPU kind, stale build locks
named or cleared) into ``<torch extensions>/moe_proto_cpu-<build key>``. Without a
compiler, or when the build fails, :func:`load_cpu_ops` logs one warning and returns
None, and every caller keeps its torch expression (:class:`moe_proto.experts.GroupedExperts`
its pure-torch loop).

What it saves over the pooled torch loop is measured in benchmarks/RESULTS.md (MoE layer sections).
GELU's backward does not recompute erf and exp (the forward pass keeps the derivative instead of the
pre-activation, same memory), the biases are added and summed inside those passes, and the per-expert
loop runs in C++ without the GIL.

Prebuild (``make venv`` does it; :mod:`moe_proto.prebuild`)::

    python -m moe_proto.prebuild

Example::

    ops = load_cpu_ops()          # the module, or None (pure-torch fallback)
"""
from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from sparse_core import jit_build

logger = logging.getLogger(__name__)

EXTENSION_NAME = "moe_proto_cpu"
SOURCES = tuple(Path(__file__).resolve().parent / "csrc" / name
                for name in ("expert_ffn.cpp", "combine_grad.cpp", "router_grad.cpp", "route_slots.cpp",
                             "bindings.cpp"))
STALE_LOCK_S = 600.0  # the build takes about 20 s on 2 cores; a lock this old with no live builder is dead
# Activation codes of the C++ kernels (activations without one run in the torch loop).
ACTIVATION_CODES = {"gelu": 0, "gelu_tanh": 1, "relu": 2, "silu": 3}

# 512-bit vectors where the CPU has them (GCC prefers 256 on AVX-512 by default): 20% off the activation pass.
CFLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-mprefer-vector-width=512")

_lock = threading.Lock()
_state: dict = {"module": None, "failed": None}


def build_directory(march: str = "native", root: Optional[Path] = None) -> Path:
    """``<root>/moe_proto_cpu-<build key>``; ``root`` defaults to torch's extensions folder.

    Example::

        >>> build_directory("x86-64-v2", Path("/tmp/ext")).name
        'moe_proto_cpu-x86-64-v2'
    """
    flags = jit_build.cpu_isa_flags() if march == "native" else ()
    return (jit_build.extensions_root() if root is None else Path(root)) / \
        f"{EXTENSION_NAME}-{jit_build.build_key(march, flags)}"


def load_cpu_ops(*, verbose: bool = False, clear_stale: bool = True) -> Optional[object]:
    """The built extension module (building it on first use), or None after one warning if it cannot be.

    A :class:`~sparse_core.jit_build.StaleLockError` (``clear_stale=False``) is raised,
    not swallowed: the user must delete the lock it names.
    """
    if _state["module"] is not None or _state["failed"] is not None:
        return _state["module"]
    with _lock:
        if _state["module"] is not None or _state["failed"] is not None:
            return _state["module"]
        started = time.perf_counter()
        reason = None
        if shutil.which("c++") is None:
            reason = "no C++ compiler ('c++' is not on PATH)"
        else:
            try:
                _state["module"] = jit_build.build_extension(
                    name=EXTENSION_NAME, sources=SOURCES, directory=build_directory(),
                    extra_cflags=CFLAGS, stale_after_s=STALE_LOCK_S,
                    clear_stale=clear_stale, verbose=verbose, log=logger)
            except jit_build.StaleLockError:
                raise
            except Exception as exc:  # a broken toolchain must not stop training: fall back, once, loudly
                reason = f"{type(exc).__name__}: {str(exc).strip()[-2000:]}"
        if reason is not None:
            _state["failed"] = reason
            logger.warning("moe_proto: the C++ CPU ops are unavailable; the torch paths run (slower on CPU). "
                           "Reason: %s. Fix: install g++ and ninja, then run `python -m moe_proto.prebuild`.",
                           reason)
            return None
        logger.info("moe_proto C++ CPU ops ready in %.1f s (%s)", time.perf_counter() - started,
                    build_directory())
        return _state["module"]


def cpu_ops_for(*tensors: "torch.Tensor") -> Optional[object]:
    """The library when every tensor given is a float32 CPU tensor (what its kernels take), else None.

    Example::

        ops = cpu_ops_for(grad, y)     # None for bf16 or CUDA operands: run the torch expression
    """
    if all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return load_cpu_ops()
    return None


def reset() -> None:
    """Forget a failed build so the next :func:`load_cpu_ops` tries again (tests, or after installing g++)."""
    with _lock:
        _state["failed"] = None


if __name__ == "__main__":  # the old prebuild command: say where it went instead of exiting 0 with nothing built
    raise SystemExit("moe_proto.ops is the library; build it with `python -m moe_proto.prebuild`")
