"""The job store, on SQLite and on a real PostgreSQL (a throwaway server started here)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest

from service.states import JobState
from service.store import Store

SPEC = {"name": "s", "training": {"steps": 10}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PG: dict = {}  # how to stop and start the module's PostgreSQL (test_a_store_that_does_not_answer_is_a_503)


@pytest.fixture(scope="module")
def postgres_url():
    """A PostgreSQL server in a temporary folder, run as the 'postgres' user."""
    pg_bin = "/usr/lib/postgresql/15/bin"
    if not os.path.exists(f"{pg_bin}/initdb") or shutil.which("runuser") is None or os.geteuid() != 0:
        pytest.skip("PostgreSQL tests need the postgresql-15 package and root (to run it as 'postgres'); "
                    "install it with apt-get install postgresql")
    data = tempfile.mkdtemp(prefix="relaytrain-pg-")
    shutil.chown(data, "postgres")
    port = _free_port()
    as_pg = ["runuser", "-u", "postgres", "--"]
    subprocess.run(as_pg + [f"{pg_bin}/initdb", "-D", f"{data}/db", "-A", "trust", "-U", "postgres"],
                   check=True, capture_output=True)
    subprocess.run(as_pg + [f"{pg_bin}/pg_ctl", "-D", f"{data}/db", "-l", f"{data}/log", "-w", "-o",
                            f"-p {port} -k {data} -h 127.0.0.1", "start"], check=True, capture_output=True)
    _PG.update(ctl=as_pg + [f"{pg_bin}/pg_ctl", "-D", f"{data}/db"], log=f"{data}/log", port=port, sockets=data)
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(as_pg + [f"{pg_bin}/pg_ctl", "-D", f"{data}/db", "-m", "immediate", "stop"],
                       capture_output=True)
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        return Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    s = Store(request.getfixturevalue("postgres_url"))
    with s.engine.begin() as c:  # a clean slate per test
        for t in ("metrics", "events", "packages", "jobs"):
            c.exec_driver_sql(f"DELETE FROM {t}")
    return s


def test_jobs_round_trip_and_states(store):
    job, created = store.create_job("j1", "alice", SPEC)
    assert created and job["state"] == "PENDING" and job["steps"] == 10
    assert store.get_job("j1", "bob") is None  # another tenant's job is not found
    assert store.set_state("j1", JobState.RUNNING)
    assert store.get_job("j1")["started_at"]
    assert store.set_state("j1", JobState.SUCCEEDED)
    assert not store.set_state("j1", JobState.FAILED, error="late")  # an ended job keeps its end
    assert store.get_job("j1")["state"] == "SUCCEEDED"
    assert store.count_by_state() == {"SUCCEEDED": 1}


def test_idempotency_key_is_per_tenant(store):
    a, created_a = store.create_job("a1", "alice", SPEC, idempotency_key="k")
    again, created_again = store.create_job("a2", "alice", SPEC, idempotency_key="k")
    b, created_b = store.create_job("b1", "bob", SPEC, idempotency_key="k")
    assert created_a and not created_again and again["id"] == "a1" and created_b
    assert store.list_jobs("alice")[1] == 1


def test_list_newest_first_filtered_and_paginated(store):
    for i in range(5):
        store.create_job(f"j{i}", "alice", SPEC)
        time.sleep(0.01)
    store.set_state("j1", JobState.RUNNING)
    rows, total = store.list_jobs("alice", limit=2, offset=1)
    assert total == 5 and [r["id"] for r in rows] == ["j3", "j2"]
    rows, total = store.list_jobs("alice", states=["RUNNING"])
    assert total == 1 and rows[0]["id"] == "j1"
    assert store.count_active("alice") == 5


def test_metrics_once_per_step_and_progress(store):
    store.create_job("m", "alice", SPEC)
    store.add_metrics("m", [{"step": 1, "loss": 2.0, "samples_per_s": 10.0}])
    store.add_metrics("m", [{"step": 1, "loss": 9.9, "samples_per_s": 1.0},
                            {"step": 2, "loss": 1.5, "samples_per_s": 12.0}])
    rows = store.get_metrics("m")
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 2.0), (2, 1.5)]  # step 1 recorded once
    job = store.get_job("m")
    assert job["step"] == 2 and job["loss"] == 1.5
    assert store.get_metrics("m", after_step=1)[0]["step"] == 2


def test_a_job_that_finished_early_after_a_restart_keeps_the_rows_up_to_its_end(store):
    store.create_job("f", "alice", SPEC)
    store.add_metrics("f", [{"step": s, "loss": 1.0 / s, "samples_per_s": 10.0 + s} for s in range(1, 6)])
    store.add_metrics("f", [{"step": 3, "loss": 0.25, "samples_per_s": 20.0, "rerun": True}])  # resumed from step 2
    store.end_metrics_at("f", 3)  # and finished after step 3
    assert [(r["step"], r["loss"]) for r in store.get_metrics("f")] == [(1, 1.0), (2, 0.5), (3, 0.25)]
    job = store.get_job("f")
    assert (job["step"], job["loss"], job["samples_per_s"]) == (3, 0.25, 20.0)


def test_events_in_order_with_data(store):
    store.create_job("e", "alice", SPEC)
    store.add_events("e", [{"type": "started", "message": "go"}, {"type": "shape", "message": "2x2", "dp": 2}])
    ev = store.get_events("e")
    assert [e["type"] for e in ev] == ["started", "shape"] and ev[1]["dp"] == 2
    assert [e["type"] for e in store.get_events("e", after=ev[0]["id"])] == ["shape"]


def test_what_a_job_waits_for_is_its_newest_waiting_event_until_a_shape_comes(store):
    store.create_job("w", "alice", SPEC)
    store.create_job("x", "alice", SPEC)
    assert store.durability(["w", "x"])["w"]["waiting"] is None
    wait = "waiting for workers: 1 slot alive, the job needs at least elastic.min_workers=2"
    store.add_events("w", [{"type": "shape", "message": "2x2"}, {"type": "waiting", "message": wait, "slots": 1}])
    store.add_events("x", [{"type": "waiting", "message": wait, "slots": 1}, {"type": "shape", "message": "1x2"}])
    got = store.durability(["w", "x"])
    assert got["w"]["waiting"] == wait and got["x"]["waiting"] is None


def test_schema_is_created_once_and_newer_schema_refused(store):
    Store(store.url.replace("postgresql+psycopg", "postgresql"))  # opening again is fine
    with store.engine.begin() as c:
        c.exec_driver_sql("UPDATE relaytrain_meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(RuntimeError, match="newer than this relaytrain"):
        Store(store.url.replace("postgresql+psycopg", "postgresql"))
    with store.engine.begin() as c:
        c.exec_driver_sql("UPDATE relaytrain_meta SET value = '1' WHERE key = 'schema_version'")


def test_packages_belong_to_tenants(store):
    store.add_package("ab" * 32, "alice", 10)
    store.add_package("ab" * 32, "alice", 10)
    assert store.has_package("ab" * 32, "alice") and not store.has_package("ab" * 32, "bob")


def test_artifacts_are_kept_and_replaced(store):
    store.create_job("a", "alice", SPEC)
    assert store.get_artifact("a", "model.pt") is None
    store.put_artifact("a", "model.pt", b"\x00first")
    store.put_artifact("a", "model.pt", b"\x00second" * 1000)
    assert store.get_artifact("a", "model.pt") == b"\x00second" * 1000


def test_list_artifacts_by_prefix_with_sizes(store):
    store.create_job("a", "alice", SPEC)
    store.create_job("b", "alice", SPEC)
    assert store.list_artifacts("a") == []
    shard = bytes(range(256)) * 40 + b"\x00" * 7  # binary, with NULs: a size in bytes, not characters
    store.put_artifact("a", "model/model-00002-of-00002.safetensors", shard)
    store.put_artifact("a", "model/model-00001-of-00002.safetensors", b"\x00" * 3)
    store.put_artifact("a", "model/model.safetensors.index.json", "{\"é\": 1}".encode())  # 2-byte é
    store.put_artifact("a", "model.pt", b"old")
    store.put_artifact("a", "MODEL/upper", b"x")   # the prefix is case-sensitive
    store.put_artifact("a", "modelXextra", b"x")   # and literal (not a LIKE pattern)
    store.put_artifact("b", "model/model-00001-of-00001.safetensors", b"other job")
    assert store.list_artifacts("a", "model/") == [
        {"name": "model/model-00001-of-00002.safetensors", "bytes": 3},
        {"name": "model/model-00002-of-00002.safetensors", "bytes": len(shard)},
        {"name": "model/model.safetensors.index.json", "bytes": 9}]
    assert [a["name"] for a in store.list_artifacts("a")] == [
        "MODEL/upper", "model.pt", "model/model-00001-of-00002.safetensors",
        "model/model-00002-of-00002.safetensors", "model/model.safetensors.index.json", "modelXextra"]
    assert store.list_artifacts("a", "model_") == []
    assert store.list_artifacts("b", "model/") == [{"name": "model/model-00001-of-00001.safetensors", "bytes": 9}]
    store.put_artifact("a", "model/model-00001-of-00002.safetensors", b"\x01" * 11)  # replaced: the new size
    assert store.list_artifacts("a", "model/model-00001")[0]["bytes"] == 11
    assert store.list_artifacts("nope", "model/") == []


def test_sqlite_store_in_a_home_that_does_not_exist_yet(tmp_path, monkeypatch):
    """A fresh machine has no ~/.local/share: the embedded store creates its folder."""
    from service.settings import Settings

    monkeypatch.setenv("RELAYTRAIN_HOME", str(tmp_path / "fresh" / "home"))
    s = Store(Settings().db_url)
    s.create_job("j1", "local", SPEC)
    assert s.get_job("j1", "local")["state"] == JobState.PENDING.value
    assert (tmp_path / "fresh" / "home" / "relaytrain.db").exists()


def test_logs_in_order_and_only_the_newest_kept(store):
    store.create_job("j1", "local", SPEC)
    store.create_job("j2", "local", SPEC)
    rows = [{"time": 100.0 + i, "source": f"w0.{i % 2}", "stream": "stdout", "line": f"line {i}"} for i in range(8)]
    store.add_logs("j1", rows[:5], keep=6)
    store.add_logs("j2", rows[:1], keep=6)
    store.add_logs("j1", rows[5:], keep=6)
    got = store.get_logs("j1")
    assert [r["line"] for r in got] == [f"line {i}" for i in range(2, 8)]
    assert got[0]["source"] == "w0.0" and got[0]["stream"] == "stdout" and got[0]["time"] == 102.0
    assert [r["line"] for r in store.get_logs("j1", after=got[3]["id"])] == ["line 6", "line 7"]
    assert [r["line"] for r in store.get_logs("j1", limit=2, tail=True)] == ["line 6", "line 7"]
    assert [r["line"] for r in store.get_logs("j2")] == ["line 0"]  # another job's lines are its own


def test_started_at_is_the_first_start_and_a_job_may_be_queued(store):
    job, _ = store.create_job("q1", "alice", {"name": "q", "training": {"steps": 3}}, state=JobState.QUEUED)
    assert job["state"] == "QUEUED" and job["started_at"] is None
    assert store.set_state("q1", JobState.PENDING) and store.set_state("q1", JobState.RUNNING)
    first = store.get_job("q1")["started_at"]
    time.sleep(0.01)
    store.set_state("q1", JobState.RESHAPING)
    store.set_state("q1", JobState.RUNNING)  # after a reshape: still the first start
    assert store.get_job("q1")["started_at"] == first


def test_a_store_that_does_not_answer_is_a_503_saying_so_and_the_api_comes_back_with_it(postgres_url, tmp_path):
    """PostgreSQL stopped under a running server: the job routes answered a bare 500 "Internal
    Server Error" (a user trial).  Now a 503 that says the store does not answer, with
    Retry-After, and no password or SQL; the same routes answer again once it is back."""
    from fastapi.testclient import TestClient

    from api.app import create_app
    from service.settings import Settings

    url = postgres_url.replace("postgres@", "postgres:s3cret@")  # trust auth: the password is ignored, and never shown
    Store(url).create_job("down-1", "local", SPEC)
    app = create_app(Settings(home=tmp_path, db=url, api_tokens=""), connect_ray=False)
    with TestClient(app, raise_server_exceptions=False) as tc:
        assert tc.get("/v1/jobs/down-1").status_code == 200
        subprocess.run(_PG["ctl"] + ["-m", "fast", "-w", "stop"], check=True, capture_output=True)
        try:
            for path in ("/v1/jobs/down-1", "/v1/jobs", "/v1/jobs/down-1/events"):
                r = tc.get(path)
                assert r.status_code == 503, (path, r.status_code, r.text)
                detail = r.json()["detail"]
                assert detail.startswith("the job store does not answer (OperationalError); "), detail
                assert "127.0.0.1" not in detail  # the server's log has the text, not the client
                assert detail.endswith("the jobs train on, try again shortly (GET /readyz says when it is back)")
                assert "s3cret" not in detail and "SELECT" not in detail
                assert r.headers["Retry-After"] == "5"
        finally:
            subprocess.run(_PG["ctl"] + ["-l", _PG["log"], "-w", "-o", f"-p {_PG['port']} -k {_PG['sockets']} -h 127.0.0.1",
                                         "start"], check=True, capture_output=True)
        deadline = time.monotonic() + 30
        while (r := tc.get("/v1/jobs/down-1")).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert r.status_code == 200 and r.json()["id"] == "down-1", r.text


def test_an_ended_job_is_deleted_with_all_it_holds_and_an_active_one_is_not(store):
    store.create_job("d1", "alice", SPEC)
    store.add_events("d1", [{"type": "started", "message": "x"}])
    store.add_metrics("d1", [{"step": 1, "loss": 1.0, "samples_per_s": 10.0}])
    store.add_logs("d1", [{"time": 1.0, "source": "scheduler", "stream": "stdout", "line": "hi"}])
    store.put_timeline("d1", {"step": 1, "workers": {}})
    store.put_artifact("d1", "model.pt", b"x" * 10)
    store.create_job("d2", "alice", SPEC)
    assert store.delete_job("d1", "alice") == "PENDING"  # active: kept, all of it
    assert store.get_events("d1") and store.get_artifact("d1", "model.pt")
    store.set_state("d1", JobState.SUCCEEDED)
    assert store.delete_job("d1", "bob") is None  # another tenant's: not found
    assert store.delete_job("d1", "alice") == ""
    assert store.get_job("d1") is None and store.delete_job("d1", "alice") is None
    assert (store.get_events("d1"), store.get_metrics("d1"), store.get_logs("d1"), store.get_timeline("d1"),
            store.get_artifact("d1", "model.pt")) == ([], [], [], None, None)
    assert store.get_job("d2")["state"] == "PENDING"  # the other job untouched
