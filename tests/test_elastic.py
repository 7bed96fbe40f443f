"""Elasticity on a simulated multi-node cluster (ray.cluster_utils.Cluster): a head with no
CPUs and 1-CPU worker nodes.  Nodes are removed, added and drained while a job trains; the
job must finish with every step committed once and the parameters of a plain PyTorch run.

The model trains in float64 unless a test says otherwise: over hundreds of steps a float32
run of this deep ReLU MLP at lr 0.05 turns rounding noise (1e-8) into differences above the
1e-4 tolerance (one ReLU flipping amplifies it 30x in a step), whatever the engine does; a
plain 2x2 run and a 1x2 -> 2x2 run then disagree with the reference at different steps.  In
float64 both agree with it to 1e-14 over 400 steps, so the comparison checks the engine, not
luck."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from actors.runner import JobFailed, run_job
from service.spec import parse_spec
from tests import reference
from tests.conftest import FIXTURES, with_nodes
from tests.test_engine import assert_same_params

STEPS = 40
COSTS = [0.1, 10, 10, 10, 10, 10, 10, 0.1]  # the mlp's entries: a light input, 6 hidden layers, a light head
# the mlp with its ReLUs as entries of their own (no state: nothing to copy when they move)
SEPARATE = [0.1, 0.01] + [10, 0.01] * 6 + [0.1]
# tests/fixtures/userpkg/models.py:entries, as users write models: GELU, SiLU, ReLU, Tanh, a Dropout(0),
# an Unflatten and a Flatten as entries of their own between Linear and residual (LayerNorm) blocks
ENTRIES_MODEL = {"builder": "userpkg.models:entries", "args": {"in_features": 64, "width": 128, "dtype": "float64"}}
ENTRIES = [0.01, 10, 0.01, 10, 10, 0.01, 10, 0.01, 0.01, 0.01, 10, 0.01, 10, 0.01, 10, 0.1]


def elastic_spec(name, dp, pp, transport="collective", steps=STEPS, dtype="float64", model=None, costs=COSTS,
                 separate_activations=False, recipe=None, schedule="1f1b", **elastic):
    """``recipe``: {"schedule": ..., "grad_clip_norm": ...} (issue 16's training recipe)."""
    wide = {"float32": 1, "float64": 2}[dtype]
    recipe = recipe or {}
    return parse_spec({
        "name": name,
        # 6 hidden layers of 64 KiB (float32) between a light input and a light head; with momentum SGD a worker
        # needs ~3x its parameters
        "model": model or {"kind": "mlp", "args": {"in_features": 64, "hidden": 128, "layers": 7, "dtype": dtype,
                                                    "separate_activations": separate_activations}},
        "data": {"kind": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9,  # Adam magnifies summation-order noise (README)
                      **({"schedule": recipe["schedule"]} if "schedule" in recipe else {})},
        "training": {"global_batch_size": 64, "microbatch_size": 8, "steps": steps, "seed": 3,
                     **({"grad_clip_norm": recipe["grad_clip_norm"]} if "grad_clip_norm" in recipe else {})},
        # the planner's costs are declared, not profiled: its choices do not depend on a noisy CPU
        "parallelism": {"dp": dp, "pp": pp, "transport": transport, "schedule": schedule,
                        "layer_costs_ms": costs},
        # the whole model (~1.25 MB in float32 with gradients and momentum, twice that in float64) does not fit one
        # worker, half of it does:
        # every shape has at least two stages
        "resources": {"memory_per_worker_mb": 1.0 * wide},
        "elastic": {"enabled": True, "min_workers": 1, "max_workers": 4, **elastic},
    })


@pytest.fixture
def cluster(simulated_cluster):
    """The session's simulated cluster (tests/conftest.py); each test sets its nodes with with_nodes."""
    return simulated_cluster


_STARTED: list = []  # the Jobs of the running test (stopped after it: see below)


@pytest.fixture(autouse=True)
def stop_leftover_jobs():
    """A test that failed with its job still running (told to run 100,000 steps) left it holding
    the simulated cluster's slots for the next tests, and its thread connected Ray again while
    the cluster was shut down: each test's jobs are cancelled after it."""
    yield
    import ray

    while _STARTED:
        job = _STARTED.pop()
        if job.thread.is_alive():
            try:
                ray.get(job.sched.cancel.remote(), timeout=10)
            except Exception:
                pass
            job.thread.join(60)


class Job:
    """run_job in a thread, with a view of its scheduler for the test to act on."""

    def __init__(self, spec, tmp_path, spec_dir=None):
        self.spec, self.out, self.spec_dir = spec, str(tmp_path), spec_dir
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, daemon=True)
        _STARTED.append(self)
        self.thread.start()
        self.sched = self._find_scheduler()

    def _run(self):
        try:
            self.result = run_job(spec=self.spec, out=self.out, progress=False, timeout=60, record=False,
                                  spec_dir=self.spec_dir)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e

    def _find_scheduler(self):
        from actors import launch

        job_id = launch.wait_for_job(self.spec.name, 60)
        if job_id is None:
            raise AssertionError(f"no scheduler started (error: {self.error})")
        return launch.find_scheduler(job_id)

    def worker(self, cell: str):
        """The actor of ``cell`` ("w1.1") in the job's first shape."""
        import ray

        a = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith(f"relaytrain:{self.spec.name}-") and a["name"].endswith(f":{cell}"))
        return ray.get_actor(a["name"], namespace=a["namespace"])

    def poll(self):
        import ray

        return ray.get(self.sched.poll.remote(10**9, 10**9))

    def wait_step(self, k, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.thread.is_alive():
            p = self.poll()
            if p["step"] >= k and p["state"] == "RUNNING":
                return p
            time.sleep(0.05)
        raise AssertionError(f"the job did not reach step {k}: {self.error or self.result}")

    def finish(self, timeout=240):
        self.thread.join(timeout)
        if self.thread.is_alive():  # say where it hung: its events, with the survey's fields
            try:
                p = self.poll()
                said = [f"{e['type']}: {e['message']} " + str({k: v for k, v in e.items() if k not in
                                                                  ("type", "message", "time", "id")})
                        for e in p["events"]]
            except Exception as e:  # noqa: BLE001 - a hint only
                p, said = {"state": "?", "step": "?"}, [f"(its scheduler did not answer: {e!r})"]
            raise AssertionError(f"the job did not finish in {timeout} s: {p['state']} at step {p['step']}, "
                                 "events:\n" + "\n".join(said))
        final = self.result or (self.error.args[2] if len(getattr(self.error, "args", ())) > 2 else None)
        for e in (final or {}).get("events", []):  # shown when a test fails
            print(f"event {e['type']}: {e['message']}")
        return self.result

    def finish_after(self, done, more: int = 3, timeout: float = 120):
        """Once ``done(events)`` holds and ``more`` steps have committed since, tell the job to
        finish (it has run long enough for the test: it ends after its step under way, keeping
        its model); its result, which says it ended early."""
        import ray

        deadline = time.monotonic() + timeout
        while not done(evs := ray.get(self.sched.poll.remote(10**9, 0))["events"]):
            said = "\n".join(f"{e['type']}: {e['message']} " + str({k: v for k, v in e.items() if k not in
                                                                    ("type", "message", "time", "id")}) for e in evs)
            assert time.monotonic() < deadline and self.thread.is_alive(), \
                f"never happened: {self.error or self.result}; events:\n{said}"
            time.sleep(0.1)
        self.wait_step(self.poll()["step"] + more)
        ray.get(self.sched.finish_early.remote("the test"))
        result = self.finish()
        assert result is not None and events(result, "finished")[-1]["early"], self.error
        return result


def node_of(cluster, node_id):
    return next(n for n in cluster.worker_nodes if n.node_id == node_id)


def events(result, kind):
    found = [e for e in result["events"] if e["type"] == kind]
    for e in found:
        print(f"{kind}: {e['message']}")
    return found


def check_result(result, spec, search=(), microbatched=False, early=False):
    """``early``: the job was told to finish before its last step (``Job.finish_after``)."""
    steps = result["step"] if early else spec.training.steps
    rows = [m for m in result["metrics"] if not m.get("rerun")]
    assert [m["step"] for m in rows] == list(range(1, steps + 1))  # every step committed once
    want = reference.run(spec, steps, search=search, microbatched=microbatched)
    for m, loss, lr, norm in zip(rows, want["losses"], want["lr"], want["grad_norm"]):
        assert m["loss"] == pytest.approx(loss, rel=1e-4, abs=1e-6)
        assert m["lr"] == pytest.approx(lr, rel=1e-12) and m["grad_norm"] == pytest.approx(norm, rel=1e-4)
    return want["params"]


def final_params(tmp_path):
    import torch

    return torch.load(tmp_path / "model.pt")


def test_node_lost_mid_run_reshapes_and_equals_plain_pytorch(cluster, tmp_path):
    """A user's model with parameterless entries (activations, a reshape, a dropout of p = 0.1):
    the reshape 2x2 -> 1x3 moves stage boundaries, so workers take layers they did not hold.  In
    ZB-V: each worker holds two model chunks in a V, and the reshape moves every chunk.  The
    dropout masks follow (seed, step, microbatch, layer), so they are the one-process loop's
    across the reshape."""
    with_nodes(cluster, 4)
    # with the training recipe: a warm-up and cosine decay that follow the step count across the
    # reshape, and clipping that acts on most steps (the gradient norm's median here is 4.6)
    model = {**ENTRIES_MODEL, "args": {**ENTRIES_MODEL["args"], "dropout": 0.1}}
    spec = elastic_spec("lose-node", 2, 2, model=model, costs=ENTRIES, schedule="zbv",
                        recipe={"schedule": {"name": "cosine", "warmup_steps": 5, "min_lr": 0.005}, "grad_clip_norm": 3.0})
    job = Job(spec, tmp_path, spec_dir=FIXTURES)
    p = job.wait_step(10)
    assert (p["shape"]["dp"], p["shape"]["pp"]) == (2, 2)
    victim = p["shape"]["workers"]["w1.1"]
    cluster.remove_node(node_of(cluster, victim), allow_graceful=False)  # a crash: SIGKILL, no goodbye
    result = job.finish()
    assert job.error is None, job.error
    assert result["state"] == "SUCCEEDED"
    want = check_result(result, spec, search=[FIXTURES], microbatched=True)
    assert_same_params(final_params(tmp_path), want)
    [reshape] = events(result, "reshape")
    assert reshape["old_shape"] == [2, 2] and reshape["new_shape"] == [1, 3]
    assert reshape["steps_lost"] == 0 and reshape["recovery_s"] < 30
    assert "lost w1.1" in reshape["reason"]
    assert events(result, "worker_lost")


def test_a_lost_node_moves_the_cut_between_a_stash_and_its_pop(cluster, tmp_path):
    """A U-Net-like model whose two nested skips cross stages (relaytrain.skip), with a
    BatchNorm1d in its bottleneck: 1x3 loses a node and goes on at 1x2, where the stage
    boundaries, and so the ends of each portal and the BatchNorm's stage, are elsewhere.  Every
    step, and the BatchNorm's buffers (training.batch_norm: deferred), equal the one-process loop."""
    with_nodes(cluster, 3)
    unet = {"builder": "userpkg.models:unet", "args": {"dtype": "float64", "batch_norm": True}}  # skips 3 -> 8, 4 -> 7
    base = elastic_spec("unet-lose", 1, 3, model=unet, costs=[0.01, 0.1, 0.01, 10, 10, 10, 0.01, 10, 10, 0.1])
    d = base.model_dump(mode="json")
    d["resources"]["memory_per_worker_mb"] = 0.12  # the whole model does not fit one worker
    spec = parse_spec(d)
    job = Job(spec, tmp_path, spec_dir=FIXTURES)
    p = job.wait_step(5)
    assert (p["shape"]["dp"], p["shape"]["pp"]) == (1, 3)
    cluster.remove_node(node_of(cluster, p["shape"]["workers"]["w0.1"]), allow_graceful=False)
    result = job.finish()
    assert job.error is None, job.error
    got, want = final_params(tmp_path), check_result(result, spec, search=[FIXTURES], microbatched=True)
    assert_same_params(got, want)
    assert int(got["5.1.num_batches_tracked"]) == spec.training.steps  # one update a step, across the reshape
    [reshape] = events(result, "reshape")
    assert reshape["old_shape"] == [1, 3] and reshape["new_shape"] == [1, 2]
    # the peer copy of the newest step may still be in flight when the node dies (steps are ~30 ms
    # here): then that step runs again, as test_without_a_current_copy_... shows; never more
    assert reshape["steps_lost"] <= 1
    skips = [r["received_bytes"] for r in result["metrics"]]
    assert skips[0][2].get("skip") and skips[-1][1].get("skip")  # a portal into the last stage, both shapes


def test_a_lost_replica_under_global_batch_norm_reshapes_and_equals_plain_pytorch(cluster, tmp_path):
    """training.batch_norm: global at dp = 2: the replicas meet at every BatchNorm, forward and
    backward; one replica's node dies mid-step, the other's meeting fails and the step is
    discarded; the job goes on in a new shape.  Every step equals plain PyTorch on the whole
    batch, and so do the BatchNorm buffers."""
    with_nodes(cluster, 3)
    resnet = {"builder": "userpkg.models:resnet_bn", "args": {"dtype": "float64"}}
    d = elastic_spec("global-bn-lose", 2, 1, model=resnet, costs=[0.01, 0.01, 1, 10, 10, 0.01, 1, 0.1, 0.01, 0.1]
                     ).model_dump(mode="json")
    d["training"]["batch_norm"], d["parallelism"]["schedule"] = "global", "gpipe"
    spec = parse_spec(d)
    job = Job(spec, tmp_path, spec_dir=FIXTURES)
    p = job.wait_step(5)
    assert p["shape"]["dp"] == 2
    cluster.remove_node(node_of(cluster, p["shape"]["workers"]["w1.0"]), allow_graceful=False)
    result = job.finish()
    assert job.error is None, job.error
    assert result["state"] == "SUCCEEDED"
    got, want = final_params(tmp_path), check_result(result, spec, search=[FIXTURES])
    assert_same_params(got, want)
    assert int(got["3.bn1.num_batches_tracked"]) == spec.training.steps
    [reshape] = events(result, "reshape")
    assert reshape["steps_lost"] <= 1 and "lost w1.0" in reshape["reason"]


def test_node_added_mid_run_scales_up(cluster, tmp_path):
    import ray

    with_nodes(cluster, 2)
    # it trains until told to finish, 3 steps after it has grown onto both new nodes
    spec = elastic_spec("scale-up", 2, 2, transport="object_store", steps=100000, separate_activations=True,
                        costs=SEPARATE, schedule="zb_h1")  # the new workers take ReLU entries: built, not copied
    job = Job(spec, tmp_path)
    p = job.wait_step(5)
    assert (p["shape"]["dp"], p["shape"]["pp"]) == (1, 2)  # the preferred 2x2 does not fit 2 slots
    cluster.add_node(num_cpus=1)
    # the second node joins while the worker for the first starts (as nodes of a scale-up do)
    deadline = time.monotonic() + 30
    while not any(":joining-" in a["name"] for a in ray.util.list_named_actors(all_namespaces=True)):
        assert time.monotonic() < deadline, "no worker started for the node that joined"
        time.sleep(0.1)
    cluster.add_node(num_cpus=1)
    result = job.finish_after(lambda evs: any(e["type"] == "reshape" and e["new_shape"] == [2, 2] for e in evs))
    assert job.error is None, job.error
    assert_same_params(final_params(tmp_path), check_result(result, spec, early=True))
    reshapes = events(result, "reshape")
    assert reshapes[0]["old_shape"] == [1, 2] and reshapes[-1]["new_shape"] == [2, 2]
    for r in reshapes:  # (one reshape onto both, unless the first worker was up before the second node)
        assert "joined" in r["reason"] and r["steps_lost"] == 0
        # every new worker started in the background: training paused only for the reshape itself
        assert "start_s" not in r["phases_s"] and r["paused_s"] < r["recovery_s"], r


def test_shrink_then_grow_changes_pp_and_dp(cluster, tmp_path):
    with_nodes(cluster, 4)
    spec = elastic_spec("shrink-grow", 2, 2, steps=100000, schedule="interleaved_1f1b")  # 2 chunks per worker
    job = Job(spec, tmp_path)
    p = job.wait_step(8)
    cluster.remove_node(node_of(cluster, p["shape"]["workers"]["w0.0"]))  # graceful: SIGTERM
    job.wait_step(20)
    assert (job.poll()["shape"]["dp"], job.poll()["shape"]["pp"]) == (1, 3)
    cluster.add_node(num_cpus=1)
    result = job.finish_after(lambda evs: len([e for e in evs if e["type"] == "reshape"]) == 2)
    assert job.error is None, job.error
    assert_same_params(final_params(tmp_path), check_result(result, spec, early=True))
    shapes = [(tuple(e["old_shape"]), tuple(e["new_shape"])) for e in events(result, "reshape")]
    assert shapes == [((2, 2), (1, 3)), ((1, 3), (2, 2))]


def test_every_replica_of_a_stage_lost_restores_from_its_peer_copy(cluster, tmp_path):
    with_nodes(cluster, 4)
    spec = elastic_spec("lose-stage", 2, 2)
    job = Job(spec, tmp_path)
    p = job.wait_step(10)
    time.sleep(0.2)  # mid-run, not within the milliseconds after a commit while its copy is on its way
    for cell in ("w0.1", "w1.1"):  # both replicas of stage 1 at once
        cluster.remove_node(node_of(cluster, p["shape"]["workers"][cell]), allow_graceful=False)
    result = job.finish()
    assert job.error is None, job.error
    assert_same_params(final_params(tmp_path), check_result(result, spec))
    [reshape] = events(result, "reshape")
    assert reshape["new_shape"] == [1, 2]
    # the copy of step s is fetched while step s + 1 runs (step s + 2 waits for it): a stage lost
    # before it landed re-runs one step, and the event says so
    # ... kept by a worker of stage 0 (on another node), not by the scheduler
    assert reshape["restored_from"] == f"copy of step {reshape['step'] - 1} kept by peer workers"
    assert reshape["steps_lost"] in (0, 1)
    assert len([m for m in result["metrics"] if m.get("rerun")]) == reshape["steps_lost"]


def test_live_workers_that_stall_for_seconds_when_a_peer_goes_are_kept(cluster, tmp_path):
    """A loaded machine can leave a live process unscheduled for seconds.  Both replicas of
    stage 1 are stopped (SIGSTOP) for 3.5 s just as the node of a stage-0 worker goes: they
    answer no ping, but they are alive, and the job must carry on with their state (no copy
    taken, no step lost), not take them for lost with the dead one."""
    import ray

    with_nodes(cluster, 4)
    spec = elastic_spec("stalled", 2, 2)
    job = Job(spec, tmp_path)
    p = job.wait_step(10)
    stalled = [ray.get(job.worker(c).__ray_call__.remote(lambda actor: os.getpid())) for c in ("w0.1", "w1.1")]
    for pid in stalled:
        os.kill(pid, signal.SIGSTOP)
    try:
        cluster.remove_node(node_of(cluster, p["shape"]["workers"]["w0.0"]))  # graceful: the loss is seen at once
        time.sleep(3.5)
    finally:
        for pid in stalled:
            os.kill(pid, signal.SIGCONT)
    result = job.finish()
    assert job.error is None, job.error
    assert_same_params(final_params(tmp_path), check_result(result, spec))
    [reshape] = events(result, "reshape")
    assert reshape["reason"].startswith("lost w0.0 "), reshape["reason"]  # the stalled ones are not in it
    assert reshape["restored_from"] is None and reshape["steps_lost"] == 0
    assert reshape["new_shape"] == [1, 3]


def stick(job, cell: str) -> None:
    """The worker of ``cell`` gets stuck in its next forward: its step thread stays in the step
    after an abort, as one stuck in a collective does, while the actor answers."""
    import ray

    def stick_in_forward(actor) -> bool:  # (in the worker; nested, so Ray sends it by value)
        actor._worker.stage[0].register_forward_pre_hook(lambda module, args: time.sleep(600))
        return True

    assert ray.get(job.worker(cell).__ray_call__.remote(stick_in_forward))


def park(job, cell: str) -> None:
    """The worker of ``cell`` parks its next forward in a wait on its peers that never ends (as
    gloo leaves a send queued to a receiver that stopped reading: tests/test_gloo_abort.py), once."""
    import ray

    def park_in_forward(actor) -> bool:  # (in the worker; nested, so Ray sends it by value)
        from actors.failures import waiting_on_peers

        parked = []

        def hook(module, args):
            if not parked:
                parked.append(True)
                with waiting_on_peers():
                    time.sleep(600)

        actor._worker.stage[0].register_forward_pre_hook(hook)
        return True

    assert ray.get(job.worker(cell).__ray_call__.remote(park_in_forward))


def stage_1_lost_while_held(cluster, tmp_path, name: str, hold) -> tuple[dict, dict]:
    """A 1x2 job on three 1-CPU nodes (the model too big for one worker) whose stage-0 worker is
    held in its next forward by ``hold(job, "w0.0")`` when stage 1's node crashes; run until its
    reshape, and checked equal to the one-process loop.  (its progress before the loss, its result)"""
    with_nodes(cluster, 3)
    spec = elastic_spec(name, 1, 2, steps=100000, min_workers=2, max_workers=2, wait_timeout_s=60)
    job = Job(spec, tmp_path)
    p = job.wait_step(5)
    assert (p["shape"]["dp"], p["shape"]["pp"]) == (1, 2)
    hold(job, "w0.0")
    time.sleep(0.5)  # in its next step's first forward by now (a step takes ~30 ms)
    cluster.remove_node(node_of(cluster, p["shape"]["workers"]["w0.1"]), allow_graceful=False)
    result = job.finish_after(lambda evs: any(e["type"] == "reshape" for e in evs))
    assert job.error is None, job.error
    assert_same_params(final_params(tmp_path), check_result(result, spec, early=True))
    return p, result


def test_a_step_parked_in_a_wait_the_abort_cannot_end_is_given_up_on_and_its_worker_kept(cluster, tmp_path):
    """1x2 on three 1-CPU nodes: stage 0's worker is parked in a wait on its peers that the abort
    does not end when stage 1's node crashes.  1.5 s after the abort the worker gives up on that
    step and answers; the reshape keeps it, with its state, on its node and goes on at 1x2 with
    the free node: nothing released, no 10 s wait, equal to the one-process loop."""
    p, result = stage_1_lost_while_held(cluster, tmp_path, "parked", park)
    assert events(result, "released") == []
    [reshape] = events(result, "reshape")
    assert reshape["old_shape"] == [1, 2] and reshape["new_shape"] == [1, 2], reshape
    assert reshape["reason"].startswith("lost w0.1 "), reshape["reason"]
    assert reshape["phases_s"]["survey_s"] < 8.0, reshape  # not the 10 s that counts a worker stuck
    assert p["shape"]["workers"]["w0.0"] in events(result, "shape")[-1]["workers"].values()  # kept where it was


def test_a_worker_stuck_in_its_step_gives_its_state_and_slot_to_the_reshape(cluster, tmp_path):
    """1x2 on three 1-CPU nodes, the model too big for one worker: stage 0's worker is stuck in
    its step (it answers, its step never ends) when stage 1's node crashes.  The one free node is
    not enough; the stuck worker's slot is.  Its layers and its copy of stage 1 go to the
    scheduler, it is stopped, and the job goes on at 1x2 on the two nodes left, equal to the
    one-process loop; it waited for slots its own worker held before."""
    _, result = stage_1_lost_while_held(cluster, tmp_path, "stuck", stick)
    [released] = events(result, "released")
    assert released["workers"] == ["w0.0"] and "still in the aborted step" in released["message"]
    assert released["pieces"] > 0 and "first the scheduler took the state only it held of step" in released["message"]
    [reshape] = events(result, "reshape")
    assert reshape["old_shape"] == [1, 2] and reshape["new_shape"] == [1, 2]
    assert reshape["steps_lost"] <= 1  # the copy of the newest step may still have been in flight


def test_a_gpt_stage_whose_only_replica_is_lost_comes_back_from_its_peer_copy(cluster, tmp_path):
    """A layer list (the built-in GPT, its head tied to the embedding across the cut) at 1x2: the
    node of stage 1 goes, and stage 1 comes back on the spare node from the copy the stage-0 worker
    keeps of it; nothing of it went through the scheduler."""
    with_nodes(cluster, 3)
    spec = parse_spec({
        "name": "gpt-peer", "model": {"kind": "gpt", "args": {"vocab_size": 96, "seq_len": 16, "d_model": 32,
                                                               "n_heads": 4, "n_layers": 2, "dtype": "float64"}},
        "data": {"kind": "chars", "args": {"context": 16, "stride": 4}}, "loss": "cross_entropy",
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "training": {"global_batch_size": 16, "microbatch_size": 4, "steps": 30, "seed": 3},
        "parallelism": {"dp": 1, "pp": 2, "transport": "collective", "layer_costs_ms": [1, 10, 10, 1, 1]},
        "resources": {"memory_per_worker_mb": 1.1},  # 1.33 MB modelled whole (state + saved activations), 0.94 MB at pp 2: two stages
        "elastic": {"enabled": True, "min_workers": 2, "max_workers": 2}})
    job = Job(spec, tmp_path)
    p = job.wait_step(8)
    time.sleep(0.2)
    cluster.remove_node(node_of(cluster, p["shape"]["workers"]["w0.1"]), allow_graceful=False)
    result = job.finish()
    assert job.error is None, job.error
    want = check_result(result, spec)
    import torch

    got = final_params(tmp_path)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-9)
    assert torch.equal(got["0.tok.weight"], got["4.weight"])
    [reshape] = events(result, "reshape")
    assert reshape["old_shape"] == [1, 2] and reshape["new_shape"] == [1, 2]
    assert reshape["restored_from"] == f"copy of step {reshape['restored_from_step']} kept by peer workers"
    assert reshape["steps_lost"] in (0, 1)


