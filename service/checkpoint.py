"""Atomic checkpoints, written in parts by the stages that hold them.

Format 2 (written now)::

    <root>/step-00000050/part-00000-of-00004.pt   one stage's {"model": {name: tensor},
                                                   "optim": {"state": {name: {slot: value}}, "groups": [...]}}
                         meta.json                 written last: {"step", "time", "format": 2,
                                                   "parts": [{"file", "model", "optim", "bytes"}], **meta}

Format 1 (still read): ``<root>/step-00000050/{state.pt,meta.json}``, the whole state in one file.

Names are those of the whole model (``"3.weight"``: layer 3), so any shape can load any
checkpoint, and a loader opens only the parts holding the names it asks for. A checkpoint is
complete when its ``meta.json`` exists and names parts that exist (on remote storage, with the
sizes it says); the manifest is written last, so this holds where there is no rename too. On a
local disk the parts are also written into a hidden ``.tmp-*`` folder that is renamed into place,
so a reader never sees half of one.

``root`` and every folder may be a local path (``str`` or ``Path``; ``file://`` URLs too) or a URL
of storage fsspec reaches (``s3://bucket/prefix``, see service/storage.py). Remote storage has no
rename: :func:`begin` empties the final ``step-NNNNNNNN`` folder (its manifest first) and the
parts go straight into it. Folders come back as ``Path`` for a local root, as ``str`` URLs for a
remote one.

Writing, one process per stage::

    folder = begin(root, step)                                     # once, anywhere
    entry = write_part(folder, s, pp, model_s, optim_s)            # each stage s, in parallel
    finish(root, folder, step, [entries...], meta)                 # once, after every part
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

from service import storage

_DIR_RE = re.compile(r"^step-(\d{8})$")
_PART_RE = re.compile(r"^part-(\d{5})-of-(\d{5})\.pt$")
FORMAT = 2
STALE_TMP_SECONDS = 3600.0
UPLOAD_BLOCK = 16 * 2**20  # bytes a part is uploaded in (S3 takes up to 10,000 blocks: parts up to 160 GiB)

Names = Union[None, Iterable[str], Callable[[str], bool]]
Where = Union[Path, str]  # a local folder, or the URL of a remote one


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


def _loc(path: str | Path) -> Where:
    """A local ``Path`` (as given, or of a ``file://`` URL), or a remote URL without a trailing slash."""
    if storage.is_local(path):
        return Path(path) if isinstance(path, os.PathLike) or "://" not in path else Path(storage.local_path(path))
    url = str(path)
    stripped = url.rstrip("/")
    return url if stripped.endswith(":") else stripped  # "memory://" stays whole


def _child(folder: Where, name: str) -> Where:
    if isinstance(folder, Path):
        return folder / name
    return (folder if folder.endswith("/") else folder + "/") + name


def _rm_quiet(fs, path: str, recursive: bool = False) -> None:
    try:
        fs.rm(path, recursive=recursive)
    except FileNotFoundError:
        pass


def remove_tree(root: str | Path) -> None:
    """Delete a job's checkpoint folder and everything in it (local or on object storage); one
    that is not there is no error."""
    where = _loc(root)
    if isinstance(where, Path):
        if where.exists():
            shutil.rmtree(where)
        return
    fs, path = storage.fs_and_path(where)
    _rm_quiet(fs, path, recursive=True)


def _files(folder: str) -> dict[str, int]:
    """The files directly in remote ``folder`` and their sizes (one listing, never cached)."""
    fs, path = storage.fs_and_path(folder)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return {}
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("size") for e in entries if e.get("type") == "file"}


