"""The zero-bubble schedules' B/W split for Linear layers (actors/deferred.py), without Ray: the
gradients of B followed by W equal one whole backward's, on models written as users write them
(transformers' Llama and GPT-2 blocks, random init; a Linear used twice; a frozen Linear; a subclass with
its own forward; 3-D inputs), and the layers come back untouched."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from actors import deferred


def grads_whole_and_split(model: nn.Module, x: torch.Tensor, runs: int = 2):
    """(whole backward's gradients, B-then-W gradients, input gradients of each), over ``runs``
    accumulated backwards, as a step's microbatches accumulate."""
    split = copy.deepcopy(model)
    pending = deferred.Pending()
    assert deferred.install(split, pending) > 0
    gx = []
    for m, is_split in ((model, False), (split, True)):
        xi = x.detach().clone().requires_grad_()
        for k in range(runs):
            out = m(xi)
            out = out[0] if isinstance(out, tuple) else out
            g = torch.randn_like(out, generator=torch.Generator().manual_seed(k))
            if is_split:
                pending.into = []
                torch.autograd.backward(out, g)
                if k == 0:  # what B alone left in the gradients
                    before_w = {n: (q.grad.clone() if q.grad is not None else None) for n, q in m.named_parameters()}
                deferred.weight_grads(pending.into)
                pending.into = None
            else:
                torch.autograd.backward(out, g)
        gx.append(xi.grad)
    whole = {n: q.grad for n, q in model.named_parameters()}
    got = {n: q.grad for n, q in split.named_parameters()}
    return whole, got, gx, before_w, split


class TwiceLinear(nn.Module):
    """One Linear applied twice (its gradient is the sum of two products), one frozen."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.lin(torch.relu(self.lin(self.norm(self.frozen(x)))))


class ScaledLinear(nn.Linear):
    """A subclass with a forward of its own: left to the autograd engine."""

    def forward(self, x):
        return super().forward(x) * 2.0


def test_a_split_backward_equals_the_whole_one_for_linears_used_twice_frozen_and_subclassed():
    torch.manual_seed(0)
    model = nn.Sequential(TwiceLinear(), nn.GELU(), ScaledLinear(8, 8), nn.Linear(8, 3, bias=False))
    whole, got, gx, before_w, split = grads_whole_and_split(model, torch.randn(4, 5, 8))
    for n in whole:
        torch.testing.assert_close(got[n], whole[n], rtol=1e-5, atol=1e-6)  # summed in another order
    torch.testing.assert_close(gx[1], gx[0], rtol=0, atol=0)
    assert got["0.frozen.weight"] is None
    # B left the plain Linears' weights to W, and did the rest (LayerNorm, the subclass) itself
    assert before_w["3.weight"] is None and before_w["0.norm.weight"] is not None
    assert before_w["2.weight"] is not None
    # the worker's copies come back as they were: no forward of their own, same state dict
    deferred.uninstall(split)
    assert all("forward" not in m.__dict__ for m in split.modules())
    assert set(split.state_dict()) == set(model.state_dict())


def llama_blocks(n: int) -> list:
    """``n`` transformers LlamaDecoderLayers of width 32 (random init), each taking the hidden
    states alone (the rotary embeddings made inside)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=16)
    rotary = LlamaRotaryEmbedding(cfg)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = LlamaDecoderLayer(cfg, layer_idx=0)

        def forward(self, h):
            pos = torch.arange(h.shape[1]).unsqueeze(0)
            return self.layer(h, position_embeddings=rotary(h, pos))

    return [Block() for _ in range(n)]


def test_a_split_backward_equals_the_whole_one_on_a_transformers_llama_block():
    torch.manual_seed(1)
    model = nn.Sequential(*llama_blocks(2))
    whole, got, gx, _, _ = grads_whole_and_split(model, torch.randn(2, 6, 32))
    assert sum(q.numel() for q in model.parameters()) > 10_000
    for n in whole:
        torch.testing.assert_close(got[n], whole[n], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx[1], gx[0], rtol=1e-6, atol=1e-7)


def test_a_backward_outside_a_step_still_computes_the_weight_gradients():
    """Nothing collects the pairs (an evaluation or a user's own backward): done at once."""
    torch.manual_seed(2)
    model = nn.Linear(4, 2)
    split = copy.deepcopy(model)
    deferred.install(split, deferred.Pending())
    x = torch.randn(3, 4)
    model(x).sum().backward()
    split(x).sum().backward()
    torch.testing.assert_close(split.weight.grad, model.weight.grad)
    with torch.no_grad():
        torch.testing.assert_close(split(x), model(x))


