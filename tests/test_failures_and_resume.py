"""A worker that raises stops the job with its traceback; bad specs start nothing;
checkpoints resume to the same parameters as an uninterrupted run."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from service import checkpoint
from actors.runner import JobFailed, run_job
from tests.fixtures.userpkg.models import BOOM
from service.spec import SpecError, parse_spec
from tests import reference
from tests.conftest import FIXTURES


def user_spec(**over):
    d = {
        "name": "fails", "model": {"builder": "userpkg.models:exploding"}, "data": {"builder": "userpkg.data:build"},
        "optimizer": {"name": "sgd", "lr": 0.1},
        "training": {"global_batch_size": 32, "microbatch_size": 8, "steps": 5},
        "parallelism": {"dp": 1, "pp": 2, "partition": [2, 2]},
    }
    d.update(over)
    return parse_spec(d)


def relaytrain_actors(ray):
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("relaytrain:")]


@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_worker_exception_fails_job_with_traceback(ray_session, tmp_path, transport):
    spec = user_spec(parallelism={"dp": 1, "pp": 2, "partition": [2, 2], "transport": transport})
    (tmp_path / "model.pt").write_bytes(b"an earlier run's model")  # not left beside this run's files
    t0 = time.monotonic()
    with pytest.raises(JobFailed) as e:
        run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False, timeout=60)
    assert time.monotonic() - t0 < 60  # stopped at once, not after a timeout
    # the third forward on stage 1 is microbatch 2 of step 1
    assert str(e.value) == "worker w0.1 at step 1 raised ValueError: " + BOOM  # the whole message
    assert "Traceback" in e.value.detail and "models.py" in e.value.detail and "boom" in e.value.detail
    events = [json.loads(x) for x in open(tmp_path / "events.jsonl")]
    failed = [ev for ev in events if ev["type"] == "failed"]
    assert failed and "boom from a user layer" in failed[0]["message"] and "Traceback" in failed[0]["detail"]
    assert not (tmp_path / "model.pt").exists()
    deadline = time.monotonic() + 15
    while relaytrain_actors(ray_session) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert relaytrain_actors(ray_session) == []  # no worker left behind


@pytest.mark.parametrize("schedule, where, partition, transport, worker", [
    ("zb_h1", 1, [3, 3], "collective", "w0.0"),            # the first chunk's whole backward is its W
    ("zb_h1", 4, [3, 3], "collective", "w0.1"),            # the last chunk's B, its input gradient awaited
    ("zbv", 4, [2, 1, 1, 2], "object_store", "w0.0"),      # the V's last chunk, on the first worker
])
def test_a_user_layer_that_raises_in_its_backward_fails_a_split_schedule_with_its_message(
        ray_session, tmp_path, schedule, where, partition, transport, worker):
    """A user's autograd Function raising in its third backward, in a B or a W of the zero-bubble
    schedules: the job fails at once with the user's whole message, naming the worker, and leaves
    no actor behind (its peer, waiting for a gradient or for the step's end, is stopped)."""
    spec = user_spec(model={"builder": "userpkg.models:exploding_backward", "args": {"where": where}},
                     parallelism={"dp": 1, "pp": 2, "partition": partition, "schedule": schedule,
                                  "transport": transport})
    t0 = time.monotonic()
    with pytest.raises(JobFailed) as e:
        run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False, timeout=60)
    assert time.monotonic() - t0 < 60
    assert str(e.value) == f"worker {worker} at step 1 raised ValueError: " + BOOM
    assert "Traceback" in e.value.detail and "models.py" in e.value.detail and "backward" in e.value.detail
    deadline = time.monotonic() + 15
    while relaytrain_actors(ray_session) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert relaytrain_actors(ray_session) == []