class _RemoteFile(io.RawIOBase):
    """A remote file, read-only and seekable, for ``torch.load``: its many small reads (the zip's
    headers, the pickle) come from one cached block; a large one (a tensor's bytes) is fetched
    in ranges, several at once, straight into the tensor's memory (torch reads with readinto),
    so besides the tensor only those few ranges are held, never a copy of it whole."""

    BLOCK = 1 << 20  # bytes cached for small reads
    RANGE = 8 << 20  # a large read's ranges, fetched CONCURRENT at a time
    CONCURRENT = 8

    def __init__(self, fs, path: str):
        super().__init__()
        self.fs, self.path = fs, path
        self.size = fs.size(path)
        self.pos, self.block_at, self.block = 0, 0, b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = max(0, {0: 0, 1: self.pos, 2: self.size}[whence] + offset)
        return self.pos

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), self.size - self.pos))
        start = self.pos
        if n > self.BLOCK:
            starts = list(range(start, start + n, self.RANGE))
            for i in range(0, len(starts), self.CONCURRENT):
                batch = starts[i:i + self.CONCURRENT]
                ends = [min(s + self.RANGE, start + n) for s in batch]
                for s, e, data in zip(batch, ends, self.fs.cat_ranges([self.path] * len(batch), batch, ends)):
                    if len(data) != e - s:
                        raise OSError(f"{self.path}: read {len(data)} bytes at {s}, expected {e - s}")
                    out[s - start:e - start] = data
        elif n:
            if not (self.block_at <= start and start + n <= self.block_at + len(self.block)):
                self.block_at, self.block = start, self.fs.cat_file(
                    self.path, start=start, end=min(start + self.BLOCK, self.size))  # by name: s3fs differs
            at = start - self.block_at
            out[:n] = self.block[at:at + n]
        self.pos += n
        return n


def _torch_load(file: Where):
    """A part's (or a format 1 ``state.pt``'s) contents: memory-mapped from a local disk, read
    through fsspec from remote storage."""
    import torch  # here: a job's scheduler finds and lists checkpoints without torch

    if isinstance(file, Path):
        return torch.load(file, map_location="cpu", mmap=True, weights_only=False)
    fs, path = storage.fs_and_path(file)
    with _RemoteFile(fs, path) as f:
        return torch.load(f, map_location="cpu", weights_only=False)


def remove(path: str | Path) -> None:
    """Remove a checkpoint folder (or one :func:`begin` gave) and all in it, its manifest first,
    so that a crash halfway leaves no manifest naming missing parts. A missing folder is fine."""
    where = _loc(path)
    if isinstance(where, Path):
        if where.is_dir():
            (where / "meta.json").unlink(missing_ok=True)
        shutil.rmtree(where, ignore_errors=True)
        return
    fs, p = storage.fs_and_path(where)
    if "/" not in p.strip("/"):
        raise ValueError(f"{where} is the top of its storage (a whole bucket), not a checkpoint folder")
    _rm_quiet(fs, p + "/meta.json")
    _rm_quiet(fs, p, recursive=True)


# ---------------------------------------------------------------- writing


def part_name(index: int, count: int) -> str:
    """The file of part ``index`` (0-based, the stage) of ``count``: ``part-00000-of-00004.pt``."""
    return f"part-{index:05d}-of-{count:05d}.pt"


def begin(root: str | Path, step: int, clean: bool = True) -> Where:
    """A fresh hidden folder under ``root`` for the parts of step ``step``'s checkpoint.
    Temporary folders left over from a crash more than an hour ago are removed.

    On remote storage (no rename) the folder is the final ``<root>/step-NNNNNNNN``, emptied of a
    checkpoint of the same step: its manifest first, then its parts, so that a crash never
    leaves an old manifest naming new parts.  ``clean=False`` skips that (two requests) for a
    step whose folder the caller knows is not there (see :func:`step_folders`)."""
    root = _loc(root)
    if not isinstance(root, Path):
        folder = _child(root, f"step-{step:08d}")
        if clean:
            fs, path = storage.fs_and_path(folder)
            _rm_quiet(fs, path + "/meta.json")
            _rm_quiet(fs, path, recursive=True)
        storage.makedirs(folder)
        return folder
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
    import torch

    if not 0 <= index < count:
        raise ValueError(f"part {index} of {count}: the index must be in [0, {count})")
    folder = _loc(folder)
    entry = {"file": part_name(index, count), "model": list(model), "optim": list(optim.get("state", {})),
             "shapes": {n: list(t.shape) for n, t in model.items() if isinstance(t, torch.Tensor)}}
    if not isinstance(folder, Path):
        fs, path = storage.fs_and_path(_child(folder, entry["file"]))
        _write_stream(fs, path, lambda f: torch.save({"model": model, "optim": optim}, f))
        return {**entry, "bytes": fs.size(path)}
    path = folder / entry["file"]
    _write_atomic(path, lambda f: torch.save({"model": model, "optim": optim}, f))
    return {**entry, "bytes": path.stat().st_size}


