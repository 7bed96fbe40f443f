"""The built-in GPT (``model.kind: gpt``), returned as a layer list with a tied embedding.

``gpt(...)`` returns ``{"layers": [...], "tied": [...]}``: ``layers`` is a list of zero-argument
callables, each building one layer (the engine builds layer i only on the worker that trains
it, right after seeding), and ``tied`` names the parameters that are one parameter.  The same
model in one process is ``nn.Sequential(*(make() for make in layers))`` with the tie applied:

====================  ===================  ==============================================
entry                 module               parameters (names in the Sequential)
====================  ===================  ==============================================
0                     ``Embedding``        ``0.tok.weight`` (vocab x d), ``0.pos.weight`` (seq_len x d)
1 .. n_layers         ``Block``            ``i.ln1.{weight,bias}``, ``i.attn.qkv.{weight,bias}``,
                                           ``i.attn.proj.{weight,bias}``, ``i.ln2.{weight,bias}``,
                                           ``i.mlp.fc.{weight,bias}``, ``i.mlp.proj.{weight,bias}``
n_layers + 1          ``nn.LayerNorm``     ``{n+1}.weight``, ``{n+1}.bias``
n_layers + 2          ``Head``             ``{n+2}.weight`` (vocab x d, no bias), tied to ``0.tok.weight``
====================  ===================  ==============================================

Input: int64 token ids (N, T) with T <= seq_len; output: logits (N, T, vocab), which the
built-in ``cross_entropy`` loss flattens over N and T.

Sizes (exact, from :func:`param_count`; mlp_ratio 4, tied head; "train state" is fp32
parameters + gradients + two Adam slots = 16 bytes a parameter, activations not included):

=========  =======  =======  ========  =======  ===============  ===========
vocab      seq_len  d_model  n_layers  n_heads  parameters       train state
=========  =======  =======  ========  =======  ===============  ===========
96         32       64       2         4        108,288          1.7 MiB
96         32       128      4         4        809,728          12.4 MiB
50257      1024     768      12        12       124,439,808      1.9 GiB     (GPT-2 small)
50304      1024     768      12        12       124,475,904      1.9 GiB
50304      1024     1024     24        16       354,871,296      5.3 GiB     (GPT-2 medium)
50304      1024     1280     36        20       774,090,240      11.5 GiB    (GPT-2 large)
50304      1024     2048     18        16       1,011,572,736    15.1 GiB
50304      1024     1600     48        25       1,557,686,400    23.2 GiB    (GPT-2 XL)
=========  =======  =======  ========  =======  ===============  ===========

Without the tie add vocab * d_model (e.g. 103,022,592 at vocab 50304, d 2048).

Tensor parallelism (``parallelism.tp``, service/tensorplan.py): ``Block.tp_plan`` splits the
fused ``attn.qkv`` as a packed column-wise layer of 3 parts (rank j holds the j-th slice of
each of q, k and v, so its ``chunk(3)`` still gives its heads of q, k and v), ``attn.proj``
row-wise, ``mlp.fc`` column-wise and ``mlp.proj`` row-wise (Megatron-LM's plan: two
all-reduces forward and two backward per block).  ``forward`` derives the number of heads
from the local width.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

STD = 0.02  # GPT-2 / nanoGPT initial std of Linear and Embedding weights


def _normal(module: nn.Module, std: float = STD) -> None:
    nn.init.normal_(module.weight, mean=0.0, std=std)
    if getattr(module, "bias", None) is not None:
        nn.init.zeros_(module.bias)


class Embedding(nn.Module):
    """Token plus learned position embedding: int ids (N, T) -> (N, T, d_model)."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab_size, d_model, dtype=dtype)
        self.pos = nn.Embedding(seq_len, d_model, dtype=dtype)
        _normal(self.tok)
        _normal(self.pos)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.seq_len:
            raise ValueError(f"gpt: input has {t} tokens per sample, more than seq_len={self.seq_len}")
        if idx.dtype not in (torch.int32, torch.int64):
            idx = idx.long()  # uint16 / uint8 token files
        return self.tok(idx) + self.pos(torch.arange(t, device=idx.device))


