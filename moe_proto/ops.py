"""moe_proto's C++ CPU ops, one library: the expert FFN loop and the layer's other heavy steps.

* ``csrc/expert_ffn.cpp``: the expert FFN loop with the activation and its derivative in one pass;
* ``csrc/combine_grad.cpp``: both gradients of the combine in one pass (``moe_proto.dispatch``);
* ``csrc/router_grad.cpp``: the router's input gradient and the dispatch's in one pass (``moe_proto.layer``);
* ``csrc/route_slots.cpp``: the top-1 choice and the capacity slots (``moe_proto.routing``).

The library is declared once as :data:`LIBRARY` and JIT-built once by the project's one loader,
:func:`sparse_core.jit_build.load` (a cache folder per CPU kind, stale build locks
named or cleared), into ``<torch extensions>/moe_proto_cpu-<build key>``. Without a
compiler, or when the build fails, :func:`load_cpu_ops` logs one warning and returns
None, and every caller keeps its torch expression (:class:`moe_proto.experts.GroupedExperts`
its pure-torch loop).

What it saves over the pooled torch loop is measured in benchmarks/RESULTS.md (MoE layer sections).
GELU's backward does not recompute erf and exp (the forward pass keeps the derivative instead of the
pre-activation, same memory), the biases are added and summed inside those passes, and the per-expert
loop runs in C++ without the GIL.

Prebuild every op of the project (``make venv`` does it)::

    python -m sparse_scale.prebuild

Example::

    ops = load_cpu_ops()          # the module, or None (pure-torch fallback)
"""
from __future__ import annotations

import logging
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
# -march=native comes from the library's build settings (the loader adds it).
CFLAGS = ("-O3", "-fopenmp-simd", "-mprefer-vector-width=512")

LIBRARY = jit_build.register(jit_build.OpLibrary(
    name=EXTENSION_NAME, package="moe_proto", sources=SOURCES, cflags=CFLAGS, march_index=1,
    fallback="the torch paths run (slower on CPU)",
    settings=lambda: jit_build.BuildSettings(march="native", stale_after_s=STALE_LOCK_S),
), declared_by=__name__)
_state = jit_build.load_state(LIBRARY)  # {"module", "failed"}: this process's load, shared with the loader


def build_directory(march: str = "native", root: Optional[Path] = None) -> Path:
    """``<root>/moe_proto_cpu-<build key>``; ``root`` defaults to torch's extensions folder.

    Example::

        >>> build_directory("x86-64-v2", Path("/tmp/ext")).name
        'moe_proto_cpu-x86-64-v2'
    """
    return LIBRARY.directory(jit_build.BuildSettings(march=march, root=root))


def load_cpu_ops(*, verbose: bool = False, clear_stale: bool = True) -> Optional[object]:
    """The built extension module (building it on first use), or None after one warning if it cannot be.

    :func:`sparse_core.jit_build.load` of :data:`LIBRARY`. A
    :class:`~sparse_core.jit_build.StaleLockError` (``clear_stale=False``) is raised, not swallowed: the
    user must delete the lock it names.
    """
    module = _state["module"]
    if module is not None:  # the hot path: the layer asks on every call
        return module
    return jit_build.load(LIBRARY, verbose=verbose, clear_stale=clear_stale)


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
    jit_build.forget_failure(LIBRARY)


if __name__ == "__main__":  # the old prebuild command: say where it went instead of exiting 0 with nothing built
    raise SystemExit("moe_proto.ops is the library; build it with `python -m sparse_scale.prebuild`")
