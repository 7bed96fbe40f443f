"""The final model over the API and the CLI: GET /v1/jobs/{id}/model/files (the index and its
shards), each file, GET /v1/jobs/{id}/model assembled from the shards in the model's order, and
`relaytrain download`.

Most tests train nothing: a job's row and its model (a tiny two-stage model written as the engine
writes it, service/shards.py) are put in the job store of a real API server (uvicorn in a thread
of this process), as a job submitted over REST or as a `relaytrain run` job. The last test trains
a small job over REST on the session's Ray (tests/conftest.py) and downloads its shards."""
from __future__ import annotations

import io
import json
import os
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file
from torch import nn

from service import shards
from service.states import JobState

ALICE = "alice-download-token-0123456789"
BOB = "bob-download-token-0123456789ab"
INDEX = shards.INDEX
SHARD_1, SHARD_2 = shards.shard_name(0, 2), shards.shard_name(1, 2)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """The real app (routes, auth, error mapping) served by uvicorn on a loopback port, in a thread
    of this process: it reads this process's environment (RELAYTRAIN_MODEL_PT_MAX_MB) at each call.
    It does not connect to Ray itself; a job submitted to it runs on the session's Ray, when a test
    has started it (ray_session)."""
    import uvicorn

    from api.app import create_app
    from service.settings import Settings

    settings = Settings(home=tmp_path_factory.mktemp("download-home"), api_tokens=f"alice:{ALICE},bob:{BOB}")
    app = create_app(settings, connect_ray=False)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="download-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the API server did not start"
        time.sleep(0.05)
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}", store=app.state.manager.store)
    server.should_exit = True
    thread.join(15)


def client(api, token=ALICE) -> httpx.Client:
    return httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def tiny_model() -> dict:
    """A state_dict whose order is not sorted order (weight before bias, layer 10 after 2)."""
    torch.manual_seed(3)
    layers = [nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 5)] + [nn.Identity()] * 7 + [nn.Linear(5, 3, bias=False)]
    layers[2].weight.data = layers[2].weight.data.double()  # a dtype of its own, kept
    return dict(nn.Sequential(*layers).state_dict())


def stages(state: dict) -> list[dict]:
    """Layer 0 on stage 0, the rest on stage 1."""
    return [{k: v for k, v in state.items() if k.startswith("0.")},
            {k: v for k, v in state.items() if not k.startswith("0.")}]


def index_for(state: dict, entries: list[dict]) -> dict:
    return shards.index_of(entries, {"format": "pt", "step": 5, "order": list(state)})


def new_job(store, tenant="alice", state=JobState.SUCCEEDED) -> str:
    job_id = f"dl-{uuid.uuid4().hex[:8]}"
    store.create_job(job_id, tenant, {"name": "dl", "training": {"steps": 5}})
    if state is not JobState.PENDING:
        store.set_state(job_id, JobState.RUNNING)
    if state not in (JobState.PENDING, JobState.RUNNING):
        store.set_state(job_id, state)
    return job_id


def stored_model(store, job_id: str, state: dict) -> dict:
    """The model as a REST job's workers and scheduler store it: model/<shard>, then the index."""
    entries, blobs = [], {}
    for i, part in enumerate(stages(state)):
        name = shards.shard_name(i, 2)
        blobs[name] = shards.to_bytes(part)
        store.put_artifact(job_id, f"model/{name}", blobs[name])
        entries.append({"file": name, "names": list(part), "bytes": sum(t.nbytes for t in part.values())})
    index = index_for(state, entries)
    blobs[INDEX] = json.dumps(index, indent=1).encode()
    store.put_artifact(job_id, f"model/{INDEX}", blobs[INDEX])
    return {"index": index, "blobs": blobs}


@pytest.fixture(scope="module")
def state():
    return tiny_model()