class Attention(nn.Module):
    """Causal multi-head self-attention with a fused qkv projection."""

    def __init__(self, d_model: int, n_heads: int, proj_std: float = STD, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, dtype=dtype)
        self.proj = nn.Linear(d_model, d_model, dtype=dtype)
        _normal(self.qkv)
        _normal(self.proj, proj_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        heads = q.shape[-1] // self.head_dim  # local heads: a tensor-parallel shard has fewer
        q, k, v = (z.reshape(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class MLP(nn.Module):
    """Linear d -> ratio*d, GELU (tanh approximation), Linear ratio*d -> d."""

    def __init__(self, d_model: int, mlp_ratio: int, proj_std: float = STD, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.fc = nn.Linear(d_model, mlp_ratio * d_model, dtype=dtype)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(mlp_ratio * d_model, d_model, dtype=dtype)
        _normal(self.fc)
        _normal(self.proj, proj_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-norm GPT-2 block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))`` (no dropout).

    ``n_layers`` is the model's depth: the residual projections start with std
    0.02 / sqrt(2 * n_layers), as in GPT-2."""

    tp_plan = {"attn.qkv": "packed_colwise", "attn.proj": "rowwise", "mlp.fc": "colwise", "mlp.proj": "rowwise"}
    tp_packed = {"attn.qkv": 3}  # q | k | v side by side

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int = 4, n_layers: int = 1,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        proj_std = STD / math.sqrt(2 * n_layers)
        self.ln1 = nn.LayerNorm(d_model, dtype=dtype)
        self.attn = Attention(d_model, n_heads, proj_std, dtype=dtype)
        self.ln2 = nn.LayerNorm(d_model, dtype=dtype)
        self.mlp = MLP(d_model, mlp_ratio, proj_std, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Output projection without bias: (N, T, d) -> logits (N, T, vocab); ``weight`` is vocab x d,
    the shape of the token embedding it is tied to."""

    def __init__(self, vocab_size: int, d_model: int, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model, dtype=dtype))
        nn.init.normal_(self.weight, mean=0.0, std=STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # x @ weight.T


def _check_sizes(**sizes) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"model.args.{name}: must be an integer >= 1, got {value!r}")


def gpt(vocab_size: int = 96, seq_len: int = 32, d_model: int = 64, n_heads: int = 4, n_layers: int = 2,
        mlp_ratio: int = 4, tie_embeddings: bool = True, dtype: str = "float32") -> dict:
    """A GPT-2 style decoder as a layer list: ``Embedding``, ``n_layers`` x ``Block``,
    ``nn.LayerNorm``, ``Head`` (``n_layers + 3`` entries).  With ``tie_embeddings`` the head's
    weight is the token embedding (``tied = [["0.tok.weight", "{n_layers+2}.weight"]]``).
    ``dtype`` is "float32" or "float64".  See the module docstring for names and sizes."""
    from service.builtins import _dtype  # lazy: service.builtins imports this module

    _check_sizes(vocab_size=vocab_size, seq_len=seq_len, d_model=d_model, n_heads=n_heads,
                 n_layers=n_layers, mlp_ratio=mlp_ratio)
    if d_model % n_heads:
        raise ValueError(f"model.args.d_model: {d_model} is not divisible by model.args.n_heads={n_heads}; "
                         "choose d_model as a multiple of n_heads")
    if not isinstance(tie_embeddings, bool):
        raise ValueError(f"model.args.tie_embeddings: must be true or false, got {tie_embeddings!r}")
    dt = _dtype(dtype)
    layers = [functools.partial(Embedding, vocab_size=vocab_size, seq_len=seq_len, d_model=d_model, dtype=dt)]
    layers += [functools.partial(Block, d_model=d_model, n_heads=n_heads, mlp_ratio=mlp_ratio,
                                 n_layers=n_layers, dtype=dt) for _ in range(n_layers)]
    layers.append(functools.partial(nn.LayerNorm, d_model, dtype=dt))
    layers.append(functools.partial(Head, vocab_size=vocab_size, d_model=d_model, dtype=dt))
    tied = [["0.tok.weight", f"{n_layers + 2}.weight"]] if tie_embeddings else []
    return {"layers": layers, "tied": tied}


def param_count(vocab_size: int, seq_len: int, d_model: int, n_layers: int, mlp_ratio: int = 4,
                tie_embeddings: bool = True) -> int:
    """The exact number of distinct parameters of ``gpt(...)`` (a tied pair counted once)::

        V*d*(1 if tied else 2)                      token embedding (+ untied head)
        + S*d                                       position embedding
        + L*((4 + 2r)*d^2 + (9 + r)*d)              blocks: qkv 3d^2+3d, proj d^2+d,
                                                    fc r*d^2+r*d, proj r*d^2+d, 2 LayerNorms 4d
        + 2*d                                       final LayerNorm

    with V = vocab_size, S = seq_len, d = d_model, L = n_layers, r = mlp_ratio (r = 4 gives
    GPT-2's 12*d^2 + 13*d a block).  n_heads does not change the count."""
    _check_sizes(vocab_size=vocab_size, seq_len=seq_len, d_model=d_model, n_layers=n_layers, mlp_ratio=mlp_ratio)
    d, r = d_model, mlp_ratio
    return (vocab_size * d * (1 if tie_embeddings else 2) + seq_len * d
            + n_layers * ((4 + 2 * r) * d * d + (9 + r) * d) + 2 * d)
