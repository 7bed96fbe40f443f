"""Atomic checkpoints, written in parts by the stages that hold them.

Format 2 (written now)::

    <root>/step-00000050/part-00000-of-00004.pt   one stage's {"model": {name: tensor},
                                                   "optim": {"state": {name: {slot: value}}, "groups": [...]}}
                         meta.json                 written last: {"step", "time", "format": 2,
                                                   "parts": [{"file", "model", "optim", "bytes"}], **meta}

Format 1 (still read): ``<root>/step-00000050/{state.pt,meta.json}``, the whole state in one file.

Names are those of the whole model (``"3.weight"``: layer 3), so any shape can load any
checkpoint, and a loader opens only the parts holding the names it asks for. A checkpoint is
complete when its ``meta.json`` exists and names parts that exist; the manifest is written last,
so this holds where there is no rename too. On a local disk the parts are also written into a
hidden ``.tmp-*`` folder that is renamed into place, so a reader never sees half of one.

Writing, one process per stage::

    folder = begin(root, step)                                     # once, anywhere
    entry = write_part(folder, s, pp, model_s, optim_s)            # each stage s, in parallel
    finish(root, folder, step, [entries...], meta)                 # once, after every part
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

import torch

_DIR_RE = re.compile(r"^step-(\d{8})$")
_PART_RE = re.compile(r"^part-(\d{5})-of-(\d{5})\.pt$")
FORMAT = 2
STALE_TMP_SECONDS = 3600.0

Names = Union[None, Iterable[str], Callable[[str], bool]]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, write: Callable) -> None:
    """``write(f)`` into a temporary file beside ``path``, fsync it, then rename it to ``path``."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _wanted(names: Names) -> Callable[[str], bool]:
    if names is None:
        return lambda n: True
    if callable(names):
        return names
    names = set(names)
    return names.__contains__


# ---------------------------------------------------------------- writing


def part_name(index: int, count: int) -> str:
    """The file of part ``index`` (0-based, the stage) of ``count``: ``part-00000-of-00004.pt``."""
    return f"part-{index:05d}-of-{count:05d}.pt"


def begin(root: str | Path, step: int) -> Path:
    """A fresh hidden folder under ``root`` for the parts of step ``step``'s checkpoint.
    Temporary folders left over from a crash more than an hour ago are removed."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for old in root.glob(".tmp-*"):
        try:
            if old.is_dir() and now - old.stat().st_mtime > STALE_TMP_SECONDS:
                shutil.rmtree(old, ignore_errors=True)
        except FileNotFoundError:
            pass
    folder = root / f".tmp-step-{step:08d}-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    return folder


def write_part(folder: str | Path, index: int, count: int, model: dict, optim: dict) -> dict:
    """Write one stage's part (its ``state_dict`` and name-keyed optimizer state) atomically
    into ``folder``; return its entry for :func:`finish`. Stages call it at the same time."""
    if not 0 <= index < count:
        raise ValueError(f"part {index} of {count}: the index must be in [0, {count})")
    path = Path(folder) / part_name(index, count)
    _write_atomic(path, lambda f: torch.save({"model": model, "optim": optim}, f))
    return {"file": path.name, "model": list(model), "optim": list(optim.get("state", {})),
            "bytes": path.stat().st_size}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _check_parts(folder: Path, parts: list[dict]) -> list[dict]:
    """The parts in order, after checking they are all there and that a name held by two parts
    (a tied parameter) has the same value in both."""
    parsed = [(_PART_RE.match(p["file"]), p) for p in parts]
    if not parts or any(m is None for m, _ in parsed):
        raise ValueError(f"checkpoint parts must be named part-NNNNN-of-NNNNN.pt, got {[p['file'] for p in parts]}")
    count = int(parsed[0][0].group(2))
    if sorted((int(m.group(1)), int(m.group(2))) for m, _ in parsed) != [(i, count) for i in range(count)]:
        raise ValueError(f"checkpoint parts {sorted(p['file'] for p in parts)} are not parts 0..{count - 1} "
                         f"of {count}, each once")
    parts = [p for _, p in sorted(parsed, key=lambda mp: mp[0].group(1))]
    for p in parts:
        if not (folder / p["file"]).is_file():
            raise FileNotFoundError(f"checkpoint part {folder / p['file']} is missing")
    for kind in ("model", "optim"):
        first: dict[str, int] = {}
        for i, p in enumerate(parts):
            for name in p[kind]:
                j = first.setdefault(name, i)
                if j != i and not _same(*(_read(folder, parts[k], kind, {name})[name] for k in (j, i))):
                    raise ValueError(f"{kind} entry {name!r} is in {parts[j]['file']} and {p['file']} "
                                     "with different values")
    return parts


def finish(root: str | Path, folder: str | Path, step: int, parts: list[dict], meta: dict,
           keep: int = 3) -> Path:
    """Complete step ``step``'s checkpoint from the entries :func:`write_part` returned: check the
    parts, write ``meta.json`` last, rename ``folder`` to ``step-NNNNNNNN`` (replacing one already
    there) and keep the ``keep`` newest checkpoints. On an error ``folder`` is removed."""
    root, folder = Path(root), Path(folder)
    final = root / f"step-{step:08d}"
    old = root / f".tmp-old-{final.name}-{uuid.uuid4().hex[:8]}"  # where a checkpoint it replaces waits
    try:
        parts = _check_parts(folder, parts)
        manifest = {**meta, "step": step, "time": time.time(), "format": FORMAT, "parts": parts}
        _write_atomic(folder / "meta.json", lambda f: f.write(json.dumps(manifest).encode()))
        _fsync_dir(folder)
        if final.exists():
            os.rename(final, old)
        os.rename(folder, final)
        _fsync_dir(root)
    except BaseException:
        if old.exists() and not final.exists():
            os.rename(old, final)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    for stale in list_checkpoints(root)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def save(root: str | Path, step: int, model: dict, optim: dict, meta: dict, keep: int = 3) -> Path:
    """Write the checkpoint of committed step ``step`` (1-based count of steps done) from one
    process, as a single part."""
    folder = begin(root, step)
    try:
        part = write_part(folder, 0, 1, model, optim)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return finish(root, folder, step, [part], meta, keep=keep)


# ---------------------------------------------------------------- finding


def _manifest(path: Path) -> Optional[dict]:
    """The ``meta.json`` of a complete checkpoint folder, else None."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    if meta.get("format", 1) == 1:
        return meta if (path / "state.pt").is_file() else None
    try:
        complete = bool(meta["parts"]) and all((path / p["file"]).is_file() for p in meta["parts"])
    except (KeyError, TypeError):
        return None
    return meta if complete else None


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _DIR_RE.match(p.name)) and _manifest(p) is not None]
    return [p for _, p in sorted(found)]


