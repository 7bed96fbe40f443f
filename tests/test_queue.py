"""The shared cluster (issue 18) on a simulated cluster (ray.cluster_utils.Cluster: a head with
no CPUs and 1-CPU worker nodes), with a real control plane process: jobs that do not fit wait
QUEUED and start when there is room, also across a control-plane restart; an elastic job
shrinks to admit another tenant's job and grows back; a preemptible job gives its slots back
after a checkpoint and resumes from it.  Every job ends equal to its one-process loop."""
from __future__ import annotations

import io
import time

import pytest
import torch

from service.spec import parse_spec
from tests import reference
from tests.conftest import with_nodes
from tests.test_api import BOB, Server, wait_state
from tests.test_durable import until
from tests.test_engine import assert_same_params


def spec_dict(name: str, steps: int, dp: int = 1, pp: int = 2, **over) -> dict:
    d = {"name": name, "model": {"kind": "mlp", "args": {"hidden": 32, "layers": 3, "dtype": "float64"}},
         "data": {"kind": "digits"}, "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
         "training": {"global_batch_size": 32, "microbatch_size": 8, "steps": steps, "seed": 7},
         "parallelism": {"dp": dp, "pp": pp, "transport": "collective", "layer_costs_ms": [0.1, 10, 10, 0.1]}}
    d.update(over)
    return d


@pytest.fixture
def cluster(simulated_cluster):
    """The session's simulated cluster (tests/conftest.py) with two 1-CPU nodes; tests add more."""
    with_nodes(simulated_cluster, 2)
    return simulated_cluster


def serve(cluster, home, **env) -> Server:
    return Server(home, cluster.address, RELAYTRAIN_QUEUE_SECONDS="0.5", **env).start()


def events(c, job_id, kinds=None) -> list[dict]:
    got = c.get(f"/v1/jobs/{job_id}/events").json()
    return [e for e in got if kinds is None or e["type"] in kinds]


def workers(job: dict) -> int:
    shape = job.get("shape") or {}
    return shape.get("dp", 0) * shape.get("pp", 0)


def story(c, job_id) -> str:
    return "\n".join(f"{e['type']}: {e['message'][:240]}" for e in events(c, job_id))


def assert_like_one_process(c, job: dict, body: dict):
    """The job's model is the one-process loop's after as many steps as it committed (all of
    them, or fewer when it was told to finish early)."""
    got = torch.load(io.BytesIO(c.get(f"/v1/jobs/{job['id']}/model").content))
    assert_same_params(got, reference.run(parse_spec(body), steps=job["step"])["params"])


def finish(c, job_id: str) -> dict:
    """Tell a job that trains to end after its step under way (it has run long enough for the
    test): its state once it has ended."""
    r = c.post(f"/v1/jobs/{job_id}/finish")
    assert r.status_code == 200, r.text
    return wait_state(c, job_id, {"SUCCEEDED", "FAILED"}, timeout=120)


