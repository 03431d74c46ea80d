import math

import torch

from partialbayes.predictive import entropy


def test_uniform_entropy_is_log_c():
    lp = torch.full((3, 5), -math.log(5.0), dtype=torch.float64)
    torch.testing.assert_close(entropy(lp), torch.full((3,), math.log(5.0), dtype=torch.float64))


def test_point_mass_has_zero_entropy_without_nan():
    lp = torch.tensor([[0.0, -math.inf]])
    assert entropy(lp).item() == 0.0
