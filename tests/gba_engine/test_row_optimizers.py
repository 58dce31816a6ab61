"""One family of row optimizers: the servers' tables and the workers' copies load the state saved before the merge.

``data/row_optimizer_states.pt`` was written by the row optimizers as they were before they became
members of picasso_ops' family (``gba_engine/ps/optim.py`` at commit fe9d154: ``LazyTorchAdam``,
``LazySGD``, ``LazyAdagrad`` with their own update code, ``SparseRowOptimizer`` over picasso's): for
each optimizer a table's ``state_dict()`` after three updates, then one more update and the
``state_dict()`` after it. Loading the first into today's table and applying the same update must
give the second bit for bit: same keys, same shapes, same arithmetic.
"""
from pathlib import Path

import pytest
import torch

from gba_engine.ps.optim import OptimizerSpec, RowOptimizer, TableOptimizerSpec
from picasso_ops.embedding.sparse_optim import (OPTIMIZERS, TORCH_ROW_OPTIMIZERS, SparseOptimizer,
                                                TorchRowAdam)

SAVED = torch.load(Path(__file__).parent / "data" / "row_optimizer_states.pt", weights_only=True)
SPECS = {
    "adamw": OptimizerSpec.of("adamw", lr=0.01),
    "adam_l2": OptimizerSpec.of("adam", lr=0.01, weight_decay=0.1, betas=(0.8, 0.95)),
    "sgd": OptimizerSpec.of("sgd", lr=0.1),
    "sgd_nesterov": OptimizerSpec.of("sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adagrad": OptimizerSpec.of("adagrad", lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
    "picasso_rowwise_adagrad": TableOptimizerSpec.of("rowwise_adagrad", lr=0.05),
    "picasso_adam": TableOptimizerSpec.of("adam", lr=0.01, weight_decay=0.1),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_state_saved_before_the_merge_loads_and_continues_bit_equal(name):
    case = SAVED[name]
    table = SPECS[name].build_rows(case["initial"])
    assert isinstance(table, RowOptimizer) and isinstance(table.sparse, SparseOptimizer)
    assert sorted(table.state_dict()) == sorted(case["state"])  # the layout of the old checkpoints
    table.load_state_dict(case["state"])
    table.step(case["next_rows"], case["next_grad"])
    after = table.state_dict()
    assert after["steps"] == case["after"]["steps"] == 4
    for key, want in case["after"].items():
        if key != "steps":
            assert torch.equal(after[key], want), f"{name}: {key} differs from the pre-merge update"


def test_a_state_of_another_optimizer_is_refused_with_both_names():
    table = SPECS["adagrad"].build_rows(torch.zeros(6, 3))
    with pytest.raises(ValueError, match=r"table state has keys .*exp_avg.*TorchRowAdagrad.*\['steps', 'sum', 'weight'\]"):
        table.load_state_dict(SAVED["adamw"]["state"])


def test_one_family_the_block_choices_and_the_servers_torch_formulas():
    assert set(OPTIMIZERS) == {"sgd", "rowwise_adagrad", "adam"}  # the picasso block's choices are unchanged
    assert all(issubclass(cls, SparseOptimizer) for cls in TORCH_ROW_OPTIMIZERS.values())
    table = OptimizerSpec.of("adamw", lr=0.01).build_rows(torch.zeros(2, 2))
    assert isinstance(table.sparse, TorchRowAdam) and table.sparse.hyperparams["weight_decay"] == 0.01
    table.lr = 2.0  # the servers' schedule sets it; torch's formulas do not cap lr x weight_decay
    assert table.lr == 2.0
    with pytest.raises(ValueError, match="learning rate must be >= 0"):
        table.lr = -1.0
