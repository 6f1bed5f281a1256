"""atomflow.tokens: the one id check and the one generation budget the facade and backends share."""

import numpy as np
import pytest

from atomflow.tokens import check_ids, generation_budget


def test_check_ids_accepts_any_integer_sequence():
    out = check_ids(np.array([[1, 2], [3, 4]], dtype=np.uint16), 5)
    assert out.dtype == np.int32 and out.tolist() == [1, 2, 3, 4]
    assert check_ids([0], 1).tolist() == [0]


@pytest.mark.parametrize(
    "ids, message",
    [
        ([], "empty prompt"),
        ([1.5, 2.0], "must be integers"),
        (["a"], "must be integers"),
        ([1, 7, 2], "token id 7 out of range [0, 5)"),
        ([-1], "token id -1 out of range"),
    ],
)
def test_check_ids_names_the_problem(ids, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
        check_ids(ids, 5)


def test_generation_budget_stops_at_the_context():
    assert generation_budget(10, 4, 100) == 4
    assert generation_budget(10, 400, 100) == 91  # steps at positions 9 .. 99
    assert generation_budget(100, 4, 100) == 1  # the last prompt token still yields one