class _Blocks:
    """A write-only file that hands ``f`` at most ``size`` bytes a write, so that fsspec's
    buffered files (S3: a multipart upload) send a block at a time rather than first copying a
    whole tensor's bytes into their buffer."""

    def __init__(self, f, size: int):
        self.f, self.size = f, size

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), self.size):
            self.f.write(view[i:i + self.size])
        return len(view)

    def flush(self) -> None:
        self.f.flush()


def _write_stream(fs, path: str, write: Callable) -> None:
    """``write(f)`` straight into remote ``path``, uploaded a block at a time (at most about two
    blocks in memory, no copy of the whole file); on an error what was written is removed."""
    f = fs.open(path, "wb", block_size=UPLOAD_BLOCK)
    try:
        write(_Blocks(f, UPLOAD_BLOCK))
    except BaseException:
        try:
            f.close()
        except Exception:  # noqa: BLE001  the write's error is the one to raise
            pass
        _rm_quiet(fs, path)
        raise
    f.close()


def _same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _check_parts(folder: Where, parts: list[dict]) -> list[dict]:
    """The parts in order, after checking they are all there (on remote storage, with the sizes
    their entries say) and that a name held by two parts (a tied parameter) has the same value
    in both."""
    parsed = [(_PART_RE.match(p["file"]), p) for p in parts]
    if not parts or any(m is None for m, _ in parsed):
        raise ValueError(f"checkpoint parts must be named part-NNNNN-of-NNNNN.pt, got {[p['file'] for p in parts]}")
    count = int(parsed[0][0].group(2))
    if sorted((int(m.group(1)), int(m.group(2))) for m, _ in parsed) != [(i, count) for i in range(count)]:
        raise ValueError(f"checkpoint parts {sorted(p['file'] for p in parts)} are not parts 0..{count - 1} "
                         f"of {count}, each once")
    parts = [p for _, p in sorted(parsed, key=lambda mp: mp[0].group(1))]
    if isinstance(folder, Path):
        for p in parts:
            if not (folder / p["file"]).is_file():
                raise FileNotFoundError(f"checkpoint part {folder / p['file']} is missing")
    else:
        files = _files(folder)
        for p in parts:
            if p["file"] not in files:
                raise FileNotFoundError(f"checkpoint part {_child(folder, p['file'])} is missing")
            if "bytes" in p and files[p["file"]] != p["bytes"]:
                raise ValueError(f"checkpoint part {_child(folder, p['file'])} has {files[p['file']]} bytes, "
                                 f"its entry says {p['bytes']}")
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
           keep: int = 3) -> Where:
    """Complete step ``step``'s checkpoint from the entries :func:`write_part` returned: check the
    parts, write ``meta.json`` last, rename ``folder`` to ``step-NNNNNNNN`` (replacing one already
    there) and keep the ``keep`` newest checkpoints. On an error ``folder`` is removed.
    On remote storage ``folder`` is already the final one: the manifest written last completes
    it; older checkpoints beyond ``keep`` and unfinished ones older than those kept are removed."""
    root, folder = _loc(root), _loc(folder)
    if not isinstance(root, Path) or not isinstance(folder, Path):
        return _finish_remote(root, folder, step, parts, meta, keep)
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
    for stale in list_checkpoints(root, meta.get("job_id"))[:-keep]:  # this job's own only
        shutil.rmtree(stale, ignore_errors=True)
    return final