def test_a_job_that_does_not_fit_waits_in_the_queue_across_a_restart(cluster, tmp_path):
    import ray

    server = serve(cluster, tmp_path)
    first_body, second_body = spec_dict("first", 100000), spec_dict("second", 20)  # first: until told to finish
    try:
        with server.client() as c:
            first = c.post("/v1/jobs", json=first_body).json()
            assert first["state"] == "PENDING", first  # admitted at once
            until(lambda: c.get(f"/v1/jobs/{first['id']}").json()["state"] == "RUNNING", timeout=60)
            second = c.post("/v1/jobs", json=second_body).json()
            assert second["state"] == "QUEUED"
            r = c.post(f"/v1/jobs/{second['id']}/finish")
            assert r.status_code == 409 and r.json()["detail"].startswith(
                f"job {second['id']} is QUEUED: it has no workers to write its model out; cancel it"), r.text
            why = "waiting for 2 CPU slots (2 workers); 0 jobs ahead; tenant alice already uses 2 of its weighted " \
                  "share of 2"
            assert second["queue"] == {"position": 1, "reason": why}
            [queued] = events(c, second["id"], {"queued"})
            assert queued["message"] == f"queued: {why}" and queued["position"] == 1
            view = c.get("/v1/cluster").json()
            assert view["capacity"] == 2 and view["queue"][0]["job"] == second["id"]
            # other tenants see the queue, not the job's name
            with server.client(BOB) as b:
                assert b.get("/v1/cluster").json()["queue"] == [{**view["queue"][0], "job": None}]
        server.kill()  # the control plane goes; the queue is in its store
        server = serve(cluster, tmp_path)
        with server.client() as c:
            again = c.get(f"/v1/jobs/{second['id']}").json()
            assert again["state"] == "QUEUED" and again["queue"]["position"] == 1
            time.sleep(2)
            assert c.get(f"/v1/jobs/{first['id']}").json()["state"] == "RUNNING", story(c, first["id"])
            assert c.get(f"/v1/jobs/{second['id']}").json()["state"] == "QUEUED", story(c, second["id"])
            done = finish(c, first["id"])  # through the new control plane
            assert done["state"] == "SUCCEEDED", story(c, first["id"])
            done2 = wait_state(c, second["id"], {"SUCCEEDED", "FAILED"}, timeout=120)
            assert done2["state"] == "SUCCEEDED", story(c, second["id"])
            [admitted] = events(c, second["id"], {"admitted"})
            assert admitted["workers"] == 2 and admitted["message"].startswith("admitted on 2 workers")
            assert done2["started_at"] >= done["ended_at"] - 1.0
            assert_like_one_process(c, done2, second_body)
            assert_like_one_process(c, done, first_body)
    finally:
        server.stop()
    assert ray.cluster_resources().get("CPU") == 2


def test_an_elastic_job_shrinks_to_admit_another_tenants_job_and_grows_back(cluster, tmp_path):
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]  # four 1-CPU nodes
    cluster.wait_for_nodes()
    server = serve(cluster, tmp_path)
    steps = 100000  # it is told to finish a few steps after it has grown back
    elastic_body = spec_dict("wide", steps, dp=2, pp=2,
                             elastic={"enabled": True, "min_workers": 2, "max_workers": 4, "snapshot_every_steps": 0})
    fixed_body = spec_dict("bobs", 30)
    try:
        with server.client() as a, server.client(BOB) as b:
            wide = a.post("/v1/jobs", json=elastic_body).json()
            until(lambda: workers(a.get(f"/v1/jobs/{wide['id']}").json()) == 4
                  and a.get(f"/v1/jobs/{wide['id']}").json()["step"] > 5, timeout=120, what="the elastic job on 4")
            bobs = b.post("/v1/jobs", json=fixed_body).json()
            assert bobs["state"] == "PENDING", bobs  # admitted: the elastic job gives way
            [shrink] = until(lambda: events(a, wide["id"], {"shrink"}), timeout=30)
            assert shrink["message"] == f"shrink from 4 to 2 workers to give 2 slots to job {bobs['id']} of tenant bob"
            done_b = wait_state(b, bobs["id"], {"SUCCEEDED", "FAILED"}, timeout=180)
            assert done_b["state"] == "SUCCEEDED", story(b, bobs["id"])
            # the elastic job is told it may grow again, and does, while it still runs
            [grow] = until(lambda: events(a, wide["id"], {"grow"}), timeout=30)
            assert grow["message"].startswith("may grow from 2 to 4 workers")
            until(lambda: len(events(a, wide["id"], {"reshape"})) >= 2, timeout=120, what="the grow-back")
            grown = a.get(f"/v1/jobs/{wide['id']}").json()["step"]
            until(lambda: a.get(f"/v1/jobs/{wide['id']}").json()["step"] >= grown + 5, timeout=60, what="5 more steps")
            done_a = finish(a, wide["id"])
            assert done_a["state"] == "SUCCEEDED", story(a, wide["id"])
            reshapes = [e for e in events(a, wide["id"], {"reshape"})]
            assert "the cluster scheduler: shrink from 4 to 2" in reshapes[0]["message"], story(a, wide["id"])
            rows = a.get(f"/v1/jobs/{wide['id']}/metrics").json()
            assert [r["step"] for r in rows] == list(range(1, done_a["step"] + 1))  # no step lost or run twice
            assert [r["dp"] * r["pp"] for r in rows][-5:] == [4] * 5  # grown back
            assert {r["dp"] * r["pp"] for r in rows} == {2, 4}
            assert_like_one_process(a, done_a, elastic_body)
            assert_like_one_process(b, done_b, fixed_body)
    finally:
        server.stop()
        for n in nodes:
            cluster.remove_node(n)


