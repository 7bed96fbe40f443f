"""Atomic checkpoints: ``<path>/step-00000050/{state.pt,meta.json}``.

A checkpoint is written into a hidden temporary folder and renamed into place, so a
reader never sees half of one; ``meta.json`` is written last and marks it complete.
The state holds the whole model's ``state_dict`` (the builder's keys) and the
optimizer state keyed by parameter name, so any shape can load it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Optional

import torch

_DIR_RE = re.compile(r"^step-(\d{8})$")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: str | Path, step: int, model: dict, optim: dict, meta: dict, keep: int = 3) -> Path:
    """Write the checkpoint of committed step ``step`` (1-based count of steps done)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        with open(tmp / "state.pt", "wb") as f:
            torch.save({"step": step, "model": model, "optim": optim}, f)
            f.flush()
            os.fsync(f.fileno())
        with open(tmp / "meta.json", "w") as f:
            json.dump({"step": step, "time": time.time(), **meta}, f)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _DIR_RE.match(p.name)) and (p / "meta.json").is_file() and (p / "state.pt").is_file()]
    return [p for _, p in sorted(found)]


def latest(root: str | Path) -> Optional[Path]:
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve(path: str | Path) -> Path:
    """A checkpoint folder, or the newest one under a checkpoint root."""
    p = Path(path)
    if (p / "state.pt").is_file() and (p / "meta.json").is_file():
        return p
    newest = latest(p)
    if newest is None:
        raise FileNotFoundError(f"no complete checkpoint at {p} (expected step-NNNNNNNN folders with "
                                "state.pt and meta.json)")
    return newest


def load(path: str | Path) -> dict:
    p = resolve(path)
    state = torch.load(p / "state.pt", map_location="cpu", weights_only=False)
    state["meta"] = json.loads((p / "meta.json").read_text())
    state["path"] = str(p)
    return state
