"""The cluster's sharing policy (service/fairshare.py) as tables: no Ray."""
from __future__ import annotations

import pytest

from service.fairshare import JobDemand, allocate


def job(id, tenant="a", order=0, lo=1, hi=None, running=0, **kw) -> JobDemand:
    """A job of ``lo`` workers (fixed), or elastic from ``lo`` to ``hi``."""
    return JobDemand(id=id, tenant=tenant, order=order, min_workers=lo, max_workers=hi or lo, running=running, **kw)


def table(capacity, jobs, weights=None, policy="elastic") -> dict:
    """job -> (workers, action)."""
    return {k: (a.workers, a.action) for k, a in allocate(capacity, jobs, weights, policy).items()}


# ---------------------------------------------------------------- admission and the queue

@pytest.mark.parametrize("policy", ["fifo", "fair", "elastic"])
def test_a_job_that_does_not_fit_is_queued_with_its_place_and_reason(policy):
    got = allocate(2, [job("a1", lo=2, running=2), job("b1", "b", order=1, lo=2), job("b2", "b", order=2, lo=1)],
                   policy=policy)
    assert (got["a1"].workers, got["a1"].action) == (2, "keep")
    assert (got["b1"].workers, got["b1"].action, got["b1"].position) == (0, "queue", 1)
    assert got["b1"].reason.startswith("waiting for 2 CPU slots (2 workers); 0 jobs ahead")
    assert (got["b2"].action, got["b2"].position) == ("queue", 2)
    assert "1 job ahead" in got["b2"].reason


def test_a_job_larger_than_its_tenants_share_says_it_waits_for_free_slots():
    """A user trial: alice (weight 2 of 3) queued a 4-slot job beside bob's elastic job grown to
    4 and read "tenant alice already uses 0 of its weighted share of 2.67", which does not say
    why bob's job kept its slots."""
    got = allocate(4, [job("b1", "b", order=0, lo=1, hi=4, running=4), job("a3", "a", order=1, lo=4)],
                   {"a": 2.0, "b": 1.0})
    assert (got["b1"].workers, got["a3"].workers) == (4, 0)
    assert got["a3"].reason == ("waiting for 4 CPU slots (4 workers); 0 jobs ahead; it needs more than tenant a's "
                                "weighted share of 2.67 slots, so other tenants' jobs do not shrink or give way for "
                                "it: it starts when 4 slots are free")


def test_the_second_job_is_admitted_when_the_first_ends():
    assert table(2, [job("b1", "b", order=1, lo=2)]) == {"b1": (2, "admit")}


def test_fifo_admits_in_arrival_order_and_nothing_passes_the_head():
    jobs = [job("a1", lo=3, running=3), job("a2", order=1, lo=2), job("b1", "b", order=2, lo=1)]
    assert table(4, jobs, policy="fifo") == {"a1": (3, "keep"), "a2": (0, "queue"), "b1": (0, "queue")}


def test_fair_admits_the_tenant_furthest_below_its_share_first():
    jobs = [job("a1", lo=2, running=2), job("a2", order=1, lo=2), job("b1", "b", order=2, lo=2)]
    assert table(4, jobs, policy="fair") == {"a1": (2, "keep"), "a2": (0, "queue"), "b1": (2, "admit")}
    # FIFO would have admitted a2, the earlier job
    assert table(4, jobs, policy="fifo")["a2"] == (2, "admit")


def test_priority_orders_a_tenants_own_jobs_only():
    jobs = [job("a1", order=0, lo=2), job("a2", order=1, lo=2, priority=5), job("b1", "b", order=2, lo=2)]
    got = table(4, jobs, policy="fair")
    assert got == {"a1": (0, "queue"), "a2": (2, "admit"), "b1": (2, "admit")}


def test_fifo_within_a_tenant_a_small_later_job_does_not_pass_the_head():
    jobs = [job("a0", lo=2, running=2), job("a1", order=1, lo=3), job("a2", order=2, lo=1)]
    assert table(4, jobs, policy="fair") == {"a0": (2, "keep"), "a1": (0, "queue"), "a2": (0, "queue")}


# ---------------------------------------------------------------- weighted shares

@pytest.mark.parametrize("weights,expect", [
    ({}, (3, 3)),
    ({"a": 2}, (4, 2)),
    ({"a": 1, "b": 5}, (1, 5)),
])
def test_elastic_jobs_split_the_slots_by_weight(weights, expect):
    jobs = [job("a1", "a", 0, 1, 6), job("b1", "b", 1, 1, 6)]
    got = table(6, jobs, weights)
    assert (got["a1"][0], got["b1"][0]) == expect


def test_a_tenant_without_work_leaves_its_share_to_the_others():
    got = table(6, [job("a1", "a", 0, 1, 6)], {"a": 1, "b": 5})
    assert got == {"a1": (6, "admit")}