def test_a_preemptible_job_gives_way_after_a_checkpoint_and_resumes(cluster, tmp_path, capsys):
    server = serve(cluster, tmp_path)
    low_body = spec_dict("low", 100000, checkpoint={"every_steps": 50, "path": "ckpt", "keep": 2},
                         scheduling={"preemptible": True})
    urgent_body = spec_dict("urgent", 40, scheduling={"priority": 5})
    try:
        with server.client() as a, server.client() as b:
            low = a.post("/v1/jobs", json=low_body).json()
            until(lambda: a.get(f"/v1/jobs/{low['id']}").json()["step"] > 60, timeout=120, what="low at step 60")
            urgent = b.post("/v1/jobs", json=urgent_body).json()  # the same tenant's, of a higher priority
            assert urgent["state"] == "PENDING", urgent  # admitted: low is preempted for it
            [asked] = until(lambda: events(a, low["id"], {"preempt"}), timeout=30)
            assert asked["message"].startswith(f"preempted: its 2 slots go to job {urgent['id']} of tenant alice")
            [gone] = until(lambda: events(a, low["id"], {"preempted"}), timeout=60)
            assert gone["step"] > 60 and str(gone["step"]) in gone["checkpoint"], gone
            assert gone["message"].startswith(f"preempted after {gone['step']} committed steps")
            # queued again, it holds no workers though its row keeps the shape it ran in: the
            # cluster's view counted that shape (alice using 4 slots of 4 beside urgent's 2 with
            # -2 starting, found by a user trial), and `relaytrain status` showed it as its shape
            # (urgent takes both slots for its 40 steps: low stays QUEUED until they are done)
            queued = until(lambda: (j := a.get(f"/v1/jobs/{low['id']}").json())["state"] == "QUEUED" and j, timeout=30)
            until(lambda: b.get(f"/v1/jobs/{urgent['id']}").json()["step"] >= 1, timeout=60, what="urgent placed")
            view = a.get("/v1/cluster").json()
            assert a.get(f"/v1/jobs/{low['id']}").json()["state"] == "QUEUED"
            # no placed shape (counted by the view and the policy until its new one): what it ran as
            assert "dp" not in queued["shape"] and queued["shape"]["ran_as"] == {"dp": 1, "pp": 2}, queued["shape"]
            [alice] = [t for t in view["tenants"] if t["tenant"] == "alice"]
            assert alice["queued"] == 1 and 0 <= alice["starting"] and alice["using"] + alice["starting"] <= 2, view
            assert sum(t["using"] for t in view["tenants"]) <= view["capacity"], view
            from api.cli import _print_job

            _print_job(queued)
            assert "no workers (ran as 1x2 until preempted)" in capsys.readouterr().out
            done_u = wait_state(b, urgent["id"], {"SUCCEEDED", "FAILED"}, timeout=120)
            assert done_u["state"] == "SUCCEEDED", story(b, urgent["id"])
            [resumed] = until(lambda: events(a, low["id"], {"resumed"}), timeout=120, what="low resumed")
            assert resumed["step"] == gone["step"]
            until(lambda: a.get(f"/v1/jobs/{low['id']}").json()["step"] >= gone["step"] + 5, timeout=60)
            done = finish(a, low["id"])
            assert done["state"] == "SUCCEEDED", story(a, low["id"])
            rows = a.get(f"/v1/jobs/{low['id']}/metrics").json()
            assert [r["step"] for r in rows] == list(range(1, done["step"] + 1))
            assert_like_one_process(a, done, low_body)
    finally:
        server.stop()
