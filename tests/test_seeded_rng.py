"""Each test starts from the same global RNG state (tests/conftest.py ``_seeded_global_rng``), so
a test's unseeded draws do not depend on which tests ran before it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch


@pytest.mark.parametrize("draws_before", [0, 5])
def test_a_test_starts_from_the_seeded_global_streams(draws_before):
    # The second case draws first, then hands over to the next test case: the next one must not see it.
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(0)))
    assert random.random() == random.Random(0).random()
    assert np.random.rand() == np.random.RandomState(0).rand()
    for _ in range(draws_before):
        torch.rand(1), random.random(), np.random.rand()