def test_a_steps_first_weight_gradient_is_written_where_the_step_befores_was_unless_it_is_held():
    """zero_grad(set_to_none=True) lets go of the gradient; the next step's product goes into
    that memory (no block freed and asked for again: actors/heap.py), with the numbers of a
    plain backward.  A gradient the user's code still holds is left as it was."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    split = copy.deepcopy(model)
    deferred.install(split, deferred.Pending())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_split = torch.optim.SGD(split.parameters(), lr=0.1, momentum=0.9)
    where, held = [], []
    for step in range(4):
        x = torch.randn(5, 64)
        for m, o in ((model, opt), (split, opt_split)):
            o.zero_grad(set_to_none=True)
            m(x).square().mean().backward()
        for a, b in zip(model.parameters(), split.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7)
        where.append(split[0].weight.grad.data_ptr())
        if step == 2:  # the user keeps this step's gradient
            held = [split[0].weight.grad, split[0].weight.grad.clone()]
        opt.step()
        opt_split.step()
    assert where[1] == where[0] and where[2] == where[0], where
    assert where[3] != where[2]  # step 3 found step 2's gradient held: new memory
    torch.testing.assert_close(held[0], held[1], rtol=0, atol=0)  # and did not write into it
    for a, b in zip(model.parameters(), split.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_recomputed_layers_under_activation_checkpointing_equal_a_plain_backward():
    """Every schedule now lets plain Linears compute their own weight gradients (1F1B and GPipe
    right after the input gradient is sent), also under ``training.checkpointing``, where the
    forward runs again inside the backward: gradients equal torch's over accumulated backwards."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(3)
    body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))
    mine = copy.deepcopy(body)
    pending = deferred.Pending()
    assert deferred.install(mine, pending) == 2
    xs = [torch.randn(5, 8) for _ in range(3)]
    gxs = []
    for m, collect in ((body, False), (mine, True)):
        got = []
        for x in xs:
            xi = x.clone().requires_grad_()
            out = checkpoint(m, xi, use_reentrant=False)
            pending.into = [] if collect else None
            out.pow(2).sum().backward()
            if collect:
                assert len(pending.into) == 2  # both Linears left their pairs, from the recomputation
                deferred.weight_grads(pending.into)
            pending.into = None
            got.append(xi.grad)
        gxs.append(got)
    for (n, q), (_, r) in zip(body.named_parameters(), mine.named_parameters()):
        torch.testing.assert_close(r.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)
    for a, b in zip(*gxs):
        torch.testing.assert_close(b, a)


def test_the_built_in_models_linear_splits_too_and_casts_its_input():
    """The built-in MLP's Linear only casts its input to the weight's dtype (float32 data into a
    float64 model) before nn.Linear's forward: it takes the split as a plain Linear does (it was
    left to autograd before, so the built-in models never used it), with the same gradients and
    outputs, and the cast's gradient reaches a float32 input."""
    from service import builtins

    torch.manual_seed(4)
    model = builtins.mlp(8, 16, 3, 2, dtype="float64")
    assert all(type(m) is builtins.Linear for m in model.modules() if isinstance(m, nn.Linear))
    whole, got, gx, before_w, split = grads_whole_and_split(model, torch.randn(5, 8))
    assert before_w["3.weight"] is None  # W did the weight products, not B
    for n in whole:
        torch.testing.assert_close(got[n], whole[n], rtol=1e-12, atol=1e-12)
    assert gx[1].dtype == torch.float32
    torch.testing.assert_close(gx[1], gx[0], rtol=0, atol=0)
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(split(x), model(x), rtol=0, atol=0)
    deferred.uninstall(split)
    assert all("forward" not in m.__dict__ for m in split.modules())


def coverage(model: nn.Module, *inputs) -> float:
    """``deferred.covered`` after one forward with the rows counted, as a split schedule's
    first step counts them; the hooks are gone afterwards."""
    deferred.install(model, deferred.Pending())
    rows: dict = {}
    deferred.count_rows(model, rows)
    with torch.no_grad():
        model(*inputs)
    deferred.forget_rows(model)
    assert not any(m._forward_hooks for m in model.modules())
    return deferred.covered(model, rows)


