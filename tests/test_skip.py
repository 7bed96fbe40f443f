"""relaytrain.skip without Ray: skippable layers run unchanged in one process as
nn.Sequential(*layers) (the reference semantics), and a model's skips are checked with messages
that say what to change."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from relaytrain.skip import Namespace, SkipError, layout, pop, skippable, stash
from tests.fixtures.userpkg import models


def unet():
    torch.manual_seed(0)
    return [make() for make in models.unet()]


def test_a_unet_runs_as_a_plain_sequential_and_its_skips_are_found():
    layers = unet()
    x = torch.randn(4, 64, requires_grad=True)
    out = nn.Sequential(*layers)(x)
    assert out.shape == (4, 10)
    out.sum().backward()
    assert all(q.grad is not None for q in nn.Sequential(*layers).parameters())  # the skips carry gradient
    found = [(s.name, s.key[0].label, s.stasher, s.popper) for s in layout(layers)]
    assert found == [("enc", "outer", 2, 7), ("enc", "inner", 3, 6)]


def test_the_skip_adds_what_was_stashed():
    """By hand: the model without the skip machinery gives the same numbers."""
    layers = unet()
    x = torch.randn(3, 64)
    got = nn.Sequential(*layers)(x)
    h = torch.relu(layers[0](x))
    e1 = torch.relu(layers[2].inner(h))
    h = layers[2].down(e1)
    e2 = torch.relu(layers[3].inner(h))
    h = torch.tanh(layers[4](layers[3].down(e2)))
    h = torch.relu(layers[6].up(h) + e2)
    h = torch.relu(layers[7].up(h) + e1)
    torch.testing.assert_close(got, layers[8](h))


@skippable(stash=["a"])
class StashA(nn.Module):
    def forward(self, x):
        yield stash("a", x)
        return x + 1


@skippable(pop=["a"])
class PopA(nn.Module):
    def forward(self, x):
        a = yield pop("a")
        return x + a


@skippable(stash=["a"])
class ForgetsToStash(nn.Module):
    def forward(self, x):
        if False:
            yield
        return x


@pytest.mark.parametrize("layers, says", [
    (lambda: [StashA(), nn.ReLU()], "skip 'a' is stashed by layer 0 and never popped: add a layer that pops it"),
    (lambda: [nn.ReLU(), PopA()], "skip 'a' is popped by layer 1 and never stashed: add a layer that stashes it"),
    (lambda: [PopA(), StashA()], "skip 'a' is popped by layer 0 before layer 1 stashes it"),
    (lambda: [StashA(), StashA(), PopA()], "skip 'a' is stashed twice in one namespace (layers 0 and 1): give each "
                                          "use of the layer its own Namespace, e.g. StashA().isolate(Namespace())"),
    (lambda: [StashA().isolate(Namespace()), PopA()], "skip 'a' is stashed by layer 0 and never popped"),
])
def test_skips_that_do_not_add_up_are_refused_with_what_to_change(layers, says):
    with pytest.raises(SkipError) as e:
        layout(layers())
    assert says in str(e.value)


def test_a_layer_that_breaks_its_declaration_says_so_when_it_runs():
    with pytest.raises(SkipError, match="declared but did not stash 'a'"):
        nn.Sequential(ForgetsToStash())(torch.zeros(1))

    @skippable(stash=["b"])
    class Undeclared(nn.Module):
        def forward(self, x):
            yield stash("c", x)
            return x

    with pytest.raises(SkipError, match=r"does stash\('c'\) but declares stash=\['b'\]: add 'c'"):
        Undeclared()(torch.zeros(1))
    with pytest.raises(SkipError, match="on both sides"):
        skippable(stash=["x"], pop=["x"])


def test_activation_checkpointing_recomputes_skippable_layers_with_their_first_pops():
    """Each entry of the U-Net checkpointed (recomputed in backward, last entry first): a plain
    checkpoint fails, since the recomputed popper pops a skip already popped; wrapped in
    ``recomputable`` it pops the same tensors again and the gradients are the plain run's."""
    from torch.utils.checkpoint import checkpoint

    from relaytrain.skip import recomputable

    torch.manual_seed(0)
    layers = [make() for make in models.unet()]
    x = torch.randn(8, 64)

    def grads(wrap):
        for q in nn.ModuleList(layers).parameters():
            q.grad = None
        h = x
        for layer in layers:
            h = wrap(layer, h)
        h.square().sum().backward()
        return [q.grad.clone() for q in nn.ModuleList(layers).parameters()]

    want = grads(lambda layer, h: layer(h))
    got = grads(lambda layer, h: checkpoint(recomputable(layer), h, use_reentrant=False))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    with pytest.raises(SkipError, match="popped before anything stashed it"):
        grads(lambda layer, h: checkpoint(layer, h, use_reentrant=False))
