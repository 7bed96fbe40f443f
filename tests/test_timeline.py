"""Measured timelines without Ray: the pure module (record, plan order, checks, view, SVG),
the store's ring, the scheduler's sink throttle, and the API routes in-process."""
from __future__ import annotations

import copy
import xml.etree.ElementTree as ET

import pytest

from service import schedules, timeline
from service.states import JobState
from service.store import Store
from tests.test_store import postgres_url  # noqa: F401  (the module's throwaway PostgreSQL)

SVG = "{http://www.w3.org/2000/svg}"


def fake_workers(schedule="1f1b", dp=2, pp=2, m=3, t_f=0.010, t_b=0.020, hop=0.001, t0=1000.0):
    """(action, start, end) per worker, timed like the plan's simulation (plus a hop per
    dependency), as a worker reports them."""
    plan = schedules.build(schedule, pp, m)
    out = {}
    for r in range(dp):
        end: dict = {}
        free = [t0 + 0.0005 * r] * pp
        pos = [0] * pp
        acts = {s: [] for s in range(pp)}
        remaining = 2 * m * pp
        while remaining:
            for s in range(pp):
                while pos[s] < len(plan.order[s]):
                    a = plan.order[s][pos[s]]
                    deps = schedules.dependencies(a, pp)
                    if any(d not in end for d in deps):
                        break
                    start = max([free[s]] + [end[d] + hop for d in deps])
                    end[a] = start + (t_f if a.kind == "F" else t_b)
                    free[s] = end[a]
                    acts[s].append((f"{a.stage}{a.kind}{a.mb + r * m}", start, end[a]))
                    pos[s] += 1
                    remaining -= 1
        for s in range(pp):
            out[f"w{r}.{s}"] = acts[s]
    return out


def shape(dp=2, pp=2, m=3, schedule="1f1b"):
    return {"dp": dp, "pp": pp, "schedule": schedule, "microbatches_per_replica": m, "partition": [2] * pp,
            "workers": {f"w{r}.{s}": f"node{r}{s}" + "0" * 50 for r in range(dp) for s in range(pp)}}


def test_record_is_relative_and_compact():
    e = timeline.record(7, shape(), fake_workers())
    assert e["step"] == 7 and e["dp"] == 2 and e["pp"] == 2 and e["microbatches_per_replica"] == 3
    assert e["start"] == 1000.0
    assert min(t0 for acts in e["workers"].values() for _, t0, _ in acts) == 0.0
    assert e["workers"]["w0.0"][0] == ["0F0", 0.0, 0.01]
    assert e["nodes"]["w1.1"].startswith("node11")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_planned_order_uses_global_microbatch_ids(schedule):
    assert timeline.planned_order(schedule, 2, 3, 0, 0) == [str(a) for a in schedules.build(schedule, 2, 3).order[0]]
    assert timeline.planned_order("1f1b", 2, 3, 1, 1) == ["1F3", "1B3", "1F4", "1B4", "1F5", "1B5"]
    assert timeline.planned_order("gpipe", 2, 2, 1, 0) == ["0F2", "0F3", "0B2", "0B3"]


def test_check_accepts_the_plan_and_names_what_is_wrong():
    e = timeline.record(1, shape(), fake_workers())
    assert timeline.check(e) == []
    swapped = copy.deepcopy(e)
    acts = swapped["workers"]["w1.0"]
    acts[1][0], acts[2][0] = acts[2][0], acts[1][0]
    assert timeline.check(swapped) == [f"w1.0 ran {' '.join(a for a, _, _ in acts)}; the plan is "
                                       "0F3 0F4 0B3 0F5 0B4 0B5"]
    overlap = copy.deepcopy(e)
    a, b = overlap["workers"]["w0.1"][0], overlap["workers"]["w0.1"][1]
    b[1] = a[2] - 0.001
    assert timeline.check(overlap) == [f"w0.1 {b[0]} starts at {b[1]:.6f}, before {a[0]} ends at {a[2]:.6f}"]
    missing = copy.deepcopy(e)
    del missing["workers"]["w1.1"]
    assert timeline.check(missing) == ["lanes ['w0.0', 'w0.1', 'w1.0'] are not the 2x2 shape's "
                                       "['w0.0', 'w0.1', 'w1.0', 'w1.1']"]
    backwards = copy.deepcopy(e)
    backwards["workers"]["w0.0"][0][2] = -1.0
    assert "w0.0 0F0 ends before it starts" in timeline.check(backwards)[0]


