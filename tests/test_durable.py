"""Durable jobs (issue 17): checkpoints on S3 written beside the steps, jobs that restart
themselves when their scheduler is lost, storage outages.  S3 is moto's server, started by the
tests on a loopback port (tests/s3server.py); the control plane is a real server process."""
from __future__ import annotations

import io
import json
import re
import threading
import time

import pytest
import torch

from actors import launch
from actors.runner import JobFailed, run_job
from service import checkpoint, restarts
from service.names import NAMESPACE, scheduler_name
from service.spec import SpecError, parse_spec
from api.jobs import JobManager
from tests import reference, s3server
from tests.test_api import Server, wait_state


def until(cond, timeout: float = 120.0, every: float = 0.05, what: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(every)
    raise TimeoutError(what or getattr(cond, "__name__", "condition"))


def spec_dict(name: str, steps: int, path: str, every: int = 2, most: int = 1, dp: int = 1, pp: int = 2, **over):
    d = {"name": name, "model": {"kind": "mlp", "args": {"hidden": 32, "layers": 3}}, "data": {"kind": "digits"},
         "optimizer": {"name": "adam", "lr": 0.003},
         "training": {"global_batch_size": 32, "microbatch_size": 8, "steps": steps, "seed": 5},
         "parallelism": {"dp": dp, "pp": pp, "transport": "collective"},
         "checkpoint": {"every_steps": every, "path": path, "keep": 2}, "restarts": {"max": most}}
    d.update(over)
    return d


# ---------------------------------------------------------------- pure: restart decisions


def test_restart_decisions_say_why():
    spec = parse_spec(spec_dict("d", 10, "s3://b/p", most=2))
    d = restarts.decide(spec, used=0, committed=7, newest_step=6, reason="lost")
    assert d.restart and "restart 1 of 2 from the checkpoint of step 6 (1 committed step runs again)" in d.message
    d = restarts.decide(spec, used=2, committed=7, newest_step=6, reason="lost")
    assert not d.restart and "restarts are used up (2 of restarts.max 2)" in d.message
    d = restarts.decide(spec, used=0, committed=1, newest_step=None, reason="lost")
    assert not d.restart and "no complete checkpoint to restart it from (none had been written yet)" in d.message
    d = restarts.decide(spec, used=0, committed=7, newest_step=6, reason="lost", cancelling=True)
    assert not d.restart and "being cancelled" in d.message
    never = parse_spec(spec_dict("d", 10, "s3://b/p", most=0))
    assert "set restarts.max" in restarts.decide(never, used=0, committed=7, newest_step=6, reason="lost").message


def test_a_job_goes_back_to_the_checkpoint_it_started_from_while_it_has_none_of_its_own(tmp_path):
    from pathlib import Path

    root, src = tmp_path / "mine", tmp_path / "src"
    root.mkdir()
    src.mkdir()
    (src / ".tmp-x").mkdir()
    part = checkpoint.write_part(src / ".tmp-x", 0, 1, {"0.weight": torch.zeros(2)}, {"state": {}})
    origin = str(checkpoint.finish(src, src / ".tmp-x", 6, [part], {"job_id": "src-1"}))
    spec = parse_spec(spec_dict("d", 10, str(root), most=1))
    d, newest = checkpoint.restart_decision(spec, str(root), "b-1", used=0, committed=9, reason="lost", origin=origin)
    assert d.restart and newest == origin and d.fields["from_step"] == 6 and d.fields["rerun_steps"] == 3
    # gone (deleted, pruned by another writer): no checkpoint, at once (a review: it waited out the storage)
    d, newest = checkpoint.restart_decision(spec, str(root), "b-1", used=0, committed=9, reason="lost",
                                            origin=str(Path(origin).with_name("step-00000099")))
    assert not d.restart and newest is None and "no complete checkpoint" in d.message


def test_a_storage_read_is_tried_again_for_the_wait_then_said_to_fail():
    """The one wait the control plane's restarts and `relaytrain run`'s share (restarts.read_waiting)."""
    tries, said = [], []

    def read():
        tries.append(1)
        if len(tries) < 3:
            raise ConnectionError("refused")
        return "step-6"

    assert restarts.read_waiting(read, why="its checkpoints could not be read", wait_s=60, said=said.append,
                                 pause=lambda: True) == (True, "step-6")
    assert said == ["its checkpoints could not be read (ConnectionError: refused); trying again for up to 60 s"]
    assert restarts.read_waiting(lambda: 1 / 0, why="w", wait_s=60, said=said.append,
                                 pause=lambda: False) == (False, None)  # the job ended meanwhile
    with pytest.raises(restarts.StorageUnreadable, match=r"^w for [1-9]\d* s: ZeroDivisionError: division by zero$"):
        restarts.read_waiting(lambda: 1 / 0, why="w", wait_s=1.0, said=said.append,
                              pause=lambda: time.sleep(0.3) is None)


def test_checkpoint_roots(tmp_path):
    spec = parse_spec(spec_dict("d", 10, "s3://bucket/runs/"))
    assert restarts.checkpoint_root(spec) == "s3://bucket/runs"
    assert restarts.checkpoint_root(spec, home=tmp_path, tenant="t", job_id="j") == "s3://bucket/runs/t/j"
    rel = parse_spec(spec_dict("d", 10, "ckpt"))
    assert restarts.checkpoint_root(rel, home=tmp_path, tenant="t", job_id="j") == str(tmp_path / "checkpoints/t/j")
    none = parse_spec(spec_dict("d", 10, "ckpt", every=0, most=0))
    assert restarts.checkpoint_root(none) is None


def test_a_submitted_jobs_local_checkpoints_stay_under_the_folders_the_server_allows(tmp_path):
    """A tenant could name /etc (or another tenant's folder) and have the service write there."""
    home = tmp_path / "home"
    for ok in ("ckpt", "./a/b", f"{home}/mine", f"file://{home}/mine", "s3://bucket/x", "/shared/ck/team"):
        restarts.check_local_root(parse_spec(spec_dict("d", 10, ok)), home, ["/shared/ck"])
    restarts.check_local_root(parse_spec(spec_dict("d", 10, "/etc", every=0, most=0)), home)  # writes no checkpoints
    for bad in ("/etc", f"{home}/../elsewhere", "file:///etc", "/shared/ckpt"):
        with pytest.raises(SpecError, match=rf"checkpoint.path '{re.escape(bad)}' is outside the folders this server "
                                            rf"lets jobs write to \({re.escape(str(home))}, /shared/ck\); use a "
                                            "relative path .*RELAYTRAIN_CHECKPOINT_ROOTS"):
            restarts.check_local_root(parse_spec(spec_dict("d", 10, bad)), home, ["/shared/ck"])


def test_bad_restarts_and_paths_are_spec_errors():
    with pytest.raises(SpecError, match=r"restarts.max \(2\) restarts a job from its newest checkpoint, and this one "
                                        r"writes none: set checkpoint.every_steps \(and checkpoint.path\), or "
                                        r"restarts.max: 0"):
        parse_spec(spec_dict("d", 10, "ckpt", every=0, most=2))
    with pytest.raises(SpecError, match=r"restarts.max: Input should be greater than or equal to 0"):
        parse_spec(spec_dict("d", 10, "s3://b/p", most=-1))
    with pytest.raises(SpecError, match="unknown storage scheme 'nosuch'"):
        restarts.check_storage("nosuch://bucket/x")


# ---------------------------------------------------------------- the control plane restarts a job


@pytest.fixture(scope="module")
def durable_server(ray_session, s3_server, tmp_path_factory):
    # the tests' own folders are where jobs may write local checkpoints (an operator's shared mount)
    s = Server(tmp_path_factory.mktemp("home"), ray_session.get_runtime_context().gcs_address,
               RELAYTRAIN_CHECKPOINT_ROOTS=str(tmp_path_factory.getbasetemp())).start()
    yield s
    s.stop()


def _kill_scheduler(ray_session, job_id):
    ray_session.kill(ray_session.get_actor(scheduler_name(job_id), namespace=NAMESPACE))


def _events(c, job_id):
    return c.get(f"/v1/jobs/{job_id}/events").json()


def test_a_job_on_s3_restarts_after_its_scheduler_is_lost(durable_server, ray_session, s3_bucket):
    steps = 200  # about 30 ms a step: time to see a checkpoint and kill the scheduler mid-run
    body = spec_dict("durable", steps, f"{s3_bucket}/ckpt", every=4, most=1, dp=2, pp=2)
    with durable_server.client() as c:
        job = c.post("/v1/jobs", json=body).json()
        # kill the scheduler once a checkpoint is written and steps after it are committed
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            seen = c.get(f"/v1/jobs/{job['id']}").json()
            if seen["checkpoint"] and seen["step"] > seen["checkpoint"]["step"]:
                break
            assert seen["state"] in ("PENDING", "RUNNING"), (seen["error"], _events(c, job["id"]))
            time.sleep(0.1)
        _kill_scheduler(ray_session, job["id"])
        killed_at = c.get(f"/v1/jobs/{job['id']}").json()["step"]
        done = wait_state(c, job["id"], {"SUCCEEDED", "FAILED"}, timeout=180)
        assert done["state"] == "SUCCEEDED", done["error"]
        assert done["restarts"] == 1 and done["checkpoint"]["step"] == steps, \
            "\n".join(f"{e['type']}: {e['message'][:200]}" for e in _events(c, job["id"]))
        assert done["checkpoint"]["path"].startswith(f"{s3_bucket}/ckpt/alice/{job['id']}/step-")
        [restarted] = [e for e in _events(c, job["id"]) if e["type"] == "restarted"]
        assert 0 < restarted["from_step"] <= killed_at, (restarted, killed_at)
        assert restarted["rerun_steps"] >= killed_at - restarted["from_step"]
        assert "restart 1 of 1 from the checkpoint of step" in restarted["message"]
        rows = c.get(f"/v1/jobs/{job['id']}/metrics").json()
        assert [r["step"] for r in rows] == list(range(1, steps + 1))  # every step once
        reruns = [r["step"] for r in rows if r.get("rerun")]
        assert reruns == list(range(restarted["from_step"] + 1, restarted["from_step"] + 1 + restarted["rerun_steps"]))
        got = torch.load(io.BytesIO(c.get(f"/v1/jobs/{job['id']}/model").content))
    want, losses = reference.train(parse_spec(body))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=2e-5)
    assert [r["loss"] for r in rows] == pytest.approx(losses, rel=1e-4)
    # the checkpoints on S3: the newest `keep` complete ones, the older ones deleted
    root = f"{s3_bucket}/ckpt/alice/{job['id']}"
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(root)][-1] == steps