def test_activation_shape_that_varies_needs_the_object_store(ray_session, tmp_path):
    """The collective transport receives into buffers of the first microbatch's shape: an activation
    whose shape varies fails the job with what to change; the object store carries it exactly."""
    spec = user_spec(model={"builder": "userpkg.models:ragged"}, training={
        "global_batch_size": 32, "microbatch_size": 4, "steps": 4, "shuffle": False})
    with pytest.raises(JobFailed) as e:
        run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path / "a"), progress=False, timeout=60)
    assert str(e.value).startswith(
        "worker w0.0 at step 1 raised ValueError: stage 0 (layers 0-1) produced an activation of shape (4, 8) "
        "torch.float32 for microbatch 1, but the pipeline was set up for (4, 4) torch.float32"), str(e.value)
    assert "set parallelism.transport: object_store for activations whose shape varies" in str(e.value)
    assert not (tmp_path / "a" / "model.pt").exists()

    store = spec.model_copy(update={"parallelism": spec.parallelism.model_copy(update={"transport": "object_store"})})
    run_job(spec=store, spec_dir=FIXTURES, out=str(tmp_path / "b"), progress=False, timeout=60)
    want, losses = reference.train(store, search=[str(FIXTURES)], microbatched=True)
    got = torch.load(tmp_path / "b" / "model.pt")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=2e-5)
    rows = [json.loads(x) for x in open(tmp_path / "b" / "metrics.jsonl")]
    assert [r["loss"] for r in rows] == pytest.approx(losses, rel=1e-4)


def test_bad_spec_starts_no_actor(ray_session, tmp_path):
    spec = user_spec(parallelism={"dp": 1, "pp": 9})
    with pytest.raises(SpecError, match="parallelism.pp is 9 but the model has only 4 layers"):
        run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False)
    assert relaytrain_actors(ray_session) == []
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_job_larger_than_cluster_is_refused(ray_session, tmp_path):
    spec = parse_spec({"name": "huge", "model": {"kind": "mlp"}, "data": {"kind": "digits"},
                       "training": {"global_batch_size": 64, "microbatch_size": 8, "steps": 1},
                       "parallelism": {"dp": 4, "pp": 4}})
    with pytest.raises(SpecError, match="needs 16 CPU slots .* but the cluster has 8"):
        run_job(spec=spec, out=str(tmp_path), progress=False)


