"""The job controller one step at a time, without Ray: the real controller and elastic policy
over the scripted doubles of tests/util.py (a cluster of 1-slot nodes, a worker group whose
steps succeed or fail as queued).  What a user would read is checked: the job's state, its
error and its events."""
from __future__ import annotations

import threading
import time

import pytest

from actors.controller import JobController
from actors.record import JobRecord
from service import elastic_policy as policy
from service.spec import parse_spec
from tests.util import FakeCluster, FakeGroup, FakeKeeper, FakeReshaper, died, peer_error, user_error


def spec(steps=6, dp=2, pp=2, **elastic):
    return parse_spec({
        "name": "ctl", "model": {"kind": "mlp", "args": {"in_features": 64, "hidden": 128, "layers": 3}},
        "data": {"kind": "digits"}, "optimizer": {"name": "sgd", "lr": 0.1},
        "training": {"global_batch_size": 32, "microbatch_size": 8, "steps": steps},
        "parallelism": {"dp": dp, "pp": pp, "layer_costs_ms": [1, 10, 10, 1]},
        # the whole model (~0.5 MB with gradients and momentum-free SGD's slot) does not fit one worker: pp >= 2
        "resources": {"memory_per_worker_mb": 0.4},
        "elastic": {"enabled": True, "min_workers": 1, "max_workers": 4, **elastic},
    })


def controller(s, nodes=4):
    cluster = FakeCluster(nodes)
    group = FakeGroup(s, cluster)
    record = JobRecord("ctl-job", s.training.steps, None)
    ctl = JobController("ctl-job", s, [], record, group, FakeKeeper(), model_out={}, save_index=lambda index: None,
                        watch=cluster, reshaper=FakeReshaper)
    return ctl, group, cluster, record


def events(record, kind):
    return [e for e in record.events if e["type"] == kind]


def test_a_lost_worker_reshapes_and_every_step_commits_once():
    s = spec()
    ctl, group, cluster, record = controller(s)
    group.queue_step()
    group.queue_step()

    def crash():
        cluster.remove(group.node_of((1, 1)))
    group.queue_step({(1, 1): died(), (0, 1): peer_error(), (1, 0): peer_error()}, before=crash)
    ctl.run()
    assert record.state.value == "SUCCEEDED"
    assert group.steps_run == [1, 2, 3, 4, 5, 6]  # step 3 failed, was discarded and ran again
    [lost] = events(record, "worker_lost")
    assert lost["step"] == 3 and "worker w1.1 at step 3 died" in lost["message"]
    [reshape] = events(record, "reshape")
    assert reshape["old_shape"] == [2, 2] and reshape["new_shape"] in ([1, 3], [1, 2])
    assert reshape["steps_lost"] == 0 and reshape["step"] == 3


def test_below_min_workers_waits_then_fails_with_the_reason():
    s = spec(dp=1, pp=2, min_workers=2, wait_timeout_s=1.5)
    ctl, group, cluster, record = controller(s, nodes=2)
    group.queue_step()
    gone = []
    group.queue_step({(0, 1): died(), (0, 0): peer_error()},
                     before=lambda: cluster.remove(gone.append(group.node_of((0, 1))) or gone[0]))
    ctl.run()
    assert record.state.value == "FAILED"
    assert record.error.startswith("waiting for workers: 1 slot alive, the job needs at least "
                                   "elastic.min_workers=2; gave up after elastic.wait_timeout_s=1.5 s")
    [waiting] = events(record, "waiting")
    # what the survey saw: w0.0 kept, no slot free, the node that lost w0.1 left out
    assert (waiting["slots"], waiting["kept"], waiting["free"], waiting["held"]) == (1, 1, 0, [])
    assert waiting["excluded"] == [gone[0][:12]]
    assert events(record, "failed")[0]["message"] == record.error


