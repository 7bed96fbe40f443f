"""Shared fixtures: one local Ray for the whole session (ray.init costs seconds)."""
from __future__ import annotations

import os

import pytest

import tempfile

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# the embedded job store of `relaytrain run` and the server's data: a folder of this session
os.environ["RELAYTRAIN_HOME"] = tempfile.mkdtemp(prefix="relaytrain-home-")
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")

# S3 of the checkpoint tests (tests/s3server.py): AWS_ENDPOINT_URL names a free loopback port,
# where the `s3_server` fixture starts a moto server on first use, and the credentials are fake.
# Set now, before any Ray starts, so Ray's workers inherit them; always set, overriding any
# real AWS_* of the environment: tests never touch real storage.
from tests import s3server  # noqa: E402

s3server.configure_env()

# The tests' Rays start as relaytrain starts its own (actors/nodeenv.py): with what a job's
# processes need in their environment and the label that says so, so that jobs start their
# processes without a runtime_env.  Set now, before any Ray starts; tests/test_memory.py and
# tests/test_priority.py check what the processes got.
from actors import nodeenv  # noqa: E402

NODE_LABELS = nodeenv.prepare()


def restart_session_ray():
    """The session's local Ray: 8 logical CPU slots on this 2-core machine, so 2x2 and 1x4 fit."""
    import ray

    # metrics exported every 2 s, not Ray's 10: tests/test_metrics.py reads them back from the export
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING",
             namespace="relaytrain-tests", _system_config={"metrics_report_interval_ms": 2000}, labels=NODE_LABELS)
    return ray


# A crashed node's raylet refuses the GCS's health checks at once; by default the GCS marks it
# dead after 5 failed checks 3 s apart (about 15 s, what a real cluster does), and each test after
# a crash waited that long for its nodes.  The simulated cluster checks every second: a crashed
# node is marked dead about 5 s after it went.  That is still after a reshape has placed the job's
# new workers (measured in test_node_lost_mid_run_reshapes_and_equals_plain_pytorch: the loss seen
# 0.55 s after the crash, the new shape's first step committed at 1.13 s, the node marked dead at
# 4.34 s; a loss that surfaces as ActorUnavailableError takes 1.5-3.5 s), so the reshape still
# places while Ray lists the lost node alive, as on a real cluster (actors/reshape.py, "suspect"
# nodes); a live node answers within the default 10 s timeout as before.
FAST_NODE_DEATH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 5}


_SIMULATED = {"cluster": None, "was_up": False}
SIMULATED = "simulated_cluster"  # the fixture's name: its tests run first, on one cluster (below)


@pytest.fixture
def simulated_cluster():
    """A ray.cluster_utils.Cluster (a head with no CPUs, and the nodes the tests add) in place
    of the session's local Ray, shared by every module that uses it; ``pytest_runtest_teardown``
    shuts it down after the last of their tests, and the session's Ray comes back if it was up.
    Its tests run first (``pytest_collection_modifyitems``), so that neither Ray starts twice
    (a ray.init costs ~2 s here, a Cluster ~5 s)."""
    import ray
    from ray.cluster_utils import Cluster

    class Labelled(Cluster):  # every node it starts, as relaytrain's own (above)
        def add_node(self, wait: bool = True, **node_args):
            return super().add_node(wait, **{"labels": NODE_LABELS, **node_args})

    if _SIMULATED["cluster"] is None:
        _SIMULATED["was_up"] = ray.is_initialized()
        if _SIMULATED["was_up"]:
            ray.shutdown()
        c = Labelled(initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": FAST_NODE_DEATH})
        c.wait_for_nodes()
        ray.init(address=c.address, logging_level="WARNING", namespace="relaytrain-tests")
        _SIMULATED["cluster"] = c
    return _SIMULATED["cluster"]


def _stop_simulated_cluster() -> None:
    import ray

    c, _SIMULATED["cluster"] = _SIMULATED["cluster"], None
    if c is None:
        return
    ray.shutdown()
    c.shutdown()
    if _SIMULATED["was_up"]:
        restart_session_ray()


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: SIMULATED not in getattr(item, "fixturenames", ()))  # stable: their order kept


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the test's own fixtures first (they may remove nodes)
    if _SIMULATED["cluster"] is not None and (nextitem is None or SIMULATED not in nextitem.fixturenames):
        _stop_simulated_cluster()
    elif nextitem is not None and nextitem.module is not item.module:  # its module's fixtures are gone too
        _free_the_session_rays_slots(item)