def test_view_lanes_and_utilization():
    # one replica, 2 stages, gpipe m=1 with no hop: F 10 ms, B 20 ms -> stage busy 30 of 60 ms
    e = timeline.record(3, shape(dp=1, pp=2, m=1, schedule="gpipe"),
                        fake_workers("gpipe", dp=1, pp=2, m=1, hop=0.0))
    v = timeline.view(e, [1, 2, 3], job="j")
    assert [lane["worker"] for lane in v["lanes"]] == ["w0.0", "w0.1"]
    assert [b["action"] for b in v["lanes"][0]["actions"]] == ["0F0", "0B0"]
    assert v["lanes"][1]["actions"][0] == {"action": "1F0", "kind": "F", "mb": 0, "start": 0.01, "end": 0.02}
    assert v["span_s"] == pytest.approx(0.06)
    assert v["utilization"] == pytest.approx(0.5)
    assert v["utilization_plan"] == pytest.approx(0.5)  # gpipe p=2, m=1: bubble (p-1)/(m+p-1)
    assert v["available"] == [1, 2, 3] and v["job"] == "j" and v["step"] == 3
    full = timeline.view(timeline.record(1, shape(), fake_workers()), [1])
    assert full["utilization_plan"] == pytest.approx(float(schedules.simulate(schedules.build("1f1b", 2, 3)).utilization))
    assert 0 < full["utilization"] < full["utilization_plan"]  # hops cost time the plan does not have


def test_svg_has_a_lane_per_worker_a_box_per_action_and_idle():
    v = timeline.view(timeline.record(5, shape(), fake_workers()), [4, 5], job="demo")
    root = ET.fromstring(timeline.render_svg(v))
    lanes = root.findall(f".//{SVG}g[@data-lane]")
    assert [g.get("data-lane") for g in lanes] == ["w0.0", "w0.1", "w1.0", "w1.1"]
    for g in lanes:
        boxes = g.findall(f"{SVG}rect[@data-action]")
        r, s = timeline.parse_worker(g.get("data-lane"))
        assert [b.get("data-action") for b in boxes] == timeline.planned_order("1f1b", 2, 3, r, s)
        assert g.findall(f"{SVG}rect[@data-idle]"), "a pipeline stage waits some of the time"
        xs = [(float(b.get("x")), float(b.get("x")) + float(b.get("width"))) for b in boxes]
        assert all(a[1] <= b[0] + 1.01 for a, b in zip(xs, xs[1:]))  # drawn in order, not on top of each other
    f, b = root.find(f".//{SVG}rect[@data-action='0F1']"), root.find(f".//{SVG}rect[@data-action='0B1']")
    assert f.get("fill") != b.get("fill") and f.get("fill") == timeline.colour(1, "F")
    assert root.get("data-step") == "5" and root.get("data-available") == "4 5"
    assert "measured utilization" in ET.tostring(root, encoding="unicode")


def test_svg_escapes_what_it_shows():
    e = timeline.record(1, {**shape(dp=1, pp=1, m=1), "workers": {"w0.0": '"><script>alert(1)</script>'}},
                        fake_workers(dp=1, pp=1, m=1))
    text = timeline.render_svg(timeline.view(e, [1], job="a<b&c"))
    assert "<script>" not in text
    root = ET.fromstring(text)
    assert root.find(f".//{SVG}g[@data-lane]").get("data-node") == '"><script>alert(1)</script>'


def test_steps_text():
    assert timeline.steps_text([9, 3, 4, 5, 7]) == "3-5, 7, 9"
    assert timeline.steps_text([]) == ""


# ---------------------------------------------------------------- the store's ring


def make_store(tmp_path, *jobs):
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    for job_id, tenant in jobs:
        store.create_job(job_id, tenant, {"name": job_id, "training": {"steps": 100}})
    return store


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'db.sqlite'}"
    return request.getfixturevalue("postgres_url")  # a throwaway server (tests/test_store.py), skipped without it


