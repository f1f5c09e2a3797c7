"""What a new user of the tables hit, each answered with a clear error: a dense rule given to a
LocalRowSource, mode='max_staleness' (a setting, not a mode), create_all_rows() on a table that
has rows (creates the rest: never too late), and the tables' errors reachable as tfl.X."""

from __future__ import annotations

import pytest
import torch

import tensorfleet as tfl
from tensorfleet.errors import ConfigError


def test_a_dense_rule_given_to_a_local_row_source_is_a_config_error_naming_the_fix() -> None:
    with pytest.raises(ConfigError, match="row-sparse rule .* the session's optimizer="):
        tfl.LocalRowSource([tfl.EmbeddingTable(1000, 8, name="d2")], rule=tfl.optim.SGD(lr=0.1))


def test_max_staleness_as_a_mode_says_how_to_ask_for_it() -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ConfigError, match="mode='async' with max_staleness=N"):
        tfl.TrainingSession(None, model, optimizer=tfl.optim.SGD(lr=0.1), mode="max_staleness")


def test_create_all_rows_on_a_table_with_rows_creates_the_rest() -> None:
    table = tfl.EmbeddingTable(100, 4, name="b")
    tfl.LocalRowSource([table])
    before = table(torch.tensor([3])).detach()  # a lookup creates row 3
    assert table.create_all_rows() == 99  # never too late: row 3 kept
    assert torch.equal(table(torch.tensor([3])).detach(), before)


def test_the_tables_errors_are_reachable_from_the_package() -> None:
    assert issubclass(tfl.TableNotAttached, tfl.TensorfleetError)
    assert issubclass(tfl.SparseRuleError, tfl.TensorfleetError)
    assert issubclass(tfl.SparseGradientError, tfl.TensorfleetError)
    with pytest.raises(tfl.TableNotAttached):
        tfl.EmbeddingTable(10, 2)(torch.tensor([1]))