def test_without_a_current_copy_the_steps_since_the_checkpoint_are_rerun(cluster, tmp_path):
    with_nodes(cluster, 2)
    ckpt = tmp_path / "ckpt"
    d = elastic_spec("lose-all-of-stage", 1, 2, steps=100000, snapshot_every_steps=0).model_dump(mode="json")
    d["checkpoint"] = {"every_steps": 8, "path": str(ckpt), "keep": 2}
    d["elastic"]["min_workers"] = 1
    spec = parse_spec(d)
    job = Job(spec, tmp_path)
    p = job.wait_step(12)
    cluster.add_node(num_cpus=1)
    cluster.remove_node(node_of(cluster, p["shape"]["workers"]["w0.1"]), allow_graceful=False)
    result = job.finish_after(lambda evs: any(e["type"] == "reshape" for e in evs))
    assert job.error is None, job.error
    assert_same_params(final_params(tmp_path), check_result(result, spec, early=True))
    [reshape] = events(result, "reshape")
    # no snapshots: the lost stage comes back from the newest checkpoint written before the loss,
    # and every stage goes back with it; the steps since then are re-run. Checkpoints are due
    # every 8 steps; one due while the previous is still being written is taken at the next
    # boundary after that ends (its event says which step asked), so the step need not be a
    # multiple of 8 on a loaded machine
    restored = reshape["restored_from_step"]
    before = [e for e in result["events"][:result["events"].index(reshape)] if e["type"] == "checkpoint"]
    assert before and before[-1]["asked_at"] % 8 == 0 and before[-1]["asked_at"] <= before[-1]["step"]
    assert reshape["restored_from"] == f"checkpoint {before[-1]['path']}" and restored == before[-1]["step"]
    assert reshape["step"] == restored + 1
    reruns = [m["step"] for m in result["metrics"] if m.get("rerun")]
    # (told to finish a few steps after the reshape, the job may end before its re-runs catch up)
    assert len(reruns) == min(reshape["steps_lost"], result["step"] - restored)
    assert reruns == list(range(restored + 1, restored + 1 + len(reruns)))