def test_a_stuck_worker_is_stopped_for_its_slot_only_when_that_slot_lets_the_job_go_on():
    """Stage 1's node goes while stage 0's worker is stuck in its step (it answers; its step never
    ends).  With one node spare, the stuck worker's slot makes the two the job needs: it is stopped
    (a `released` event) and the job reshapes on the two.  With no node spare, its slot alone would
    not do: it is left as it is, and the job waits, saying it holds that slot, then fails."""
    s = spec(steps=4, dp=1, pp=2, min_workers=2, wait_timeout_s=1.5)
    for nodes, ends in ((3, "SUCCEEDED"), (2, "FAILED")):
        ctl, group, cluster, record = controller(s, nodes=nodes)
        group.queue_step()

        def crash():
            group.stuck.add((0, 0))
            cluster.remove(group.node_of((0, 1)))
        group.queue_step({(0, 1): died(), (0, 0): peer_error()}, before=crash)
        ctl.run()
        assert record.state.value == ends, (nodes, record.error)
        released = events(record, "released")
        if ends == "SUCCEEDED":
            assert [r["workers"] for r in released] == [["w0.0"]]
            assert released[0]["message"].startswith("stopped w0.0 (w0.0 still in the aborted step) to free its slots "
                                                     "for the reshape; ")
            assert group.steps_run == [1, 2, 3, 4] and events(record, "reshape")[0]["new_shape"] == [1, 2]
        else:
            assert released == [] and group.stuck == {(0, 0)}
            assert events(record, "waiting")[0]["held"] == ["w0.0"]
            assert record.error.startswith("waiting for workers: 0 slots alive, the job needs at least "
                                           "elastic.min_workers=2"), record.error


def test_a_process_lost_on_a_node_that_stays_up_is_replaced_there_rather_than_waited_out(monkeypatch):
    """A worker's process dies (killed for memory, say) on a node it had to itself, and the job
    needs every slot (min_workers = 2 on two nodes).  The node is suspect at first (no other
    worker there answered), so the job waits; once Ray still lists it alive after SUSPECT_S its
    free slot counts, and the job goes on in its shape there instead of failing at the timeout."""
    from actors import reshape

    monkeypatch.setattr(reshape, "SUSPECT_S", 1.0)
    s = spec(dp=1, pp=2, min_workers=2, wait_timeout_s=20)
    ctl, group, cluster, record = controller(s, nodes=2)
    group.queue_step()
    group.queue_step({(0, 1): died(), (0, 0): peer_error()}, before=lambda: group.killed.add((0, 1)))
    ctl.run()
    assert record.state.value == "SUCCEEDED", record.error
    assert group.steps_run == [1, 2, 3, 4, 5, 6]
    [waiting] = events(record, "waiting")
    assert (waiting["slots"], waiting["kept"], waiting["free"]) == (1, 1, 0)
    [reshape_event] = events(record, "reshape")
    assert reshape_event["old_shape"] == reshape_event["new_shape"] == [1, 2] and reshape_event["steps_lost"] == 0
    assert sorted(group.describe().values()) == ["node0", "node1"]


def test_what_a_waiting_job_waits_for_is_said_again_when_it_changes():
    s = spec(dp=1, pp=3, min_workers=3, wait_timeout_s=2.5)
    ctl, group, cluster, record = controller(s, nodes=1)
    threading.Timer(1.2, lambda: cluster.add("node8")).start()  # a node joins; still one short
    ctl.run()
    assert record.state.value == "FAILED"
    assert [(e["message"], e["slots"]) for e in events(record, "waiting")] == [
        ("waiting for workers: 1 slot alive, the job needs at least elastic.min_workers=3", 1),
        ("waiting for workers: 2 slots alive, the job needs at least elastic.min_workers=3", 2)]


def test_a_draining_node_is_left_at_the_next_boundary():
    s = spec(dp=1, pp=2)
    ctl, group, cluster, record = controller(s, nodes=3)
    group.queue_step()
    group.queue_step(before=lambda: cluster.draining.update({group.node_of((0, 1)): None}))
    ctl.run()
    assert record.state.value == "SUCCEEDED"
    assert group.steps_run == [1, 2, 3, 4, 5, 6]  # a planned move: no step failed
    [reshape] = events(record, "reshape")
    assert "draining" in reshape["reason"] and reshape["steps_lost"] == 0
    assert reshape["step"] == 3  # left at the boundary after step 2
    assert not events(record, "worker_lost")
    assert all(node not in cluster.draining for node in group.describe().values())


