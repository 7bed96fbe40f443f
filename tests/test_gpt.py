"""The built-in GPT layer list (service/builtins/gpt.py): pure torch, no Ray, small sizes."""
from __future__ import annotations

import copy
import functools
import hashlib
import importlib
import math
import pickle
import re

import pytest
import torch
from torch import nn

from service.loading import cross_entropy

mod = importlib.import_module("service.builtins.gpt")  # the module, even if the package exports the function


def layer_seed(seed: int, i: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{i}".encode()).digest()[:8], "little") >> 1


def build(layers, seed: int = 0) -> list[nn.Module]:
    """As the engine does: layer i right after torch.manual_seed(s_i)."""
    out = []
    for i, make in enumerate(layers):
        torch.manual_seed(layer_seed(seed, i))
        out.append(make())
    return out


def assemble(spec: dict, seed: int = 0) -> nn.Sequential:
    """The one-process model: nn.Sequential of the built layers, each tied group one parameter."""
    seq = nn.Sequential(*build(spec["layers"], seed))
    for group in spec["tied"]:
        first = seq.get_parameter(group[0])
        for name in group[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(seq.get_submodule(owner), attr, first)
    return seq


def n_unique(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a shared one once


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is much faster on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SMALL = dict(vocab_size=96, seq_len=16, d_model=32, n_heads=4, n_layers=2)


def test_structure_names_and_output_shape():
    spec = mod.gpt(**SMALL)
    assert len(spec["layers"]) == SMALL["n_layers"] + 3
    assert spec["tied"] == [["0.tok.weight", "4.weight"]]
    untied = nn.Sequential(*build(spec["layers"]))
    names = dict(untied.named_parameters())
    for group in spec["tied"]:
        assert all(n in names for n in group)
        assert len({names[n].shape for n in group}) == 1
    assert {"0.tok.weight", "0.pos.weight", "1.attn.qkv.weight", "1.attn.proj.bias", "2.mlp.fc.weight",
            "2.mlp.proj.weight", "2.ln1.weight", "3.weight", "3.bias", "4.weight"} <= set(names)
    assert "4.bias" not in names
    assert [type(m).__name__ for m in untied] == ["Embedding", "Block", "Block", "LayerNorm", "Head"]
    model = assemble(spec)
    assert model[4].weight is model[0].tok.weight
    for t in (SMALL["seq_len"], 5):
        out = model(torch.randint(0, 96, (3, t)))
        assert out.shape == (3, t, 96) and out.dtype == torch.float32
    with pytest.raises(ValueError, match="seq_len=16"):
        model(torch.randint(0, 96, (1, 17)))


def test_layers_are_separate_objects_and_picklable():
    spec = mod.gpt(**SMALL)
    built = build(spec["layers"])
    assert built[1] is not built[2] and built[1].attn.qkv.weight is not built[2].attn.qkv.weight
    again = pickle.loads(pickle.dumps(spec))  # the engine may ship the list to workers
    for a, b in zip(build(again["layers"]), built):
        assert torch.equal(torch.cat([p.flatten() for p in a.parameters()]),
                           torch.cat([p.flatten() for p in b.parameters()]))


@pytest.mark.parametrize("cfg", [
    dict(vocab_size=96, seq_len=16, d_model=32, n_layers=2),
    dict(vocab_size=50, seq_len=8, d_model=24, n_layers=3, mlp_ratio=2),
    dict(vocab_size=96, seq_len=16, d_model=32, n_layers=2, tie_embeddings=False),
    dict(vocab_size=7, seq_len=5, d_model=8, n_layers=1, mlp_ratio=3, tie_embeddings=False),
])
def test_param_count_is_exact(cfg):
    model = assemble(mod.gpt(n_heads=4 if cfg["d_model"] % 4 == 0 else 2, **cfg))
    assert mod.param_count(**cfg) == n_unique(model)


def test_param_count_table_in_docstring_is_true():
    rows = re.findall(r"^(\d+) +(\d+) +(\d+) +(\d+) +(\d+) +([\d,]+) ", mod.__doc__, re.M)
    assert len(rows) >= 6
    for v, s, d, layers, heads, count in rows:
        assert int(d) % int(heads) == 0
        assert mod.param_count(int(v), int(s), int(d), int(layers)) == int(count.replace(",", ""))
    assert max(int(c.replace(",", "")) for *_, c in rows) > 1e9
    # GPT-2 small, the published figure
    assert mod.param_count(50257, 1024, 768, 12) == 124_439_808


def test_causal():
    torch.manual_seed(1)
    model = assemble(mod.gpt(**SMALL, dtype="float64"))
    x = torch.randint(0, 96, (2, 16))
    base = model(x)
    for t in (0, 7, 15):
        y = x.clone()
        y[:, t] = (y[:, t] + 1) % 96
        out = model(y)
        assert torch.equal(out[:, :t], base[:, :t])
        assert not torch.allclose(out[:, t], base[:, t])


def test_block_matches_a_plain_reference_in_float64():
    d, h = 32, 4
    torch.manual_seed(0)
    blk = mod.Block(d, h, mlp_ratio=4, n_layers=2, dtype=torch.float64)
    for p in blk.parameters():  # non-trivial norms and biases too
        nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 9, d, dtype=torch.float64)

    def ln(z, m):
        mu, var = z.mean(-1, keepdim=True), z.var(-1, unbiased=False, keepdim=True)
        return (z - mu) / torch.sqrt(var + 1e-5) * m.weight + m.bias

    b, t, _ = x.shape
    q, k, v = (ln(x, blk.ln1) @ blk.attn.qkv.weight.T + blk.attn.qkv.bias).split(d, -1)
    q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
    att = q @ k.transpose(-1, -2) / math.sqrt(d // h)
    att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    y = (att @ v).transpose(1, 2).reshape(b, t, d)
    r = x + y @ blk.attn.proj.weight.T + blk.attn.proj.bias
    u = ln(r, blk.ln2) @ blk.mlp.fc.weight.T + blk.mlp.fc.bias
    u = 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
    ref = r + u @ blk.mlp.proj.weight.T + blk.mlp.proj.bias
    torch.testing.assert_close(blk(x), ref, rtol=1e-12, atol=1e-12)


def test_tp_plan_names_and_local_shards():
    blk = mod.Block(32, 4, n_layers=2, dtype=torch.float64)
    subs = dict(blk.named_modules())
    for name, style in mod.Block.tp_plan.items():
        assert isinstance(subs[name], nn.Linear) and style in ("colwise", "rowwise", "packed_colwise")
    assert mod.Block.tp_packed == {"attn.qkv": 3}  # q | k | v: each split on its own

    # a 2-way split by hand: each rank's attention/MLP runs on its local width only
    ranks, d = 2, 32
    x = torch.randn(2, 6, d, dtype=torch.float64)

    def shard(sub, col: str, row: str, col_fused: int):
        outs = []
        for r in range(ranks):
            s = copy.deepcopy(sub)
            c, w = getattr(sub, col), getattr(sub, row)
            k = c.out_features // col_fused // ranks
            cw = c.weight.view(col_fused, -1, d)[:, r * k:(r + 1) * k].reshape(-1, d)
            cb = c.bias.view(col_fused, -1)[:, r * k:(r + 1) * k].reshape(-1)
            setattr(s, col, nn.Linear(d, cw.shape[0], dtype=torch.float64))
            getattr(s, col).weight.data, getattr(s, col).bias.data = cw.clone(), cb.clone()
            setattr(s, row, nn.Linear(k, d, dtype=torch.float64))
            getattr(s, row).weight.data = w.weight[:, r * k:(r + 1) * k].clone()
            getattr(s, row).bias.data = w.bias.clone() if r == 0 else torch.zeros_like(w.bias)
            outs.append(s(x))
        return sum(outs)

    torch.testing.assert_close(shard(blk.attn, "qkv", "proj", 3), blk.attn(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(shard(blk.mlp, "fc", "proj", 1), blk.mlp(x), rtol=1e-12, atol=1e-12)


def test_same_seed_same_layer_no_hidden_state():
    spec = mod.gpt(**SMALL)
    for i, make in enumerate(spec["layers"]):
        torch.manual_seed(123)
        a = make()
        torch.randn(1000)  # disturb the global generator between the two builds
        torch.manual_seed(123)
        b = make()
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), i
    # and a fresh spec with the same args builds the same model
    m1, m2 = assemble(mod.gpt(**SMALL), seed=5), assemble(mod.gpt(**SMALL), seed=5)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))
    m3 = assemble(mod.gpt(**SMALL), seed=6)
    assert not torch.equal(m1[1].attn.qkv.weight, m3[1].attn.qkv.weight)


def test_initialisation():
    n_layers = 2
    model = assemble(mod.gpt(vocab_size=96, seq_len=32, d_model=64, n_heads=4, n_layers=n_layers,
                             tie_embeddings=False))
    for name, p in model.named_parameters():
        if name.endswith("bias"):  # Linear and LayerNorm biases
            assert torch.equal(p, torch.zeros_like(p)), name
        elif ".ln" in name or name == "3.weight":  # LayerNorm scales
            assert torch.equal(p, torch.ones_like(p)), name
        else:  # Embedding, Linear and head weights
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith("proj.weight") else 0.02
            assert abs(p.std().item() / std - 1) < 0.1, (name, p.std().item(), std)
            assert abs(p.mean().item()) < std / 5, name


def test_float64_and_meta_device():
    model = assemble(mod.gpt(**SMALL, dtype="float64"))
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert model(torch.randint(0, 96, (2, 4))).dtype == torch.float64
    # a planner can learn shapes and counts without memory: build on the meta device
    big = dict(vocab_size=50304, seq_len=1024, d_model=2048, n_layers=18)
    spec = mod.gpt(n_heads=16, **big)
    with torch.device("meta"):
        layers = build(spec["layers"])
    assert all(p.is_meta for m in layers for p in m.parameters())
    total = sum(p.numel() for m in layers for p in m.parameters())
    assert total - 50304 * 2048 == mod.param_count(**big) > 1e9  # the head's copy counted once


def test_training_reduces_loss():
    torch.manual_seed(0)
    model = assemble(mod.gpt(vocab_size=96, seq_len=32, d_model=64, n_heads=4, n_layers=2))
    x, y = torch.randint(0, 96, (8, 32)), torch.randint(0, 96, (8, 32))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        loss = cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(96)) < 0.3  # small init: near-uniform predictions
    assert losses[-1] < 0.7 * losses[0], losses
    assert model[4].weight is model[0].tok.weight  # still one parameter


@pytest.mark.parametrize("kwargs, arg", [
    (dict(d_model=30, n_heads=4), "d_model"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(seq_len=0), "seq_len"),
    (dict(d_model=0), "d_model"),
    (dict(n_heads=0), "n_heads"),
    (dict(n_layers=0), "n_layers"),
    (dict(mlp_ratio=0), "mlp_ratio"),
    (dict(d_model=64.0), "d_model"),
    (dict(dtype="float16"), "dtype"),
    (dict(tie_embeddings="yes"), "tie_embeddings"),
])
def test_bad_args_name_the_arg(kwargs, arg):
    with pytest.raises(ValueError, match=rf"model\.args\.{arg}\b"):
        mod.gpt(**kwargs)


def test_param_count_rejects_bad_sizes():
    with pytest.raises(ValueError, match="n_layers"):
        mod.param_count(96, 32, 64, 0)


class HFBlock(nn.Module):
    """A transformers GPT2Block as one layer: hidden states in, hidden states out."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
        self.block = GPT2Block(config, layer_idx=layer_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


def test_a_transformers_block_fits_the_layer_list():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    spec = mod.gpt(**SMALL)
    spec["layers"][2] = functools.partial(HFBlock, cfg, 1)  # ours at 1, theirs at 2
    model = assemble(spec)
    assert isinstance(model[2], HFBlock)
    out = model(torch.randint(0, 96, (2, 16)))
    assert out.shape == (2, 16, 96)
    cross_entropy(out, torch.randint(0, 96, (2, 16))).backward()
    grads = [p.grad for p in model[2].parameters()]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model[0].tok.weight.grad is not None and model[1].attn.qkv.weight.grad is not None