def _free_the_session_rays_slots(item, wait_s: float = 30.0) -> None:
    """Between two modules, every CPU slot of the session's Ray is free again: a job a module's
    tests (or its server) left running held 2 of the 8 slots through the rest of one run, and four
    tests of other modules that need free slots failed after waiting for them (2026-12-01).  What
    still holds slots after ``wait_s`` is named on the terminal, with the module that left it,
    and then stopped, so that it costs that module's run and no other's."""
    import time

    import ray

    if not ray.is_initialized():
        return
    total = ray.cluster_resources().get("CPU", 0)

    def free_within(seconds: float) -> float:
        deadline = time.monotonic() + seconds
        while ray.available_resources().get("CPU", 0) < total and time.monotonic() < deadline:
            time.sleep(0.25)
        return ray.available_resources().get("CPU", 0)

    free = free_within(wait_s)
    if free >= total:
        return
    # (Ray's state API needs the dashboard, which the session's Ray does not run: its GCS tables)
    actors = {k: v for k, v in ray._private.state.actors().items()
              if v.get("State") == "ALIVE"
              and (v.get("ActorClassName") or "").rsplit(".", 1)[-1] in ("JobScheduler", "StageWorker")}
    groups = {k: v for k, v in ray.util.placement_group_table().items() if v.get("state") != "REMOVED"}
    said = (f"!!! {item.module.__name__} left {total - free:g} of the session Ray's {total:g} CPU slots held "
            f"{wait_s:.0f} s after its last test: actors {[(v['ActorClassName'], v.get('Name')) for v in actors.values()]}, "
            f"placement groups {[v.get('name') for v in groups.values()]}; stopping them !!!")
    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(said)
    worker = ray._private.worker.global_worker
    for actor_id in actors:
        try:
            worker.core_worker.kill_actor(ray.ActorID.from_hex(actor_id), True)
        except Exception:  # noqa: BLE001 - gone meanwhile
            pass
    from ray.util.placement_group import PlacementGroup

    for pg_id in groups:
        try:
            ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
        except Exception:  # noqa: BLE001
            pass
    free_within(15)


def with_nodes(cluster, n):
    """Exactly ``n`` alive 1-CPU worker nodes in the simulated cluster, known to Ray."""
    import time

    import ray

    alive = {x["NodeID"] for x in ray.nodes() if x["Alive"]}
    for node in [x for x in cluster.worker_nodes if x.node_id not in alive]:  # e.g. a drained node that exited
        cluster.worker_nodes.discard(node)
        node.kill_all_processes(check_alive=False, allow_graceful=False)
    workers = [node for node in cluster.worker_nodes]
    while len(workers) < n:
        workers.append(cluster.add_node(num_cpus=1))
    for node in workers[n:]:
        cluster.remove_node(node)  # gracefully: gone at once (a crashed node is marked dead ~5 s later)
    deadline = time.monotonic() + 40  # a crashed node is marked dead ~5 s after it went (FAST_NODE_DEATH)
    while sum(1 for x in ray.nodes() if x["Alive"]) != n + 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    cluster.wait_for_nodes()
    deadline = time.monotonic() + 30
    while ray.cluster_resources().get("CPU", 0) != n and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.cluster_resources().get("CPU", 0) == n


@pytest.fixture(scope="session")
def ray_session():
    import ray

    restart_session_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def s3_server():
    """The session's moto server, on the endpoint AWS_ENDPOINT_URL names (started on first use)."""
    server = s3server.MotoServer(s3server.configure_env()).start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A fresh, empty bucket of the session's moto server: ``"s3://<bucket>"``."""
    return f"s3://{s3_server.create_bucket()}"


@pytest.fixture
def s3_auth_server():
    """A moto server of its own that checks credentials against its IAM, once set up:
    ``(server, bucket, keys)``, keys as :meth:`s3server.MotoServer.require_auth` gives them."""
    server = s3server.MotoServer().start()
    try:
        bucket = server.create_bucket()
        keys = server.require_auth()
        yield server, bucket, keys
    finally:
        server.stop()