def test_a_fixed_shape_job_that_loses_a_node_restarts_on_another_and_keeps_its_live_worker(cluster, tmp_path):
    """A fixed shape (no elastic) with restarts.max: w0.1's node crashes; the job keeps w0.0 and
    its process, Ray places the lost bundle of the job's placement group on the spare node, a new
    worker takes it, and every worker goes back to the newest checkpoint."""
    import ray

    with_nodes(cluster, 3)
    d = elastic_spec("fixed-lose-node", 1, 2, steps=100000).model_dump(mode="json")
    d["elastic"]["enabled"] = False
    d["checkpoint"] = {"every_steps": 5, "path": str(tmp_path / "ckpt"), "keep": 2}
    d["restarts"] = {"max": 1}
    spec = parse_spec(d)
    job = Job(spec, tmp_path)
    p = job.wait_step(12)
    survivor, victim = job.worker("w0.0"), p["shape"]["workers"]["w0.1"]
    cluster.remove_node(node_of(cluster, victim), allow_graceful=False)
    result = job.finish_after(lambda evs: any(e["type"] == "resumed" for e in evs))
    assert job.error is None, job.error
    assert_same_params(final_params(tmp_path), check_result(result, spec, early=True))
    [restarted] = events(result, "restarted")
    assert restarted["kept"] == ["w0.0"] and restarted["replaced"] == ["w0.1"]
    assert "restart 1 of 1 from the checkpoint of step" in restarted["message"]
    shapes = events(result, "shape")
    assert shapes[-1]["workers"]["w0.1"] not in (victim, shapes[-1]["workers"]["w0.0"])  # on the spare node
    first = [m for m in result["metrics"] if m["step"] == restarted["from_step"] + 1][-1]
    assert 0 < first["recovery_s"] < 60
    for e in events(result, "worker_lost"):  # a new worker placed on the crashed node before Ray marked it dead
        assert e["message"].startswith("the restart's new worker w0.1 was lost while it started") and e["workers"] == ["w0.1"]
    with pytest.raises(ray.exceptions.RayActorError):  # the job's end stopped the kept worker: it was one process
        ray.get(survivor.ping.remote(), timeout=10)