def test_store_keeps_a_ring_of_the_newest_timelines(store_url):
    store = Store(store_url)
    for job_id in ("a", "b"):
        store.create_job(job_id, "t", {"name": job_id, "training": {"steps": 100}})
    for step in range(1, 21):
        store.put_timeline("a", {"step": step, "x": step}, keep=16)
    store.put_timeline("b", {"step": 1, "x": "b"}, keep=16)
    assert store.timeline_steps("a") == list(range(5, 21))
    assert store.get_timeline("a") == {"step": 20, "x": 20}
    assert store.get_timeline("a", 5) == {"step": 5, "x": 5}
    assert store.get_timeline("a", 4) is None
    # a step written again (a re-run after a restore) replaces the old one and is the newest
    store.put_timeline("a", {"step": 6, "x": "again"}, keep=16)
    assert store.get_timeline("a") == {"step": 6, "x": "again"} and store.timeline_steps("a") == list(range(5, 21))
    assert store.timeline_steps("b") == [1] and store.get_timeline("b")["x"] == "b"
    assert store.timeline_steps("nope") == [] and store.get_timeline("nope") is None


def test_sink_writes_a_timeline_a_second_and_the_last_with_a_state_change(tmp_path, monkeypatch):
    from actors.store_sink import StoreSink

    store = make_store(tmp_path, ("j", "t"))
    sink = StoreSink(store.url, "j")
    row = {"loss": 1.0, "samples_per_s": 1.0}
    sink.write(metrics=[{"step": 1, **row}], timeline_entry={"step": 1})
    sink.write(metrics=[{"step": 2, **row}], timeline_entry={"step": 2})
    sink.write(metrics=[{"step": 3, **row}], timeline_entry={"step": 3})
    assert store.timeline_steps("j") == [1]  # 2 and 3 came within a second of 1: only the newest waits
    sink.write(state=JobState.SUCCEEDED)
    assert store.timeline_steps("j") == [1, 3] and store.get_job("j")["state"] == "SUCCEEDED"
    monkeypatch.setattr(timeline, "EVERY_S", 0.0)
    sink.write(metrics=[{"step": 4, **row}], timeline_entry={"step": 4})
    assert store.timeline_steps("j") == [1, 3, 4]


# ---------------------------------------------------------------- the routes, in-process


@pytest.fixture
def api(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from api.app import create_app
    from service.settings import Settings

    monkeypatch.setenv("RELAYTRAIN_API_TOKENS", "alice:alice-token-0123456789,bob:bob-token-0123456789abc")
    settings = Settings(home=tmp_path)
    store = Store(settings.db_url)
    store.create_job("run-1", "alice", {"name": "run-1", "training": {"steps": 30}})
    store.create_job("fresh-1", "alice", {"name": "fresh-1", "training": {"steps": 30}})
    store.create_job("failed-1", "alice", {"name": "failed-1", "training": {"steps": 30}})
    store.update_job("failed-1", state="FAILED")
    for step in (11, 12, 13):
        store.put_timeline("run-1", timeline.record(step, shape(), fake_workers()))
    store.update_job("run-1", step=13)
    with TestClient(create_app(settings, connect_ray=False)) as client:
        yield client


def get(client, path, token="alice-token-0123456789", **params):
    return client.get(path, params=params, headers={"Authorization": f"Bearer {token}"})


def test_timeline_route_answers_and_refuses_clearly(api):
    r = get(api, "/v1/jobs/run-1/timeline")
    assert r.status_code == 200
    v = r.json()
    assert v["step"] == 13 and v["available"] == [11, 12, 13] and v["job"] == "run-1"
    assert len(v["lanes"]) == 4 and timeline.check(
        {**v, "workers": {lane["worker"]: [(b["action"], b["start"], b["end"]) for b in lane["actions"]]
                          for lane in v["lanes"]}}) == []
    assert get(api, "/v1/jobs/run-1/timeline", step=12).json()["step"] == 12
    r = get(api, "/v1/jobs/run-1/timeline", step=5)
    assert r.status_code == 404 and r.json()["detail"] == "step 5 of job run-1 is not kept; timelines kept: steps 11-13"
    r = get(api, "/v1/jobs/run-1/timeline", step=99)
    assert r.status_code == 404 and r.json()["detail"] == "job run-1 has 30 steps; timelines kept: steps 11-13"
    r = get(api, "/v1/jobs/run-1/timeline", step=0)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "step"]
    assert get(api, "/v1/jobs/run-1/timeline", step="x").status_code == 422
    r = get(api, "/v1/jobs/fresh-1/timeline")
    assert r.status_code == 404 and "no measured timeline yet" in r.json()["detail"]
    r = get(api, "/v1/jobs/failed-1/timeline")  # "yet" told a user to wait for a job that had ended
    assert r.status_code == 404 and r.json()["detail"] == ("job failed-1 has no measured timeline: it ended (FAILED) "
                                                           "before any step committed")
    assert get(api, "/v1/jobs/nope/timeline").json() == {"detail": "no job 'nope'"}
    assert get(api, "/v1/jobs/run-1/timeline", token="bob-token-0123456789abc").status_code == 404
    assert get(api, "/v1/jobs/run-1/timeline", token="").status_code == 401
    svg = get(api, "/v1/jobs/run-1/timeline.svg", step=11)
    assert svg.status_code == 200 and svg.headers["content-type"] == "image/svg+xml"
    assert len(ET.fromstring(svg.text).findall(f".//{SVG}g[@data-lane]")) == 4
    assert get(api, "/v1/jobs/run-1/timeline.svg", step=1).status_code == 404