@pytest.fixture(scope="module")
def rest_job(api, state):
    job_id = new_job(api.store)
    return SimpleNamespace(id=job_id, **stored_model(api.store, job_id, state))


def assert_same(got: dict, want: dict, ordered: bool = True):
    assert (list(got) == list(want)) if ordered else (sorted(got) == sorted(want))
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_files_lists_the_index_and_the_shards(api, rest_job, state):
    with client(api) as c:
        r = c.get(f"/v1/jobs/{rest_job.id}/model/files")
        assert r.status_code == 200, r.text
        body = r.json()
    assert body["metadata"] == rest_job.index["metadata"]
    assert body["metadata"]["order"] == list(state) and body["metadata"]["step"] == 5
    assert body["metadata"]["total_size"] == sum(t.nbytes for t in state.values())
    assert body["weight_map"] == {k: SHARD_1 if k.startswith("0.") else SHARD_2 for k in sorted(state)}
    assert body["files"] == [{"name": SHARD_1, "bytes": len(rest_job.blobs[SHARD_1])},
                             {"name": SHARD_2, "bytes": len(rest_job.blobs[SHARD_2])}]


def test_each_file_is_its_bytes(api, rest_job, state):
    with client(api) as c:
        for name in (SHARD_1, SHARD_2, INDEX):
            r = c.get(f"/v1/jobs/{rest_job.id}/model/files/{name}")
            assert r.status_code == 200, r.text
            assert r.content == rest_job.blobs[name]
            assert r.headers["content-type"] == "application/octet-stream"
            assert r.headers["content-disposition"] == f'attachment; filename="{name}"'
    assert_same(load_safetensors(rest_job.blobs[SHARD_2]), stages(state)[1], ordered=False)


def test_whole_model_is_assembled_in_the_models_order(api, rest_job, state, monkeypatch):
    monkeypatch.delenv("RELAYTRAIN_MODEL_PT_MAX_MB", raising=False)
    with client(api) as c:
        r = c.get(f"/v1/jobs/{rest_job.id}/model")
    assert r.status_code == 200, r.text
    assert r.headers["content-disposition"] == f'attachment; filename="{rest_job.id}.pt"'
    got = torch.load(io.BytesIO(r.content))
    assert_same(got, state)
    assert list(got) != sorted(got)  # the order is the model's, not the index's sorted names
    nn.Sequential(*[nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 5).double()] + [nn.Identity()] * 7
                  + [nn.Linear(5, 3, bias=False)]).load_state_dict(got)


def test_whole_model_above_the_limit_is_409_pointing_at_the_shards(api, rest_job, state, monkeypatch):
    size = sum(t.nbytes for t in state.values())
    monkeypatch.setenv("RELAYTRAIN_MODEL_PT_MAX_MB", str((size - 1) / 2**20))  # read at each request
    with client(api) as c:
        r = c.get(f"/v1/jobs/{rest_job.id}/model")
        assert r.status_code == 409
        detail = r.json()["detail"]
        assert f"is {size} bytes" in detail and f"/v1/jobs/{rest_job.id}/model/files" in detail
        assert "RELAYTRAIN_MODEL_PT_MAX_MB" in detail
        assert c.get(f"/v1/jobs/{rest_job.id}/model/files").status_code == 200  # the shards still are
        monkeypatch.setenv("RELAYTRAIN_MODEL_PT_MAX_MB", str(size / 2**20))  # exactly the size: fits
        assert c.get(f"/v1/jobs/{rest_job.id}/model").status_code == 200


@pytest.mark.parametrize("name", ["..%2Fetc%2Fpasswd", "%2Fetc%2Fpasswd", "..%2F..%2F" + SHARD_1, "model.pt",
                                  shards.shard_name(2, 3), "model", "", ".%2F" + SHARD_1])