def test_drained_node_is_left_before_its_deadline(cluster, tmp_path):
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2

    with_nodes(cluster, 3)
    spec = elastic_spec("drain", 1, 2)
    job = Job(spec, tmp_path)
    p = job.wait_step(5)
    victim = p["shape"]["workers"]["w0.1"]
    ok, msg = GcsClient(address=cluster.address).drain_node(
        victim, autoscaler_pb2.DRAIN_NODE_REASON_PREEMPTION, "test drain", int(time.time() * 1000) + 60_000)
    assert ok, msg
    result = job.finish()
    assert job.error is None, job.error
    assert_same_params(final_params(tmp_path), check_result(result, spec))
    [reshape] = events(result, "reshape")
    assert "draining" in reshape["reason"] and reshape["steps_lost"] == 0
    assert victim not in result["shape"]["workers"].values()
    assert not events(result, "worker_lost")  # a planned move, not a failure


def test_below_min_workers_waits_then_fails_with_the_reason(cluster, tmp_path):
    with_nodes(cluster, 2)
    d = elastic_spec("too-few", 1, 2, steps=400).model_dump(mode="json")
    d["elastic"].update(min_workers=2, wait_timeout_s=3)
    spec = parse_spec(d)
    job = Job(spec, tmp_path)
    p = job.wait_step(3)
    cluster.remove_node(node_of(cluster, p["shape"]["workers"]["w0.1"]))
    job.finish()
    assert isinstance(job.error, JobFailed)
    assert str(job.error).startswith("waiting for workers: 1 slot alive, the job needs at least "
                                     "elastic.min_workers=2; gave up after elastic.wait_timeout_s=3 s")