def latest(root: str | Path) -> Optional[Path]:
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve(path: str | Path) -> Path:
    """A checkpoint folder, or the newest one under a checkpoint root."""
    p = Path(path)
    if _manifest(p) is not None:
        return p
    newest = latest(p)
    if newest is None:
        raise FileNotFoundError(f"no complete checkpoint at {p} (expected step-NNNNNNNN folders with "
                                "meta.json and the parts it names, or state.pt)")
    return newest


def step_of(path: str | Path) -> int:
    """The committed step count of a checkpoint folder (or of the newest under a root), from
    its manifest alone."""
    return int(_manifest(resolve(path))["step"])


# ---------------------------------------------------------------- reading


def _read(folder: Path, part: dict, kind: str, names: set[str]) -> dict:
    """Entries ``names`` of one part's ``kind`` ("model" or the optimizer's "optim" state)."""
    state = torch.load(folder / part["file"], map_location="cpu", mmap=True, weights_only=False)
    held = state["model"] if kind == "model" else state["optim"]["state"]
    return {n: held[n] for n in names}


def names_in(path: str | Path) -> list[str]:
    """The parameter and buffer names a checkpoint holds, in the model's order, without
    reading tensors."""
    p = resolve(path)
    meta = _manifest(p)
    if meta.get("format", 1) == 1:
        state = torch.load(p / "state.pt", map_location="cpu", mmap=True, weights_only=False)
        return list(state["model"])
    return list(dict.fromkeys(n for part in meta["parts"] for n in part["model"]))


def load(path: str | Path, names: Names = None) -> dict:
    """``{"step", "model", "optim", "meta", "path"}`` of a checkpoint folder or of the newest one
    under a root. With ``names`` (a set of names or a predicate), only those model and optimizer
    entries, reading only the parts that hold them; tensors are memory-mapped, read when used."""
    p = resolve(path)
    meta = _manifest(p)
    want = _wanted(names)
    if meta.get("format", 1) == 1:
        state = torch.load(p / "state.pt", map_location="cpu", mmap=True, weights_only=False)
        model = {n: v for n, v in state["model"].items() if want(n)}
        optim = {"state": {n: v for n, v in state["optim"]["state"].items() if want(n)},
                 "groups": state["optim"]["groups"]}
        return {"step": state["step"], "model": model, "optim": optim, "meta": meta, "path": str(p)}
    # each name from the first part that holds it (a tied parameter may be in two)
    owner: dict[tuple[str, str], int] = {}
    for i, part in enumerate(meta["parts"]):
        for kind in ("model", "optim"):
            for n in part[kind]:
                if want(n):
                    owner.setdefault((kind, n), i)
    model, optim = {}, {"state": {}, "groups": None}
    for i, part in enumerate(meta["parts"]):
        mine = [key for key, j in owner.items() if j == i]
        if not mine:
            continue
        state = torch.load(p / part["file"], map_location="cpu", mmap=True, weights_only=False)
        model.update((n, state["model"][n]) for kind, n in mine if kind == "model")
        optim["state"].update((n, state["optim"]["state"][n]) for kind, n in mine if kind == "optim")
        optim["groups"] = optim["groups"] or state["optim"]["groups"]
    return {"step": meta["step"], "model": model, "optim": optim, "meta": meta, "path": str(p)}