def _finish_remote(root: Where, folder: Where, step: int, parts: list[dict], meta: dict, keep: int) -> str:
    final = _child(root, f"step-{step:08d}") if not isinstance(root, Path) else None
    if final is None or folder != final:
        raise ValueError(f"checkpoint folder {folder} is not the one begin({str(root)!r}, {step}) gives "
                         f"({final or 'a local folder'})")
    try:
        parts = _check_parts(folder, parts)
        manifest = {**meta, "step": step, "time": time.time(), "format": FORMAT, "parts": parts}
        fs, path = storage.fs_and_path(_child(folder, "meta.json"))
        fs.pipe_file(path, json.dumps(manifest).encode())  # one PUT: there, or not
    except BaseException:
        remove(folder)
        raise
    found = _scan(root)
    job = meta.get("job_id")
    complete = [(s, f) for s, f, m in found if _of_job(m, job)]  # this job's own only
    kept = complete[-keep:] if keep > 0 else complete
    for _, stale in complete[:-keep] if keep > 0 else []:
        remove(stale)
    others = any(m is not None and not _of_job(m, job) for _, _, m in found)
    if kept and not others:  # parts of writes that never finished, older than any checkpoint kept
        for s, f, m in found:  # (not where another job writes: they may be its write going on)
            if m is None and s < kept[0][0]:
                remove(f)
    return final


def save(root: str | Path, step: int, model: dict, optim: dict, meta: dict, keep: int = 3) -> Where:
    """Write the checkpoint of committed step ``step`` (1-based count of steps done) from one
    process, as a single part."""
    folder = begin(root, step)
    try:
        part = write_part(folder, 0, 1, model, optim)
    except BaseException:
        if isinstance(folder, Path):
            shutil.rmtree(folder, ignore_errors=True)
        else:
            remove(folder)
        raise
    return finish(root, folder, step, [part], meta, keep=keep)


# ---------------------------------------------------------------- finding


def _manifest(path: Where) -> Optional[dict]:
    """The ``meta.json`` of a complete checkpoint folder, else None."""
    if not isinstance(path, Path):
        return _manifest_remote(path)
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


def _complete(meta, files: dict[str, int]) -> Optional[dict]:
    """``meta`` if it is a manifest whose files are all in ``files`` (name -> size), with the sizes
    it says."""
    if not isinstance(meta, dict):
        return None
    if meta.get("format", 1) == 1:
        return meta if "state.pt" in files else None
    try:
        complete = bool(meta["parts"]) and all(
            p["file"] in files and ("bytes" not in p or files[p["file"]] == p["bytes"]) for p in meta["parts"])
    except (KeyError, TypeError):
        return None
    return meta if complete else None


def _parse(data) -> Optional[dict]:
    try:
        return json.loads(data)
    except (TypeError, ValueError):
        return None


def _manifest_remote(url: str) -> Optional[dict]:
    fs, path = storage.fs_and_path(_child(url, "meta.json"))
    try:
        meta = _parse(fs.cat_file(path))  # the manifest first: then the parts it names
    except FileNotFoundError:  # (refused credentials or an unreachable endpoint are raised)
        return None
    return _complete(meta, _files(url)) if meta is not None else None


