import pytest
import torch

from service import partition as P
from service import tracing


def test_uniform():
    assert P.uniform(5, 2) == [3, 2]
    assert P.uniform(8, 4) == [2, 2, 2, 2]


def test_the_first_layers_compute_no_input_gradient():
    """The model's input needs no gradient: a layer before any parameter has no backward, the first
    with parameters only its weight gradient, every later one both; the estimate weighs them so."""
    assert tracing.backward_passes([0, 64, 0, 64, 64]) == [1, 2, 3, 3, 3]
    assert tracing.backward_passes([0, 0]) == [1, 1] and tracing.backward_passes([]) == []
    t = tracing.Trace(metas=[None] * 3, flops=[10**6] * 3, param_bytes=[64, 0, 64], io_bytes=[4096] * 3,
                      stateless=frozenset({1}), on_meta=True)
    first, relu, second = tracing.estimate_seconds(t, threads=1)
    assert first == pytest.approx(second * 2 / 3) and relu == pytest.approx(second)
    # five equal Linears on 2 stages: the first stage, whose first layer makes 2 passes, takes the
    # odd layer (8 units against 6; the other way 5 against 9)
    assert P.balanced([float(n) for n in tracing.backward_passes([64] * 5)], 2) == [3, 2]


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
