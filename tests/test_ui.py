"""Observability for real: a uvicorn server on the session's Ray runs a 2x2 job; its measured
timelines are checked against the schedule, the CLI draws one, and the web page is driven in
Debian's chromium through Playwright (the system browser, never a downloaded one)."""
from __future__ import annotations

import json
import os
import re
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from service import timeline
from tests.conftest import FIXTURES
from tests.test_api import ALICE, BOB, Server, cli, small_spec, wait_state

CHROMIUM = "/usr/bin/chromium"
# the network is closed here: without these chromium stalls on its background services
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(os.environ.get("RELAYTRAIN_ARTIFACTS") or Path(__file__).resolve().parent / "artifacts")
SVG = "{http://www.w3.org/2000/svg}"
DP, PP, M = 2, 2, 8   # 8 microbatches: 4 per replica, 8 actions per worker


@pytest.fixture(scope="module")
def server(ray_session, tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("ui-home"), ray_session.get_runtime_context().gcs_address).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def job(server):
    """A 2x2 1F1B job that trains until the page finishes it, once its first timelines are kept."""
    # wide enough that an action's compute (~1 ms) shows beside the hops between stages
    spec = small_spec("swimlane", steps=100000, parallelism={"dp": DP, "pp": PP, "schedule": "1f1b"},
                      model={"kind": "mlp", "args": {"hidden": 768, "layers": 3}},
                      training={"global_batch_size": 64, "microbatch_size": 64 // M, "steps": 100000, "seed": 1},
                      restarts={"max": 1}, checkpoint={"every_steps": 5})
    with server.client() as c:
        r = c.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        try:
            wait_state(c, job_id, {"RUNNING"})
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if c.get(f"/v1/jobs/{job_id}").json()["step"] >= 3 and \
                        len(c.get(f"/v1/jobs/{job_id}/timeline").json().get("available", [])) >= 2:
                    break
                time.sleep(0.3)
            yield job_id
        finally:
            c.post(f"/v1/jobs/{job_id}/cancel")


def as_entry(v: dict) -> dict:
    """The JSON view back into the stored form timeline.check reads."""
    return {**v, "workers": {lane["worker"]: [(b["action"], b["start"], b["end"]) for b in lane["actions"]]
                             for lane in v["lanes"]}}


def test_timeline_json_agrees_with_the_schedule(server, job):
    with server.client() as c:
        newest = c.get(f"/v1/jobs/{job}/timeline").json()
        assert len(newest["available"]) >= 2 and newest["step"] == max(newest["available"])
        assert newest["step"] <= c.get(f"/v1/jobs/{job}").json()["step"]
        for step in newest["available"][-3:]:
            r = c.get(f"/v1/jobs/{job}/timeline", params={"step": step})
            if r.status_code == 404:  # it left the ring meanwhile (the job runs on)
                continue
            v = r.json()
            assert v["step"] == step and (v["dp"], v["pp"], v["schedule"]) == (DP, PP, "1f1b")
            assert [lane["worker"] for lane in v["lanes"]] == ["w0.0", "w0.1", "w1.0", "w1.1"]
            for lane in v["lanes"]:  # the plan's order, per worker, with global microbatch ids
                assert [b["action"] for b in lane["actions"]] == timeline.planned_order(
                    "1f1b", PP, M // DP, lane["dp_rank"], lane["pp_rank"])
                assert lane["node"]
            assert timeline.check(as_entry(v)) == []  # and no box overlaps another of its worker
            # the MLP's Linears send each input gradient before their weight gradients: the plan
            # is 1F1B as run so (schedules.sends_early)
            assert v["sends_early"] is True
            assert 0 < v["utilization"] <= 1 and v["utilization_plan"] == pytest.approx(
                timeline.plan_utilization("1f1b", PP, M // DP, early=True))
        r = c.get(f"/v1/jobs/{job}/timeline", params={"step": 10**9})
        assert r.status_code == 404 and "has 100000 steps; timelines kept: steps " in r.json()["detail"]
        with server.client(BOB) as other:
            assert other.get(f"/v1/jobs/{job}/timeline").status_code == 404


def test_cli_draws_the_timeline(server, job, tmp_path):
    out = tmp_path / "step.svg"
    p = cli(server, "timeline", job, "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert p.stderr.startswith(f"wrote {out}: step ") and "4 lanes, measured utilization" in p.stderr
    root = ET.fromstring(out.read_text())
    assert len(root.findall(f".//{SVG}g[@data-lane]")) == DP * PP
    assert len(root.findall(f".//{SVG}rect[@data-action]")) == DP * PP * 2 * (M // DP)
    text = cli(server, "timeline", job)
    assert text.returncode == 0 and text.stdout.startswith("step ") and "w1.1" in text.stdout
    js = cli(server, "timeline", job, "--json")
    assert js.returncode == 0 and json.loads(js.stdout)["job"] == job
    bad = cli(server, "timeline", job, "--step", "999999999")
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.startswith(f"relaytrain: HTTP 404: job {job} has 100000 steps; timelines kept: steps ")
    assert len(bad.stderr.strip().splitlines()) == 1
    zero = cli(server, "timeline", job, "--step", "0")
    assert zero.returncode == 1 and zero.stderr.strip() == \
        "relaytrain: HTTP 422: step: Input should be greater than or equal to 1"
    assert cli(server, "timeline", "no-such-job").stderr.strip() == "relaytrain: HTTP 404: no job 'no-such-job'"
    unwritable = cli(server, "timeline", job, "--out", str(tmp_path / "missing" / "x.svg"))
    assert unwritable.returncode == 1 and unwritable.stderr.startswith("relaytrain: cannot write ")


def launch_chromium(p):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"!!! THE WEB PAGE WAS NOT TESTED: no {CHROMIUM}. `make test` installs it with "
                    "`apt-get install -y chromium` where apt-get can; install it and run again !!!")
    return p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


def signed_in_page(browser, url: str, timeout_ms: int = 20_000):
    """A page of ``url`` signed in as alice, and the list its script errors go into (dialogs accepted)."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(timeout_ms)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("dialog", lambda d: d.accept())
    page.goto(url)
    page.locator("#token").fill(ALICE)
    page.locator("#login-form button").click()
    return page, errors


def listed(page, job_id: str):
    """The jobs list's row of ``job_id``, once the page shows it."""
    row = page.locator(f'#jobs tr[data-job-id="{job_id}"]')
    row.wait_for()
    return row


def test_web_page_shows_the_job_and_finishes_it(server, job):
    sync_api = pytest.importorskip("playwright.sync_api", reason="!!! THE WEB PAGE WAS NOT TESTED: the playwright "
                                   "package is missing (pip install -e '.[test]') !!!")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            # the token is asked for once and kept in the tab's session
            page, errors = signed_in_page(browser, server.url + "/", 60_000)
            row = listed(page, job)
            assert row.get_attribute("data-state") in ("RUNNING", "RESHAPING")
            assert "2×2 · 1f1b" in row.inner_text()
            page.reload()
            row.wait_for()  # no second sign-in
            assert page.locator("#login").is_hidden()
            page.screenshot(path=str(ARTIFACTS / "ui-jobs.png"))

            row.locator("a").click()
            first = page.wait_for_selector("#swimlane svg[data-step]").get_attribute("data-step")
            points = page.locator("#loss-curve circle[data-step]").count()
            # the page follows the running job: a newer step's swimlane, more points
            # (functions, not expressions: the page's Content-Security-Policy forbids eval)
            page.wait_for_function("s => document.querySelector('#swimlane svg').dataset.step !== s", arg=first)
            page.wait_for_function("n => document.querySelectorAll('#loss-curve circle[data-step]').length > n",
                                   arg=points)
            # restarts (none used of restarts.max 1) and the newest checkpoint (one every 5 steps)
            assert page.locator("#job-restarts").inner_text() == "0 / 1"
            assert page.locator("#job-restarts-note").inner_text() == "1 left"
            page.wait_for_selector("#job-checkpoint[data-step]")
            assert page.locator("#cancel").is_enabled()
            assert page.locator("#finish").is_enabled()
            page.locator("#finish").click()  # "Finish now": it ends after the step under way, keeping its model
            page.wait_for_selector('#view-job[data-state="SUCCEEDED"]')
            page.wait_for_function("() => document.querySelector('#cancel').disabled")
            page.wait_for_function("() => document.querySelector('#finish').disabled")

            with server.client() as c:
                job_row = c.get(f"/v1/jobs/{job}").json()
                rows = c.get(f"/v1/jobs/{job}/metrics").json()
                tl = c.get(f"/v1/jobs/{job}/timeline").json()
                written = [e for e in c.get(f"/v1/jobs/{job}/events").json() if e["type"] == "checkpoint"]
                assert c.get(f"/v1/jobs/{job}/model/files").status_code == 200
            assert job_row["state"] == "SUCCEEDED"
            # the swimlane of the job's newest kept step: a lane per worker, a box per action
            page.wait_for_selector(f'#swimlane svg[data-step="{tl["step"]}"]')
            lanes = page.locator("#swimlane svg g[data-lane]")
            assert lanes.count() == DP * PP
            for i in range(lanes.count()):
                lane = lanes.nth(i)
                r, s = timeline.parse_worker(lane.get_attribute("data-lane"))
                boxes = lane.locator("rect[data-action]")
                assert [boxes.nth(k).get_attribute("data-action") for k in range(boxes.count())] == \
                    timeline.planned_order("1f1b", PP, M // DP, r, s)
            assert page.locator("#swimlane rect[data-idle]").count() > 0
            assert page.locator("#util-measured").inner_text().endswith("%")
            assert page.locator("#util-plan").inner_text() == f"{timeline.plan_utilization('1f1b', PP, M // DP, early=True):.1%}"
            assert page.locator("#util-plan").get_attribute("title").startswith("the plan with input gradients sent early")
            # the loss and samples/s curves: a point per committed step
            steps = [r["step"] for r in rows]
            assert len(steps) == job_row["step"] >= 3
            for curve in ("#loss-curve", "#speed-curve"):
                points = page.locator(f"{curve} circle[data-step]")
                assert points.count() == len(steps), curve
                assert page.locator(f"{curve} svg").get_attribute("data-points") == str(len(steps))
            got = page.eval_on_selector_all("#loss-curve circle[data-step]", "cs => cs.map(c => +c.dataset.step)")
            assert got == steps
            # the shape (worker -> node) and the events
            shape = page.locator("#shape tbody tr")
            assert shape.count() == DP * PP
            assert page.locator("#shape tbody tr[data-worker='w1.1']").get_attribute("data-node") == \
                job_row["shape"]["workers"]["w1.1"]
            kinds = page.eval_on_selector_all("#events li", "ls => ls.map(l => l.dataset.type)")
            assert kinds[0] == "submitted" and "shape" in kinds and kinds[-1] == "finished" and "finish_requested" in kinds
            assert "checkpoint" in kinds
            assert page.locator('#events li[data-type="finished"]').inner_text().count(
                f"job finished early, as alice asked: {job_row['step']} of 100000 steps") == 1
            ck = job_row["checkpoint"]
            # the newest written: due every 5 steps (one due while the previous is still being
            # written is taken at the next boundary after, its event says which step asked)
            assert job_row["restarts"] == 0 and written[-1]["asked_at"] % 5 == 0 and job in ck["path"]
            assert (ck["step"], ck["path"]) == (written[-1]["step"], written[-1]["path"])
            assert page.locator("#job-checkpoint").inner_text() == f"step {ck['step']}"
            assert page.locator("#job-checkpoint-path").get_attribute("title").startswith(ck["path"] + "\n")
            page.screenshot(path=str(ARTIFACTS / "ui-job.png"), full_page=True)
            # what a job's user code printed, under Output (the built-in model above prints nothing)
            done = cli(server, "submit", os.path.join(FIXTURES, "user_job.yaml"), "--wait", "--json")
            assert done.returncode == 0, done.stderr
            printed = json.loads(done.stdout.strip().splitlines()[-1])["id"]
            page.goto(server.url + f"/#/jobs/{printed}")
            page.wait_for_selector(f'#view-job[data-job-id="{printed}"][data-state="SUCCEEDED"]')
            page.wait_for_function("() => document.querySelector('#output').textContent.includes('userpkg: build')")
            output = page.locator("#output").inner_text()
            assert int(page.locator("#output").get_attribute("data-lines")) == len(output.strip().splitlines())
            for who in ("scheduler", "w0.0", "w0.1"):
                assert f"[{who} stdout] userpkg: building a 32-wide model" in output, output
            # a spec without restarts or checkpoints says so
            assert page.locator("#job-restarts").inner_text() == "off"
            assert page.locator("#job-checkpoint").inner_text() == "off"
            assert page.locator("#job-checkpoint-path").inner_text() == "checkpoint.every_steps is 0"
            assert errors == []
        finally:
            browser.close()
    assert (ARTIFACTS / "ui-job.png").stat().st_size > 10_000



# ---------------------------------------------------------------- the recipe's metrics and an evaluation's forwards

LRS = [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3]   # 4 warmup steps to 1e-3
GRAD_NORMS = [2.0, 1.5, 1.2, 0.9, float("inf"), 0.8, 0.7, 0.6]  # step 5's is not finite: skipped
EVAL_LOSS = {3: 2.05, 6: 1.71, 8: 1.52}
SHAPE = {"dp": 1, "pp": 2, "schedule": "gpipe", "microbatches_per_replica": 2, "transport": "ray", "partition": [1, 1],
         "workers": {"w0.0": "node-a" * 4, "w0.1": "node-b" * 4}}
TRAIN = [("F0", 0, 1), ("F1", 1, 2), ("B0", 4, 6), ("B1", 6, 8)]   # stage 0's (ms); stage 1 runs 2 ms later
EVAL = [("E0", 9, 10), ("E1", 10, 11)]                            # then the evaluation's forwards
CKPT_URL = "s3://relaytrain-checkpoints/runs"                    # never reached: the job is written straight


def recipe_job(server) -> str:
    """A SUCCEEDED 1x2 job written straight into the server's store (no Ray job): 8 committed
    steps with lr, grad_norm and three evaluations; step 5 skipped; step 8's timeline ends with
    its evaluation's forwards ("0E0", ...)."""
    from service.settings import Settings
    from service.states import JobState
    from service.store import Store

    store = Store(Settings(home=Path(server.home)).db_url)
    job_id = f"recipe-ui-{time.time_ns() % 10**9}"
    spec = small_spec("recipe-ui", steps=8, training={"global_batch_size": 32, "microbatch_size": 8, "steps": 8,
                                                       "seed": 4, "grad_clip_norm": 1.0, "skip_nonfinite": True},
                      restarts={"max": 2}, checkpoint={"every_steps": 3, "path": CKPT_URL})
    store.create_job(job_id, "alice", spec)
    store.update_job(job_id, shape=SHAPE)
    store.set_state(job_id, JobState.RUNNING)
    store.add_events(job_id, [{"type": "submitted", "message": "submitted"}])
    now = time.time()
    rows = []
    for i, (lr, norm) in enumerate(zip(LRS, GRAD_NORMS)):
        s = i + 1
        rows.append({"step": s, "loss": 2.4 - 0.1 * s, "lr": lr, "grad_norm": norm, "time": now - 8 + s,
                     "samples_per_s": 900.0 + s, "step_time_s": 0.03, "dp": 1, "pp": 2, "bubble": 0.3,
                     **({"skipped": True} if s == 5 else {}),
                     **({"eval_loss": EVAL_LOSS[s]} if s in EVAL_LOSS else {})})
    store.add_metrics(job_id, rows)
    store.add_events(job_id, [{"type": "skipped_step", "step": 5, "message": "step 5 skipped: its gradient norm is "
                               "inf; no parameter changed"}])
    # a restart from step 3's checkpoint, step 6's checkpoint failed, step 8's written
    ckpt = f"{CKPT_URL}/alice/{job_id}"
    store.add_events(job_id, [
        {"type": "checkpoint", "step": 3, "path": f"{ckpt}/step-00000003", "message": "checkpoint of step 3"},
        {"type": "restarted", "reason": "the job's scheduler was lost", "restart": 1, "restarts_max": 2, "from_step": 3,
         "rerun_steps": 1, "checkpoint": f"{ckpt}/step-00000003", "message": "restart 1 of 2 from step 3"},
        {"type": "checkpoint_failed", "step": 6, "failures": 1, "reason": "OSError: timed out",
         "message": "checkpoint of step 6 failed"},
        {"type": "checkpoint", "step": 8, "path": f"{ckpt}/step-00000008", "message": "checkpoint of step 8"}])
    store.put_timeline(job_id, timeline.record(8, SHAPE, {
        f"w0.{s}": [(f"{s}{a}", now + (t0 + 2 * s) / 1000, now + (t1 + 2 * s) / 1000) for a, t0, t1 in TRAIN + EVAL]
        for s in range(2)}))
    store.set_state(job_id, JobState.SUCCEEDED)
    return job_id


def rgb(hex_colour: str) -> str:
    return "rgb({}, {}, {})".format(*(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)))


def test_web_page_shows_eval_loss_lr_grad_norm_and_eval_forwards(server):
    sync_api = pytest.importorskip("playwright.sync_api", reason="!!! THE WEB PAGE WAS NOT TESTED: the playwright "
                                   "package is missing (pip install -e '.[test]') !!!")
    job_id = recipe_job(server)
    with server.client() as c:
        assert c.get(f"/v1/jobs/{job_id}/metrics").json()[4]["grad_norm"] is None  # inf: JSON has none
        assert c.get(f"/v1/jobs/{job_id}/timeline.svg").status_code == 200  # a step with eval forwards draws
        assert c.get(f"/v1/jobs/{job_id}/timeline").json()["lanes"][0]["actions"][-1]["kind"] == "E"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page, errors = signed_in_page(browser, server.url + f"/#/jobs/{job_id}")
            page.wait_for_selector(f'#view-job[data-job-id="{job_id}"][data-state="SUCCEEDED"]')
            page.wait_for_selector("#loss-curve svg")
            page.wait_for_selector('#swimlane svg[data-step="8"]')

            # the loss chart: the training loss on every step, the eval loss on the 3 that have it
            loss = page.locator("#loss-curve")
            assert loss.locator("circle[data-step]").count() == 8
            evals = loss.locator("circle[data-eval-step]")
            assert page.eval_on_selector_all("#loss-curve circle[data-eval-step]",
                                             "cs => cs.map(c => +c.dataset.evalStep)") == sorted(EVAL_LOSS)
            assert evals.first.get_attribute("fill") == "#dd6b20"
            assert evals.nth(1).locator("title").text_content() == "step 6: eval loss 1.71"
            assert page.locator("#loss-legend").inner_text().split("\n") == \
                ["training loss", "eval loss (3)", "skipped step (1)", "restart (1)"]
            # the restart from step 3's checkpoint: a mark where the steps ran again, on every chart
            for chart in ("#loss-curve", "#speed-curve", "#lr-curve", "#grad-curve"):
                assert page.locator(f'{chart} g[data-restart="4"]').count() == 1, chart
            mark = loss.locator('g[data-restart="4"]')
            assert mark.locator("title").text_content() == "restart 1 at step 4: restart 1 of 2 from step 3"
            assert mark.locator("line").get_attribute("stroke") == "#9c4221"
            swatch = page.locator('#loss-legend [data-series="eval_loss"] .swatch')
            assert swatch.evaluate("e => getComputedStyle(e).backgroundColor") == rgb("#dd6b20")
            # the skipped step: a mark on the loss and gradient-norm charts, its loss point ringed,
            # its (infinite) gradient norm a gap in that line, and an event
            assert loss.locator('g[data-skipped="5"]').is_visible()
            assert loss.locator("circle.skipped").get_attribute("data-step") == "5"
            grad = page.locator("#grad-curve")
            assert grad.locator('g[data-skipped="5"]').is_visible()
            assert grad.locator("circle[data-step]").count() == 7
            assert grad.locator('polyline[data-series="grad_norm"]').count() == 2
            assert grad.locator("g[data-hline] text").text_content() == "clip 1"
            assert page.locator("#lr-curve circle[data-step]").count() == 8
            assert page.locator('#events li[data-type="skipped_step"] .kind').text_content() == "skipped step"
            # restarts and the checkpoint in use; a restart and a failed checkpoint stand out in the events
            restarts = page.locator("#job-restarts")
            assert (restarts.inner_text(), page.locator("#job-restarts-note").inner_text()) == ("1 / 2", "1 left")
            assert restarts.evaluate("e => getComputedStyle(e).color") == rgb("#b7791f")
            assert page.locator("#job-checkpoint").inner_text() == "step 8"
            where = page.locator("#job-checkpoint-path")
            assert where.inner_text().endswith(f"{job_id}/step-00000008")
            assert where.get_attribute("title").startswith(f"{CKPT_URL}/alice/{job_id}/step-00000008\nwritten ")
            color = "e => getComputedStyle(e).color"
            assert page.locator('#events li[data-type="restarted"] .kind').evaluate(color) == rgb("#b7791f")
            failed = page.locator('#events li[data-type="checkpoint_failed"] .kind')
            assert failed.text_content() == "checkpoint failed" and failed.evaluate(color) == rgb("#c53030")
            # the step readout: the newest step, then the one the mouse points at
            detail = page.locator("#step-detail")
            assert detail.get_attribute("data-step") == "8"
            assert "step 8 · loss 1.6 · eval loss 1.52 · lr 1e-3 · grad norm 0.6" in \
                " · ".join(detail.locator(".field").all_inner_texts())
            loss.locator('circle[data-step="2"]').hover()
            page.wait_for_selector('#step-detail[data-step="2"]')
            assert detail.locator('[data-field="lr"]').inner_text() == "lr 5e-4"
            assert detail.locator('[data-field="grad_norm"]').inner_text() == "grad norm 1.5"
            assert detail.locator('[data-field="eval_loss"]').count() == 0
            assert "lr 5e-4 · grad norm 1.5" in loss.locator('circle[data-step="2"] title').text_content()
            loss.locator('circle[data-step="5"]').hover()
            page.wait_for_selector('#step-detail[data-step="5"].skipped')
            assert detail.locator('[data-field="grad_norm"]').inner_text() == "grad norm not finite"
            assert detail.locator('[data-field="skipped"]').inner_text() == "skipped: its gradient was not finite"
            page.mouse.move(5, 5)
            page.wait_for_selector('#step-detail[data-step="8"]')

            # the timeline: the evaluation's forwards in their own colour, named in the legend
            lane_boxes = page.locator('#swimlane g[data-lane="w0.0"] rect[data-action]')
            assert [lane_boxes.nth(i).get_attribute("data-action") for i in range(lane_boxes.count())] == \
                ["0F0", "0F1", "0B0", "0B1", "0E0", "0E1"]
            assert page.locator("#swimlane rect.eval").count() == 4
            fill = "e => getComputedStyle(e).fill"
            eval_fill = page.locator('#swimlane rect[data-action="1E1"]').evaluate(fill)
            assert eval_fill == page.locator('#swimlane rect[data-action="0E0"]').evaluate(fill) == rgb("#3f3f46")
            assert eval_fill not in {page.locator(f'#swimlane rect[data-action="{a}"]').evaluate(fill)
                                     for a in ("0F0", "0F1", "0B0", "0B1", "1F1", "1B1")}
            assert "(eval forward of eval microbatch 1)" in \
                page.locator('#swimlane rect[data-action="1E1"] title').text_content()
            legend = page.locator("#legend-eval")
            assert legend.is_visible() and legend.inner_text() == "eval forward (E)"
            assert legend.locator(".swatch").evaluate("e => getComputedStyle(e).backgroundColor") == eval_fill
            page.screenshot(path=str(ARTIFACTS / "ui-recipe.png"), full_page=True)

            # rows as Python's json writes them (bare Infinity, NaN) are read too: not finite is a gap
            def python_json(route):
                body = route.fetch().text()
                assert body.count('"grad_norm":null') == 1 and body.count('"grad_norm":0.7') == 1
                route.fulfill(status=200, content_type="application/json",
                              body=body.replace('"grad_norm":null', '"grad_norm":Infinity')
                                       .replace('"grad_norm":0.7', '"grad_norm":NaN'))
            page.route(f"**/v1/jobs/{job_id}/metrics*", python_json)
            page.reload()
            page.wait_for_selector("#grad-curve svg")
            assert page.locator("#grad-curve circle[data-step]").count() == 6
            assert page.locator("#loss-curve circle[data-step]").count() == 8
            assert page.locator('#grad-curve g[data-skipped="5"]').count() == 1
            assert page.locator("#banner").is_hidden()
            assert errors == []
        finally:
            browser.close()


def test_the_api_pages_render_from_this_server_alone(server):
    """/docs (Swagger UI) and /redoc render the API's operations with every other host refused:
    FastAPI's defaults load their script and style from cdn.jsdelivr.net, and on a cluster with
    no internet /docs was a blank page.  (ReDoc's footer still asks cdn.redoc.ly for its logo,
    an image: refused, nothing else changes, when the page gets that far before the test ends.)"""
    sync_api = pytest.importorskip("playwright.sync_api", reason="!!! THE API PAGES WERE NOT TESTED: the playwright "
                                   "package is missing (pip install -e '.[test]') !!!")
    here = server.url.split("//", 1)[1]
    with sync_api.sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(30_000)
            asked: list[tuple[str, str]] = []
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))

            def only_this_server(route):
                asked.append((route.request.resource_type, route.request.url))
                if route.request.url.split("//", 1)[-1].startswith(here):
                    route.continue_()
                else:
                    route.abort()

            page.route("**/*", only_this_server)
            page.goto(server.url + "/docs")
            # Swagger UI 5 lists the operations of the OpenAPI 3.1 document, grouped by tag
            page.locator('.opblock-summary-path[data-path="/v1/jobs/{job_id}"]').first.wait_for()
            assert page.locator(".opblock").count() >= 10
            assert "relaytrain" in page.locator(".info .title").inner_text()
            page.goto(server.url + "/redoc")
            page.get_by_text("/v1/jobs/{job_id}/cancel").first.wait_for(state="attached")
            elsewhere = [(kind, u) for kind, u in asked if not u.split("//", 1)[-1].startswith(here)]
            assert set(elsewhere) <= {("image", "https://cdn.redoc.ly/redoc/logo-mini.svg")}, elsewhere
            assert not errors, errors
        finally:
            browser.close()


def test_web_page_says_what_an_admitted_job_waits_for(server):
    """A job admitted while work outside relaytrain holds the cluster's CPUs (here a placement
    group of the test) waits for its placement: the job page's Waiting fact says for what, as
    GET /v1/jobs/{id}'s ``waiting`` does, and is gone once the job has its workers."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="!!! THE WEB PAGE WAS NOT TESTED: the playwright "
                                   "package is missing (pip install -e '.[test]') !!!")
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    total = int(ray.cluster_resources()["CPU"])
    hold = placement_group([{"CPU": 1}] * total)  # placed once the earlier tests' workers are gone
    ray.get(hold.ready(), timeout=60)
    held, job_id = True, None
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        with server.client() as c:
            r = c.post("/v1/jobs", json=small_spec("waits", steps=20))
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
            deadline = time.monotonic() + 60
            while not (job := c.get(f"/v1/jobs/{job_id}").json()).get("waiting") and time.monotonic() < deadline:
                time.sleep(0.3)
        assert job["state"] == "PENDING", job
        assert re.fullmatch(rf"waiting for 2 worker slots of {{'CPU': 1\.0}}: 0 of the cluster's {total} CPUs free now; "
                            r"the job fails if they are not placed within \d+ s \(RELAYTRAIN_START_TIMEOUT_S\)",
                            job["waiting"] or ""), job
        with sync_api.sync_playwright() as p:
            browser = launch_chromium(p)
            try:
                page, errors = signed_in_page(browser, server.url + "/")
                row = listed(page, job_id)
                assert row.get_attribute("data-state") == "PENDING"
                row.locator("a").click()
                page.wait_for_selector("#job-waiting-fact", state="visible")
                assert page.locator("#job-waiting").inner_text() == job["waiting"]
                page.screenshot(path=str(ARTIFACTS / "ui-waiting.png"))
                remove_placement_group(hold)  # the CPUs come free: the job is placed and trains
                held = False
                page.wait_for_selector('#view-job[data-state="SUCCEEDED"]', timeout=120_000)
                assert page.locator("#job-waiting-fact").is_hidden()
                assert errors == []
            finally:
                browser.close()
        with server.client() as c:
            assert c.get(f"/v1/jobs/{job_id}").json()["waiting"] is None
    finally:
        if held:
            remove_placement_group(hold)
        if job_id:
            with server.client() as c:
                c.post(f"/v1/jobs/{job_id}/cancel")


# ---------------------------------------------------------------- the cluster scheduler's queue

NEVER_FITS = 4096   # CPU slots per worker: no test cluster has them, so the jobs stay QUEUED


def ordinal(n: int) -> str:
    return f"{n}{'th' if 11 <= n % 100 <= 13 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


@pytest.fixture(scope="module")
def queued_jobs(server):
    """Three QUEUED jobs written straight into the server's store, each asking for more CPU slots
    than the cluster has: two of alice's (the first elastic) and one of bob's.  The server's
    cluster scheduler queues them itself (its place and reason, as GET /v1/jobs shows them).
    Returns {name: job}; the jobs are cancelled after the module's tests."""
    from service.settings import Settings
    from service.spec import JobSpec
    from service.states import JobState
    from service.store import Store

    store = Store(Settings(home=Path(server.home)).db_url)
    made = {}
    for name, tenant, over in [("a", "alice", {"elastic": {"enabled": True, "min_workers": 1, "max_workers": 2}}),
                               ("b", "alice", {}), ("c", "bob", {})]:
        spec = small_spec(f"queued-{name}", resources={"cpus_per_worker": NEVER_FITS}, **over)
        JobSpec.model_validate(spec)  # the cluster scheduler reads it
        job_id = f"queued-ui-{name}-{time.time_ns() % 10**9}"
        store.create_job(job_id, tenant, spec, state=JobState.QUEUED)
        store.add_events(job_id, [{"type": "submitted", "message": f"job {job_id} submitted by {tenant}"}])
        made[name] = (job_id, tenant)
        time.sleep(0.01)  # distinct arrival times: a, b, c in that order
    tokens = {"alice": ALICE, "bob": BOB}
    try:
        deadline = time.monotonic() + 30
        jobs = {}
        while time.monotonic() < deadline:  # the scheduler looks every queue_seconds (2 s)
            for name, (job_id, tenant) in made.items():
                with server.client(tokens[tenant]) as c:
                    jobs[name] = c.get(f"/v1/jobs/{job_id}").json()
            if all(j["queue"] for j in jobs.values()):
                break
            time.sleep(0.3)
        assert all(j["state"] == "QUEUED" and j["queue"] for j in jobs.values()), jobs
        yield jobs
    finally:
        for job_id, tenant in made.values():
            with server.client(tokens[tenant]) as c:
                c.post(f"/v1/jobs/{job_id}/cancel")


def test_an_admitted_job_short_of_slots_says_what_it_waits_for(capsys):
    """GET /v1/jobs/{id}'s ``waiting`` (the job's newest waiting event, while it has no shape
    since: tests/test_store.py) on the line after the status line."""
    from api.cli import _print_job

    wait = "waiting for workers: 1 slot alive, the job needs at least elastic.min_workers=2"
    _print_job({"id": "j-1", "state": "PENDING", "step": 0, "steps": 6, "spec": {"elastic": {"enabled": True}},
                "allotted_workers": 2, "waiting": wait})
    assert capsys.readouterr().out.splitlines() == ["j-1  PENDING    step 0/6  loss -  shape ?x?  allotted 2 workers",
                                                    f"  {wait}"]


def test_queue_in_the_api_and_the_cli(server, queued_jobs):
    a, b, c = (queued_jobs[k] for k in "abc")
    assert sorted(j["queue"]["position"] for j in (a, b, c)) == [1, 2, 3]
    assert b["queue"]["position"] == 2 and a["queue"]["position"] == 1  # alice's in arrival order
    assert b["queue"]["reason"].startswith(f"waiting for {2 * NEVER_FITS} CPU slots (2 workers); 1 job ahead")
    assert a["queue"]["reason"].startswith(f"waiting for {NEVER_FITS} CPU slots (1 worker); 0 jobs ahead")
    assert a["allotted_workers"] is None
    with server.client() as cl:
        view = cl.get("/v1/cluster").json()
    assert [t["tenant"] for t in view["tenants"]] == ["alice", "bob"]
    assert [(t["queued"], t["running"], t["using"], t["starting"]) for t in view["tenants"]] == [(2, 0, 0, 0), (1, 0, 0, 0)]
    assert [(q["position"], q["tenant"], q["job"]) for q in view["queue"]] == \
        [(1, "alice", a["id"]), (2, "alice", b["id"]), (3, "bob", None)]  # bob's job, unnamed

    # status and list: the place and reason on the line after the status line
    st = cli(server, "status", b["id"])
    assert st.returncode == 0, st.stderr
    lines = st.stdout.splitlines()
    assert lines[0].startswith(f"{b['id']}  QUEUED     step 0/6")
    assert lines[1] == f"  queued: 2nd, {b['queue']['reason']}"
    ls = cli(server, "list", "--state", "QUEUED")
    assert ls.returncode == 0, ls.stderr
    assert f"  queued: 1st, {a['queue']['reason']}" in ls.stdout.splitlines()
    assert c["id"] not in ls.stdout
    assert ls.stderr.strip() == "2 of 2 jobs, 2 of them queued (relaytrain cluster shows the queue)"

    # relaytrain cluster: the policy and capacity, a row per tenant, the queue in order
    cluster = cli(server, "cluster")
    assert cluster.returncode == 0, cluster.stderr
    out = cluster.stdout.splitlines()
    assert out[0] == f"policy {view['policy']}, capacity {view['capacity']:g} CPU slots, 3 jobs queued"
    assert out[1].split() == ["TENANT", "WEIGHT", "SHARE", "USING", "STARTING", "RUNNING", "QUEUED"]
    assert out[2].split() == ["alice", "1", f"{view['tenants'][0]['share']:.3g}", "0", "0", "0", "2"]
    assert out[3].split() == ["bob", "1", f"{view['tenants'][1]['share']:.3g}", "0", "0", "0", "1"]
    assert out[4] == "queue:"
    assert out[5:] == [f"    1. alice  {a['id']}: {a['queue']['reason']}",
                       f"    2. alice  {b['id']}: {b['queue']['reason']}",
                       f"    3. bob  (another tenant's job): {c['queue']['reason']}"]
    as_bob = cli(server, "cluster", token=BOB)
    assert f"    3. bob  {c['id']}: " in as_bob.stdout and a["id"] not in as_bob.stdout
    js = cli(server, "cluster", "--json")
    assert js.returncode == 0 and json.loads(js.stdout)["queue"] == view["queue"]
    bad = cli(server, "cluster", token="not-a-token")
    assert bad.returncode == 1 and bad.stderr.startswith("relaytrain: HTTP 401")


def test_web_page_shows_the_queue_and_the_cluster(server, queued_jobs):
    sync_api = pytest.importorskip("playwright.sync_api", reason="!!! THE WEB PAGE WAS NOT TESTED: the playwright "
                                   "package is missing (pip install -e '.[test]') !!!")
    a, b = queued_jobs["a"], queued_jobs["b"]
    with server.client() as cl:
        view = cl.get("/v1/cluster").json()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page, errors = signed_in_page(browser, server.url + "/")

            # the list: a QUEUED badge in its own colour, its place and reason as the badge's tip
            row = listed(page, b["id"])
            assert row.get_attribute("data-state") == "QUEUED"
            tag = row.locator(".badge")
            assert tag.inner_text() == "QUEUED"
            assert tag.get_attribute("title") == f"2nd in the queue: {b['queue']['reason']}"
            colours = "e => [getComputedStyle(e).backgroundColor, getComputedStyle(e).color]"
            assert tag.evaluate(colours) == [rgb("#e0f3f5"), rgb("#1d7480")]
            others = {tuple(page.locator(f"#jobs .badge.{s}").first.evaluate(colours))
                      for s in ("PENDING", "RUNNING", "SUCCEEDED", "CANCELLED")
                      if page.locator(f"#jobs .badge.{s}").count()}
            assert tuple(tag.evaluate(colours)) not in others

            # the cluster panel: policy, capacity, a row per tenant, the queue's length
            panel = page.locator("#cluster-panel")
            page.wait_for_selector('#cluster-tenants tr[data-tenant="bob"]')
            assert panel.is_visible() and panel.get_attribute("data-policy") == view["policy"]
            assert page.locator("#cluster-policy").inner_text() == view["policy"]
            assert page.locator("#cluster-capacity").inner_text() == f"{view['capacity']:g}"
            queue = page.locator("#cluster-queue")
            assert (queue.inner_text(), queue.get_attribute("data-length")) == ("3 jobs", "3")
            assert f"2. {b['id']}: {b['queue']['reason']}" in queue.get_attribute("title")
            assert "3. a job of tenant bob: " in queue.get_attribute("title")
            cells = "r => [...r.querySelectorAll('td')].map(td => td.textContent)"
            share = [f"{t['share']:.3g}" for t in view["tenants"]]
            assert page.locator('#cluster-tenants tr[data-tenant="alice"]').evaluate(cells) == \
                ["alice", "1", share[0], "0", "0", "0", "2"]
            assert page.locator('#cluster-tenants tr[data-tenant="bob"]').evaluate(cells) == \
                ["bob", "1", share[1], "0", "0", "0", "1"]
            page.screenshot(path=str(ARTIFACTS / "ui-queue-list.png"))

            # the state filter knows QUEUED: alice's two queued jobs, nothing else
            page.locator("#state-filter").select_option("QUEUED")
            page.wait_for_function("() => [...document.querySelectorAll('#jobs tbody tr')]"
                                   ".every(r => r.dataset.state === 'QUEUED')")
            page.wait_for_selector(f'#jobs tr[data-job-id="{a["id"]}"]')
            ids = page.eval_on_selector_all("#jobs tbody tr", "rs => rs.map(r => r.dataset.jobId)")
            assert sorted(ids) == sorted([a["id"], b["id"]])

            # the job's page: the badge, its place and reason; no shape yet; it may be cancelled
            row.locator("a").click()
            page.wait_for_selector(f'#view-job[data-job-id="{b["id"]}"][data-state="QUEUED"]')
            place = page.locator("#job-queue")
            page.wait_for_selector('#job-queue[data-position="2"]')
            assert place.is_visible()
            assert place.inner_text() == f"2nd in the queue: {b['queue']['reason']}"
            assert page.locator("#job-state").inner_text() == "QUEUED"
            assert page.locator("#job-state").evaluate(colours) == [rgb("#e0f3f5"), rgb("#1d7480")]
            assert page.locator("#job-allotted").is_hidden()  # a queued job has none
            assert page.locator("#job-time").inner_text() == "not started"
            assert page.locator("#shape-summary").inner_text().startswith("The job is queued")
            assert page.locator("#live").inner_text() == "live"
            assert page.locator("#cancel").is_enabled()
            assert page.locator("#finish").is_disabled()  # nothing trained yet: nothing to keep
            assert page.eval_on_selector_all("#events li", "ls => ls.map(l => l.dataset.type)") == ["submitted"]
            page.screenshot(path=str(ARTIFACTS / "ui-queue-job.png"), full_page=True)

            # an elastic job once admitted: the workers the cluster scheduler allots it, under Shape
            # (the server would run it; here its row is rewritten on the way to the page)
            def admitted(route):
                job = route.fetch().json()
                assert job["spec"]["elastic"]["enabled"]
                route.fulfill(status=200, content_type="application/json",
                              body=json.dumps({**job, "state": "RUNNING", "queue": None, "allotted_workers": 2,
                                               "shape": {"dp": 2, "pp": 1, "schedule": "1f1b"}}))
            page.route(f"**/v1/jobs/{a['id']}", admitted)
            page.goto(server.url + f"/#/jobs/{a['id']}")
            page.wait_for_selector(f'#view-job[data-job-id="{a["id"]}"][data-state="RUNNING"]')
            allotted = page.locator("#job-allotted")
            page.wait_for_selector('#job-allotted[data-workers="2"]')
            assert allotted.is_visible() and allotted.inner_text() == "allotted 2 workers"
            assert page.locator("#job-queue-fact").is_hidden()
            page.unroute(f"**/v1/jobs/{a['id']}")

            # cancelling a queued job takes it out of the queue
            page.goto(server.url + f"/#/jobs/{b['id']}")
            page.wait_for_selector(f'#view-job[data-job-id="{b["id"]}"][data-state="QUEUED"]')
            page.locator("#cancel").click()
            page.wait_for_selector('#view-job[data-state="CANCELLED"]')
            assert page.locator("#job-queue-fact").is_hidden()
            page.wait_for_function("() => document.querySelector('#cancel').disabled")
            page.wait_for_selector('#events li[data-type="cancelled"]')
            assert "cancelled while queued" in page.locator('#events li[data-type="cancelled"]').inner_text()
            assert page.locator("#banner").is_hidden()
            assert errors == []
        finally:
            browser.close()
