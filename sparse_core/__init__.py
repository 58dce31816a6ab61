"""The foundation the three packages share: leaves with no dependency on any package of this project.

``picasso_ops``, ``moe_proto`` and ``gba_engine`` may import ``sparse_core`` and nothing
else of ``sparse_scale``; ``sparse_core`` imports none of them (tests/repo/test_architecture.py).
"""