def test_page_and_its_files_are_served_without_a_token(api):
    page = api.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/static/app.js"' in page.text and "http" not in page.text.replace("http-equiv", "")
    for path, kind in [("/static/app.js", "javascript"), ("/static/style.css", "text/css")]:
        r = api.get(path)
        assert r.status_code == 200 and kind in r.headers["content-type"], path
        assert "https://" not in r.text and "http://" not in r.text.replace("http://www.w3.org/2000/svg", "")
    assert api.get("/static/../app.py").status_code == 404


# ---------------------------------------------------------------- every schedule: W boxes, model chunks


def simulated_workers(schedule, dp=2, pp=2, m=3, chunks=1, unit=0.010, t0=1000.0):
    """(action, start, end) per worker timed as the plan's simulation (forward = ``unit``)."""
    plan = schedules.build(schedule, pp, m, chunks)
    timing = schedules.simulate(plan)
    return {f"w{r}.{s}": [(f"{a.stage}{a.kind}{a.mb + r * m}", t0 + float(timing.start[a]) * unit,
                           t0 + float(timing.end[a]) * unit) for a in plan.order[s]]
            for r in range(dp) for s in range(pp)}


def test_weight_gradients_have_their_own_shade():
    for mb in range(len(timeline.PALETTE)):
        w = timeline.colour(mb, "W")
        assert w not in {timeline.colour(mb, "F"), timeline.colour(mb, "B"), timeline.EVAL_COLOUR}
        assert w not in {timeline.colour(n, k) for n in range(len(timeline.PALETTE)) for k in "FB"}


def test_record_keeps_the_chunks_per_worker():
    assert timeline.record(1, shape(), fake_workers())["chunks"] == 1
    e = timeline.record(1, {**shape(schedule="interleaved_1f1b"), "chunks": 2}, {})
    assert e["chunks"] == 2 and e["schedule"] == "interleaved_1f1b"
    assert timeline.record(1, {**shape(schedule="interleaved_1f1b"), "stages_per_worker": 3}, {})["chunks"] == 3
    # absent: the schedule's default, as the spec's (2 for interleaved_1f1b and zbv)
    assert timeline.record(1, shape(schedule="zbv"), {})["chunks"] == 2
    assert timeline.record(1, shape(schedule="interleaved_1f1b"), {})["chunks"] == 2
    assert timeline.record(1, shape(schedule="zb_h1"), {})["chunks"] == 1


@pytest.mark.parametrize("schedule, chunks, where", [("zb_h1", 1, "loop"), ("interleaved_1f1b", 2, "loop"),
                                                     ("interleaved_1f1b", 3, "loop"), ("zbv", 2, "v")])
