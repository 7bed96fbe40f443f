"""``training.batch_norm: global`` without Ray (actors/globalnorm.py): the joint BatchNorm equals
PyTorch's BatchNorm on the concatenated batch, forward and backward; microbatch forwards run as
threads meet at each BatchNorm and keep their own dropout draws; what goes wrong is said."""
from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from actors.batchnorm import RunningStats
from actors import globalnorm
from actors.globalnorm import GlobalNorm, Lockstep
from service.tracing import norms_of


@pytest.mark.parametrize("make, shape", [(lambda: nn.BatchNorm2d(3), (2, 3, 4, 4)),
                                         (lambda: nn.BatchNorm1d(5, affine=False), (2, 5))])
def test_the_joint_norm_is_pytorchs_on_the_whole_batch_forward_and_backward(make, shape):
    torch.manual_seed(0)
    bn = make()
    if bn.affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    sizes = [2, 3, 1]  # microbatches of different sizes
    xs = [torch.randn(n, *shape[1:], requires_grad=True) for n in sizes]
    w = torch.randn(sum(sizes), *shape[1:])
    ys = GlobalNorm.apply(bn.weight, bn.bias, bn.eps, None, globalnorm.sums(xs), *xs)
    (torch.cat(ys) * w).sum().backward()
    got = [x.grad.clone() for x in xs], [q.grad.clone() for q in bn.parameters()]

    ref = copy.deepcopy(bn)
    for q in bn.parameters():
        q.grad = None
    whole = torch.cat([x.detach() for x in xs]).requires_grad_()
    out = ref(whole)
    (out * w).sum().backward()
    torch.testing.assert_close(torch.cat(ys), out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat(got[0]), whole.grad, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(got[1], ref.parameters()):
        torch.testing.assert_close(mine, theirs.grad, rtol=1e-5, atol=1e-6)


def test_under_bf16_the_joint_norm_returns_bf16_computed_in_float32():
    """As PyTorch's BatchNorm under bf16 autocast: bf16 in, bf16 out, float32 arithmetic."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(8)
    xs = [(torch.randn(4, 8) * 3 + 1).bfloat16() for _ in range(3)]
    ys = GlobalNorm.apply(bn.weight, bn.bias, bn.eps, None, globalnorm.sums(xs), *xs)
    assert all(y.dtype == torch.bfloat16 for y in ys)
    want = bn(torch.cat(xs).float())
    torch.testing.assert_close(torch.cat(ys).float(), want, rtol=1e-2, atol=1e-2)


def _layer():
    """Linear, BatchNorm and Dropout in one user layer: the dropout after the BatchNorm."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4, momentum=0.3), nn.Dropout(0.5))


def _run_together(layer, xs, seeds, fail=None):
    stats = RunningStats(norms_of(layer), "global", len(xs))
    outs = {}
    lock = Lockstep(stats.together, lambda j, out: outs.__setitem__(j, out))
    stats.lockstep = lock
    try:
        for j, x in enumerate(xs):
            def fn(j=j, x=x):
                torch.manual_seed(seeds[j])
                if fail is not None:
                    fail(j)
                return layer(x)
            lock.start(j, fn)
        lock.go_on()
    finally:
        stats.lockstep = None
        lock.abort()
    return [outs[j] for j in range(len(xs))], stats


def test_microbatches_meet_at_the_norm_and_keep_their_own_dropout_masks():
    """Each microbatch's dropout after the BatchNorm draws what it would draw alone after its
    seed (the generator's state is kept across the wait); the gradients and the running
    statistics are one process's on the whole batch."""
    layer, ref = _layer(), _layer()
    xs = [torch.randn(3, 6) for _ in range(4)]
    seeds = [11, 12, 13, 14]
    ys, stats = _run_together(layer, xs, seeds)
    sum((y * (k + 1)).sum() for k, y in enumerate(ys)).backward()
    stats.apply(stats.reduce())

    lin, bn, drop = ref
    normed = bn(lin(torch.cat(xs))).split(3)
    want = []
    for s, h in zip(seeds, normed):
        torch.manual_seed(s)
        want.append(drop(h))
    sum((y * (k + 1)).sum() for k, y in enumerate(want)).backward()
    for a, b in zip(ys, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert (torch.cat(ys) == 0).any()  # the dropout acted
    for (name, a), b in zip(layer.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4, msg=name)  # |grad| up to 100
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(layer[1], name), getattr(ref[1], name), rtol=1e-5, atol=1e-7)


def _all_idle():
    """Every microbatch thread is back in the pool (none left waiting at a BatchNorm)."""
    for _ in range(100):
        kept, idle = globalnorm.pool()
        if kept == idle:
            return True
        time.sleep(0.01)
    return False


def test_a_user_error_in_one_microbatch_is_raised_with_its_text_and_no_thread_is_left_waiting():

    def fail(j):
        if j == 2:
            raise ValueError("my layer refuses microbatch 2 (whatever it says: {braces}, 100%)")
    with pytest.raises(ValueError, match=r"my layer refuses microbatch 2 \(whatever it says: \{braces\}, 100%\)"):
        _run_together(_layer(), [torch.randn(3, 6) for _ in range(4)], [1, 2, 3, 4], fail)
    assert _all_idle()


def test_microbatches_that_take_different_paths_are_refused_saying_why():
    class Sometimes(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(6)

        def forward(self, x):
            return self.bn(x) if x[0, 0] > 0 else x

    xs = [torch.full((2, 6), 1.0), torch.full((2, 6), -1.0), torch.full((2, 6), 1.0)]
    with pytest.raises(RuntimeError, match="global needs every microbatch to reach every BatchNorm"):
        _run_together(Sometimes(), xs, [0, 0, 0])
    assert _all_idle()