@pytest.mark.parametrize("exc, says", [
    (RuntimeError("peer review failed"), "raised RuntimeError: peer review failed"),
    (RuntimeError("gloo: Connection closed by peer"), "raised RuntimeError: gloo: Connection closed by peer"),
    (TimeoutError("the data server did not answer"), "raised TimeoutError: the data server did not answer"),
])
def test_a_user_error_fails_an_elastic_job_whatever_its_words(exc, says):
    """The user's exception is the user's: never taken for a lost peer, however it reads."""
    s = spec()
    ctl, group, cluster, record = controller(s)
    group.queue_step()
    group.queue_step({(0, 1): user_error(exc), (1, 1): peer_error(), (0, 0): peer_error()})
    ctl.run()
    assert record.state.value == "FAILED"
    assert record.error == f"worker w0.1 at step 2 {says}"
    assert not events(record, "reshape") and not events(record, "worker_lost")


def test_a_joining_node_grows_the_job_at_a_boundary():
    s = spec(dp=2, pp=2, steps=8, grow_payback_s=0)  # these modelled steps take milliseconds
    ctl, group, cluster, record = controller(s, nodes=2)
    group.queue_step()
    group.queue_step(before=lambda: (cluster.add("node8"), cluster.add("node9")))
    ctl.run()
    assert record.state.value == "SUCCEEDED" and group.steps_run == list(range(1, 9))
    [reshape] = events(record, "reshape")
    assert reshape["old_shape"] == [1, 2] and reshape["new_shape"] == [2, 2] and "joined" in reshape["reason"]


def test_free_slots_a_job_does_not_take_are_said_once():
    """A user trial: a job stayed at 1x3 beside a node that joined, with no word of why
    (its growth would not pay back elastic.grow_payback_s)."""
    s = spec(dp=2, pp=2, steps=8)  # grow_payback_s 5 s: these modelled steps take milliseconds
    ctl, group, cluster, record = controller(s, nodes=2)
    group.queue_step()
    group.queue_step(before=lambda: (cluster.add("node8"), cluster.add("node9")))
    ctl.run()
    assert record.state.value == "SUCCEEDED" and not events(record, "reshape")
    [declined] = events(record, "grow_declined")
    assert declined["free_slots"] == 2 and declined["message"].startswith("2 free worker slots not taken: growing to 2x2 "
                                                                          "would save ")
    assert declined["message"].endswith("less than elastic.grow_payback_s=5 s"), declined


def growth_spec(steps: int):
    """An elastic job whose best shape is 1x3 on 3 slots and 2x2 on 4 (growths are modelled to pay)."""
    d = spec(dp=2, pp=2, steps=steps, grow_payback_s=0).model_dump(mode="json")
    d["model"]["args"]["layers"], d["parallelism"]["layer_costs_ms"] = 5, [10] * 6
    d["resources"]["memory_per_worker_mb"] = 0.6
    return parse_spec(d)