def test_planned_order_of_every_schedule(schedule, chunks, where):
    pp, m = 3, 6
    plan = schedules.build(schedule, pp, m, chunks)
    kinds = "FBW" if schedule in schedules.SPLIT else "FB"
    for s in range(pp):
        assert timeline.planned_order(schedule, pp, m, 0, s, chunks) == [str(a) for a in plan.order[s]]
        row = timeline.planned_order(schedule, pp, m, 1, s, chunks)
        acts = [schedules.Action.parse(a) for a in row]
        mine = schedules.chunks_of(s, pp, chunks, where)
        # each of the worker's chunks runs each kind once for each of replica 1's microbatches m..2m-1
        assert sorted((a.stage, a.kind, a.mb) for a in acts) == \
            sorted((vs, k, mb) for vs in mine for k in kinds for mb in range(m, 2 * m))
    assert timeline.planned_order("zbv", 2, 2, 0, 1, 2)[0] == "1F0"  # worker 1 holds chunks 1 and 2


def test_zbv_holds_the_v_and_interleaved_the_loop():
    assert {schedules.Action.parse(a).stage for a in timeline.planned_order("zbv", 2, 2, 0, 0, 2)} == {0, 3}
    assert {schedules.Action.parse(a).stage for a in timeline.planned_order("zbv", 2, 2, 0, 1, 2)} == {1, 2}
    inter = timeline.planned_order("interleaved_1f1b", 2, 2, 1, 1, 2)
    assert {schedules.Action.parse(a).stage for a in inter} == {1, 3} and "3B2" in inter


@pytest.mark.parametrize("schedule, chunks", [("zb_h1", 1), ("interleaved_1f1b", 2), ("zbv", 2)])
def test_check_knows_w_and_virtual_stages(schedule, chunks):
    e = timeline.record(4, {**shape(schedule=schedule), "chunks": chunks},
                        simulated_workers(schedule, chunks=chunks))
    assert e["chunks"] == chunks
    assert timeline.check(e) == []
    # the view's JSON says the chunks too, so it checks as well (as the API test does)
    v = timeline.view(e, [4])
    assert v["chunks"] == chunks and timeline.check(
        {**v, "workers": {lane["worker"]: [(b["action"], b["start"], b["end"]) for b in lane["actions"]]
                          for lane in v["lanes"]}}) == []
    assert v["utilization_plan"] == pytest.approx(timeline.plan_utilization(schedule, 2, 3, chunks=chunks))
    assert v["utilization"] == pytest.approx(v["utilization_plan"])  # timed as the plan, no hops
    # a worker that ran the wrong chunk's action is named
    wrong = copy.deepcopy(e)
    acts = wrong["workers"]["w1.1"]
    name = acts[-1][0]
    acts[-1][0] = name.replace(name[0], str(int(name[0]) ^ 1), 1)
    plan = " ".join(timeline.planned_order(schedule, 2, 3, 1, 1, chunks))
    assert timeline.check(wrong) == [f"w1.1 ran {' '.join(a for a, _, _ in acts)}; the plan is {plan}"]
    # an interleaved entry read with another count of chunks is not its plan
    if schedule == "interleaved_1f1b":
        assert timeline.check({**e, "chunks": 3})


def test_plan_utilization_of_split_and_chunked_schedules():
    one = timeline.plan_utilization("1f1b", 4, 8)
    assert timeline.plan_utilization("zb_h1", 4, 8) > one
    assert timeline.plan_utilization("interleaved_1f1b", 4, 8, chunks=2) > one
    assert timeline.plan_utilization("zbv", 4, 8, chunks=2) > one


def test_svg_draws_w_boxes_in_their_own_shade_striped():
    e = timeline.record(9, {**shape(schedule="zbv"), "chunks": 2}, simulated_workers("zbv", chunks=2))
    v = timeline.view(e, [9], job="zb")
    text = timeline.render_svg(v)
    root = ET.fromstring(text)
    assert root.find(f".//{SVG}pattern[@id='rt-weight']") is not None
    lane = root.find(f".//{SVG}g[@data-lane='w0.1']")
    boxes = lane.findall(f"{SVG}rect[@data-action]")
    assert [b.get("data-action") for b in boxes] == timeline.planned_order("zbv", 2, 3, 0, 1, 2)
    w = [b for b in boxes if b.get("data-kind") == "W"]
    assert len(w) == 2 * 3  # two chunks x three microbatches
    for b in w:
        mb = int(b.get("data-mb"))
        assert b.get("fill") == timeline.colour(mb, "W")
        assert b.get("fill") not in {timeline.colour(mb, "F"), timeline.colour(mb, "B")}
        assert "weight-gradient backward of microbatch" in b.find(f"{SVG}title").text
    b_box = lane.find(f"{SVG}rect[@data-action='1B0']")
    assert "input-gradient backward of microbatch 0" in b_box.find(f"{SVG}title").text
    assert len(lane.findall(f"{SVG}rect[@class='weight-stripes']")) == len(w)
    assert "zbv (2 chunks per worker)" in text and "B = W = forward" in text