class Relay:
    """A loopback TCP relay to ``target`` (host, port) on a port of its own: ``close()`` shuts it
    and every connection through it (connections to its port are refused, as to a storage
    endpoint that is down), ``open()`` listens on the same port again."""

    def __init__(self, target: tuple):
        import socket

        self.target, self.port, self.conns, self.listener = target, s3server.free_port(), [], None
        self.socket = socket

    def open(self) -> "Relay":
        import threading

        sock = self.socket
        lst = sock.socket(sock.AF_INET, sock.SOCK_STREAM)
        lst.setsockopt(sock.SOL_SOCKET, sock.SO_REUSEADDR, 1)
        lst.bind(("127.0.0.1", self.port))
        lst.listen(16)
        self.listener = lst

        def pump(a, b):
            try:
                while data := a.recv(65536):
                    b.sendall(data)
            except OSError:
                pass
            finally:
                for c in (a, b):
                    try:
                        c.shutdown(sock.SHUT_RDWR)
                    except OSError:
                        pass

        def accept():
            while True:
                try:
                    client, _ = lst.accept()
                except OSError:
                    return
                upstream = sock.create_connection(self.target)
                self.conns += [client, upstream]
                threading.Thread(target=pump, args=(client, upstream), daemon=True).start()
                threading.Thread(target=pump, args=(upstream, client), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        return self

    def close(self) -> None:
        try:  # wakes the accept (a close alone leaves it listening)
            self.listener.shutdown(self.socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        for c in self.conns:
            try:
                c.shutdown(self.socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        self.conns = []


def test_a_restart_waits_for_its_storage_to_answer_and_fails_when_it_does_not(ray_session, s3_server, s3_bucket,
                                                                             tmp_path):
    """The control plane reads a lost scheduler's checkpoints to restart it. Its S3 endpoint
    refusing connections then failed the job at once, restarts left and all (found by a user
    trial). Now the job waits, saying so (a ``waiting`` event), and restarts when the storage
    answers; past ``storage_wait_s`` it fails, saying how long it waited. Only the control
    plane's connections go through the relay: the job's workers write to S3 throughout."""
    relay = Relay(("127.0.0.1", s3_server.port)).open()
    (tmp_path / "home").mkdir()
    server = Server(tmp_path / "home", ray_session.get_runtime_context().gcs_address,
                    AWS_ENDPOINT_URL=f"http://127.0.0.1:{relay.port}", RELAYTRAIN_STORAGE_WAIT_S="8").start()
    body = spec_dict("storage-down", 100000, f"{s3_bucket}/ckpt", every=4, most=3)
    try:
        with server.client() as c:
            job = c.post("/v1/jobs", json=body).json()

            def restarts() -> list:
                return [e for e in _events(c, job["id"]) if e["type"] == "restarted"]

            def lose_the_scheduler_with_the_storage_down(n: int) -> list:
                since = restarts()[-1]["from_step"] if restarts() else 0  # a checkpoint of this run
                until(lambda: (j := c.get(f"/v1/jobs/{job['id']}").json())["checkpoint"]
                      and j["checkpoint"]["step"] > since and j["step"] > j["checkpoint"]["step"], timeout=120,
                      what="a checkpoint and a step after it")
                relay.close()
                _kill_scheduler(ray_session, job["id"])
                return until(lambda: len(got := [e for e in _events(c, job["id"]) if e["type"] == "waiting"
                                                 and e.get("reason") == "storage"]) == n and got, timeout=60,
                             what="the storage waiting event: " + "\n".join(
                                 f"{e['type']}: {e['message'][:300]}" for e in _events(c, job["id"])))

            [waiting] = lose_the_scheduler_with_the_storage_down(1)
            assert waiting["message"].startswith(
                f"{JobManager.LOST}, and its checkpoints at {s3_bucket}/ckpt/alice/{job['id']} could not be read ("), waiting
            assert waiting["message"].endswith("trying again for up to 8 s"), waiting
            assert "EndpointConnectionError" in waiting["message"], waiting
            assert c.get(f"/v1/jobs/{job['id']}").json()["state"] == "RUNNING"
            relay.open()  # the storage is back within the wait: the job restarts
            [first] = until(restarts, timeout=60, what="the restart")
            assert "restart 1 of 3 from the checkpoint of step" in first["message"]
            # its new scheduler killed while it starts (as its node lost then): restarted again, not
            # failed ("the job's scheduler did not start: ... cancelled before it started running")
            def kill_the_new_scheduler() -> bool:
                try:
                    ray_session.kill(ray_session.get_actor(scheduler_name(job["id"]), namespace=NAMESPACE))
                    return True
                except ValueError:  # not created yet
                    return False

            until(kill_the_new_scheduler, timeout=60, every=0.01, what="the new scheduler, to kill it")
            [_, second] = until(lambda: len(r := restarts()) == 2 and r, timeout=60,
                                what="the second restart: " + str(_events(c, job["id"])[-3:]))
            assert "restart 2 of 3 from the checkpoint of step" in second["message"]
            assert f"job {job['id']}: its scheduler was lost while it started (" in open(server.log.name).read()
            # down again, and for longer than the wait: the job fails, saying why and how long
            lose_the_scheduler_with_the_storage_down(2)
            failed = wait_state(c, job["id"], {"FAILED", "SUCCEEDED"}, timeout=60)
            assert failed["state"] == "FAILED" and failed["restarts"] == 2, failed
            waited = re.fullmatch(rf"{re.escape(JobManager.LOST)}, and its checkpoints at \S+ could not be read for "
                                  rf"(\d+) s: \w+: .+", failed["error"], re.S)
            assert waited and int(waited[1]) >= 8, failed["error"]  # (and a read's retries beyond)
    finally:
        server.stop()
        relay.close()


def test_a_job_starts_from_an_ended_jobs_checkpoint_in_another_shape(durable_server, ray_session, tmp_path):
    """POST /v1/jobs?resume_from=JOB (relaytrain submit --resume-from JOB): a 1x2 job is cancelled
    after a few checkpoints; a 2x2 job starts from its newest checkpoint, its rows from the step
    after the checkpoint, its model the one-process loop's after all the steps. (A REST job could
    not be resumed at all: a user trial.)  Its scheduler is lost before it writes a checkpoint of
    its own: it restarts from the checkpoint it started from (it failed, "no complete
    checkpoint"), and is finished.  A retry of its Idempotency-Key without ``resume_from`` is a
    409 (it answered with this job)."""
    first = spec_dict("first", 100000, str(tmp_path / "ckpt"), every=3, most=0)
    with durable_server.client() as c:
        a = c.post("/v1/jobs", json=first).json()
        until(lambda: (j := c.get(f"/v1/jobs/{a['id']}").json())["checkpoint"] and j["checkpoint"]["step"] >= 6,
              what="two checkpoints")
        while_running = c.post("/v1/jobs", params={"resume_from": a["id"]}, json=first)
        assert while_running.status_code == 409, while_running.text
        assert while_running.json()["detail"].startswith(f"resume_from: job {a['id']} is RUNNING; it still writes "
                                                         "checkpoints: finish or cancel it first")
        c.post(f"/v1/jobs/{a['id']}/cancel")
        ended = wait_state(c, a["id"], {"CANCELLED"}, timeout=60)
        n = ended["checkpoint"]["step"]
        second = spec_dict("second", 100000, str(tmp_path / "ckpt2"), every=100000, most=1, dp=2, pp=2)
        key = {"Idempotency-Key": "resume-second"}
        r = c.post("/v1/jobs", params={"resume_from": a["id"]}, json=second, headers=key)
        assert r.status_code == 201, r.text
        b = r.json()
        again = c.post("/v1/jobs", params={"resume_from": a["id"]}, json=second, headers=key)
        assert again.status_code == 200 and again.json()["id"] == b["id"], again.text
        other = c.post("/v1/jobs", json=second, headers=key)
        assert other.status_code == 409 and other.json()["detail"] == (
            f"Idempotency-Key 'resume-second' was already used for job {b['id']} with resume_from={a['id']}; a retry "
            "must send the same request: use a new key for a new job"), other.text
        until(lambda: c.get(f"/v1/jobs/{b['id']}").json()["step"] >= n + 3, what="3 steps past the source's")
        assert c.get(f"/v1/jobs/{b['id']}").json()["checkpoint"] is None
        # the source's checkpoints are the new job's way back until it writes its own: not deleted
        r = c.delete(f"/v1/jobs/{a['id']}", params={"checkpoints": "true"})
        assert r.status_code == 409 and r.json()["detail"] == (
            f"job {a['id']}'s checkpoints are where job {b['id']} started from and would restart from until it "
            "writes its own: delete them once it has ended, or delete this job without its checkpoints"), r.text
        _kill_scheduler(ray_session, b["id"])
        [restarted] = until(lambda: [e for e in _events(c, b["id"]) if e["type"] == "restarted"],
                            what="the restart", timeout=60)
        until(lambda: c.get(f"/v1/jobs/{b['id']}").json()["step"] > n + 3, what="a step after the restart")
        assert c.post(f"/v1/jobs/{b['id']}/finish").status_code == 200
        done = wait_state(c, b["id"], {"SUCCEEDED", "FAILED"}, timeout=120)
        assert done["state"] == "SUCCEEDED", done["error"]
        evs = _events(c, b["id"])
        [src] = [e for e in evs if e["type"] == "resume_from"]
        assert src["job"] == a["id"] and src["step"] == n and src["checkpoint"] == ended["checkpoint"]["path"], src
        assert src["message"] == f"starts from job {a['id']}'s checkpoint of step {n} at {src['checkpoint']}"
        assert restarted["from_step"] == n and restarted["checkpoint"] == src["checkpoint"], restarted
        rows = c.get(f"/v1/jobs/{b['id']}/metrics").json()
        assert [r["step"] for r in rows] == list(range(n + 1, done["step"] + 1))
        got = torch.load(io.BytesIO(c.get(f"/v1/jobs/{b['id']}/model").content))
        # bad sources: not a job of yours, and a job that wrote no checkpoint
        r = c.post("/v1/jobs", params={"resume_from": "nope-00000000"}, json=second)
        assert r.status_code == 422 and r.json()["detail"] == "resume_from: you have no job 'nope-00000000'"
        from tests.test_api import cli

        (tmp_path / "second.json").write_text(json.dumps(second))
        p = cli(durable_server, "submit", str(tmp_path / "second.json"), "--resume-from", "nope-00000000")
        assert p.returncode == 2 and p.stderr.strip().endswith(
            "HTTP 422: resume_from: you have no job 'nope-00000000'"), p.stderr
        wider = {**second, "model": {"kind": "mlp", "args": {"hidden": 48, "layers": 3}}}
        r = c.post("/v1/jobs", params={"resume_from": a["id"]}, json=wider)  # another model's checkpoint
        assert r.status_code == 422 and re.fullmatch(
            rf"resume_from: the checkpoint {re.escape(src['checkpoint'])} \(job {a['id']}\) is not of this model: "
            r"\S+ is \[32, 64\] in the checkpoint and \[48, 64\] in the model; .+\. A checkpoint restores a model "
            r"with the same parameter and buffer names and shapes: resume from one of this model, or give the model "
            r"its layers' names as they were", r.json()["detail"]), r.text
        none = c.post("/v1/jobs", json=spec_dict("none", 2, str(tmp_path / "ckpt3"), every=0, most=0)).json()
        wait_state(c, none["id"], {"SUCCEEDED", "FAILED"}, timeout=120)
        r = c.post("/v1/jobs", params={"resume_from": none["id"]}, json=second)
        assert r.status_code == 422 and r.json()["detail"] == (
            f"resume_from: job {none['id']} has no complete checkpoint (its spec writes none: checkpoint.every_steps "
            "is 0)"), r.text
    want, _ = reference.train(parse_spec(second), steps=done["step"])
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=2e-5)


def test_a_finish_asked_while_the_scheduler_is_lost_is_kept_by_its_restart(durable_server, ray_session, tmp_path):
    """The finish is on record before the scheduler is asked: the restarted scheduler resumes from
    the newest checkpoint, runs one step and finishes, with the one-process loop's model."""
    body = spec_dict("finish-lost", 100000, str(tmp_path / "ckpt"), every=3, most=1)
    with durable_server.client() as c:
        job = c.post("/v1/jobs", json=body).json()
        def past_a_checkpoint():  # 2 steps past it: rows a restart's finish must drop
            seen = c.get(f"/v1/jobs/{job['id']}").json()
            return seen["checkpoint"] and seen["step"] >= seen["checkpoint"]["step"] + 2
        until(past_a_checkpoint)
        _kill_scheduler(ray_session, job["id"])
        killed_at = c.get(f"/v1/jobs/{job['id']}").json()["step"]
        r = c.post(f"/v1/jobs/{job['id']}/finish")
        assert r.status_code == 200, r.text
        done = wait_state(c, job["id"], {"SUCCEEDED", "FAILED"}, timeout=120)
        evs = _events(c, job["id"])
        assert done["state"] == "SUCCEEDED", evs
        [restarted] = [e for e in evs if e["type"] == "restarted"]
        assert done["step"] == restarted["from_step"] + 1, (done["step"], restarted, killed_at)
        assert evs[-1]["message"].startswith(f"job finished early, as alice asked: {done['step']} of 100000 steps")
        rows = c.get(f"/v1/jobs/{job['id']}/metrics").json()
        got = torch.load(io.BytesIO(c.get(f"/v1/jobs/{job['id']}/model").content))
    assert [r["step"] for r in rows] == list(range(1, done["step"] + 1))
    want, _ = reference.train(parse_spec(body), steps=done["step"])
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=2e-5)


def test_a_finish_that_lands_while_the_scheduler_is_being_started_is_passed_on(ray_session, tmp_path):
    """A finish written to the store just after the control plane read the job's events to start
    its scheduler, before the scheduler could be found by name, reaches it once it has started
    (the control plane in this process, its store SQLite; the request's moment forced)."""
    from api.jobs import JobManager
    from service.settings import Settings
    from service.store import Store

    settings = Settings(home=tmp_path / "home", queue_policy="fifo")
    settings.home.mkdir()
    store = Store(settings.db_url)
    read = store.events_of

    def events_of(job_id, types):  # the request lands the moment after _launch read the events
        seen = read(job_id, types)
        if "finish_requested" in types and not seen:
            store.add_events(job_id, [{"type": "finish_requested", "message": "finish requested by alice", "by": "alice"}])
        return seen

    store.events_of = events_of
    manager = JobManager(settings, store)
    job, _ = manager.submit("alice", parse_spec(spec_dict("finish-race", 100000, "ckpt", every=0, most=0)))
    try:
        done = until(lambda: store.get_job(job["id"])["state"] in ("SUCCEEDED", "FAILED") and store.get_job(job["id"]),
                     timeout=90, what="the job to end")
    finally:
        actor = launch.find_scheduler(job["id"])
        if actor is not None and store.get_job(job["id"])["state"] not in ("SUCCEEDED", "FAILED"):
            actor.cancel.remote()
    assert done["state"] == "SUCCEEDED" and done["step"] < 100000, done
    last = read(job["id"], ["finished"])[-1]["message"]
    assert last.startswith(f"job finished early, as alice asked: {done['step']} of 100000 steps"), last


def test_a_second_loss_after_the_restarts_are_used_up_fails_the_job(durable_server, ray_session, tmp_path):
    body = spec_dict("once", 100000, str(tmp_path / "ckpt"), every=1, most=1)
    with durable_server.client() as c:
        job = c.post("/v1/jobs", json=body).json()
        until(lambda: c.get(f"/v1/jobs/{job['id']}").json()["checkpoint"])
        _kill_scheduler(ray_session, job["id"])
        until(lambda: any(e["type"] == "resumed" for e in _events(c, job["id"])))  # the new scheduler runs
        _kill_scheduler(ray_session, job["id"])
        failed = wait_state(c, job["id"], {"FAILED"}, timeout=60)
        assert "scheduler actor was lost" in failed["error"]
        assert "restarts are used up (1 of restarts.max 1)" in failed["error"]
        assert failed["restarts"] == 1


def test_a_cancelled_job_is_never_restarted(durable_server, ray_session, tmp_path):
    """Even when its scheduler is lost as the user cancels it (a restart could resume it)."""
    body = spec_dict("cancelled", 100000, str(tmp_path / "ckpt"), every=1, most=3)
    with durable_server.client() as c:
        job = c.post("/v1/jobs", json=body).json()
        until(lambda: c.get(f"/v1/jobs/{job['id']}").json()["checkpoint"])
        _kill_scheduler(ray_session, job["id"])
        assert c.post(f"/v1/jobs/{job['id']}/cancel").json()["state"] == "CANCELLED"
        time.sleep(1.5)  # a reconcile round (every second here) after the end
        again = c.get(f"/v1/jobs/{job['id']}").json()
        assert again["state"] == "CANCELLED" and again["restarts"] == 0


def test_storage_errors_are_refused_before_any_actor_starts(durable_server, s3_bucket):
    with durable_server.client() as c:
        r = c.post("/v1/jobs", json=spec_dict("nobucket", 4, "s3://no-such-bucket-here/x"))
        assert r.status_code == 422 and "no-such-bucket-here" in r.json()["detail"], r.text
        r = c.post("/v1/jobs", json=spec_dict("scheme", 4, "nosuch://x/y"))
        assert r.status_code == 422 and "unknown storage scheme 'nosuch'" in r.json()["detail"], r.text
        r = c.post("/v1/jobs", json=spec_dict("neg", 4, f"{s3_bucket}/x", most=-1))
        assert r.status_code == 422, r.text
        [err] = r.json()["detail"]  # FastAPI's validation error: where, and what is wrong
        assert err["loc"] == ["body", "restarts", "max"] and err["msg"] == "Input should be greater than or equal to 0"
        listed = c.get("/v1/jobs").json()["items"]
        assert not {"nobucket", "scheme", "neg"} & {j["name"] for j in listed}  # nothing stored


def test_a_job_whose_storage_is_gone_fails_after_max_failures_in_a_row(durable_server, s3_bucket):
    import boto3

    body = spec_dict("gone", 100000, f"{s3_bucket}/x", every=1, most=0)
    body["checkpoint"]["max_failures"] = 2
    body["checkpoint"]["fail_after_s"] = 0  # at max_failures alone
    with durable_server.client() as c:
        job = c.post("/v1/jobs", json=body).json()  # the bucket is there when the job is checked
        boto3.client("s3").delete_bucket(Bucket=s3_bucket.removeprefix("s3://"))  # and gone before it runs
        failed = wait_state(c, job["id"], {"FAILED"}, timeout=120)
        assert failed["error"].startswith(f"2 checkpoints in a row could not be written to {s3_bucket}/x/alice/"), \
            failed["error"]
        assert "(checkpoint.max_failures is 2, checkpoint.fail_after_s 0); the last: " in failed["error"] and \
            "bucket" in failed["error"].lower()
        assert failed["step"] >= 2 and failed["checkpoint"] is None
        fails = [e for e in _events(c, job["id"]) if e["type"] == "checkpoint_failed"]
        assert [e["failures"] for e in fails] == [1, 2]
        assert "training goes on" in fails[0]["message"]
        assert "the job stops: checkpoint.max_failures is reached" in fails[1]["message"]  # not "goes on"


# ---------------------------------------------------------------- relaytrain run, in the foreground


def _find_scheduler(name: str, timeout: float = 60):
    job_id = launch.wait_for_job(name, timeout)
    if job_id is None:
        raise TimeoutError(name)
    return launch.find_scheduler(job_id)


def test_run_restarts_its_scheduler_and_an_outage_costs_checkpoints_not_the_job(ray_session, s3_server, s3_bucket,
                                                                                tmp_path, monkeypatch, request):
    """`relaytrain run` restarts a lost scheduler from S3, waiting for the storage when it does
    not answer then (it failed at once: a user trial; only the run's own connections go through
    a relay that is closed, the workers write to S3 throughout); a bucket that vanishes mid-run
    costs checkpoints (checkpoint_failed), not the job, and checkpoints resume when it is back."""
    import boto3

    relay = Relay(("127.0.0.1", s3_server.port)).open()
    request.addfinalizer(relay.close)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{relay.port}")
    monkeypatch.setenv("RELAYTRAIN_STORAGE_WAIT_S", "40")  # tried again every 2 s

    bucket = s3_bucket.removeprefix("s3://")
    # long enough to outlive the outage: with its workers at the driver's priority (resources.nice 0) an 80-step
    # job finished before the bucket came back
    steps = 240
    body = spec_dict("fg", steps, f"{s3_bucket}/run", every=2, most=1)
    body["checkpoint"]["max_failures"] = 1000
    spec = parse_spec(body)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=run_job(spec=spec, out=str(tmp_path / "out"), progress=False)))
    t.start()
    metrics, events_file = tmp_path / "out" / "metrics.jsonl", tmp_path / "out" / "events.jsonl"

    def committed():
        return max([json.loads(x)["step"] for x in open(metrics)] or [0]) if metrics.exists() else 0

    def kinds():
        return [json.loads(x)["type"] for x in open(events_file)] if events_file.exists() else []

    sched = _find_scheduler("fg")
    until(lambda: "checkpoint" in kinds() and committed() >= 5, what="a checkpoint and 5 steps")
    relay.close()
    ray_session.kill(sched)
    until(lambda: "waiting" in kinds(), what="the run waiting for its storage", timeout=60)
    waiting = next(e for e in map(json.loads, open(events_file)) if e["type"] == "waiting")
    assert waiting["reason"] == "storage" and waiting["message"].startswith(
        f"the job's scheduler actor was lost (killed, out of memory, or its node went), and its checkpoints at "
        f"{s3_bucket}/run could not be read (") and waiting["message"].endswith("trying again for up to 40 s"), waiting
    assert t.is_alive() and "failed" not in kinds()
    relay.open()
    until(lambda: "resumed" in kinds(), what="the restarted scheduler resumed")
    s3 = boto3.client("s3")  # take the bucket away for a while (parts may land while it is emptied)

    gone: dict = {}

    def bucket_gone():
        for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=o["Key"])
        try:
            s3.delete_bucket(Bucket=bucket)
            gone["at"] = time.time()
            return True
        except s3.exceptions.ClientError as e:
            assert "BucketNotEmpty" in str(e)
            return False

    def failures(since=0.0):
        return [e for e in map(json.loads, open(events_file)) if e["type"] == "checkpoint_failed" and e["time"] >= since]

    until(bucket_gone, every=0, what="the bucket deleted")
    # a part deleted while the bucket was emptied may fail a checkpoint before the bucket is gone
    # ("part ... is missing"): wait for one that fails without its bucket
    def without_bucket():
        return [f for f in failures(gone["at"]) if "bucket" in f["reason"].lower()]

    until(lambda: without_bucket() or not t.is_alive(), what="a checkpoint failed without its bucket")
    s3.create_bucket(Bucket=bucket)
    t.join(180)
    assert out["r"]["state"] == "SUCCEEDED"
    events = [json.loads(x) for x in open(events_file)]
    k = [e["type"] for e in events]
    assert k.count("restarted") == 1 and "checkpoint_failed" in k
    assert [e["type"] for e in out["r"]["events"]].count("restarted") == 1  # the run's report has it too
    assert "checkpoint" in k[k.index("checkpoint_failed"):]  # written again once the bucket is back
    assert all("training goes on" in f["message"] for f in failures()), failures()
    assert without_bucket(), failures()
    assert checkpoint.step_of(checkpoint.latest(f"{s3_bucket}/run")) == steps
    rows = [json.loads(x) for x in open(metrics)]
    assert sorted({r["step"] for r in rows}) == list(range(1, steps + 1))
    restarted = next(e for e in events if e["type"] == "restarted")
    assert [r["step"] for r in rows if r.get("rerun")] == \
        list(range(restarted["from_step"] + 1, restarted["from_step"] + 1 + restarted["rerun_steps"]))
    want, _ = reference.train(spec)
    got = torch.load(tmp_path / "out" / "model.pt")
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=2e-5)


