"""A job's code, shipped to its processes by relaytrain instead of in a ``runtime_env``.

A job whose spec imports user code names its folder as ``runtime_env.working_dir``: a package
in Ray's GCS (``gcs://_ray_pkg_<hash>.zip``, uploaded by ``relaytrain run`` or ``POST
/v1/packages``).  Given to Ray in a ``runtime_env``, that costs each of the job's processes a
second start (actors/nodeenv.py: Ray starts it through ``setup_worker.py``, which imports part
of Ray, asks the runtime-env agent, then execs the worker).  When the working_dir is all the
job's runtime_env asks, relaytrain ships it itself, with what Ray's working_dir gives a process:

- the scheduler reads the package from the GCS when it starts (whoever starts it has just made
  sure the GCS holds it: ``launch.upload_runtime_env``, ``packages.ensure_in_cluster``) and
  keeps its bytes in the object store, owned by the scheduler, for as long as the job runs: a
  worker started later (a reshape, a restart of a worker) gets them from there, not from the GCS,
  which keeps a package no actor's runtime_env names for only 10 minutes;
- each process unpacks it once per node, under the Ray session's folder
  (``relaytrain_code/<node id>/_ray_pkg_<hash>``: its content's hash, so two jobs of the same
  code share it), then makes it its working directory and the first entry of ``sys.path`` and ``PYTHONPATH``,
  as Ray's working_dir does.

Any other runtime_env (``pip``, ``py_modules``, ``env_vars``, a working_dir that is a local
path or an https URI) goes to Ray as before, and so does every one under ``RELAYTRAIN_SHIP_CODE=0``."""
from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Optional

URI_RE = re.compile(r"^gcs://(_ray_pkg_[0-9a-f]+)\.zip$")
FOLDER = "relaytrain_code"


def split(runtime_env: dict) -> tuple[dict, Optional[str]]:
    """(what of ``runtime_env`` still goes to Ray, the URI of the package relaytrain ships
    itself or None).  ``RELAYTRAIN_SHIP_CODE=0`` in the environment of what starts the job's
    scheduler (``relaytrain run``, ``relaytrain serve``) leaves every working_dir to Ray."""
    uri = (runtime_env or {}).get("working_dir")
    if (set(runtime_env or {}) == {"working_dir"} and isinstance(uri, str) and URI_RE.match(uri)
            and os.environ.get("RELAYTRAIN_SHIP_CODE", "1") != "0"):
        return {}, uri
    return dict(runtime_env or {}), None


class PackageMissing(RuntimeError):
    pass


def fetch(uri: str) -> bytes:
    """The package's bytes from Ray's GCS (in the scheduler, as it starts)."""
    from ray.experimental.internal_kv import _internal_kv_get

    data = _internal_kv_get(uri)
    if not data:
        raise PackageMissing(f"the job's code package {uri} is not in the cluster's store (Ray keeps a package "
                             "10 minutes after its upload unless a running job uses it): submit the job again, "
                             "which uploads it again")
    return data


def _base() -> Path:
    """This node's folder for unpacked packages: in the Ray session's folder, under the node's
    id (the nodes of a simulated cluster share one machine's session folder, and each unpacks
    its own copy from the object store, as the nodes of a real cluster do)."""
    try:
        import ray
        import ray._private.worker as w

        return Path(w.global_worker.node.get_session_dir_path()) / FOLDER / ray.get_runtime_context().get_node_id()
    except Exception:  # not in a Ray worker (a test, a tool): the machine's temp folder
        return Path(tempfile.gettempdir()) / FOLDER


def install(uri: str, data: Any) -> str:
    """The package unpacked on this node (once: later calls, and the node's other processes,
    find it); ``data`` is its bytes or an ObjectRef to them, read only when the package is not
    unpacked here yet.  Returns the folder."""
    m = URI_RE.match(uri)
    if not m:
        raise ValueError(f"{uri!r} is not a package URI")
    base = _base()
    target = base / m.group(1)
    if target.is_dir():
        return str(target)
    if not isinstance(data, (bytes, bytearray)):
        import ray

        data = ray.get(data)
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{m.group(1)}.", dir=base))
    try:
        zpath = tmp.with_suffix(".zip")
        zpath.write_bytes(data)
        try:
            with zipfile.ZipFile(zpath) as z:
                for name in z.namelist():  # what Ray's unzip would refuse too: nothing outside the folder
                    if name.startswith("/") or ".." in Path(name).parts:
                        raise ValueError(f"the code package {uri} holds an unsafe path {name!r}")
                z.extractall(tmp)
        finally:
            zpath.unlink(missing_ok=True)
        try:
            os.rename(tmp, target)  # atomic: another process of the node may have done it meanwhile
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def enter(folder: str) -> None:
    """Make ``folder`` this process's working directory and the first place imports look, as
    Ray's working_dir does (its child processes inherit ``PYTHONPATH``)."""
    os.chdir(folder)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    old = os.environ.get("PYTHONPATH")
    if not old or old.split(os.pathsep)[0] != folder:
        os.environ["PYTHONPATH"] = folder + (os.pathsep + old if old else "")


class Shipped:
    """The scheduler's side: the package read from the GCS, kept in the object store (owned by
    the scheduler), unpacked and entered here; ``for_workers`` is what each worker is given."""

    def __init__(self, uri: str):
        self.uri = uri
        self.ref = None
        self.folder: Optional[str] = None

    def ready(self) -> str:
        """Fetch, keep, unpack and enter, once; returns the folder (``PackageMissing`` when the
        GCS no longer holds it)."""
        if self.folder is None:
            import ray

            data = fetch(self.uri)
            self.ref = ray.put(data)
            self.folder = install(self.uri, data)
            enter(self.folder)
        return self.folder

    @property
    def for_workers(self) -> Optional[tuple]:
        return (self.uri, self.ref) if self.ref is not None else None


def worker_enter(code: Optional[tuple]) -> None:
    """A worker's side: unpack (if this node has not) and enter the job's package."""
    if code:
        uri, ref = code
        enter(install(uri, ref))