def test_nodes_joining_a_moment_apart_grow_the_job_once_without_a_pause_for_a_start():
    """The second node joins while the worker for the first one starts: the job goes on
    training while the second's worker starts too, then reshapes once, onto both (it used to
    start the last worker with training paused, ~5 s)."""
    s = growth_spec(steps=8)
    ctl, group, cluster, record = controller(s, nodes=2)
    stored = []  # the metrics rows as the job store gets them (copies, at the moment they are written)

    class Sink:
        def write(self, metrics=(), **_):
            stored.extend(dict(r) for r in metrics)

    record.sink = Sink()
    group.queue_step(before=lambda: cluster.add("node8"))  # at the boundary after step 1: start one worker
    group.queue_step(before=lambda: cluster.add("node9"))  # it is up after step 2; by then node9 joined
    ctl.run()
    assert record.state.value == "SUCCEEDED" and group.steps_run == list(range(1, 9))
    assert group.started_joining == [(1, 0), (1, 1)]  # the second start carries the worker already up
    [reshape] = events(record, "reshape")
    assert reshape["old_shape"] == [1, 2] and reshape["new_shape"] == [2, 2]
    assert reshape["reason"].startswith("2 more worker slots joined")
    assert ctl.reshaper.started_in_foreground == [0]  # every worker of 2x2 was up before training paused
    assert reshape["paused_s"] < reshape["recovery_s"]  # trained on while its workers started
    # the store's row of the reshape's first step has its recovery_s (it was added after the row
    # was written, so REST's metrics lacked it: a user trial)
    [first] = [r for r in stored if r["step"] == reshape["step"]]
    assert first["recovery_s"] == reshape["recovery_s"]


def test_a_node_that_joins_while_workers_start_for_another_gets_its_worker_at_once():
    """A scale-up's nodes come seconds apart: the second node's worker starts as soon as it
    is seen, beside the first's (not once the first is up, a worker's start later), and the
    job grows once, onto both."""
    s = growth_spec(steps=10)
    ctl, group, cluster, record = controller(s, nodes=2)
    ctl.join_more_every_s = 0.0
    group.start_boundaries = 4  # a worker's start takes four steps here
    group.queue_step(before=lambda: cluster.add("node8"))  # at the boundary after step 1: start one worker
    group.queue_step(before=lambda: cluster.add("node9"))  # at the next: one more, while the first starts
    ctl.run()
    assert record.state.value == "SUCCEEDED" and group.steps_run == list(range(1, 11))
    assert group.started_joining == [(1, 0)] and group.added_joining == [1]
    [reshape] = events(record, "reshape")
    assert reshape["old_shape"] == [1, 2] and reshape["new_shape"] == [2, 2]
    assert reshape["reason"].startswith("2 more worker slots joined")
    # the first step of 2x2: both workers were up at the 4th boundary after the first's start (after step 5);
    # had the second started once the first was up, it would have been up after step 9
    assert reshape["step"] == 6


def test_a_view_of_the_cluster_from_before_a_growths_workers_started_starts_no_more():
    """The look for more slots reads the cluster watch's view of the last second: one taken
    before the growth's workers took their slots shows those slots free still, and must not
    start workers for them (they would wait for slots that do not exist, and fail the growth)."""
    s = growth_spec(steps=10)
    ctl, group, cluster, record = controller(s, nodes=2)
    ctl.join_more_every_s = 0.0
    group.start_boundaries = 4

    group.queue_step(before=lambda: cluster.add("node8"))  # the growth's worker starts for node8
    group.queue_step(before=lambda: setattr(cluster, "seen_at", time.time() - 5))  # the view is older than it
    ctl.run()
    assert record.state.value == "SUCCEEDED", (record.error, [e.get("detail") for e in record.events])
    assert group.started_joining == [(1, 0)] and group.added_joining == []
    [reshape] = events(record, "reshape")
    assert reshape["old_shape"] == [1, 2] and reshape["new_shape"] == [1, 3]


def test_a_draining_node_with_nowhere_to_go_trains_on_until_a_slot_frees_up():
    s = spec(dp=1, pp=2, steps=8)
    ctl, group, cluster, record = controller(s, nodes=2)
    ctl.drain_recheck_s = 0.0
    ctl.keeper.checkpoint_root = "s3://bucket/ckpt"  # a job that writes checkpoints writes one as it stays
    ctl.keeper.checkpoint_now = lambda step, spec, rec, job_id: f"s3://bucket/ckpt/{job_id}-step-{step}"
    group.queue_step(before=lambda: cluster.draining.update({group.node_of((0, 1)): None}))
    for _ in range(3):  # the job needs two workers (memory) and the only other node is its own
        group.queue_step()
    group.queue_step(before=lambda: cluster.add("node9"))
    ctl.run()
    assert record.state.value == "SUCCEEDED" and group.steps_run == list(range(1, 9))  # no step failed or waited
    [stay] = events(record, "draining_stay")
    assert stay["step"] == 1 and "no free slot to move its workers to" in stay["message"]
    assert stay["message"].endswith("training goes on there until a slot frees up or the node goes; "
                                    "checkpoint of step 1: s3://bucket/ckpt/ctl-job-step-1")
    [reshape] = events(record, "reshape")
    assert "draining" in reshape["reason"] and reshape["step"] == 6 and reshape["steps_lost"] == 0
    assert not events(record, "waiting") and not events(record, "worker_lost")
    assert "node1" not in group.describe().values()