def test_a_worker_killed_mid_upload_leaves_no_checkpoint_that_resumes(ray_session, s3_bucket, tmp_path):
    """Big parts (an 8 M-parameter mlp: about 100 MB a part) so the upload takes a while; the
    second stage's worker is killed once the first stage's part is on S3 and before the manifest."""
    import boto3

    bucket = s3_bucket.removeprefix("s3://")
    body = spec_dict("cut", 10000, f"{s3_bucket}/cut", every=1, most=0)
    body["model"] = {"kind": "mlp", "args": {"hidden": 1400, "layers": 4}}
    spec = parse_spec(body)
    err: dict = {}

    def go():
        try:
            run_job(spec=spec, out=str(tmp_path / "out"), progress=False)
        except JobFailed as e:
            err["e"] = e
    t = threading.Thread(target=go)
    t.start()
    s3 = boto3.client("s3")
    victim = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and victim is None:
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="cut/").get("Contents", [])]
        for step_dir in sorted({k.split("/")[1] for k in keys}):
            parts = {k.split("/")[-1] for k in keys if k.split("/")[1] == step_dir}
            if "part-00000-of-00002.pt" in parts and "part-00001-of-00002.pt" not in parts \
                    and "meta.json" not in parts:
                victim = step_dir
                break
        time.sleep(0.02)
    assert victim, "never saw a checkpoint with one part written"
    for a in ray_session.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == NAMESPACE and a["name"].startswith("relaytrain:cut-") and a["name"].endswith(":w0.1"):
            ray_session.kill(ray_session.get_actor(a["name"], namespace=NAMESPACE))
    t.join(120)
    assert "e" in err  # a fixed-shape job fails when a worker is lost
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoint.resolve(f"{s3_bucket}/cut/{victim}")
    newest = checkpoint.latest(f"{s3_bucket}/cut")
    if newest is not None:  # an older complete one: it loads whole
        assert checkpoint.step_of(newest) < int(victim.split("-")[1])
        assert checkpoint.load(newest)["model"]
