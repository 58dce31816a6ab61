"""``python -m sparse_scale.lm --config ... --data ...``: the MoE LM job's command line."""
from .cli import main

if __name__ == "__main__":
    main()
