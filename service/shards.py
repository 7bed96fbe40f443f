"""The final model as Hugging Face publishes large ones: safetensors shards and an index.

::

    <out>/model-00001-of-00004.safetensors   stage 0's tensors, by the whole model's names
          ...
          model.safetensors.index.json        written last: {"metadata": {"total_size": bytes, ...},
                                                             "weight_map": {name: shard file}}

Each stage writes its own shard (:func:`write_shard`), at the same time as the others; one
process then writes the index (:func:`write_index`) from their entries. Reading needs only
``json`` and ``safetensors``; :func:`load` reads just the names asked for.
"""
from __future__ import annotations

import json
import os
import struct
import uuid
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

from safetensors import safe_open

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

Names = Union[None, Iterable[str], Callable[[str], bool]]


def model_pt_max_bytes() -> int:
    """The largest final model also made into one ``model.pt`` (by ``relaytrain run`` and by
    GET /v1/jobs/{id}/model): env RELAYTRAIN_MODEL_PT_MAX_MB (default 1024), read at each call."""
    raw = os.environ.get("RELAYTRAIN_MODEL_PT_MAX_MB", "1024")
    try:
        return int(float(raw) * 2**20)
    except ValueError:
        raise ValueError(f"RELAYTRAIN_MODEL_PT_MAX_MB is {raw!r}; set it to a number of MiB") from None


def shard_name(index: int, count: int) -> str:
    """The file of shard ``index`` (0-based, the stage) of ``count``, numbered from 1 as
    Hugging Face does: ``shard_name(0, 4) == "model-00001-of-00004.safetensors"``."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace(tmp: Path, path: Path) -> None:
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(path.parent)


def _atomic(path: Path, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` a temporary file beside ``path``, then rename it to ``path``."""
    tmp = _tmp(path)
    try:
        write(tmp)
        _replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _plain(tensors: dict) -> dict:
    """CPU, contiguous tensors, none sharing storage with another (safetensors refuses that):
    a tied parameter or a view is cloned; the dtype is kept."""
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != t.nbytes:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def write_shard(folder: str | Path, index: int, count: int, tensors: dict) -> dict:
    """Write stage ``index``'s tensors (``{name: tensor}``) as one shard, atomically; return
    its entry for :func:`write_index`: ``{"file", "names", "bytes"}`` (bytes of tensor data)."""
    if not 0 <= index < count:
        raise ValueError(f"shard {index} of {count}: the index must be in [0, {count})")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / shard_name(index, count)
    tensors = _plain(tensors)
    from safetensors.torch import save_file  # imports torch: the scheduler writes only the index

    _atomic(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    return {"file": path.name, "names": list(tensors), "bytes": sum(t.nbytes for t in tensors.values())}


def to_bytes(tensors: dict) -> bytes:
    """One shard as bytes (for a store that takes blobs), as :func:`write_shard` would write it."""
    from safetensors.torch import save

    return save(_plain(tensors), metadata={"format": "pt"})


def index_of(shards: list[dict], metadata: Optional[dict] = None) -> dict:
    """The index of shards whose entries name distinct tensors (one stage each), without
    reading them: ``total_size`` is the sum of the entries' bytes."""
    weight_map = {name: s["file"] for s in sorted(shards, key=lambda s: s["file"]) for name in s["names"]}
    return {"metadata": {"total_size": sum(s["bytes"] for s in shards), **(metadata or {})},
            "weight_map": dict(sorted(weight_map.items()))}


def _sizes(path: Path) -> dict[str, int]:
    """Bytes of each tensor of a safetensors file, from its header alone."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def write_index(folder: str | Path, shards: list[dict], metadata: Optional[dict] = None) -> Path:
    """Write ``model.safetensors.index.json`` from the entries :func:`write_shard` returned, after
    every shard is written. A name in two shards (a tied parameter two stages hold) maps to the
    first and counts once in ``total_size``."""
    folder = Path(folder)
    weight_map, total = {}, 0
    for shard in sorted(shards, key=lambda s: s["file"]):
        sizes = _sizes(folder / shard["file"])
        for name in shard["names"]:
            if name not in sizes:
                raise ValueError(f"{name!r} is not in {folder / shard['file']}")
            if name not in weight_map:
                weight_map[name] = shard["file"]
                total += sizes[name]
    index = {"metadata": {"total_size": total, **(metadata or {})},
             "weight_map": dict(sorted(weight_map.items()))}
    return write_text(folder, INDEX, json.dumps(index, indent=2))


def write_text(folder: str | Path, name: str, text: str) -> Path:
    """A small file of ``folder`` (the index), atomically."""
    return _atomic(Path(folder) / name, lambda tmp: tmp.write_text(text))


def _natural(name: str) -> list:
    """'10.weight' after '2.weight': layer indices compare as numbers."""
    return [(0, int(c), "") if c.isdigit() else (1, 0, c) for c in name.split(".")]


def load(folder: str | Path, names: Names = None) -> dict:
    """``{name: tensor}`` of the model in ``folder`` (an index and its shards, or a single
    ``model.safetensors``), by layer and then by name; with ``names`` (a set or a predicate),
    only those, reading only the shards that hold them."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
    elif (folder / SINGLE).is_file():
        with safe_open(folder / SINGLE, framework="pt") as f:
            weight_map = {k: SINGLE for k in f.keys()}
    else:
        raise FileNotFoundError(f"no {INDEX} or {SINGLE} in {folder}")
    if names is not None:
        want = names if callable(names) else set(names).__contains__
        weight_map = {k: v for k, v in weight_map.items() if want(k)}
    out = {}
    for file in sorted(set(weight_map.values())):
        with safe_open(folder / file, framework="pt", device="cpu") as f:
            out.update((k, f.get_tensor(k)) for k, v in weight_map.items() if v == file)
    return {k: out[k] for k in sorted(out, key=_natural)}


def to_model_pt(folder: str | Path, path: str | Path) -> Path:
    """Write the whole model in ``folder`` as one ``model.pt`` (a plain ``torch.save`` of its
    state_dict, in the index's ``metadata.order`` when it has one), for a model that fits one
    process."""
    state = load(folder)
    index = Path(folder) / INDEX
    order = json.loads(index.read_text())["metadata"].get("order") if index.is_file() else None
    if order:
        state = {n: state[n] for n in order}
    import torch

    return _atomic(Path(path), lambda tmp: torch.save(state, tmp))
