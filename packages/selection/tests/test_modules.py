import pytest
from torch import nn

from partialbayes.selection import linear_modules


def test_linear_modules_in_order():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))
    assert list(linear_modules(model)) == ["0", "2.0"]


def test_no_linear_maps():
    with pytest.raises(ValueError, match="no linear maps"):
        linear_modules(nn.Sequential(nn.ReLU()))