def test_a_lost_replica_of_a_replicated_stage_leaves_the_job_going_on_the_others(cluster, tmp_path):
    """``replicas: [1, 2, 1]`` on 4 nodes: the node of stage 1's second replica crashes mid-run.
    The job goes on at the next step boundary as 1x3 on the other three workers, each keeping
    the layers it held (no layer is copied, no step lost), and ends equal to plain PyTorch."""
    with_nodes(cluster, 4)
    spec = elastic_spec("lose-replica", 1, 3, min_gain=0.9)  # keep the spec's shape unless one is 1.9x faster
    d = spec.model_dump(mode="json")
    d["parallelism"].update(replicas=[1, 2, 1], partition=[3, 2, 3])
    spec = parse_spec(d)
    job = Job(spec, tmp_path)
    p = job.wait_step(10)
    assert p["shape"]["replicas"] == [1, 2, 1] and len(p["shape"]["workers"]) == 4
    victim = p["shape"]["workers"]["w0.2"]  # slot 2: stage 1, replica 1
    cluster.remove_node(node_of(cluster, victim), allow_graceful=False)
    result = job.finish()
    assert job.error is None, job.error
    assert result["state"] == "SUCCEEDED"
    assert_same_params(final_params(tmp_path), check_result(result, spec))
    [reshape] = events(result, "reshape")
    assert reshape["old_shape"] == [1, 3, [1, 2, 1]] and reshape["new_shape"] == [1, 3]
    assert reshape["steps_lost"] == 0 and reshape["layers_moved"] == 0
    assert "no state moves" in reshape["message"]


