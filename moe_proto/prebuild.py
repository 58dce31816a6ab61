"""Build moe_proto's C++ CPU ops now, so that no training job or test waits on a JIT build.

    python -m moe_proto.prebuild            # exit 0 when the library is ready, 1 when it cannot be built
    python -m moe_proto.prebuild --verbose  # with the compiler's commands

A module of its own (not ``python -m moe_proto.ops``): the package imports :mod:`moe_proto.ops`, and running an
already imported module as ``__main__`` makes Python warn and load it twice.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

from sparse_core import jit_build

from .ops import load_cpu_ops

logger = logging.getLogger(__name__)


def main(argv: Optional[list] = None) -> int:
    """Build (or find) the library; the exit status says whether it is ready."""
    parser = argparse.ArgumentParser(prog="python -m moe_proto.prebuild", description=__doc__.split("\n")[0])
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return 0 if load_cpu_ops(verbose=args.verbose) is not None else 1
    except jit_build.StaleLockError as exc:
        logger.error("%s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
