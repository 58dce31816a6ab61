"""Distribution "sparse-scale": a DeepSpeed plugin for large sparse models."""
from setuptools import find_packages, setup

setup(
    name="sparse-scale",
    version="0.1.0",
    description="DeepSpeed plugin for large-scale MoE and embeddings: GBA, PICASSO, expert prototyping",
    python_requires=">=3.10",
    packages=find_packages(include=["sparse_core*", "sparse_scale*", "picasso_ops*", "moe_proto*", "gba_engine*"]),
    # every native source and header ships: the C++ ops are JIT-built from source on first use
    package_data={"picasso_ops.ops": ["csrc/*.cpp", "csrc/*.h"], "moe_proto": ["csrc/*.cpp", "csrc/*.h"]},
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.19.8",
        "wandb",
        "pydantic>=2",
        "numpy",
        "tqdm",
        "hjson",
        "pyarrow",
    ],
    entry_points={
        "console_scripts": [
            "sparse-train-rec = sparse_scale.rec.cli:main",
            "sparse-train-moe-lm = sparse_scale.lm.cli:main",
            "sparse-plan = sparse_scale.lm.plan:main",
        ],
    },
    extras_require={
        "mpi": ["mpi4py", "mpich"],
        # moe_proto.hf: Mixtral-style transformers models on moe_proto.MoE; Trainer + DeepSpeed needs accelerate.
        "hf": ["transformers>=5.0,<6", "accelerate>=1.0"],
        # NVIDIA apex is built from source (see README); PyPI's "apex" is an unrelated package.
        "gpu": ["triton"],
        # triton runs the GPU kernels' correctness tests on CPU (TRITON_INTERPRET=1); ninja builds the C++ ops.
        "test": ["pytest", "pytest-timeout", "mpi4py", "mpich", "triton", "ninja"],
        # torchrec is installed with --no-deps by the Makefile (its pins would pull a CUDA torch).
        "bench": ["fbgemm-gpu-cpu==1.8.0", "tensordict", "torchmetrics", "pyre-extensions"],
    },
)