def test_a_tp_group_larger_than_any_node_is_refused(cluster):
    """4 nodes of 1 CPU hold 4 workers, but not a TP group of 2 on one node: refused before any
    actor starts, saying so (unless an autoscaler may add larger nodes)."""
    from actors import launch
    from service.spec import SpecError
    from tests.test_tensor_parallel import tp_spec

    with_nodes(cluster, 4)
    spec = tp_spec("unused.bin", 1, 2, 2)
    with pytest.raises(SpecError) as e:
        launch.check_fits(spec)
    assert "places each stage's 2 workers on one node" in str(e.value) and "largest node has 1 CPUs" in str(e.value)
    launch.check_fits(spec, max_cpus=64)  # an autoscaler's ceiling: nodes may come larger


def test_each_tp_group_is_placed_on_one_node(cluster, tmp_path, tmp_path_factory):
    """Two nodes of 2 CPUs: a (1, 2, 2) job's two TP groups each sit on one node (one placement
    bundle per group), and the job equals the one-process loop."""
    import numpy as np
    import torch

    from actors.runner import run_job
    from tests import reference
    from tests.test_large_models import assert_equal
    from tests.test_tensor_parallel import tp_spec

    with_nodes(cluster, 0)
    big = [cluster.add_node(num_cpus=2) for _ in range(2)]
    try:
        cluster.wait_for_nodes()
        path = tmp_path_factory.mktemp("tp-tokens") / "train.bin"
        np.random.default_rng(0).integers(0, 64, 16 * 17 * 12).astype(np.uint16).tofile(path)
        spec = tp_spec(str(path), 1, 2, 2, steps=2)
        final = run_job(spec=spec, out=str(tmp_path), progress=False)
        shape = events(final, "shape")[0]
        nodes = shape["workers"]
        assert nodes["w0.0"] == nodes["w0.1"] and nodes["w0.2"] == nodes["w0.3"], nodes
        want, _ = reference.train(spec)
        assert_equal(torch.load(tmp_path / "model.pt"), want)
    finally:
        for node in big:
            cluster.remove_node(node)


