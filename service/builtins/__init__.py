"""Built-in models and data sets that need no download.

Models are ``torch.nn.Sequential`` so the engine can cut them into stages.
Data builders return ``(X, Y)`` tensors.
"""
from __future__ import annotations

import math
from importlib import resources

import torch
from torch import nn
from torch.nn import functional as F

from service.datasets import tokens

# ---------------------------------------------------------------- models


DTYPES = {"float32": torch.float32, "float64": torch.float64}


class Linear(nn.Linear):
    """``nn.Linear`` that takes input of another floating dtype (float32 data into a float64
    model); the same state_dict keys as ``nn.Linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x if x.dtype == self.weight.dtype else x.to(self.weight.dtype))


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"model.args.dtype: {name!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def mlp(in_features: int = 64, hidden: int = 128, layers: int = 4, out_features: int = 10,
        dtype: str = "float32", separate_activations: bool = False) -> nn.Sequential:
    """``layers`` hidden Linear+ReLU blocks, then a Linear head (one Sequential entry per layer).
    ``separate_activations=True`` makes each ReLU an entry of its own, as most user code writes
    it (2 * layers + 1 entries; a ReLU entry has no state).  ``dtype="float64"`` trains in
    double precision (the float32 input is cast by the first layer)."""
    dt = _dtype(dtype)
    mods: list[nn.Module] = []
    width = in_features
    for _ in range(layers):
        linear = Linear(width, hidden, dtype=dt)
        mods += [linear, nn.ReLU()] if separate_activations else [nn.Sequential(linear, nn.ReLU())]
        width = hidden
    mods.append(Linear(width, out_features, dtype=dt))
    return nn.Sequential(*mods)


def regression_mlp(in_features: int = 16, hidden: int = 64, layers: int = 3, out_features: int = 1,
                   dtype: str = "float32", separate_activations: bool = False) -> nn.Sequential:
    return mlp(in_features, hidden, layers, out_features, dtype, separate_activations)


def cnn(channels: int = 16, classes: int = 10) -> nn.Sequential:
    """A small CNN for 1x8x8 digit images."""
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(1, channels, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Flatten(),
        nn.Sequential(nn.Linear(2 * channels * 4, 64), nn.ReLU()),
        nn.Linear(64, classes),
    )


class Embed(nn.Module):
    """Token plus learned position embedding."""

    def __init__(self, vocab: int, dim: int, context: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos[: idx.shape[1]]


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP block (no dropout: runs are reproducible)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


def char_transformer(vocab: int = 96, dim: int = 64, heads: int = 4, layers: int = 4, context: int = 32) -> nn.Sequential:
    """A small character-level GPT: embedding, ``layers`` blocks, norm and head."""
    return nn.Sequential(
        Embed(vocab, dim, context),
        *[Block(dim, heads) for _ in range(layers)],
        nn.LayerNorm(dim),
        nn.Linear(dim, vocab),
    )


from service.builtins import gpt as _gpt  # noqa: E402  (a layer list; keeps service.builtins.gpt the module)

MODELS = {"mlp": mlp, "cnn": cnn, "regression_mlp": regression_mlp, "char_transformer": char_transformer,
          "gpt": _gpt.gpt}

# ---------------------------------------------------------------- data


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled 8x8 digits: 1797 samples of 64 features scaled to [0, 1], 10 classes.

    Read from scikit-learn's data file itself (what ``sklearn.datasets.load_digits`` reads):
    importing scikit-learn costs about 2 s of CPU in every process that loads the data."""
    import gzip
    import importlib.util
    import os

    import numpy as np

    found = importlib.util.find_spec("sklearn")  # finds the package without running it
    path = os.path.join(found.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return (torch.tensor(data[:, :-1], dtype=torch.float32) / 16.0,
            torch.tensor(data[:, -1].astype(int), dtype=torch.long))


def digits_images() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = digits()
    return x.view(-1, 1, 8, 8), y


def regression(n: int = 2048, in_features: int = 16, out_features: int = 1, noise: float = 0.1, seed: int = 1234):
    """Synthetic regression: y = sin(x W1) W2 + noise, from its own fixed seed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=g)
    w1 = torch.randn(in_features, 32, generator=g) / math.sqrt(in_features)
    w2 = torch.randn(32, out_features, generator=g) / math.sqrt(32)
    y = torch.sin(x @ w1) @ w2 + noise * torch.randn(n, out_features, generator=g)
    return x, y


def bundled_text() -> str:
    return resources.files(__package__).joinpath("text.txt").read_text(encoding="utf-8")


def chars(context: int = 32, stride: int = 8, vocab: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of the bundled text as (context chars, next chars); printable ASCII mapped to 0..95."""
    text = bundled_text()
    codes = torch.tensor([min(max(ord(c) - 32, 0), vocab - 1) if c != "\n" else 0 for c in text], dtype=torch.long)
    starts = torch.arange(0, len(codes) - context - 1, stride)
    x = torch.stack([codes[s: s + context] for s in starts])
    y = torch.stack([codes[s + 1: s + context + 1] for s in starts])
    return x, y


DATA = {"digits": digits, "digits_images": digits_images, "regression": regression, "chars": chars,
        "tokens": tokens}