def test_a_drained_node_that_goes_with_nowhere_to_move_fails_the_job_naming_the_drain():
    s = spec(dp=1, pp=2, steps=8, wait_timeout_s=1.0)
    ctl, group, cluster, record = controller(s, nodes=2)
    ctl.drain_recheck_s = 0.0
    group.queue_step(before=lambda: cluster.draining.update({"node1": None}))
    group.queue_step()

    def gone():
        cluster.remove("node1")
        cluster.draining.pop("node1")
    group.queue_step({(0, 1): died(), (0, 0): peer_error()}, before=gone)
    ctl.run()
    assert record.state.value == "FAILED" and group.steps_run == [1, 2]
    assert len(events(record, "draining_stay")) == 1
    assert record.error.startswith("waiting for workers: ")
    assert record.error.endswith("(the job had trained on node node1 after it announced it was draining: "
                                 "no other slot came free before it went)")


def test_cancel_ends_the_job_between_steps():
    s = spec()
    ctl, group, cluster, record = controller(s)
    group.queue_step(before=ctl.cancelled.set)
    ctl.run()
    assert record.state.value == "CANCELLED" and group.steps_run == [1]
    assert events(record, "cancelled")[0]["message"] == "job cancelled after 1 committed steps"


def test_finish_early_ends_after_the_step_under_way_and_writes_that_model():
    s = spec()
    ctl, group, cluster, record = controller(s)
    group.queue_step()
    group.queue_step(before=lambda: ctl.finish_early("alice"))  # asked while step 2 runs
    ctl.run()
    assert record.state.value == "SUCCEEDED" and group.steps_run == [1, 2]
    [done] = events(record, "finished")
    assert done["message"] == "job finished early, as alice asked: 2 of 6 steps, last loss 1"
    assert done["step"] == 2 and done["early"] is True and ctl.final["metadata"]["step"] == 2


def test_finish_asked_between_steps_runs_one_more_and_a_cancel_still_wins():
    s = spec()
    ctl, group, cluster, record = controller(s)
    ctl.finish_early("bob")  # before any step (as after a restart): one step, then the end
    ctl.run()
    assert record.state.value == "SUCCEEDED" and group.steps_run == [1]
    assert events(record, "finished")[0]["message"].startswith("job finished early, as bob asked: 1 of 6 steps")
    ctl, group, cluster, record = controller(s)
    group.queue_step(before=lambda: (ctl.finish_early("alice"), ctl.cancelled.set()))
    ctl.run()
    assert record.state.value == "CANCELLED" and group.steps_run == [1] and not events(record, "finished")


def test_a_finish_is_not_turned_into_a_preemption():
    s = spec()
    ctl, group, cluster, record = controller(s)
    group.queue_step(before=lambda: (ctl.preempt("another job"), ctl.finish_early("alice")))
    ctl.run()
    assert record.state.value == "SUCCEEDED" and group.steps_run == [1] and not events(record, "preempted")