def tp_elastic_spec(tokens, name, dp, pp, steps, **elastic):
    """The built-in GPT split over TP groups of 2 (tests/test_tensor_parallel.py), elastic: the
    planner keeps tp = 2 and chooses dp x pp; its costs are declared (a pipeline pays)."""
    from tests.test_tensor_parallel import tp_spec

    d = tp_spec(tokens, dp, pp, 2, steps=steps).model_dump(mode="json")
    d["name"] = name
    d["parallelism"]["layer_costs_ms"] = [1, 10, 10, 1, 1]
    d["optimizer"] = {"name": "sgd", "lr": 0.05, "momentum": 0.9}  # Adam magnifies summation-order noise (README)
    d["elastic"] = {"enabled": True, "min_workers": 2, "max_workers": 4, "grow_payback_s": 0, **elastic}
    return parse_spec(d)


@pytest.fixture
def tp_nodes(cluster, tmp_path_factory):
    """Nodes of 2 CPUs (a TP group of 2 each) instead of the module's 1-CPU nodes, and a token file."""
    import numpy as np

    with_nodes(cluster, 0)
    added = []

    def add(n=1):
        for _ in range(n):
            added.append(cluster.add_node(num_cpus=2))
        cluster.wait_for_nodes()

    path = tmp_path_factory.mktemp("tp-tokens") / "train.bin"
    np.random.default_rng(0).integers(0, 64, 16 * 17 * 12).astype(np.uint16).tofile(path)
    yield add, str(path)
    for node in added:  # gracefully: gone at once (a crashed node is marked dead ~5 s later, which
        if node in cluster.worker_nodes:  # the next test's with_nodes would wait out)
            cluster.remove_node(node)


def check_tp_result(result, spec, tmp_path, early=False):
    import torch

    from tests.test_large_models import assert_equal

    steps = result["step"] if early else spec.training.steps
    rows = [m for m in result["metrics"] if not m.get("rerun")]
    assert [m["step"] for m in rows] == list(range(1, steps + 1))  # every step committed once
    want, losses = reference.train(spec, steps)
    assert [m["loss"] for m in rows] == pytest.approx(losses, rel=1e-9)
    assert_equal(torch.load(tmp_path / "model.pt"), want)
    assert all(m["tp"] == 2 for m in rows)


def test_a_tp_stage_whose_only_group_loses_its_node_comes_back_from_the_kept_slices(cluster, tp_nodes, tmp_path):
    """Elastic tensor parallelism, TP groups of 2 on 2-CPU nodes: a (1,2,2) job loses the node
    of stage 1's group.  It goes on at (1,1,2) on the other node, whose group keeps its own
    slices of stage 0 and takes stage 1's from the copies it kept of them (each rank its own
    rank's slices: shapes with the same tp split every layer alike).  Every step commits once
    and the result equals the one-process loop."""
    add, tokens = tp_nodes
    add(2)
    spec = tp_elastic_spec(tokens, "tp-lose-node", 1, 2, steps=40, min_gain=0.5)  # keeps the preferred 1x2x2
    job = Job(spec, tmp_path)
    p = job.wait_step(6)
    assert (p["shape"]["dp"], p["shape"]["pp"], p["shape"]["tp"]) == (1, 2, 2), p["shape"]
    workers = p["shape"]["workers"]
    assert workers["w0.0"] == workers["w0.1"] and workers["w0.2"] == workers["w0.3"] != workers["w0.0"]
    time.sleep(0.2)  # mid-step
    cluster.remove_node(node_of(cluster, workers["w0.2"]), allow_graceful=False)
    result = job.finish()
    assert job.error is None, job.error
    check_tp_result(result, spec, tmp_path)
    [lost] = events(result, "reshape")
    assert lost["old_shape"] == [1, 2] and lost["new_shape"] == [1, 1] and lost["tp"] == 2
    assert lost["message"].startswith("reshaped 1x2x2 (tp) -> 1x1x2 (tp) after lost w0.")
    assert lost["restored_from"] == f"copy of step {lost['restored_from_step']} kept by peer workers"
    assert lost["steps_lost"] in (0, 1)


def two_tp_groups(tp_nodes, tmp_path, name):
    """A (2,1,2) job on two 2-CPU nodes, told to run 100,000 steps (the test finishes it), at step 6."""
    add, tokens = tp_nodes
    add(2)
    spec = tp_elastic_spec(tokens, name, 2, 1, steps=100000)
    job = Job(spec, tmp_path)
    p = job.wait_step(6)
    assert (p["shape"]["dp"], p["shape"]["pp"], p["shape"]["tp"]) == (2, 1, 2), p["shape"]
    return job, spec


