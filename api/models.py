"""The final model of a SUCCEEDED job, as the REST API serves it: its index, one shard, or the
whole state_dict as one ``model.pt`` (api/routes/jobs.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from api.errors import Conflict, NotFound
from service import shards
from service.states import JobState
from service.store import Store


class FinalModel:
    def __init__(self, get_job: Callable[[str, str], dict], store: Store):
        """``get_job(tenant, job_id)``: the job as the API shows it (NotFound when it is not the tenant's)."""
        self.get_job, self.store = get_job, store

    # The final model (service/shards.py) is an index and a safetensors shard per stage: for a
    # job submitted here, the job store's artifacts model/<file>; for a `relaytrain run` job,
    # the files of the folder model/ beside its model_path. Only the files its index names (and
    # the index) are served, so a name is never a path.
    MODEL_DIR = "model"

    def _model_job(self, tenant: str, job_id: str) -> dict:
        job = self.get_job(tenant, job_id)
        if job["state"] != JobState.SUCCEEDED.value:
            raise Conflict(f"job {job_id} is {job['state']}; its model can be downloaded once it is SUCCEEDED")
        return job

    def _model_folder(self, job: dict) -> Optional[Path]:
        """A `relaytrain run` job's shards: ``model_path`` if it is the folder, else the folder
        ``model/`` beside its ``model.pt``; None for a job whose model is in the store."""
        if not job.get("model_path"):
            return None
        path = Path(job["model_path"])
        return path if path.is_dir() else path.parent / self.MODEL_DIR

    def _model_sizes(self, job: dict) -> dict[str, int]:
        folder = self._model_folder(job)
        if folder is None:
            prefix = f"{self.MODEL_DIR}/"
            return {a["name"][len(prefix):]: a["bytes"] for a in self.store.list_artifacts(job["id"], prefix)}
        try:
            return {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
        except OSError:  # no folder: a job of an older relaytrain wrote model.pt alone
            return {}

    def _model_read(self, job: dict, name: str) -> Optional[bytes]:
        folder = self._model_folder(job)
        if folder is None:
            return self.store.get_artifact(job["id"], f"{self.MODEL_DIR}/{name}")
        if Path(name).name != name or name in ("", ".", ".."):
            return None  # a file of the folder, never a path out of it
        try:
            return (folder / name).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def _model_index(self, job: dict) -> dict:
        import json

        text = self._model_read(job, shards.INDEX)
        if text is None:
            folder = self._model_folder(job)
            raise NotFound(f"the model of job {job['id']} is not in " + (f"{folder}" if folder else "the store")
                           + (f" (no {shards.INDEX})" if folder else ""))
        return json.loads(text)

    @staticmethod
    def _model_shards(index: dict) -> list[str]:
        """The shard files the index names, in order."""
        return sorted(set(index["weight_map"].values()))

    def files(self, tenant: str, job_id: str) -> dict:
        """The final model's index (``metadata``, ``weight_map``) and ``files``: its shards as
        ``[{"name", "bytes"}]``, in order."""
        job = self._model_job(tenant, job_id)
        index = self._model_index(job)
        sizes = self._model_sizes(job)
        names = self._model_shards(index)
        missing = [n for n in names if n not in sizes]
        if missing:
            raise NotFound(f"the model of job {job_id} lacks {', '.join(missing)}, which its index names")
        return {**index, "files": [{"name": n, "bytes": sizes[n]} for n in names]}

    def file(self, tenant: str, job_id: str, name: str) -> bytes:
        """One file of the final model: a shard its index names, or the index itself."""

        job = self._model_job(tenant, job_id)
        served = self._model_shards(self._model_index(job)) + [shards.INDEX]
        data = self._model_read(job, name) if name in served else None
        if data is None:
            raise NotFound(f"the model of job {job_id} has no file {name!r}; its files are {', '.join(served)}")
        return data

    def whole(self, tenant: str, job_id: str) -> bytes:
        """The whole model as one ``torch.save`` of its state_dict, in the model's order
        (``metadata.order``), assembled from the shards; a model larger than
        ``shards.model_pt_max_bytes()`` is a Conflict that points at the shards. A `relaytrain run`
        job's own ``model.pt`` is served as it is."""
        import io

        import torch
        from safetensors.torch import load as load_safetensors

        job = self._model_job(tenant, job_id)
        path = Path(job["model_path"]) if job.get("model_path") else None
        if path is not None and path.is_file():
            return path.read_bytes()
        try:
            index = self._model_index(job)
        except NotFound:
            old = self.store.get_artifact(job_id, "model.pt")  # a job of an older relaytrain: one file
            if old is None:
                raise
            return old
        limit, size = shards.model_pt_max_bytes(), int(index["metadata"].get("total_size", 0))
        if size > limit:
            raise Conflict(f"the model of job {job_id} is {size} bytes, more than one model.pt holds here "
                           f"({limit} bytes, RELAYTRAIN_MODEL_PT_MAX_MB); download its shards from "
                           f"/v1/jobs/{job_id}/model/files (relaytrain download {job_id} --out DIR)")
        state: dict = {}
        for name in self._model_shards(index):
            data = self._model_read(job, name)
            if data is None:
                raise NotFound(f"the model of job {job_id} lacks {name}, which its index names")
            tensors = load_safetensors(data)
            state.update((k, tensors[k]) for k, v in index["weight_map"].items() if v == name)
        order = [k for k in index["metadata"].get("order") or [] if k in state]
        listed = set(order)
        order += [k for k in sorted(state) if k not in listed]  # an index without an order
        buf = io.BytesIO()
        torch.save({k: state[k] for k in order}, buf)
        return buf.getvalue()