def test_max_min_a_tenant_that_wants_less_than_its_share_gets_what_it_wants():
    jobs = [job("a1", "a", 0, 1, 1), job("b1", "b", 1, 1, 8)]
    assert table(6, jobs) == {"a1": (1, "admit"), "b1": (5, "admit")}


def test_growth_follows_usable_sizes():
    jobs = [job("a1", "a", 0, 1, 8, sizes=(1, 2, 4, 8)), job("b1", "b", 1, 1, 1)]
    assert table(6, jobs)["a1"] == (4, "admit")  # 5 would be free, but 4 is the largest shape it uses


def test_cpus_per_worker_count_as_slots():
    jobs = [job("a1", "a", 0, 1, 4, per_worker=2.0), job("b1", "b", 1, 1, 8)]
    got = table(8, jobs)
    assert got["a1"][0] * 2.0 == got["b1"][0] == 4


# ---------------------------------------------------------------- elastic jobs give way and take back

def test_an_elastic_job_shrinks_to_admit_another_tenants_job():
    got = allocate(4, [job("a1", "a", 0, 1, 4, running=4), job("b1", "b", 1, 2)])
    assert (got["a1"].workers, got["a1"].action) == (2, "shrink")
    assert got["a1"].reason == "shrink from 4 to 2 workers to give 2 slots to job b1 of tenant b"
    assert (got["b1"].workers, got["b1"].action) == (2, "admit")


def test_an_elastic_job_grows_back_when_slots_free_up():
    got = allocate(4, [job("a1", "a", 0, 1, 4, running=2)])
    assert (got["a1"].workers, got["a1"].action) == (4, "grow")
    assert got["a1"].reason.startswith("may grow from 2 to 4 workers")


def test_nothing_goes_below_min_workers():
    got = table(4, [job("a1", "a", 0, 3, 4, running=4), job("b1", "b", 1, 2)])
    assert got == {"a1": (4, "keep"), "b1": (0, "queue")}  # shrinking to 3 frees 1: not enough


def test_fixed_jobs_are_never_reshaped():
    got = table(4, [job("a1", "a", 0, 4, running=4), job("b1", "b", 1, 1, 4)])
    assert got == {"a1": (4, "keep"), "b1": (0, "queue")}


def test_rigid_fair_does_not_shrink_elastic_jobs():
    got = table(4, [job("a1", "a", 0, 1, 4, running=4), job("b1", "b", 1, 2)], policy="fair")
    assert got == {"a1": (4, "keep"), "b1": (0, "queue")}


def test_rigid_policies_give_an_elastic_job_its_preferred_shape():
    got = table(8, [job("a1", "a", 0, 1, 8, preferred=2)], policy="fair")
    assert got == {"a1": (2, "admit")}


# ---------------------------------------------------------------- preemption

def test_a_fixed_job_is_preempted_only_when_it_allows_it():
    jobs = [job("a1", "a", 0, 2, running=2, preemptible=True), job("a2", "a", 1, 2, running=2, preemptible=True),
            job("b1", "b", 2, 2)]
    got = allocate(4, jobs)
    assert (got["a2"].workers, got["a2"].action) == (0, "preempt")  # the newer of two equal victims
    assert got["a2"].reason.startswith("preempted: its 2 slots go to job b1 of tenant b; back in the queue")
    assert (got["a1"].workers, got["b1"].workers, got["b1"].action) == (2, 2, "admit")
    not_allowed = [job("a1", "a", 0, 2, running=2), job("a2", "a", 1, 2, running=2), job("b1", "b", 2, 2)]
    assert table(4, not_allowed)["a2"] == (2, "keep")


def test_a_tenant_is_never_emptied_for_a_poorer_one():
    """Preempting a's only job for b's would leave a with nothing and 2 slots idle: no better."""
    jobs = [job("a1", "a", 0, 4, running=4, preemptible=True), job("b1", "b", 1, 2)]
    assert table(4, jobs) == {"a1": (4, "keep"), "b1": (0, "queue")}
    # whatever the weights: without a1, tenant a would use nothing
    assert table(4, jobs, {"b": 4})["a1"] == (4, "keep")


def test_preemption_within_a_tenant_needs_a_higher_priority():
    low = [job("a1", "a", 0, 4, running=4, preemptible=True), job("a2", "a", 1, 2)]
    assert table(4, low)["a1"] == (4, "keep")
    high = [job("a1", "a", 0, 4, running=4, preemptible=True), job("a2", "a", 1, 2, priority=1)]
    assert table(4, high) == {"a1": (0, "preempt"), "a2": (2, "admit")}


def test_preemption_never_swaps_back_and_forth():
    """After b1 took a2's slots, a2 (now queued) may not take them back."""
    after = [job("a1", "a", 0, 2, running=2, preemptible=True), job("a2", "a", 1, 2, preemptible=True),
             job("b1", "b", 2, 2, running=2, preemptible=True)]
    assert table(4, after) == {"a1": (2, "keep"), "a2": (0, "queue"), "b1": (2, "keep")}


