import pytest
import torch

from service import partition as P


def test_uniform():
    assert P.uniform(5, 2) == [3, 2]
    assert P.uniform(8, 4) == [2, 2, 2, 2]


def test_balanced_minimises_slowest_stage():
    assert P.balanced([1, 1, 1, 1], 2) == [2, 2]
    assert P.balanced([8, 1, 1, 1, 1], 2) == [1, 4]
    assert P.balanced([1, 1, 1, 1, 8], 3) == [2, 2, 1]
    assert P.balanced([3, 3, 3], 3) == [1, 1, 1]


def test_balanced_refuses_more_stages_than_layers():
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3"):
        P.balanced([1, 1], 3)


def test_choose_explicit_and_bounds():
    assert P.choose([1, 3], 4, 2) == [1, 3]
    assert P.bounds([1, 3]) == [(0, 1), (1, 4)]
    with pytest.raises(ValueError):
        P.choose([1, 2], 4, 2)


def test_profile_puts_the_heavy_layer_alone():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), *[torch.nn.ReLU() for _ in range(4)])
    costs = P.profile_layers(model, torch.randn(256, 512))
    assert len(costs) == 5 and costs[0] == max(costs)
    assert P.balanced(costs, 2)[0] == 1
    assert all(p.grad is None for p in model.parameters())


def test_profile_handles_integer_inputs():
    from service.builtins import char_transformer

    model = char_transformer(layers=2)
    costs = P.profile_layers(model, torch.randint(0, 96, (4, 32)))
    assert len(costs) == len(model) and all(c > 0 for c in costs)
