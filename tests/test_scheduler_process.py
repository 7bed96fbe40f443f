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
    (kept by Ray for the next job with the same runtime_env) imports each job's own.  The jobs are
    elastic: a fixed shape's trace runs in its first worker instead (actors/layerfacts.py)."""
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
                "parallelism": {"dp": 1, "pp": 2}, "elastic": {"enabled": True, "min_workers": 2, "max_workers": 2}}
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


NOTED_MODEL = """
import json, os
import ray
from torch import nn

def build():
    width = int(open("width.txt").read())  # a file of the job's folder, read from the working directory
    with open({notes!r}, "a") as f:
        f.write(json.dumps({{"argv0": open("/proc/self/cmdline").read().split(chr(0))[1:2],
                             "title": open("/proc/self/cmdline").read()[:80], "cwd": os.getcwd(),
                             "runtime_env": ray.get_runtime_context().runtime_env}}) + "\\n")
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))
"""


@pytest.mark.parametrize("elastic", [False, True], ids=["fixed", "elastic"])
def test_a_jobs_code_package_reaches_its_trace_and_workers_without_a_runtime_env(ray_session, tmp_path, monkeypatch,
                                                                                 elastic):
    """A job whose code is a package in the cluster (`relaytrain run` and `relaytrain submit`
    upload it): its scheduler, its pre-flight trace and its workers get it from relaytrain, not
    through a runtime_env (which costs each process a second start, actors/codepkg.py), and run in
    its unpacked folder as Ray's working_dir would: the builder reads a file of the folder by a
    relative path. A fixed shape's trace runs in its first worker, no process of its own; an
    elastic job's (no worker before its shape is chosen) in a task. The numbers equal one
    process's."""
    import json

    import torch

    from actors import launch
    from tests.reference import train as reference_train
    from tests.test_engine import assert_same_params

    ray = ray_session
    folder = tmp_path / "code"
    folder.mkdir()
    notes = tmp_path / "notes.jsonl"
    (folder / "notedpkg.py").write_text(NOTED_MODEL.format(notes=str(notes)))
    (folder / "width.txt").write_text("48\n")
    spec = parse_spec({"name": "pkg", "model": {"builder": "notedpkg:build"}, "data": {"kind": "digits"},
                       "training": {"global_batch_size": 16, "microbatch_size": 8, "steps": 3},
                       "parallelism": {"dp": 1, "pp": 2},
                       "elastic": {"enabled": elastic, "min_workers": 2, "max_workers": 2}})
    env = launch.upload_runtime_env(launch.job_runtime_env(spec, str(folder)))
    assert set(env) == {"working_dir"} and env["working_dir"].startswith("gcs://_ray_pkg_")
    job_id = f"pkg-{uuid.uuid4().hex[:8]}"
    model_dir = tmp_path / "model"
    sched = launch.start_scheduler(job_id, spec.model_dump(mode="json"), [], runtime_env=env,
                                   model_dir=str(model_dir))
    try:
        final = ray.get(sched.run.remote(), timeout=240)
        index = ray.get(sched.model_index.remote())
    finally:
        ray.kill(sched)
    assert final["state"] == "SUCCEEDED", final["error"]
    seen = [json.loads(line) for line in notes.read_text().splitlines()]
    titles = " ".join(s["title"] for s in seen)
    assert ("preflight" in titles) == elastic, titles  # the trace: in a task of its own, or in a worker
    assert titles.count("StageWorker") >= 2 + (not elastic), titles  # both workers built their stages
    pkg_name = env["working_dir"][len("gcs://"):-len(".zip")]
    for s in seen:
        assert s["runtime_env"] == {}, s
        assert s["cwd"].endswith(f"/relaytrain_code/{ray.get_runtime_context().get_node_id()}/{pkg_name}"), s
    from actors.runner import _save_model

    _save_model(index, model_dir, tmp_path / "model.pt")
    monkeypatch.chdir(folder)  # one process, run in the job's folder
    want, _ = reference_train(spec, search=[str(folder)])
    assert_same_params(torch.load(tmp_path / "model.pt"), want)


def test_a_code_package_gone_from_the_cluster_fails_the_job_saying_what_to_do(ray_session):
    ray = ray_session
    from actors import launch

    spec = {"name": "gone", "model": {"builder": "nosuchpkg:build"}, "data": {"kind": "digits"},
            "training": {"global_batch_size": 16, "microbatch_size": 8, "steps": 1}, "parallelism": {"dp": 1, "pp": 2}}
    uri = "gcs://_ray_pkg_" + "ab" * 32 + ".zip"
    sched = launch.start_scheduler(f"gone-{uuid.uuid4().hex[:8]}", spec, [], runtime_env={"working_dir": uri})
    try:
        final = ray.get(sched.run.remote(), timeout=120)
    finally:
        ray.kill(sched)
    assert final["state"] == "FAILED"
    assert final["error"].startswith(f"the job's code package {uri} is not in the cluster's store"), final["error"]
    assert "submit the job again" in final["error"]


def test_which_runtime_envs_relaytrain_ships_itself_and_how_it_unpacks(tmp_path, monkeypatch):
    """Pure: only a working_dir package alone is shipped by relaytrain; unpacking is once per
    node, safe against a concurrent unpack and refuses paths outside the folder."""
    import io
    import os
    import zipfile

    from actors import codepkg

    uri = "gcs://_ray_pkg_" + "cd" * 32 + ".zip"
    assert codepkg.split({"working_dir": uri}) == ({}, uri)
    for env in ({}, {"working_dir": "/home/me/code"}, {"working_dir": "https://example.com/code.zip"},
                {"working_dir": uri, "pip": ["x"]}, {"working_dir": uri, "env_vars": {"A": "1"}}):
        assert codepkg.split(env) == (env, None)
    monkeypatch.setenv("RELAYTRAIN_SHIP_CODE", "0")  # everything to Ray, as before
    assert codepkg.split({"working_dir": uri}) == ({"working_dir": uri}, None)
    monkeypatch.delenv("RELAYTRAIN_SHIP_CODE")

    monkeypatch.setattr(codepkg, "_base", lambda: tmp_path / "base")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("mod.py", "X = 1\n")
        z.writestr("sub/data.txt", "hello")
    data = buf.getvalue()
    folder = codepkg.install(uri, data)
    assert folder == str(tmp_path / "base" / f"_ray_pkg_{'cd' * 32}")
    assert (tmp_path / "base" / f"_ray_pkg_{'cd' * 32}" / "sub" / "data.txt").read_text() == "hello"
    # unpacked once: the second call finds the folder and never reads what it is given (not a zip)
    assert codepkg.install(uri, b"not a zip") == folder
    assert [p.name for p in (tmp_path / "base").iterdir()] == [f"_ray_pkg_{'cd' * 32}"]  # no scratch left

    bad = io.BytesIO()
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("../evil.py", "")
    with pytest.raises(ValueError, match="unsafe path '../evil.py'"):
        codepkg.install("gcs://_ray_pkg_" + "ef" * 32 + ".zip", bad.getvalue())
    assert not (tmp_path / "evil.py").exists()

    back, path = os.getcwd(), list(sys.path)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    try:
        codepkg.enter(folder)
        assert os.getcwd() == folder and sys.path[0] == folder
        assert os.environ["PYTHONPATH"] == f"{folder}{os.pathsep}/elsewhere"
    finally:
        os.chdir(back)
        sys.path[:] = path