def test_fifo_never_preempts():
    jobs = [job("a1", "a", 0, 2, running=2, preemptible=True), job("a2", "a", 1, 2, running=2, preemptible=True),
            job("b1", "b", 2, 2)]
    assert table(4, jobs, policy="fifo") == {"a1": (2, "keep"), "a2": (2, "keep"), "b1": (0, "queue")}


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown queue policy 'lifo'; one of fifo, fair, elastic"):
        allocate(4, [], policy="lifo")


def test_an_admitted_job_with_no_workers_placed_shows_as_starting_not_using(tmp_path):
    """A user trial: an elastic job admitted against the autoscaler's ceiling, waiting for slots,
    showed USING 8 in `relaytrain cluster`, and its allotment's changes were written as "shrink
    from 8 to 4 workers" though no worker of it had started.  The fair shares still count its
    allotment as held (so it is not given away twice); the view and the events say what it is."""
    from api.cluster import ClusterScheduler, allotment_message
    from service.fairshare import Allocation
    from service.settings import Settings
    from service.states import JobState
    from service.store import Store
    from tests.test_api import small_spec

    settings = Settings(home=tmp_path)
    store = Store(settings.db_url)
    elastic = {"elastic": {"enabled": True, "min_workers": 2, "max_workers": 8}}
    store.create_job("runs", "alice", small_spec("runs", **elastic), state=JobState.RUNNING)
    store.update_job("runs", shape={"dp": 2, "pp": 2})
    store.create_job("waits", "alice", small_spec("waits", **elastic), state=JobState.PENDING)
    store.create_job("bobs", "bob", small_spec("bobs"), state=JobState.QUEUED)
    cs = ClusterScheduler(settings, store, {}, admit=lambda job, workers, resume: None)
    cs.allotted["waits"] = 8
    alice, bob = cs.view("alice")["tenants"]
    assert (alice["using"], alice["starting"], alice["running"], alice["queued"]) == (4, 8, 2, 0)
    assert (bob["using"], bob["starting"], bob["running"], bob["queued"]) == (0, 0, 0, 1)

    why = "shrink from 8 to 4 workers to give 4 slots to job bobs of tenant bob"
    a = Allocation(workers=4, action="shrink", reason=why)
    assert allotment_message(store.get_job("waits"), a) == (
        f"{why} (it has no workers placed yet: only its allotment changes, nothing stops)")
    assert allotment_message(store.get_job("runs"), a) == why


def test_the_tenants_weights_are_read_again_when_their_file_changes(tmp_path, caplog):
    """A weights file edited while the server runs: the cluster's view and its next decisions
    use the new weights (looked at once a second, or at once after SIGHUP's ``reread``); a file
    that no longer parses keeps the weights before, and the server's log says why."""
    import logging
    import time

    from api.cluster import ClusterScheduler
    from service.auth import Weights
    from service.settings import Settings
    from service.states import JobState
    from service.store import Store
    from tests.test_api import small_spec

    f = tmp_path / "weights.yaml"
    f.write_text("alice: 1\nbob: 1\n")
    tokens = "alice:" + "a" * 20 + ",bob:" + "b" * 24
    weights = Weights(tokens, None, "", f)
    settings = Settings(home=tmp_path)
    store = Store(settings.db_url)
    store.create_job("a1", "alice", small_spec("a1"), state=JobState.QUEUED)
    store.create_job("b1", "bob", small_spec("b1"), state=JobState.QUEUED)
    cs = ClusterScheduler(settings, store, weights.current, admit=lambda job, workers, resume: None)
    cs.capacity = 8.0
    shares = lambda: {t["tenant"]: (t["weight"], t["share"]) for t in cs.view("alice")["tenants"]}
    assert shares() == {"alice": (1.0, 4.0), "bob": (1.0, 4.0)}
    f.write_text("alice: 3\nbob: 1\n")
    weights.reread()  # SIGHUP
    assert shares() == {"alice": (3.0, 6.0), "bob": (1.0, 2.0)}
    with caplog.at_level(logging.WARNING, logger="uvicorn.error"):
        f.write_text("alice: [3\n")
        time.sleep(1.1)  # no signal: looked at again within a second
        assert shares() == {"alice": (3.0, 6.0), "bob": (1.0, 2.0)}
        assert "the tenants' weights changed but were not taken (weights file" in caplog.text
        assert "is not valid YAML" in caplog.text and "the weights before stay in force" in caplog.text
        f.write_text("alice: 1\nbob: 2\n")
        time.sleep(1.1)
        assert shares() == {"alice": (1.0, 2.667), "bob": (2.0, 5.333)}  # (the view rounds to 3 places)
        assert "tenants' weights read again: alice 1, bob 2 (before: alice 3, bob 1)" in caplog.text