def test_a_tp_rank_lost_drops_its_replica_then_the_job_grows_back(cluster, tp_nodes, tmp_path):
    """A (2,1,2) job on two 2-CPU nodes loses one worker (TP rank 1 of replica 1): that replica's
    group is stopped whole and the job goes on at (1,1,2) with no state moved; once the broken
    group's slots are free again it grows back to (2,1,2), the new group taking every slice from
    the old one, rank by rank.  The result equals the one-process loop."""
    import ray

    # it grew back by step 23-38 in earlier runs (27 of 120 on 2026-11-27), each step after that
    # taking 0.36 s: it is told to finish 3 steps after it has grown back
    job, spec = two_tp_groups(tp_nodes, tmp_path, "tp-lose-rank")
    ray.kill(job.worker("w1.1"))
    result = job.finish_after(lambda evs: len([e for e in evs if e["type"] == "reshape"]) == 2, timeout=180)
    assert job.error is None, job.error
    check_tp_result(result, spec, tmp_path, early=True)
    # every TP group's placement group is gone once the job ends (the broken one's at the reshape)
    made = [pg for pg in ray.util.placement_group_table().values() if pg["name"].startswith(f"relaytrain:{spec.name}-")]
    assert len(made) == 3 and all(pg["state"] == "REMOVED" for pg in made), made
    lost, grow = events(result, "reshape")
    assert lost["old_shape"] == [2, 1] and lost["new_shape"] == [1, 1] and lost["steps_lost"] == 0
    assert lost["restored_from"] is None and "w1.1" in lost["reason"]
    assert grow["old_shape"] == [1, 1] and grow["new_shape"] == [2, 1] and grow["steps_lost"] == 0
    assert "joined" in grow["reason"]


def test_a_tp_group_with_a_stuck_rank_and_a_broken_group_give_their_slots_back(cluster, tp_nodes, tmp_path):
    """(2,1,2) on two 2-CPU nodes: TP rank 0 of replica 0 is stuck in its step (it answers, its
    step never ends) when replica 1 loses its rank 1.  No group is whole and no slot is free; the
    three live workers hold them.  Their slices go to the scheduler, rank by rank, they are
    stopped, and the job goes on on the slots they held, equal to the one-process loop."""
    import ray

    job, spec = two_tp_groups(tp_nodes, tmp_path, "tp-stuck")
    stick(job, "w0.0")
    time.sleep(0.5)
    ray.kill(job.worker("w1.1"))
    result = job.finish_after(lambda evs: any(e["type"] == "reshape" for e in evs), timeout=180)
    assert job.error is None, job.error
    check_tp_result(result, spec, tmp_path, early=True)
    [released] = events(result, "released")
    assert released["workers"] == ["w0.0", "w0.1", "w1.0"]
    assert "w0.0 still in the aborted step" in released["message"], released["message"]
    assert "w0.1 and w1.0 in a tensor-parallel group not whole any more" in released["message"]
    [reshape] = events(result, "reshape")
    assert reshape["old_shape"] == [2, 1] and reshape["steps_lost"] <= 1


def test_a_dead_schedulers_tp_group_placement_groups_are_released(cluster, tp_nodes):
    """An elastic TP job's placement groups are detached (one per TP group): when its scheduler
    dies without cleaning up, releasing the job's slots removes them all, and only them."""
    import ray
    from ray.util.placement_group import placement_group

    from actors import launch
    from service.names import tp_group_name

    add, _ = tp_nodes
    add(1)
    mine = [placement_group([{"CPU": 1}] * 2, strategy="STRICT_PACK", lifetime="detached",
                            name=tp_group_name("job-a", n)) for n in (1, 2)]
    other = placement_group([{"CPU": 0.01}], lifetime="detached", name=tp_group_name("job-b", 1))
    try:
        launch.release_placement_group("job-a")
        table = ray.util.placement_group_table()
        assert [table[pg.id.hex()]["state"] for pg in mine] == ["REMOVED", "REMOVED"]
        assert table[other.id.hex()]["state"] != "REMOVED"
    finally:
        ray.util.remove_placement_group(other)


def test_a_node_started_without_relaytrains_environment_still_runs_the_jobs_processes_as_it_asks(cluster, tmp_path):
    """A cluster with one node started without relaytrain's environment and label (someone
    else's `ray start`: Ray renices its workers to 15, Ray's get re-check, glibc's malloc): the
    job's scheduler sees the unlabelled node and passes the settings in a runtime_env
    (actors/nodeenv.py), so the worker placed there runs at the job's niceness with the get
    re-check and the malloc settings, as the one on a labelled node does."""
    from actors import launch
    from tests.test_priority import run_sampled

    with_nodes(cluster, 1)
    plain = cluster.add_node(num_cpus=1, labels={}, env_vars={
        "RAY_worker_niceness": "15", "RAY_get_check_signal_interval_milliseconds": "1000",
        "MALLOC_ARENA_MAX": "8", "GLIBC_TUNABLES": ""})
    try:
        cluster.wait_for_nodes()
        assert launch.job_process_env({}, 0) is not None  # not every node gives the settings
        name = f"plain-node-{os.getpid()}-{int(time.time())}"
        spec = parse_spec({
            "name": name, "model": {"kind": "mlp", "args": {"hidden": 16, "layers": 2}}, "data": {"kind": "digits"},
            "optimizer": {"name": "sgd", "lr": 0.05},
            "training": {"global_batch_size": 16, "microbatch_size": 8, "steps": 300, "seed": 1},
            "parallelism": {"dp": 1, "pp": 2}})
        done, actors, envs = run_sampled(spec, tmp_path)
        workers = {n: a for n, a in actors.items() if a["kind"] == "worker"}
        envs = {n: e for n, e in envs.items() if n in workers}
        assert done.get("state") == "SUCCEEDED", done
        placed = set(done["shape"]["workers"].values())
        assert plain.node_id in placed and len(placed) == 2, placed  # one worker on each node
        assert sorted(a["nice"] for a in workers.values()) == [0, 0], workers
        got = {n: (e.get("RAY_get_check_signal_interval_milliseconds"), e.get("MALLOC_ARENA_MAX"),
                   e.get("GLIBC_TUNABLES")) for n, e in envs.items()}
        assert list(got.values()) == [("100", "1", "glibc.malloc.tcache_count=0")] * 2, got
    finally:
        cluster.remove_node(plain)