def test_a_job_preempted_before_its_first_step_says_it_starts_again_from_step_0():
    """(It said "preempted after 0 committed steps (... to resume from its checkpoint)", with no
    checkpoint written: a user trial.)"""
    s = spec()
    ctl, group, cluster, record = controller(s)
    ctl.preempt("preempted: its 2 slots go to job b-1 of tenant bob; back in the queue at place 1, to resume "
                "from its checkpoint")
    ctl.run()
    [gone] = events(record, "preempted")
    assert record.state.value == "QUEUED" and group.steps_run == [], group.steps_run
    assert gone["message"] == ("preempted before its first step (preempted: its 2 slots go to job b-1 of tenant bob; "
                               "back in the queue at place 1); it starts from step 0 again when admitted")
    assert gone["step"] == 0 and gone["checkpoint"] is None


# ---------------------------------------------------------------- the policy alone, as a table

def facts():
    from service.planner import LayerFacts
    return LayerFacts([0.001, 0.01, 0.01, 0.001], [60_000, 60_000, 60_000, 2_000], [64, 64, 64, 40])


@pytest.mark.parametrize("sit, want", [
    (policy.Situation(kept=0, free=4, current=None), ("Reshape", (2, 2))),
    (policy.Situation(kept=3, free=0, current=None, forced=True), ("Reshape", None)),
    (policy.Situation(kept=4, free=0, current=(2, 2)), ("Keep", None)),
    (policy.Situation(kept=2, free=2, current=(1, 2)), ("Reshape", (2, 2))),
    (policy.Situation(kept=0, free=0, current=None, forced=True), ("Wait", None)),
    (policy.Situation(kept=0, free=0, current=None, forced=True, waited_s=99), ("Fail", None)),
])
def test_policy_table(sit, want):
    s = spec(min_workers=1, wait_timeout_s=10)
    d = policy.decide(sit, s, facts())
    assert type(d).__name__ == want[0], d
    if want[1]:
        assert (d.shape.dp, d.shape.pp) == want[1]
    if isinstance(d, policy.Fail):
        assert d.reason.endswith("gave up after elastic.wait_timeout_s=10 s")


def test_the_cluster_schedulers_allotment_caps_the_job():
    s = spec(min_workers=1)
    grow = policy.decide(policy.Situation(kept=2, free=2, current=(1, 2), cap=2), s, facts())
    assert isinstance(grow, policy.Keep) and grow.reason == "at the workers the cluster scheduler allots it"
    place = policy.decide(policy.Situation(kept=0, free=4, current=None, forced=True, cap=2), s, facts())
    assert place.shape.workers == 2  # 4 free, 2 allotted


def test_a_growth_must_pay_back_its_reshape():
    s = spec(min_workers=1)
    sit = dict(kept=2, free=2, current=(1, 2), step_s=0.050)
    few = policy.decide(policy.Situation(**sit, steps_left=10), s, facts())
    assert isinstance(few, policy.Keep) and "steps left, less than elastic.grow_payback_s=5 s" in few.reason
    many = policy.decide(policy.Situation(**sit, steps_left=100_000), s, facts())
    assert isinstance(many, policy.Reshape) and (many.shape.dp, many.shape.pp) == (2, 2)
    # the same steps left at a measured pace far from the model's: the gain scales with it (a user
    # trial's job kept its shape on a modelled gain 10x below the real one)
    modelled = policy.decide(policy.Situation(**sit, steps_left=200), s, facts())
    assert isinstance(modelled, policy.Keep), modelled
    slow = policy.decide(policy.Situation(**sit, steps_left=200, measured_s=0.050 * 1000), s, facts())
    assert isinstance(slow, policy.Reshape), slow


def test_a_node_that_lost_workers_counts_again_once_dead_or_still_alive_after_a_while():
    import time

    from actors.reshape import SUSPECT_S, Reshaper

    r = Reshaper(None, None, 1, set())
    now = time.monotonic()
    r._suspect = {"slow": now - SUSPECT_S - 1, "lost": now, "dead": now}
    assert r.suspect(alive={"slow", "lost"}) == {"lost"}  # "dead" is gone from the view anyway


