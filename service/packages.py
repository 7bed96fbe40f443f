"""Uploaded code packages: content-addressed zips a spec's runtime_env.working_dir can name
(``gcs://_ray_pkg_<sha256>.zip``), as with Ray's own job submission."""
from __future__ import annotations

import hashlib
import io
import os
import re
import zipfile
from pathlib import Path

URI_RE = re.compile(r"^gcs://_ray_pkg_([0-9a-f]{64})\.zip$")
MAX_EXPANSION = 20  # uncompressed size may be at most this many times the upload


class PackageError(ValueError):
    pass


def uri_for(sha: str) -> str:
    return f"gcs://_ray_pkg_{sha}.zip"


def check_zip(data: bytes, max_bytes: int) -> None:
    if len(data) > max_bytes:
        raise PackageError(f"the package is {len(data)} bytes, over the limit of {max_bytes}")
    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise PackageError("the upload is not a zip file; send the zipped folder of your code")
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        total = 0
        for info in z.infolist():
            name = info.filename
            if name.startswith("/") or ".." in Path(name).parts:
                raise PackageError(f"the zip holds an unsafe path {name!r}; paths must stay inside the folder")
            total += info.file_size
        if total > max(max_bytes, len(data)) * MAX_EXPANSION:
            raise PackageError(f"the zip expands to {total} bytes, over the limit of "
                               f"{max(max_bytes, len(data)) * MAX_EXPANSION} ({MAX_EXPANSION}x the upload limit of "
                               f"{max_bytes} bytes); leave data and checkpoints out of the code package")


def save(data: bytes, root: Path, max_bytes: int) -> tuple[str, str]:
    """Store the zip under ``root`` by content; returns (sha256, uri)."""
    check_zip(data, max_bytes)
    sha = hashlib.sha256(data).hexdigest()
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{sha}.zip"
    if not path.exists():
        tmp = root / f".{sha}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return sha, uri_for(sha)


def ensure_in_cluster(uri: str, root: Path) -> None:
    """Make sure Ray's GCS holds the package (again, after a cluster restart)."""
    from ray._private.runtime_env.packaging import package_exists, upload_package_to_gcs

    m = URI_RE.match(uri)
    if not m:
        raise PackageError(f"{uri!r} is not a package URI from POST /v1/packages")
    if not package_exists(uri):
        path = root / f"{m.group(1)}.zip"
        if not path.exists():
            raise PackageError(f"package {uri} is not known here; upload it with POST /v1/packages")
        upload_package_to_gcs(uri, path.read_bytes())


# what a spec's folder holds that is not its code, left out of the package shipped to the cluster
EXCLUDED_DIRS = (".git", ".venv", "venv", "__pycache__", "node_modules", "checkpoints", "out")
EXCLUDED_SUFFIXES = (".pt", ".pth", ".pyc", ".safetensors")


def _is_run_output(filenames) -> bool:
    """A folder a relaytrain run wrote (its ``--out``: metrics.jsonl beside events.jsonl)."""
    return "metrics.jsonl" in filenames and "events.jsonl" in filenames


def run_outputs(folder: Path, depth: int = 4, most: int = 5000) -> list[str]:
    """The folders under ``folder`` (relative, posix) that hold a relaytrain run's outputs: an
    earlier run's ``--out`` inside the spec's folder, whatever its name. Its model shards went
    into every later job's package until one was over Ray's 512 MiB (a user trial).  Symlinked
    folders are followed, as Ray's packaging does (each real folder once); the look goes
    ``depth`` levels down and stops after ``most`` folders (a spec beside a huge data tree)."""
    found, seen, looked = [], set(), 0
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        real = os.path.realpath(dirpath)
        rel = Path(dirpath).relative_to(folder)
        looked += 1
        if real in seen or looked > most:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS) if len(rel.parts) < depth else []
        if rel.parts and _is_run_output(filenames):
            found.append(rel.as_posix())
            dirnames[:] = []
    return found


def gitignore_escaped(path: str) -> str:
    """``path`` as a literal gitignore pattern (Ray's excludes): a folder named ``exp*`` or
    ``run[1]`` names that folder only."""
    return re.sub(r"([\[\]*?!#\\])", r"\\\1", path)


def largest_files(data: bytes, n: int = 3) -> list[tuple[str, int]]:
    """The ``n`` largest files of a zip, (name, bytes), largest first."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return sorted(((i.filename, i.file_size) for i in z.infolist() if not i.is_dir()), key=lambda x: -x[1])[:n]


def too_large_message(data: bytes, folder: Path, answer: str) -> str:
    """What ``relaytrain submit`` says when the server refuses the code package as too large (a
    bare "HTTP 413: request body over the limit" named no file: a user trial)."""
    big = ", ".join(f"{name} ({size / 2**20:.1f} MiB)" for name, size in largest_files(data))
    return (f"the code package of {folder} is {len(data) / 2**20:.1f} MiB zipped, which the server refuses ({answer}); "
            f"its largest files: {big}. Move data out of the spec's folder (a data builder can read it from a path "
            "every node sees, or from object storage), or give runtime_env.working_dir yourself")


def zip_folder(folder: Path) -> bytes:
    """Zip a folder's files at the zip's root (what the CLI uploads), without what is not code
    (``EXCLUDED_DIRS``, ``EXCLUDED_SUFFIXES``, runs' outputs)."""
    buf = io.BytesIO()
    folder = Path(folder)
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
            if dirpath != str(folder) and _is_run_output(filenames):
                dirnames[:] = []
                continue
            for f in sorted(filenames):
                if f.endswith(EXCLUDED_SUFFIXES):
                    continue
                full = Path(dirpath) / f
                z.write(full, full.relative_to(folder).as_posix())
    return buf.getvalue()