class FunctionalLinear(nn.Module):
    """Keeps an nn.Linear for its weight and calls F.linear itself."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(nn.functional.linear(x, self.lin.weight, self.lin.bias))


def test_what_the_linears_own_products_cover_is_weighed_by_work_not_by_weights():
    """A split schedule keeps the Linears' own products as W only where they hold at least
    ``LINEAR_COVER`` of the chunk's weight-gradient work; else torch's split makes every weight
    gradient wait for W.  Convolutions before a Linear head: the head holds 93% of the weights
    but a fifth of the work (each kernel is applied at all 64 positions of an 8 x 8 image)."""
    torch.manual_seed(5)
    convs = nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(16 * 64, 32), nn.ReLU(), nn.Linear(32, 10))
    linear_params = sum(q.numel() for m in convs if isinstance(m, nn.Linear) for q in m.parameters())
    assert linear_params / sum(q.numel() for q in convs.parameters()) > 0.9
    cover = coverage(convs, torch.randn(4, 64))
    assert 0.1 < cover < 0.3, cover
    # plain Linears with a LayerNorm and activations as entries of their own: all but the norm
    mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 16))
    assert deferred.LINEAR_COVER < coverage(mlp, torch.randn(4, 3, 16)) < 1.0
    # the F.linear layers' Linears never ran: only the plain Linears around them count
    functional = nn.Sequential(nn.Linear(16, 16), FunctionalLinear(16), FunctionalLinear(16), nn.Linear(16, 4))
    assert coverage(functional, torch.randn(4, 16)) < deferred.LINEAR_COVER
    # nn.MultiheadAttention passes its projections' weights to F: its out_proj never runs
    attn = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    assert coverage(attn, x, x, x) == 0.0
    # a Linear that did not run in the step (an unused head) weighs nothing either way
    unused = nn.ModuleDict({"used": nn.Linear(8, 8), "head": nn.Linear(8, 1000)})
    deferred.install(unused, deferred.Pending())
    rows: dict = {}
    deferred.count_rows(unused, rows)
    unused["used"](torch.randn(3, 8))
    assert deferred.covered(unused, rows) == 1.0
    # hooks of a first step that never ended are dropped by the next count and by uninstall
    deferred.count_rows(unused, rows)
    assert sum(len(m._forward_hooks) for m in unused.modules()) == 3
    deferred.uninstall(unused)
    assert not any(m._forward_hooks for m in unused.modules())


def gpt2_blocks(n: int, d: int = 32) -> list:
    """``n`` transformers GPT2Blocks (random init; their projections are transformers' Conv1D,
    ``addmm(b, x, W)`` with the weight stored (in, out)), each returning the hidden states alone."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    cfg = transformers.GPT2Config(n_embd=d, n_head=4, n_positions=16, attn_implementation="eager",
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = GPT2Block(cfg, layer_idx=0)

        def forward(self, h):
            out = self.block(h)
            return out[0] if isinstance(out, tuple) else out

    return [Block() for _ in range(n)]


def test_coverage_of_transformers_blocks_llama_s_linears_and_gpt2_s_conv1d():
    """Code nobody here wrote: a Llama block's projections are nn.Linear, GPT-2's transformers'
    Conv1D (the same product, the weight transposed): the own products hold both blocks' weight
    gradients but their norms' (until 2026-12-02 GPT-2's Conv1D held none: its chunks took torch's
    split, or none)."""
    torch.manual_seed(6)
    h = torch.randn(2, 6, 32)
    assert coverage(llama_blocks(1)[0], h) > 0.99
    assert coverage(gpt2_blocks(1)[0], h) > 0.99


def test_a_split_backward_equals_the_whole_one_on_transformers_gpt2_blocks_and_their_conv1d():
    """GPT-2's Conv1D projections leave their weight products for W (B has none of them) and
    the gradients equal one whole backward's, over two accumulated backwards; a Conv1D subclass
    with a forward of its own is left to autograd; uninstalled, the blocks are as they were."""
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    class Scaled(Conv1D):
        def forward(self, x):
            return super().forward(x) * 2.0

    torch.manual_seed(7)
    model = nn.Sequential(*gpt2_blocks(2), Scaled(16, 32)).double()
    whole, got, gx, before_w, split = grads_whole_and_split(model, torch.randn(3, 6, 32, dtype=torch.float64))
    for n in whole:
        torch.testing.assert_close(got[n], whole[n], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx[1], gx[0], rtol=1e-12, atol=1e-12)
    conv1d = [n for n, m in model.named_modules() if type(m) is Conv1D]
    assert len(conv1d) == 8  # each block's c_attn, c_proj, mlp.c_fc, mlp.c_proj
    assert all(before_w[f"{n}.weight"] is None and before_w[f"{n}.bias"] is None for n in conv1d)
    assert before_w["0.block.ln_1.weight"] is not None and before_w["2.weight"] is not None
    deferred.uninstall(split)
    assert all("forward" not in m.__dict__ for m in split.modules())
    assert set(split.state_dict()) == set(model.state_dict())