def test_portals_are_drawn_from_the_stashers_forward_to_the_poppers():
    """A skip from chunk 0 to chunk 2 at pp = 3 (relaytrain.skip): one dashed line per microbatch
    from w0.0's forward to w0.2's, none into w0.1."""
    e = timeline.record(2, {**shape(dp=1, pp=3, m=2), "portals": [[0, 2, "enc"]]}, fake_workers(dp=1, pp=3, m=2))
    v = timeline.view(e, [2])
    assert [(q["skip"], q["mb"], q["from"], q["to"]) for q in v["portals"]] == [("enc", 0, "w0.0", "w0.2"),
                                                                              ("enc", 1, "w0.0", "w0.2")]
    f0 = next(b for lane in v["lanes"] for b in lane["actions"] if b["action"] == "0F0")
    f2 = next(b for lane in v["lanes"] for b in lane["actions"] if b["action"] == "2F0")
    assert (v["portals"][0]["start"], v["portals"][0]["end"]) == (f0["end"], f2["start"])
    svg = timeline.render_svg(v)
    assert svg.count('class="portal"') == 2 and "skip 'enc' of microbatch 0: w0.0 -&gt; w0.2" in svg
    assert timeline.view(timeline.record(2, shape(dp=1, pp=3, m=2), fake_workers(dp=1, pp=3, m=2)))["portals"] == []


def test_a_tp_or_replicated_shape_is_said_whole_in_the_timeline_and_the_cli(capsys):
    """A user trial: a 1x2 job with tp 2 (four lanes) was "1x2" in the timeline, the status and
    the list, and one with replicas [1,2,1] "1x3"."""
    from api.cli import _print_job
    from service.replicas import shape_label_of

    one = fake_workers(dp=1, pp=2)
    workers = {f"w0.{2 * s + j}": one[f"w0.{s}"] for s in range(2) for j in range(2)}  # each stage's 2 TP ranks
    tp_shape = {**shape(dp=1, pp=2), "tp": 2, "workers": {w: "node0" + "0" * 50 for w in workers}}
    v = timeline.view(timeline.record(3, tp_shape, workers), [3])
    assert v["tp"] == 2 and [lane.get("tp_rank") for lane in v["lanes"]] == [0, 1, 0, 1]
    assert timeline.summary(v).startswith("step 3  shape 1x2x2 (tp) 1f1b, 3 microbatches per replica")
    assert shape_label_of({"dp": 1, "pp": 3, "replicas": [1, 2, 1]}) == "1x3 replicas [1,2,1]"
    assert shape_label_of({"dp": 2, "pp": 2}) == "2x2"
    job = {"id": "tp-1", "state": "RUNNING", "step": 5, "steps": 10, "loss": 0.5, "shape": tp_shape,
           "spec": {"restarts": {"max": 0}}, "checkpoint": None, "queue": None, "allotted_workers": None}
    _print_job(job)
    _print_job({**job, "id": "rep-1", "shape": {"dp": 1, "pp": 3, "replicas": [1, 2, 1]}})
    _print_job({**job, "id": "pre-1", "state": "QUEUED", "shape": {"ran_as": {"dp": 1, "pp": 2, "tp": 2}}})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "tp-1  RUNNING    step 5/10  loss 0.5  shape 1x2x2 (tp)"
    assert out[1] == "rep-1  RUNNING    step 5/10  loss 0.5  shape 1x3 replicas [1,2,1]"
    assert out[2].startswith("pre-1  QUEUED     step 5/10  loss 0.5  no workers (ran as 1x2x2 (tp) until preempted)")