def _scan(root: str) -> list[tuple[int, str, Optional[dict]]]:
    """``(step, folder, manifest or None if incomplete)`` of the ``step-NNNNNNNN`` folders under
    remote ``root``, oldest first: one listing of everything below, then their manifests at once."""
    fs, path = storage.fs_and_path(root)
    try:
        found = fs.find(path, detail=True)
    except FileNotFoundError:
        return []
    prefix = path.rstrip("/") + "/"
    folders: dict[str, dict[str, int]] = {}
    for name, info in found.items():
        rel = name[len(prefix):].split("/") if name.startswith(prefix) else []
        if len(rel) == 2 and _DIR_RE.match(rel[0]) and info.get("type", "file") == "file":
            folders.setdefault(rel[0], {})[rel[1]] = info.get("size")
    manifests = {d: prefix + d + "/meta.json" for d, files in folders.items() if "meta.json" in files}
    data = fs.cat(list(manifests.values()), on_error="return") if manifests else {}
    if len(manifests) == 1 and not isinstance(data, dict):  # one path: some filesystems give its bytes
        data = {next(iter(manifests.values())): data}
    out = []
    for d, files in folders.items():
        raw = data.get(manifests[d]) if d in manifests else None
        meta = _complete(_parse(raw), files) if isinstance(raw, (bytes, str)) else None
        out.append((int(_DIR_RE.match(d).group(1)), _child(root, d), meta))
    return sorted(out, key=lambda t: t[0])


def step_folders(root: str | Path) -> set[int]:
    """The steps of every ``step-NNNNNNNN`` folder under ``root``, complete or not."""
    root = _loc(root)
    if not isinstance(root, Path):
        return {s for s, _, _ in _scan(root)}
    return {int(m.group(1)) for p in (root.iterdir() if root.is_dir() else []) if (m := _DIR_RE.match(p.name))}


def _of_job(meta: Optional[dict], job_id: Optional[str]) -> bool:
    """A complete checkpoint's manifest written by job ``job_id`` (any job when None)."""
    return meta is not None and (job_id is None or meta.get("job_id") == job_id)


def list_checkpoints(root: str | Path, job_id: Optional[str] = None) -> list[Where]:
    """Complete checkpoints under ``root``, oldest first; with ``job_id``, only that job's.

    Several jobs may write into one folder (``relaytrain run`` of two specs with the same
    ``checkpoint.path``): a job restarts, goes back and prunes among its own checkpoints only
    (it restarted from another job's step 60, and deleted its own as it wrote them)."""
    root = _loc(root)
    if not isinstance(root, Path):
        return [folder for _, folder, meta in _scan(root) if _of_job(meta, job_id)]
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _DIR_RE.match(p.name)) and _of_job(_manifest(p), job_id)]
    return [p for _, p in sorted(found)]


def latest(root: str | Path, job_id: Optional[str] = None) -> Optional[Where]:
    """The newest complete checkpoint under ``root`` (with ``job_id``: of that job)."""
    found = list_checkpoints(root, job_id)
    return found[-1] if found else None


def newest_or_origin(root: Optional[str], job_id: str, origin: Optional[str] = None) -> Optional[Where]:
    """Where a job goes back to: its newest complete checkpoint under ``root``, else ``origin``,
    the checkpoint it started from (``resume_from``, ``relaytrain run --resume``): a job lost
    before it wrote a checkpoint of its own goes back there, not to step 0 or to a failure."""
    newest = latest(root, job_id) if root else None
    if newest is not None or origin is None:
        return newest
    return origin if _manifest(_loc(origin)) is not None else None  # gone (deleted, pruned): no checkpoint


def restart_decision(spec, root: Optional[str], job_id: str, *, used: int, committed: int, reason: str,
                     cancelling: bool = False, origin: Optional[str] = None):
    """Whether a job that lost its scheduler or a worker restarts (service/restarts.py
    ``decide``), with the newest complete checkpoint of its own under ``root`` (else ``origin``,
    see ``newest_or_origin``), read only when a restart could use it: (the decision, that
    checkpoint or None).  Reading the storage may raise."""
    from service import restarts

    newest = newest_or_origin(root, job_id, origin) if used < spec.restarts.max and not cancelling else None
    d = restarts.decide(spec, used=used, committed=committed, newest_step=step_of(newest) if newest is not None else None,
                        reason=reason, cancelling=cancelling)
    return d, newest


def resolve(path: str | Path) -> Where:
    """A checkpoint folder, or the newest one under a checkpoint root."""
    p = _loc(path)
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


