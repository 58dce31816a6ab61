"""``python -m sparse_scale.rec --config ...``: the same as the ``sparse-train-rec`` console script."""
from sparse_scale.rec.cli import main

main()
