"""Deprecated: ``python -m sparse_scale.prebuild`` builds every C++ op of the project, this library included.

    python -m moe_proto.prebuild            # still builds moe_proto's library (exit 0 / 1), with a warning
    python -m moe_proto.prebuild --verbose  # with the compiler's commands

Kept for one release so that scripts holding the old command keep working.
"""
from __future__ import annotations

import argparse
import logging
import sys
import warnings
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
    warnings.warn("`python -m moe_proto.prebuild` is deprecated and goes in the next release: "
                  "`python -m sparse_scale.prebuild` builds every C++ op of the project", DeprecationWarning,
                  stacklevel=2)
    try:
        return 0 if load_cpu_ops(verbose=args.verbose) is not None else 1
    except jit_build.StaleLockError as exc:
        logger.error("%s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