@pytest.mark.parametrize("model", [
    {"kind": "mlp", "args": {"hidden": 32, "layers": 3}},
    # the ReLUs are entries of their own: the 1x3 stages take layers with no state (nothing to copy)
    {"builder": "userpkg.models:classifier", "args": {"width": 32}},
], ids=["builtin-mlp", "user-classifier-with-relu-entries"])
def test_checkpoint_resume_equals_uninterrupted(ray_session, tmp_path, model, monkeypatch):
    ckpt = tmp_path / "ckpt"
    spec = parse_spec({
        "name": "resume", "model": model, "data": {"kind": "digits"},
        "optimizer": {"name": "adam", "lr": 0.003},
        "training": {"global_batch_size": 64, "microbatch_size": 16, "steps": 9, "seed": 2},
        "parallelism": {"dp": 2, "pp": 2, "transport": "collective"},
        "checkpoint": {"every_steps": 4, "path": str(ckpt), "keep": 5},
    })
    run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path / "a"), progress=False)
    # step 8's is taken at step 9 when it comes due while step 4's is still being written ("Durable jobs"):
    # on a loaded machine it was (a CI run, 2026-11-30)
    names = [p.name for p in checkpoint.list_checkpoints(ckpt)]
    assert names in (["step-00000004", "step-00000008", "step-00000009"], ["step-00000004", "step-00000009"]), names
    full = torch.load(tmp_path / "a" / "model.pt")
    want, _ = reference.train(spec, search=[FIXTURES])
    for k in want:
        torch.testing.assert_close(full[k], want[k], rtol=1e-4, atol=2e-5)
    # resume from step 4 in another shape: same parameters as the uninterrupted run; the path
    # as typed on a command line, relative to where it runs (user code runs in its uploaded folder)
    other = spec.model_copy(update={"parallelism": spec.parallelism.model_copy(update={"dp": 1, "pp": 3})})
    final = run_job(spec=other, spec_dir=FIXTURES, out=str(tmp_path / "b"), progress=False,
                    resume=os.path.relpath(ckpt / "step-00000004"))
    resumed = torch.load(tmp_path / "b" / "model.pt")
    for k in want:
        torch.testing.assert_close(resumed[k], full[k], rtol=1e-4, atol=2e-5)
    rows = [json.loads(x) for x in open(tmp_path / "b" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [5, 6, 7, 8, 9]  # every step after the checkpoint committed once
    assert any(e["type"] == "resumed" for e in final["events"])
    # another model's checkpoint: refused before anything starts, saying what differs (it loaded
    # the names that matched and trained on from the others' initial values: a user trial)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("mine")
    wider = {"kind": "mlp", "args": {"hidden": 48, "layers": 3}} if model.get("kind") else {**model, "args": {"width": 48}}
    renamed = {"builder": "userpkg.models:classifier", "args": {"width": 32}} if model.get("kind") else \
        {"kind": "mlp", "args": {"hidden": 32, "layers": 3}}
    for bad, said in ((wider, r"\S+ is \[32, 64\] in the checkpoint and \[48, 64\] in the model"),
                      (renamed, r"the model has .+, which the checkpoint lacks; the checkpoint has .+, which the model "
                                r"lacks")):
        with pytest.raises(SpecError, match=rf"^--resume: the checkpoint {re.escape(str(ckpt / 'step-00000004'))} "
                                            rf"\(job resume-\w+\) is not of this model: .*{said}.*\. A checkpoint "
                                            "restores a model with the same parameter and buffer names and shapes"):
            run_job(spec=spec.model_copy(update={"model": type(spec.model).model_validate(bad)}), spec_dir=FIXTURES,
                    out=str(tmp_path / "c"), progress=False, resume=str(ckpt / "step-00000004"))
    assert [p.name for p in (tmp_path / "c").iterdir()] == ["keep.txt"]
    if model.get("kind"):  # the job's scheduler checks too (a REST job of user code has no check before it)
        import actors.runner

        monkeypatch.setattr(actors.runner.checkpoint, "check_fits", lambda *a, **k: None)  # this process only
        with pytest.raises(JobFailed, match=rf"^the checkpoint {re.escape(str(ckpt / 'step-00000004'))} \(job "
                                            r"resume-\w+\) is not of this model: .*\S+ is \[32, 64\] in the checkpoint "
                                            r"and \[48, 64\] in the model"):
            run_job(spec=spec.model_copy(update={"model": type(spec.model).model_validate(wider)}), spec_dir=FIXTURES,
                    out=str(tmp_path / "d"), progress=False, resume=str(ckpt / "step-00000004"))


def test_resume_without_checkpoint_is_a_clear_error(ray_session, tmp_path):
    spec = user_spec(checkpoint={"every_steps": 2, "path": str(tmp_path / "none")})
    with pytest.raises(SpecError, match="--resume: no complete checkpoint at"):
        run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False, resume="")


def test_cli_run_end_to_end(ray_session, tmp_path):
    """`relaytrain run` as a user runs it, against the session's cluster by address, from a folder
    that holds files named like relaytrain's packages (a user's actors.py and service.py): Ray
    puts the folder a driver starts in on its workers' import path, where they took the place of
    relaytrain's own (every job failed: "No module named 'actors.scheduler'")."""
    (tmp_path / "actors.py").write_text("print('my own actors')\n")
    (tmp_path / "service.py").write_text("print('my own service')\n")
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(
        "name: cli-job\nmodel: {kind: mlp, args: {hidden: 32, layers: 2}}\ndata: {kind: digits}\n"
        "training: {global_batch_size: 32, microbatch_size: 8, steps: 6}\nparallelism: {pp: 2}\n")
    address = ray_session.get_runtime_context().gcs_address
    out = tmp_path / "out"
    relaytrain = os.path.join(os.path.dirname(sys.executable), "relaytrain")  # the console script
    p = subprocess.run([relaytrain, "run", "job.yaml", "--out", "out", "--ray-address", address], cwd=tmp_path,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    assert "SUCCEEDED: 6 steps" in p.stdout
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert {"step", "loss", "time", "samples_per_s", "dp", "pp", "bubble"} <= set(rows[0])
    sd = torch.load(out / "model.pt")
    from service.builtins import mlp

    assert list(sd) == list(mlp(hidden=32, layers=2).state_dict())


def test_cli_run_on_its_own_local_ray_with_more_slots_than_cores_and_a_ctrl_c_that_finishes_it(tmp_path):
    """No --ray-address: `relaytrain run` starts (and stops) a local Ray; --local-cpus 4 lets a
    2x2 job run on this 2-core machine.  A Ctrl-C once it trains finishes it after the step under
    way: exit 0, SUCCEEDED, the one-process loop's model after the steps it ran."""
    import signal

    from service.spec import load_spec

    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(
        "name: local-job\nmodel: {kind: mlp, args: {hidden: 16, layers: 2}}\ndata: {kind: digits}\n"
        "training: {global_batch_size: 32, microbatch_size: 8, steps: 100000}\n"
        "parallelism: {dp: 2, pp: 2, transport: collective}\n")
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "api.cli", "run", str(spec_file), "--out", str(out),
                          "--local-cpus", "4", "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "metrics.jsonl").exists() or len(open(out / "metrics.jsonl").readlines()) < 3:
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.1)
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, stderr
    assert "relaytrain: finishing after the step under way (" in stderr
    assert "Ctrl-C again stops it at its next step boundary" in stderr
    n = int(re.search(r"SUCCEEDED: (\d+) steps of 100000, finished early, last loss ", stdout)[1])
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, n + 1)) and {r["dp"] for r in rows} == {2}
    want, _ = reference.train(load_spec(str(spec_file)), steps=n)
    got = torch.load(out / "model.pt")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=2e-5)
    # the same job on 2 slots cannot run: refused, saying how to give the local Ray more, and
    # the run before's files in the folder untouched (a user trial lost model/ and its logs)
    before = {f: (out / f).read_bytes() for f in ("model.pt", "metrics.jsonl", "events.jsonl")}
    shards = sorted(p.name for p in (out / "model").iterdir())
    p = subprocess.run([sys.executable, "-m", "api.cli", "run", str(spec_file), "--out", str(out), "--local-cpus", "2",
                        "--no-progress"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines()[-1] == (
        "relaytrain: the job needs 4 CPU slots (4 workers x 1) but the cluster has 2; lower parallelism.dp x "
        "parallelism.pp or resources.cpus_per_worker, or add nodes; on this machine `--local-cpus N` gives the "
        "local Ray N worker slots (they are logical: more than its cores run, sharing them)")
    assert {f: (out / f).read_bytes() for f in before} == before
    assert sorted(p.name for p in (out / "model").iterdir()) == shards


def test_a_second_ctrl_c_keeps_every_committed_step_in_the_files_and_a_resume_marks_its_reruns(ray_session,
                                                                                                   tmp_path,
                                                                                                   monkeypatch):
    """Two Ctrl-Cs (the first asks the job to finish after the step under way, the second stops
    it): every step the job store holds is in metrics.jsonl too (a user trial: 17 rows in the
    file, 19 in the store, the scheduler having committed two more before it was stopped).  A
    --resume into the same --out from an earlier checkpoint appends the steps it runs again with
    "rerun": true (the trial's two unmarked rows of steps 16 and 17), and ends at the one-process
    loop's model.  The second Ctrl-C comes as the run says it took the first (a second sent from
    a thread after that raced the end of the step under way on a loaded machine)."""
    import io
    import signal
    import threading

    from service.settings import Settings
    from service.store import Store

    def spec(steps: int):
        return parse_spec({"name": "twice-stopped",
                           "model": {"builder": "userpkg.models:functional_linears",
                                     "args": {"layers": 2, "weight_grad_ms": 40}},
                           "data": {"kind": "digits"}, "optimizer": {"name": "sgd", "lr": 0.1},
                           "training": {"global_batch_size": 32, "microbatch_size": 8, "steps": steps},
                           "parallelism": {"pp": 2}, "checkpoint": {"every_steps": 2, "path": str(tmp_path / "ck")}})

    out = tmp_path / "out"

    class Told(io.StringIO):  # the run's stderr: once it says the first Ctrl-C was taken, the second
        def write(self, text):  # (in the main thread, before the job can end after the step under way)
            if "finishing after the step under way" in text:
                signal.raise_signal(signal.SIGINT)
            return super().write(text)

    monkeypatch.setattr(sys, "stderr", Told())

    def first_ctrl_c():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 4:
                break
            time.sleep(0.02)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    threading.Thread(target=first_ctrl_c, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        run_job(spec=spec(100000), out=str(out), progress=False, spec_dir=FIXTURES)
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    n = len(rows)
    assert [r["step"] for r in rows] == list(range(1, n + 1)) and n >= 4
    store = Store(Settings().db_url)
    job = next(r for r in store.list_jobs("local")[0] if r["name"] == "twice-stopped")
    assert job["state"] == "CANCELLED"
    assert [m["step"] for m in store.get_metrics(job["id"])] == list(range(1, n + 1)), n

    # from the oldest checkpoint kept (the newest may be the last step), a folder of its own
    oldest = checkpoint.list_checkpoints(str(tmp_path / "ck"))[0]
    newest = checkpoint.step_of(oldest)
    assert newest < n
    steps = n + 2
    run_job(spec=spec(steps), out=str(out), progress=False, resume=str(oldest), spec_dir=FIXTURES)
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    again = rows[n:]
    assert [r["step"] for r in again] == list(range(newest + 1, steps + 1))
    assert [r["step"] for r in again if r.get("rerun")] == list(range(newest + 1, n + 1))
    assert not any(r.get("rerun") for r in rows[:n])
    want, _ = reference.train(spec(steps), search=[FIXTURES])
    got = torch.load(out / "model.pt")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=2e-5)


def test_cli_run_with_a_ray_address_where_nothing_answers_says_so_at_once(tmp_path):
    """ray.init of a GCS address where nothing listens retried it for more than ten minutes."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("name: nowhere\nmodel: {kind: mlp, args: {hidden: 16, layers: 2}}\ndata: {kind: digits}\n"
                         "training: {global_batch_size: 32, microbatch_size: 8, steps: 2}\n")
    p = subprocess.run([sys.executable, "-m", "api.cli", "run", str(spec_file), "--out", str(tmp_path / "o"),
                        "--ray-address", f"127.0.0.1:{port}", "--no-progress"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1] == (
        f"relaytrain: cannot connect to Ray at 127.0.0.1:{port}: nothing answers there (Connection refused); is its "
        "head running (`ray status` on it), and is this its GCS address, HOST:6379 by default?"), p.stderr
    assert not (tmp_path / "o").exists()


def test_cli_run_bad_spec_says_one_sentence(tmp_path):
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("name: bad\nmodel: {kind: mlp}\ndata: {kind: digits}\n"
                         "training: {global_batch_size: 30, microbatch_size: 8, steps: 6}\n")
    p = subprocess.run([sys.executable, "-m", "api.cli", "run", str(spec_file), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "relaytrain: invalid job spec: training: training.global_batch_size (30) must be a multiple of "
        "training.microbatch_size (8)"]


def test_run_is_recorded_in_the_embedded_store(ray_session, tmp_path):
    from service.settings import Settings
    from service.store import Store

    spec = parse_spec({"name": "recorded", "model": {"kind": "mlp", "args": {"hidden": 16, "layers": 2}},
                       "data": {"kind": "digits"},
                       "training": {"global_batch_size": 32, "microbatch_size": 8, "steps": 3},
                       "parallelism": {"pp": 2}})
    run_job(spec=spec, out=str(tmp_path), progress=False)
    store = Store(Settings().db_url)
    rows, _ = store.list_jobs("local")
    job = next(r for r in rows if r["name"] == "recorded")
    assert job["state"] == "SUCCEEDED" and job["step"] == 3
    assert job["model_path"] == str((tmp_path / "model.pt").resolve())
    assert [m["step"] for m in store.get_metrics(job["id"])] == [1, 2, 3]


def test_fit_check_uses_the_autoscaling_ceiling(ray_session):
    from actors.launch import check_fits

    spec = parse_spec({"name": "big", "model": {"kind": "mlp"}, "data": {"kind": "digits"},
                       "training": {"global_batch_size": 64, "microbatch_size": 8, "steps": 1},
                       "parallelism": {"dp": 2, "pp": 6}})
    with pytest.raises(SpecError, match="needs 12 CPU slots .* but the cluster has 8"):
        check_fits(spec)
    check_fits(spec, max_cpus=16)  # an autoscaler can grow the cluster to 16: accepted
    with pytest.raises(SpecError, match="needs 12 CPU slots .* but the cluster has 10"):
        check_fits(spec, max_cpus=10)


def test_a_new_run_starts_its_output_files_anew_and_a_resume_continues_them(tmp_path):
    from actors.runner import _Outputs

    def run(append, steps):
        o = _Outputs(tmp_path, append=append)
        o.write(o.metrics, [{"step": s} for s in steps])
        o.event("finished", "done")
        o.close()
        return [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")]

    assert run(False, [1, 2, 3]) == [1, 2, 3]
    assert run(False, [1, 2]) == [1, 2]  # not the previous run's rows and then these
    assert run(True, [3, 4]) == [1, 2, 3, 4]
    assert len(open(tmp_path / "events.jsonl").readlines()) == 2
    # finished early at step 2 after going back to an older copy: the later rows go, the file is
    # replaced whole (no .part left), and rows written after it follow step 2
    o = _Outputs(tmp_path, append=True)
    o.end_at(2)
    o.write(o.metrics, [{"step": 2, "again": True}])
    o.close()
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [1, 2, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl", "metrics.jsonl"]


def test_a_multi_line_key_error_keeps_its_lines():
    """str(KeyError) is the repr of its key: a user's two-line message came out as one line with
    a literal backslash-n (found by a user trial)."""
    from actors.failures import _message

    said = "weird key 'a:b'\nsecond line: set foo.bar=3 to fix"
    assert _message(KeyError(said)) == said
    assert _message(KeyError("tok_embeddings")) == "'tok_embeddings'"  # a plain missing key, as Python shows it
    assert _message(ValueError(said)) == said


def test_a_model_no_node_can_hold_fails_before_its_workers_allocate_it(ray_session, tmp_path):
    """A built-in MLP of width 1,000,000 (4 TB of float32 parameters) failed in the workers'
    allocator ("DefaultCPUAllocator: can't allocate memory"); now the scheduler refuses it from
    the pre-flight's sizes, saying what to change."""
    spec = parse_spec({"name": "huge", "model": {"kind": "mlp", "args": {"hidden": 1_000_000, "layers": 2}},
                       "data": {"kind": "digits"}, "optimizer": {"name": "adam", "lr": 0.001},
                       "training": {"global_batch_size": 32, "microbatch_size": 8, "steps": 2},
                       "parallelism": {"dp": 1, "pp": 2}})
    t0 = time.monotonic()
    with pytest.raises(JobFailed) as e:
        run_job(spec=spec, out=str(tmp_path), progress=False, timeout=60)
    assert re.fullmatch(r"the model cannot fit on this cluster's nodes in shape 1x2: the worker holding layers \d-\d "
                        r"needs at least [\d,.]+ GiB for their parameters and gradients alone \(before optimizer state "
                        r"and activations\), and the largest node offers [\d,.]+ GiB \(Ray's memory resource\); raise "
                        r"parallelism.pp \(or tp\) to split the model over more workers, or make it smaller",
                        str(e.value)), str(e.value)
    assert time.monotonic() - t0 < 60


def test_restarts_max_restarts_a_fixed_shape_job_that_lost_a_worker(ray_session, tmp_path):
    """A worker's process killed mid-run (as an out-of-memory kill or a lost spot node would):
    the fixed-shape job keeps the live worker, starts one in place of the lost one, resumes
    from its newest checkpoint, and ends with the parameters of an uninterrupted run; the steps
    since the checkpoint run again."""
    import ray

    from tests.test_elastic import Job, check_result, events, final_params
    from tests.test_engine import assert_same_params

    spec = parse_spec({
        "name": "fixed-restart", "model": {"kind": "mlp", "args": {"in_features": 64, "hidden": 32, "layers": 3,
                                                                  "dtype": "float64"}},
        "data": {"kind": "digits"}, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "training": {"global_batch_size": 32, "microbatch_size": 8, "steps": 150, "seed": 4},
        "parallelism": {"dp": 1, "pp": 2},
        "checkpoint": {"every_steps": 5, "path": str(tmp_path / "ckpt"), "keep": 2},
        "restarts": {"max": 1},
    })
    job = Job(spec, tmp_path)
    job.wait_step(12)
    survivor = job.worker("w0.0")
    ray.kill(job.worker("w0.1"))
    deadline = time.monotonic() + 60
    while not [e for e in ray.get(job.sched.poll.remote(10**9, 0))["events"] if e["type"] == "restarted"]:
        assert time.monotonic() < deadline and job.thread.is_alive(), f"no restarted event: {job.error}"
        time.sleep(0.02)
    assert ray.get(survivor.ping.remote(), timeout=10)  # its process lives on: kept, not started again
    result = job.finish()
    assert job.error is None, job.error
    assert_same_params(final_params(tmp_path), check_result(result, spec))
    [restarted] = events(result, "restarted")
    # from the newest checkpoint written before the loss: due every 5 steps (one due while the
    # previous is still being written is taken at the next boundary after; its event says so)
    before = [e for e in result["events"][:result["events"].index(restarted)] if e["type"] == "checkpoint"]
    assert restarted["from_step"] == before[-1]["step"] >= 5 and before[-1]["asked_at"] % 5 == 0
    assert restarted["restart"] == 1
    assert re.fullmatch(r"worker w0\.1 at step \d+ died \(its process or node was lost\); restart 1 of 1 from the "
                        r"checkpoint of step \d+ \(\d+ committed steps? runs? again\); w0\.0 is kept and a new worker "
                        r"takes the place of w0\.1", restarted["message"]), restarted
    assert restarted["kept"] == ["w0.0"] and restarted["replaced"] == ["w0.1"]
    reruns = [m for m in result["metrics"] if m.get("rerun")]
    since = restarted["from_step"] + 1
    assert [m["step"] for m in reruns] == list(range(since, since + len(reruns)))
    first = [m for m in result["metrics"] if m["step"] == restarted["from_step"] + 1][-1]  # after the restart
    assert 0 < first["recovery_s"] < 60  # from the loss to its commit
    assert [e["type"] for e in result["events"]].count("resumed") == 1


def test_a_fixed_shape_job_that_cannot_be_placed_says_it_waits_and_what_is_free(ray_session):
    """Admitted against an autoscaler's ceiling, or while other jobs hold the CPUs, a fixed shape
    waits for its placement: a waiting event says so (GET /v1/jobs/{id}'s ``waiting``), and the
    failure after the start timeout counts the free CPUs, not only the cluster's."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from actors.failures import JobFailure
    from actors.workergroup import WorkerGroup

    total = int(ray.cluster_resources()["CPU"])
    hold = placement_group([{"CPU": total - 1}])  # another job's workers
    ray.get(hold.ready(), timeout=30)
    group = WorkerGroup("placing", user_spec(), [], timeout=30, start_timeout=5, detached=False, log=lambda o: None)
    said = []
    group.on_wait = said.append
    try:
        with pytest.raises(JobFailure) as failed:
            group._reserve(2, {"CPU": 1.0})
    finally:
        remove_placement_group(hold)
        group.teardown()
    free = rf"\d of the cluster's {total} CPUs free now"
    assert len(said) == 1 and re.fullmatch(rf"waiting for 2 worker slots of {{'CPU': 1.0}}: {free}; the job fails if "
                                           r"they are not placed within 5 s \(RELAYTRAIN_START_TIMEOUT_S\)", said[0])
    assert re.match(rf"could not place 2 workers of {{'CPU': 1.0}} within 5 s \({free}, 0 GPUs in all\); lower dp x pp "
                    "or the resources per worker, wait for the other jobs, or add nodes", str(failed.value))


def test_a_spec_folder_with_earlier_runs_outputs_ships_its_code_only_and_a_run_that_fails_early_ends_its_row(
        ray_session, tmp_path, monkeypatch):
    """A user trial: earlier runs' --out folders inside the spec's folder (their model shards
    are not *.pt) went into every job's code package until one was over Ray's 512 MiB, and that
    run died with Ray's traceback, its job left PENDING in the store (a server's reconcile later
    failed it as "the job's scheduler actor was lost")."""
    import shutil
    import zipfile
    from io import BytesIO

    import actors.runner
    from actors import launch
    from service import packages
    from service.settings import Settings
    from service.store import Store

    code = tmp_path / "code"
    shutil.copytree(os.path.join(FIXTURES, "userpkg"), code / "userpkg")
    for old in ("out_a", "runs/b"):  # two earlier runs' outputs, whatever their names
        (code / old / "model").mkdir(parents=True)
        for f in ("metrics.jsonl", "events.jsonl"):
            (code / old / f).write_text("{}\n")
        (code / old / "model" / "model-00001-of-00001.safetensors").write_bytes(b"x" * 1000)
    (code / "weights.safetensors").write_bytes(b"x" * 1000)
    assert packages.run_outputs(code) == ["out_a", "runs/b"]
    assert packages.gitignore_escaped("run[1]") == r"run\[1\]" and packages.gitignore_escaped("exp*") == r"exp\*"
    names = zipfile.ZipFile(BytesIO(packages.zip_folder(code))).namelist()
    assert "userpkg/models.py" in names and not any(n.startswith(("out_a/", "runs/")) or n.endswith(".safetensors")
                                                    for n in names), names
    spec = user_spec(name="early")
    env = launch.job_runtime_env(spec, str(code))
    assert {"/out_a", "/runs/b", "*.safetensors"} <= set(env["excludes"])

    def refused(*a, **k):
        raise RuntimeError("the cluster said no")

    monkeypatch.setattr(actors.runner.launch, "start_scheduler", refused)
    with pytest.raises(RuntimeError, match="the cluster said no"):
        run_job(spec=spec, spec_dir=str(code), out=str(tmp_path / "o"), progress=False)
    rows, _ = Store(Settings().db_url).list_jobs(limit=500)
    [row] = [r for r in rows if r["name"] == "early"]
    assert row["state"] == "FAILED" and row["error"] == "RuntimeError: the cluster said no", row