def test_the_lost_worker_is_named_though_a_survivors_error_came_first():
    """The survivors' PeerLost comes back before the dead worker's own error (or without it): the
    event named a survivor ("worker w0.0 ... raised PeerLost") as the worker lost (user trial)."""
    s = spec()
    ctl, group, cluster, record = controller(s)
    group.queue_step()

    def crash():
        cluster.remove(group.node_of((1, 1)))
    group.queue_step({(0, 1): peer_error(), (1, 0): peer_error()}, before=crash)
    ctl.run()
    assert record.state.value == "SUCCEEDED"
    [lost] = events(record, "worker_lost")
    assert lost["message"].startswith("lost w1.1 during step 2 (the first error: worker w0.1 at step 2 raised "), lost
    assert lost["workers"] == ["w1.1"] and lost["message"].endswith("; reshaping")


def test_a_fixed_shape_job_that_loses_a_worker_says_what_would_have_kept_it_going():
    """A user who relied on restarts.max for spot nodes read only "died (its process or node
    was lost)" (user trial); restarts.max now covers a lost worker too (tests/test_failures_and_resume.py)."""
    from actors.failures import step_failure

    failure = step_failure({(1, 1): died(), (0, 1): peer_error()}, 1, "", elastic=False, t_error=0.0)
    assert str(failure).startswith("worker w1.1 at step 2 died"), str(failure)
    assert str(failure).endswith("; a fixed-shape job stops when a worker is lost: set elastic.enabled: true to go "
                                 "on with the workers left, or restarts.max (with checkpoint.every_steps) to restart "
                                 "it from its newest checkpoint")
    user = step_failure({(1, 1): user_error(ValueError("boom"))}, 1, "", elastic=False, t_error=0.0)
    assert "fixed-shape" not in str(user)  # a user's error is only that


@pytest.mark.parametrize("restarts, used, says", [
    ({"max": 0}, 0, "; a fixed-shape job stops when a worker is lost: set elastic.enabled: true to go on with the "
                    "workers left, or restarts.max (with checkpoint.every_steps) to restart it from its newest "
                    "checkpoint"),
    ({"max": 2}, 0, ", and there is no complete checkpoint to restart it from (none had been written yet)"),
    ({"max": 2}, 2, ", and its restarts are used up (2 of restarts.max 2)"),
])
def test_a_fixed_shape_job_that_lost_a_worker_and_cannot_restart_says_why(restarts, used, says, monkeypatch):
    monkeypatch.setattr("actors.controller.largest_node_memory", lambda: 2.0**40)  # (asks Ray)
    d = spec(dp=1, pp=2).model_dump(mode="json")
    d["elastic"]["enabled"], d["restarts"] = False, restarts
    d["checkpoint"] = {"every_steps": 10, "path": "ckpt"}  # (none written by the time the worker is lost)
    s = parse_spec(d)
    ctl, group, cluster, record = controller(s, nodes=2)
    ctl.restarts_used = used  # by the job's earlier schedulers
    group.queue_step()
    group.queue_step({(0, 1): died(), (0, 0): peer_error()})
    ctl.run()
    assert record.state.value == "FAILED" and not events(record, "restarted")
    assert record.error == "worker w0.1 at step 2 died (its process or node was lost)" + says


def test_a_lost_worker_is_named_by_its_cell_and_by_its_ray_actor_where_they_differ():
    """A user trial killed the process of `relaytrain:<job>:w0.3`, which held cell w0.2 after a
    reshape, and the event said "lost w0.2": the name `ray list actors` shows is said beside it."""
    from types import SimpleNamespace

    from actors.workergroup import WorkerGroup

    def handle(hex_id):
        return SimpleNamespace(_actor_id=SimpleNamespace(hex=lambda: hex_id))

    g = WorkerGroup.__new__(WorkerGroup)
    g.workers = {(0, 2): handle("aa"), (0, 1): handle("bb")}
    g.names = {"aa": "relaytrain:job-1:w0.3", "bb": "relaytrain:job-1:w0.1"}
    assert g.said((0, 2)) == "w0.2 (Ray actor relaytrain:job-1:w0.3)"
    assert g.said((0, 1)) == "w0.1"
