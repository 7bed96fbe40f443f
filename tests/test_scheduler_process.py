"""A job's scheduler process: it imports no torch (about 2.4 s of CPU and 250 MB in every job's
scheduler, before its workers could be asked for); it names its workers' class through
actors/workeractor.py and has the model traced in a Ray task (actors/layerfacts.py), which
reports a spec the trace refuses as the job's error."""
from __future__ import annotations

import sys
import uuid

import pytest

from service.loading import preflight
from service.spec import SpecError, parse_spec
from tests.conftest import FIXTURES
from tests.test_lazydynamo import run


def test_a_jobs_scheduler_imports_no_torch():
    """A job's scheduler names its workers' class and plans without torch (about 2.4 s of CPU and
    250 MB in each job's scheduler); the model is traced in a task (actors/layerfacts.py)."""
    got = run("""
        import json, sys
        import actors.launch, actors.scheduler
        print(json.dumps({"torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))}))
    """)
    assert got["torch"] == []


def test_the_worker_actor_class_calls_every_method_of_the_worker():
    import inspect

    from actors import workeractor
    from actors.worker import StageWorker

    public = {n for n, f in inspect.getmembers(StageWorker, inspect.isfunction) if not n.startswith("_")}
    assert set(workeractor.METHODS) == public
    assert workeractor.StageWorker.__name__ == "StageWorker"  # the dashboard's and the tracebacks' name

    class Real:  # each method answers with its name and arguments; attributes are read through
        cell = "w0.1"

        def __getattr__(self, name):
            return lambda *args, **kwargs: (name, args, kwargs)

    actor = object.__new__(workeractor.StageWorker)
    actor._worker = Real()
    for name in public:
        assert getattr(actor, name)(1, b=2) == (name, (1,), {"b": 2})
    assert actor.cell == "w0.1"


def test_a_job_runs_with_a_scheduler_that_holds_no_torch(ray_session):
    ray = ray_session
    from actors.launch import start_scheduler
    from tests.test_api import small_spec

    def process(actor) -> dict:  # run in the scheduler's process (defined here: Ray ships it by value)
        status = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return {"torch": "torch" in sys.modules, "hwm_kb": int(status["VmHWM"].split()[0])}

    spec = small_spec("torchless", steps=4)  # 1 x 2 on the built-in MLP and digits
    job_id = f"torchless-{uuid.uuid4().hex[:8]}"
    sched = start_scheduler(job_id, spec, [])
    try:
        final = ray.get(sched.run.remote(), timeout=240)
        assert final["state"] == "SUCCEEDED", final["error"]
        assert [e["type"] for e in ray.get(sched.poll.remote())["events"]][:2] == ["started", "shape"]
        proc = ray.get(sched.__ray_call__.remote(process))
    finally:
        ray.kill(sched)
    assert proc["torch"] is False
    # measured here: 118 MB with this design, 368 MB when the scheduler imported torch and traced
    assert proc["hwm_kb"] < 200 * 1024, proc


def test_a_spec_the_trace_refuses_fails_the_job_saying_what_to_change(ray_session):
    """The control plane does not run user code: its scheduler's trace is the first to; the
    job fails with the message the pre-flight check gives where the code is (relaytrain run)."""
    ray = ray_session
    from actors.launch import start_scheduler

    spec = {"name": "notseq", "model": {"builder": "userpkg.models:not_sequential"},
            "data": {"builder": "userpkg.data:build"},
            "training": {"global_batch_size": 16, "microbatch_size": 8, "steps": 2},
            "parallelism": {"dp": 1, "pp": 2}}
    with pytest.raises(SpecError) as here:
        preflight(parse_spec(spec), [FIXTURES])
    sched = start_scheduler(f"notseq-{uuid.uuid4().hex[:8]}", spec, [FIXTURES])
    try:
        final = ray.get(sched.run.remote(), timeout=240)
        events = ray.get(sched.poll.remote())["events"]
    finally:
        ray.kill(sched)
    assert final["state"] == "FAILED"
    assert final["error"] == str(here.value)
    assert [e["type"] for e in events] == ["started", "failed"] and events[-1]["message"] == str(here.value)


def test_each_job_traces_its_own_code_though_the_trace_process_serves_them_all(ray_session, tmp_path):
    """Two jobs whose code has the same module name in two folders: the pre-flight task's process
    (kept by Ray for the next job with the same runtime_env) imports each job's own."""
    ray = ray_session
    from actors.launch import start_scheduler

    shapes = []
    for layers in (2, 4):
        folder = tmp_path / f"code{layers}"
        folder.mkdir()
        (folder / "twinmodel.py").write_text(
            "from torch import nn\n\n"
            "def build():\n"
            f"    return nn.Sequential(*[nn.Linear(64, 64) for _ in range({layers} - 1)], nn.Linear(64, 10))\n")
        spec = {"name": "twin", "model": {"builder": "twinmodel:build"}, "data": {"kind": "digits"},
                "training": {"global_batch_size": 16, "microbatch_size": 8, "steps": 1},
                "parallelism": {"dp": 1, "pp": 2}}
        sched = start_scheduler(f"twin-{layers}-{uuid.uuid4().hex[:8]}", spec, [str(folder)])
        try:
            final = ray.get(sched.run.remote(), timeout=240)
            events = ray.get(sched.poll.remote())["events"]
        finally:
            ray.kill(sched)
        assert final["state"] == "SUCCEEDED", final["error"]
        shapes.append(next(e for e in events if e["type"] == "shape"))
    assert [sum(s["partition"]) for s in shapes] == [2, 4], shapes


def test_relaytrain_run_hands_its_trace_to_the_scheduler(ray_session, tmp_path):
    """`relaytrain run` traces the model itself (its pre-flight check, before anything starts):
    the scheduler takes that trace and starts no pre-flight task.  The model's builder notes
    which processes build it."""
    from actors.runner import run_job

    (tmp_path / "notedmodel.py").write_text(
        "import os\nfrom torch import nn\n\n"
        "def build():\n"
        f"    with open({str(tmp_path / 'built_in')!r}, 'a') as f:\n"
        "        f.write(open('/proc/self/cmdline').read().split(chr(0))[0] + '\\n')\n"
        "    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))\n")
    spec = parse_spec({"name": "noted", "model": {"builder": "notedmodel:build"}, "data": {"kind": "digits"},
                       "training": {"global_batch_size": 16, "microbatch_size": 8, "steps": 2},
                       "parallelism": {"dp": 1, "pp": 2}})
    final = run_job(spec=spec, spec_dir=str(tmp_path), out=str(tmp_path / "out"), progress=False, record=False)
    assert final["state"] == "SUCCEEDED"
    built_in = set((tmp_path / "built_in").read_text().split())
    assert not any("preflight" in p for p in built_in), built_in
    assert any("StageWorker" in p for p in built_in), built_in  # the workers build their layers
