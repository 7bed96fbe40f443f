"""Data sets read by index, never loaded whole: ``data.kind: tokens``.

A token file is a flat binary array of token ids, little-endian uint16 or uint32 with no
header (nanoGPT's ``train.bin``, Megatron's ``.bin``). With ``L = seq_len`` and ``n`` tokens
the file holds ``(n - 1) // L`` samples; sample k is tokens ``[k*L, (k+1)*L + 1)``::

    tokens  t0 t1 t2 t3 t4 t5 t6 t7 t8 ...          (L = 4)
    k = 0   x = t0..t3   y = t1..t4
    k = 1   x = t4..t7   y = t5..t8

so consecutive samples share one token; tokens after the last whole sample are not used.
The file is memory-mapped: a process reads only the pages of the samples it asks for.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from service.spec import SpecError

TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
Indices = Union[torch.Tensor, Sequence[int]]


def resolve_path(path: str, search: Sequence[str] = ()) -> Optional[Path]:
    """The absolute path of ``path``: as given if absolute, else the first of ``search``'s
    folders (in order), then the current directory, that holds it; ``None`` if none does."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p if p.is_file() else None
    for folder in [*search, os.getcwd()]:
        if (Path(folder) / p).is_file():
            return (Path(folder) / p).resolve()
    return None


class TokenFile(Dataset):
    """Samples of ``seq_len`` tokens from a token file, as (x, y) int64 tensors.

    The map is opened on first use, in the process that uses it; pickling keeps only the
    path, dtype, seq_len and sample count, so Ray ships this object in a few bytes."""

    def __init__(self, path: Union[str, Path], seq_len: int, dtype: str = "uint16"):
        self.path, self.seq_len, self.dtype = str(path), seq_len, dtype
        n_tokens = os.path.getsize(self.path) // TOKEN_DTYPES[dtype].itemsize
        self.n = (n_tokens - 1) // seq_len
        self._map: Optional[np.memmap] = None

    def __getstate__(self) -> dict:
        return {"path": self.path, "seq_len": self.seq_len, "dtype": self.dtype, "n": self.n}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _map=None)

    def __len__(self) -> int:
        return self.n

    def _tokens(self) -> np.memmap:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=TOKEN_DTYPES[self.dtype], mode="r")
        return self._map

    def _rows(self, shift: int) -> np.ndarray:
        """The file as an (n, seq_len) view whose row k is sample k's x (shift 0) or y (shift 1)."""
        n, length = self.n, self.seq_len
        return self._tokens()[shift: shift + n * length].reshape(n, length)

    def _check(self, idx: Indices) -> np.ndarray:
        i = np.asarray(idx.cpu() if isinstance(idx, torch.Tensor) else idx, dtype=np.int64).reshape(-1)
        bad = i[(i < 0) | (i >= self.n)]
        if bad.size:
            raise IndexError(f"sample index {int(bad[0])} is out of range: {self.path} has samples 0..{self.n - 1}")
        return i

    def _read(self, idx: Indices, shift: int) -> torch.Tensor:
        return torch.from_numpy(self._rows(shift)[self._check(idx)].astype(np.int64))

    def inputs(self, idx: Indices) -> torch.Tensor:
        """Samples ``idx``'s inputs, ``[len(idx), seq_len]`` int64; reads only those tokens."""
        return self._read(idx, 0)

    def targets(self, idx: Indices) -> torch.Tensor:
        """Samples ``idx``'s targets (the inputs shifted by one token), ``[len(idx), seq_len]`` int64."""
        return self._read(idx, 1)

    def __getitem__(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self._check([k])[0]) * self.seq_len
        window = torch.from_numpy(self._tokens()[start: start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]

    def __repr__(self) -> str:
        return f"TokenFile({self.path!r}, seq_len={self.seq_len}, dtype={self.dtype!r}: {self.n} samples)"


def tokens(path: str, seq_len: int, dtype: str = "uint16", search: Sequence[str] = ()) -> TokenFile:
    """The builder of ``data: {kind: tokens, args: {path, seq_len, dtype}}``: checks the file
    (it exists, its size is whole tokens, it holds at least one sample) without reading it."""
    what = "data.kind=tokens:"
    if dtype not in TOKEN_DTYPES:
        raise SpecError(f"{what} dtype {dtype!r} is not supported; use uint16 (vocabularies up to 65536) "
                        "or uint32")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise SpecError(f"{what} seq_len is {seq_len!r}; give a whole number of tokens per sample, at least 1")
    if not isinstance(path, str) or not path:
        raise SpecError(f"{what} path is {path!r}; give the token file's path (absolute, or relative to the "
                        "spec's folder)")
    found = resolve_path(path, search)
    if found is None:
        where = [path] if Path(path).expanduser().is_absolute() else [*search, os.getcwd()]
        raise SpecError(f"{what} no file {path!r} (looked in {', '.join(map(str, where))}); "
                        "check args.path, or give an absolute path")
    size, item = found.stat().st_size, TOKEN_DTYPES[dtype].itemsize
    if size % item:
        raise SpecError(f"{what} {found} is {size} bytes, not a whole number of {dtype} tokens "
                        f"({item} bytes each); is dtype right?")
    if size // item < seq_len + 1:
        raise SpecError(f"{what} {found} holds {size // item} tokens, fewer than one sample needs "
                        f"(seq_len + 1 = {seq_len + 1}); lower seq_len or give a longer file")
    return TokenFile(found, seq_len, dtype)