def test_a_name_the_index_does_not_list_is_404_naming_the_files(api, rest_job, name):
    api.store.put_artifact(rest_job.id, "model.pt", b"not served by name")
    with client(api) as c:
        r = c.get(f"/v1/jobs/{rest_job.id}/model/files/{name}")
    assert r.status_code == 404, r.text
    detail = r.json()["detail"]
    assert "has no file" in detail and f"{SHARD_1}, {SHARD_2}, {INDEX}" in detail, detail


def raw_get(api, path: str, token=ALICE) -> tuple[int, dict]:
    """GET ``path`` byte for byte (httpx would resolve its dots first): (status, JSON body)."""
    import socket
    from urllib.parse import urlsplit

    host = urlsplit(api.url)
    with socket.create_connection((host.hostname, host.port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host.netloc}\r\nAuthorization: Bearer {token}\r\n"
                  "Connection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_raw_dot_dot_path_is_404(api, rest_job):
    with client(api) as c:  # httpx resolves the dots: this asks for /v1/jobs/{id}/model/etc/passwd
        assert c.get(f"/v1/jobs/{rest_job.id}/model/files/../../etc/passwd").status_code == 404
    status, body = raw_get(api, f"/v1/jobs/{rest_job.id}/model/files/../../../etc/passwd")
    assert status == 404 and "has no file '../../../etc/passwd'" in body["detail"], body
    status, body = raw_get(api, f"/v1/jobs/{rest_job.id}/model/files/{SHARD_1}/../{INDEX}")
    assert status == 404 and "has no file" in body["detail"], body


def test_running_unknown_and_other_tenants_jobs(api, rest_job, state):
    running = new_job(api.store, state=JobState.RUNNING)
    stored_model(api.store, running, state)  # even with files in the store, not before SUCCEEDED
    failed = new_job(api.store, state=JobState.FAILED)
    empty = new_job(api.store)  # SUCCEEDED, but no model was stored
    paths = ["/model", "/model/files", f"/model/files/{SHARD_1}", f"/model/files/{INDEX}"]
    with client(api) as alice, client(api, BOB) as bob:
        for p in paths:
            for job_id in (running, failed):
                r = alice.get(f"/v1/jobs/{job_id}{p}")
                assert r.status_code == 409 and "once it is SUCCEEDED" in r.json()["detail"], (p, r.text)
            r = alice.get(f"/v1/jobs/{empty}{p}")
            assert r.status_code == 404 and "is not in the store" in r.json()["detail"], (p, r.text)
            r = alice.get(f"/v1/jobs/no-such-job{p}")
            assert r.status_code == 404 and "no job 'no-such-job'" in r.json()["detail"]
            r = bob.get(f"/v1/jobs/{rest_job.id}{p}")  # alice's job does not exist for bob
            assert r.status_code == 404 and r.json()["detail"] == f"no job {rest_job.id!r}"
            assert httpx.get(f"{api.url}/v1/jobs/{rest_job.id}{p}").status_code == 401


def test_a_job_of_an_older_relaytrain_keeps_its_model_pt(api, state):
    job_id = new_job(api.store)
    buf = io.BytesIO()
    torch.save(state, buf)
    api.store.put_artifact(job_id, "model.pt", buf.getvalue())
    with client(api) as c:
        assert c.get(f"/v1/jobs/{job_id}/model").content == buf.getvalue()
        assert c.get(f"/v1/jobs/{job_id}/model/files").status_code == 404


def run_job_folder(api, state, out: Path, with_model_pt: bool) -> str:
    """A `relaytrain run --out DIR` job: DIR/model/ holds the shards and the index, DIR/model.pt
    the whole model when it was small enough; model_path is that file, else the folder."""
    entries = [shards.write_shard(out / "model", i, 2, part) for i, part in enumerate(stages(state))]
    shards.write_text(out / "model", INDEX, json.dumps(index_for(state, entries), indent=1))
    job_id = new_job(api.store)
    if with_model_pt:
        torch.save(state, out / "model.pt")
    where = out / "model.pt" if with_model_pt else out / "model"
    api.store.update_job(job_id, model_path=str(where.resolve()))
    return job_id


@pytest.mark.parametrize("with_model_pt", [True, False])
def test_a_run_jobs_model_is_served_from_its_folder(api, state, tmp_path, monkeypatch, with_model_pt):
    job_id = run_job_folder(api, state, tmp_path, with_model_pt)
    (tmp_path / "model.pt.secret").write_bytes(b"beside the model, never served")
    with client(api) as c:
        body = c.get(f"/v1/jobs/{job_id}/model/files").json()
        assert [f["name"] for f in body["files"]] == [SHARD_1, SHARD_2]
        for f in body["files"]:
            data = c.get(f"/v1/jobs/{job_id}/model/files/{f['name']}").content
            assert data == (tmp_path / "model" / f["name"]).read_bytes() and len(data) == f["bytes"]
        assert c.get(f"/v1/jobs/{job_id}/model/files/{INDEX}").content == (tmp_path / "model" / INDEX).read_bytes()
        for name in ("..%2Fmodel.pt", "..%2Fmodel.pt.secret", "%2Fetc%2Fpasswd"):
            assert c.get(f"/v1/jobs/{job_id}/model/files/{name}").status_code == 404
        r = c.get(f"/v1/jobs/{job_id}/model")
        assert r.status_code == 200
        if with_model_pt:
            assert r.content == (tmp_path / "model.pt").read_bytes()  # the run's own file
        assert_same(torch.load(io.BytesIO(r.content)), state)
        if not with_model_pt:  # the run found it too large for one file: so may the server
            monkeypatch.setenv("RELAYTRAIN_MODEL_PT_MAX_MB", "0.0001")
            r = c.get(f"/v1/jobs/{job_id}/model")
            assert r.status_code == 409 and "/model/files" in r.json()["detail"]
    gone = new_job(api.store)  # a run job whose folder was deleted
    api.store.update_job(gone, model_path=str(tmp_path / "deleted" / "model.pt"))
    with client(api) as c:
        r = c.get(f"/v1/jobs/{gone}/model/files")
        assert r.status_code == 404 and "deleted" in r.json()["detail"]
        assert c.get(f"/v1/jobs/{gone}/model").status_code == 404


def cli_main(api, monkeypatch, capsys, *args, token=ALICE):
    from api.cli import main

    monkeypatch.setenv("RELAYTRAIN_TOKEN", token)
    code = main([*args, "--server", api.url])
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


def load_folder(folder: Path) -> dict:
    """The model back with plain json + safetensors, in its order: what a user would write."""
    index = json.loads((folder / INDEX).read_text())
    state = {}
    for file in sorted(set(index["weight_map"].values())):
        state.update(load_file(folder / file))
    return {k: state[k] for k in index["metadata"]["order"]}


def test_cli_download_writes_the_shards_and_the_index(api, rest_job, state, tmp_path, monkeypatch, capsys):
    out = tmp_path / "a" / "b"
    p = cli_main(api, monkeypatch, capsys, "download", rest_job.id, "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(out)
    assert sorted(os.listdir(out)) == [SHARD_1, SHARD_2, INDEX]  # no temporary file left
    lines = p.stderr.strip().splitlines()
    assert lines[0] == f"[1/2] {SHARD_1}: {len(rest_job.blobs[SHARD_1])} bytes"
    assert lines[1] == f"[2/2] {SHARD_2}: {len(rest_job.blobs[SHARD_2])} bytes"
    assert lines[2].startswith(f"[index] {INDEX}")
    for name in (SHARD_1, SHARD_2, INDEX):
        assert (out / name).read_bytes() == rest_job.blobs[name]
    assert_same(load_folder(out), state)
    assert_same(shards.load(out), state, ordered=False)

    p = cli_main(api, monkeypatch, capsys, "download", rest_job.id, "--out", str(tmp_path / "one"), "--single")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(tmp_path / "one" / "model.pt") and os.listdir(tmp_path / "one") == ["model.pt"]
    assert_same(torch.load(tmp_path / "one" / "model.pt"), state)


def test_cli_download_errors(api, rest_job, state, tmp_path, monkeypatch, capsys):
    running = new_job(api.store, state=JobState.RUNNING)
    for extra in ([], ["--single"]):
        p = cli_main(api, monkeypatch, capsys, "download", running, "--out", str(tmp_path / "r"), *extra)
        assert p.returncode == 1 and p.stdout == ""
        assert p.stderr.strip() == (f"relaytrain: HTTP 409: job {running} is RUNNING; its model can be "
                                    "downloaded once it is SUCCEEDED")
        p = cli_main(api, monkeypatch, capsys, "download", "no-such-job", "--out", str(tmp_path / "n"), *extra)
        assert p.returncode == 1 and p.stderr.strip() == "relaytrain: HTTP 404: no job 'no-such-job'"
        p = cli_main(api, monkeypatch, capsys, "download", rest_job.id, "--out", str(tmp_path / "b"), *extra,
                     token=BOB)
        assert p.returncode == 1 and "HTTP 404" in p.stderr
    assert not any(os.listdir(tmp_path / d) for d in ("r", "n", "b"))  # --single made the folders: empty
    monkeypatch.setenv("RELAYTRAIN_MODEL_PT_MAX_MB", "0.0001")
    p = cli_main(api, monkeypatch, capsys, "download", rest_job.id, "--out", str(tmp_path / "big"), "--single")
    assert p.returncode == 1 and "HTTP 409" in p.stderr and f"relaytrain download {rest_job.id}" in p.stderr
    assert os.listdir(tmp_path / "big") == []  # nothing half-written
    blocked = tmp_path / "file"
    blocked.write_text("a file, not a folder")
    p = cli_main(api, monkeypatch, capsys, "download", rest_job.id, "--out", str(blocked))
    assert p.returncode == 1 and p.stderr.startswith(f"relaytrain: cannot write into {blocked}")
    from api.cli import main

    assert main(["download", rest_job.id, "--out", str(tmp_path / "x"), "--server", "http://127.0.0.1:1"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach the server at http://127.0.0.1:1" in err and "HTTP 0" not in err  # no HTTP status to give


def test_a_job_trained_over_rest_yields_downloadable_shards(ray_session, api, tmp_path, monkeypatch, capsys):
    """End to end: a 1x2 job submitted over REST to the same server (its scheduler and workers on
    the session's Ray), whose workers store a shard each and whose scheduler stores the index; the
    CLI downloads them and they equal GET /model and the one-process reference."""
    from service.spec import parse_spec
    from tests import reference
    from tests.test_api import small_spec, wait_state

    spec = small_spec("shards-e2e", steps=3)
    with client(api) as c:
        r = c.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        job = wait_state(c, r.json()["id"], {"SUCCEEDED", "FAILED", "CANCELLED"})
        assert job["state"] == "SUCCEEDED", job["error"]
        listing = c.get(f"/v1/jobs/{job['id']}/model/files").json()
        whole = torch.load(io.BytesIO(c.get(f"/v1/jobs/{job['id']}/model").content))
    assert [f["name"] for f in listing["files"]] == [SHARD_1, SHARD_2]
    assert listing["metadata"]["step"] == 3 and listing["metadata"]["order"] == list(whole)
    assert [a["name"] for a in api.store.list_artifacts(job["id"])] == [f"model/{n}" for n in (SHARD_1, SHARD_2, INDEX)]
    p = cli_main(api, monkeypatch, capsys, "download", job["id"], "--out", str(tmp_path / "m"))
    assert p.returncode == 0, p.stderr
    got = load_folder(tmp_path / "m")
    assert_same(got, whole)
    want, _ = reference.train(parse_spec(spec))
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=2e-5)