def _read(folder: Where, part: dict, kind: str, names: set[str]) -> dict:
    """Entries ``names`` of one part's ``kind`` ("model" or the optimizer's "optim" state)."""
    state = _torch_load(_child(folder, part["file"]))
    held = state["model"] if kind == "model" else state["optim"]["state"]
    return {n: held[n] for n in names}


def names_in(path: str | Path) -> list[str]:
    """The parameter and buffer names a checkpoint holds, in the model's order, without
    reading tensors."""
    p = resolve(path)
    meta = _manifest(p)
    if meta.get("format", 1) == 1:
        state = _torch_load(_child(p, "state.pt"))
        return list(state["model"])
    return list(dict.fromkeys(n for part in meta["parts"] for n in part["model"]))


def check_fits(path: str | Path, model_state: dict, what: str = "", own_job: Optional[str] = None) -> None:
    """Raise ValueError, saying what differs, unless the checkpoint ``path`` holds exactly the
    state of the model ``model_state`` ({name: shape}, tracing's ``model_state``): the same
    names, and the same shapes where the manifest records them (checkpoints written since
    2026-11-30).  A resume loads by name, so a checkpoint of another model (a layer renamed or
    wrapped, another width) loaded what matched and left the rest at its initial values
    without a word (a user trial); ``what`` begins the message (``--resume``).  A checkpoint of
    ``own_job`` is not checked: the job wrote it, and a buffer its forward sizes by the data
    (a positional table grown for a longer sequence) may differ from the trace's."""
    if not model_state:
        return
    p = resolve(path)
    meta = _manifest(p)
    if own_job is not None and meta.get("job_id") == own_job:
        return
    held = names_in(p)
    shapes = {n: tuple(s) for part in meta.get("parts", []) for n, s in (part.get("shapes") or {}).items()}
    have = set(held)
    lacks = [n for n in model_state if n not in have]
    extra = [n for n in held if n not in model_state]
    differ = [n for n in model_state if n in shapes and model_state[n] is not None
              and shapes[n] != tuple(model_state[n])]
    if not (lacks or extra or differ):
        return

    def listed(names: list) -> str:
        return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")

    said = []
    if lacks:
        said.append(f"the model has {listed(lacks)}, which the checkpoint lacks")
    if extra:
        said.append(f"the checkpoint has {listed(extra)}, which the model lacks")
    if differ:
        said.append("; ".join(f"{n} is {list(shapes[n])} in the checkpoint and {list(model_state[n])} in the model"
                              for n in differ[:4]) + (f" (and {len(differ) - 4} more)" if len(differ) > 4 else ""))
    source = f" (job {meta['job_id']})" if meta.get("job_id") else ""
    raise ValueError(f"{what}the checkpoint {p}{source} is not of this model: {'; '.join(said)}. A checkpoint "
                     "restores a model with the same parameter and buffer names and shapes: resume from one of "
                     "this model, or give the model its layers' names as they were")


def load(path: str | Path, names: Names = None) -> dict:
    """``{"step", "model", "optim", "meta", "path"}`` of a checkpoint folder or of the newest one
    under a root. With ``names`` (a set of names or a predicate), only those model and optimizer
    entries, reading only the parts that hold them; tensors are memory-mapped, read when used
    (from remote storage, the parts it opens are read whole)."""
    p = resolve(path)
    meta = _manifest(p)
    want = _wanted(names)
    if meta.get("format", 1) == 1:
        state = _torch_load(_child(p, "state.pt"))
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
        state = _torch_load(_child(p, part["file"]))
        model.update((n, state["model"][n]) for kind, n in mine if kind == "model")
        optim["state"].update((n, state["optim"]["state"][n]) for kind, n in mine if kind == "optim")
        optim["groups"] = optim["groups"] or state["optim"]["groups"]
    return {"step": meta["step"], "model": model, "optim": optim, "meta": meta, "path": str(p)}
