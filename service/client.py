"""HTTP client of the REST API, used by the CLI (token from RELAYTRAIN_TOKEN)."""
from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional
from urllib.parse import quote

import httpx


class ApiError(RuntimeError):
    def __init__(self, status: int, detail: Any):
        self.status, self.detail = status, detail
        # status 0: no HTTP answer at all (the server is not reachable): the detail says so alone
        super().__init__(f"HTTP {status}: {format_detail(detail)}" if status else format_detail(detail))


def format_detail(detail: Any) -> str:
    if isinstance(detail, list):  # FastAPI validation errors
        return "; ".join(f"{'.'.join(str(x) for x in d.get('loc', [])[1:]) or 'body'}: "
                         f"{str(d.get('msg', '')).removeprefix('Value error, ')}" for d in detail)
    return str(detail)


class Client:
    def __init__(self, server: str, token: Optional[str] = None, timeout: float = 60.0):
        token = token if token is not None else os.environ.get("RELAYTRAIN_TOKEN")
        self.has_token = bool(token)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=server.rstrip("/"), headers=headers, timeout=timeout,
                                 transport=httpx.HTTPTransport(retries=3))

    def _call(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise ApiError(0, f"cannot reach the server at {self.http.base_url}: {e}") from None
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            if r.status_code == 401 and isinstance(detail, str):  # where this command takes its token from
                detail += ("; relaytrain sends the token in RELAYTRAIN_TOKEN" + ("" if self.has_token else ", which is not set"))
            raise ApiError(r.status_code, detail)
        return r

    def upload_package(self, data: bytes) -> dict:
        return self._call("POST", "/v1/packages", content=data, headers={"Content-Type": "application/zip"}).json()

    def submit(self, spec: dict, idempotency_key: Optional[str] = None, resume_from: Optional[str] = None) -> dict:
        key = idempotency_key or uuid.uuid4().hex
        params = {"resume_from": resume_from} if resume_from else None
        return self._call("POST", "/v1/jobs", json=spec, headers={"Idempotency-Key": key}, params=params).json()

    def job(self, job_id: str) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}").json()

    def jobs(self, state: Optional[list[str]] = None, limit: int = 50, offset: int = 0) -> dict:
        return self._call("GET", "/v1/jobs", params={"state": state or [], "limit": limit, "offset": offset}).json()

    def cluster(self) -> dict:
        """The cluster as its scheduler sees it: ``policy``, ``capacity``, ``tenants`` (weight, share,
        using, running, queued) and the ``queue`` in order (other tenants' job ids left out)."""
        return self._call("GET", "/v1/cluster").json()

    def delete(self, job_id: str, checkpoints: bool = False) -> dict:
        return self._call("DELETE", f"/v1/jobs/{job_id}", params={"checkpoints": str(checkpoints).lower()}).json()

    def cancel(self, job_id: str) -> dict:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel").json()

    def finish(self, job_id: str) -> dict:
        """End a training job after the step under way, keeping its model (it SUCCEEDS)."""
        return self._call("POST", f"/v1/jobs/{job_id}/finish").json()

    def events(self, job_id: str, after: int = 0) -> list[dict]:
        return self._call("GET", f"/v1/jobs/{job_id}/events", params={"after": after}).json()

    def metrics(self, job_id: str, after_step: int = 0) -> list[dict]:
        return self._call("GET", f"/v1/jobs/{job_id}/metrics", params={"after_step": after_step}).json()

    def timeline(self, job_id: str, step: Optional[int] = None) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}/timeline", params={"step": step} if step is not None else {}).json()

    def output(self, job_id: str, after: int = 0) -> list[dict]:
        return self._call("GET", f"/v1/jobs/{job_id}/output", params={"after": after}).json()

    def logs(self, job_id: str, source: str = "all", tail: Optional[int] = None) -> str:
        params = {"source": source, **({"tail": tail} if tail is not None else {})}
        return self._call("GET", f"/v1/jobs/{job_id}/logs", params=params).text

    def model(self, job_id: str) -> bytes:
        return self._call("GET", f"/v1/jobs/{job_id}/model").content

    def model_files(self, job_id: str) -> dict:
        """The final model's index (``metadata``, ``weight_map``) and ``files``: its shards, ``{name, bytes}``."""
        return self._call("GET", f"/v1/jobs/{job_id}/model/files").json()

    def model_file(self, job_id: str, name: str) -> bytes:
        return self._call("GET", f"/v1/jobs/{job_id}/model/files/{quote(name, safe='')}").content

    def download(self, path: str, dest, chunk: int = 1 << 20) -> int:
        """GET ``path`` into the file ``dest``, streamed and atomically (a temporary file beside it,
        renamed when whole); returns its bytes."""
        dest = Path(dest)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with self.http.stream("GET", path) as r:
                if r.status_code >= 400:
                    r.read()
                    try:
                        detail = r.json().get("detail", r.text)
                    except ValueError:
                        detail = r.text
                    raise ApiError(r.status_code, detail)
                size = 0
                with open(tmp, "wb") as f:
                    for block in r.iter_bytes(chunk):
                        f.write(block)
                        size += len(block)
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, dest)
            return size
        except httpx.TransportError as e:
            raise ApiError(0, f"cannot download {path} from {self.http.base_url}: {e}") from None
        finally:
            tmp.unlink(missing_ok=True)

    def download_model_file(self, job_id: str, name: str, dest) -> int:
        return self.download(f"/v1/jobs/{job_id}/model/files/{quote(name, safe='')}", dest)

    def download_model(self, job_id: str, dest) -> int:
        """The whole model as one model.pt (the server assembles it; 409 above its limit)."""
        return self.download(f"/v1/jobs/{job_id}/model", dest)

    # what following a job (``wait``, ``relaytrain logs -f``) sits out: the server restarting
    # (jobs train on meanwhile) or a proxy in front of it answering 502-504
    PATIENCE_S = float(os.environ.get("RELAYTRAIN_FOLLOW_PATIENCE_S", "300"))

    def patiently(self, call, *args, **kwargs):
        """``call(*args, **kwargs)``, tried again for up to ``PATIENCE_S`` seconds while the
        server cannot be reached; says so once on stderr."""
        deadline, told = time.monotonic() + self.PATIENCE_S, False
        while True:
            try:
                out = call(*args, **kwargs)
            except ApiError as e:
                if e.status not in (0, 502, 503, 504) or time.monotonic() > deadline:
                    raise
                if not told:
                    print(f"relaytrain: {e}; trying again for up to {self.PATIENCE_S:.0f} s (the job goes on "
                          "without the server)", file=sys.stderr, flush=True)
                    told = True
                time.sleep(2.0)
                continue
            if told:
                print("relaytrain: the server answers again", file=sys.stderr, flush=True)
            return out

    def wait(self, job_id: str, on_update=None, poll: float = 1.0) -> dict:
        terminal = {"SUCCEEDED", "FAILED", "CANCELLED"}
        while True:
            job = self.patiently(self.job, job_id)
            if on_update:
                on_update(job)
            if job["state"] in terminal:
                return job
            time.sleep(poll)
