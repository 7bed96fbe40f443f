"""The elastic planner's choices for a table of (alive slots, layers, B, microbatch size), without Ray."""
import pytest

from service.planner import LayerFacts, model_shape, plan

MB = 2**20
# six equal layers of 10 ms (forward + backward of one microbatch), 1 MiB of parameters each
EQUAL6 = LayerFacts([0.010] * 6, [MB] * 6, [0] * 6)
# whole model (6 x 1 MiB x (2 + 2 Adam slots) = 24 MiB) does not fit a 13 MiB worker; half of it does
HALF_FITS = 13 * MB


@pytest.mark.parametrize("slots, memory, preferred, current, expect, reason", [
    # no memory limit: pure data parallelism has no bubble, so it wins where M divides
    (4, None, (2, 2), None, (4, 1), "fastest modelled shape for 4 slots: 4x1"),
    # 3 slots, M = 8: dp = 3 does not divide the 8 microbatches; 1x3 beats 2x1
    (3, None, (2, 2), None, (1, 3), "fastest modelled shape for 3 slots: 1x3"),
    # the model needs two stages: the preferred 2x2 is also the fastest
    (4, HALF_FITS, (2, 2), None, (2, 2), "preferred shape 2x2 fits 4 slots"),
    (3, HALF_FITS, (2, 2), None, (1, 3), "fastest modelled shape for 3 slots: 1x3"),
    (2, HALF_FITS, (2, 2), None, (1, 2), "fastest modelled shape for 2 slots: 1x2"),
    # scale-up from 1x3 when a node joins: 2x2 is modelled 25% faster, above the 10% bar
    (4, HALF_FITS, (2, 2), (1, 3), (2, 2), "fastest modelled shape for 4 slots: 2x2"),
    # one more slot than 2x2 uses: nothing is 10% faster, so no reshape
    (5, HALF_FITS, (2, 2), (2, 2), (2, 2), "kept 2x2"),
    (8, HALF_FITS, (2, 2), (2, 2), (4, 2), "fastest modelled shape for 8 slots: 4x2"),
])
def test_plan_table(slots, memory, preferred, current, expect, reason):
    d = plan(slots, EQUAL6, 64, 8, preferred=preferred, current=current, memory_bytes=memory,
             transport="collective", max_workers=16)
    assert (d.shape.dp, d.shape.pp) == expect, d.reason
    assert d.reason.startswith(reason), d.reason
    # B and the microbatch size never change: every replica gets M / dp microbatches
    assert d.shape.dp * d.shape.microbatches_per_replica == 8
    assert sum(d.shape.sizes) == 6 and len(d.shape.sizes) == d.shape.pp


def test_below_min_workers_waits_with_the_reason():
    d = plan(1, EQUAL6, 64, 8, preferred=(2, 2), min_workers=2)
    assert d.wait and d.shape is None
    assert d.reason == "waiting for workers: 1 slot alive, the job needs at least elastic.min_workers=2"
    assert plan(0, EQUAL6, 64, 8, preferred=(1, 1)).wait


def test_no_shape_fits_memory_waits_and_says_how_much_is_needed():
    d = plan(2, EQUAL6, 64, 8, preferred=(1, 2), memory_bytes=8 * MB)
    assert d.wait
    assert d.reason == ("waiting for workers: no shape of at most 2 workers fits resources.memory_per_worker_mb=8 "
                        "(the smallest stage, of shape 1x2, needs 12 MB)")
    # one more slot and three stages of 8 MiB fit
    assert (plan(3, EQUAL6, 64, 8, preferred=(1, 2), memory_bytes=8 * MB).shape.pp) == 3


def test_max_workers_caps_the_shape():
    d = plan(16, EQUAL6, 64, 8, preferred=(1, 1), max_workers=2)
    assert d.shape.workers <= 2


def test_microbatches_must_divide_among_replicas():
    # B = 24, mbs = 8: three microbatches, so dp is 1 or 3 and never 2
    for slots in range(1, 8):
        d = plan(slots, EQUAL6, 24, 8, preferred=(1, 1))
        assert 3 % d.shape.dp == 0


def test_expensive_hops_favour_fewer_stages():
    big_acts = LayerFacts([0.002] * 4, [1000] * 4, [8 * MB] * 4)
    on_store = plan(2, big_acts, 16, 8, preferred=(1, 2), transport="object_store")
    assert (on_store.shape.dp, on_store.shape.pp) == (2, 1)


def test_balanced_partition_follows_layer_costs():
    facts = LayerFacts([0.03, 0.01, 0.01, 0.01], [0] * 4, [0] * 4)
    s = model_shape(facts, 1, 2, 8)
    assert s.sizes == (1, 3)
    assert model_shape(facts, 1, 2, 8, partition_rule="uniform").sizes == (2, 2)
    assert model_shape(facts, 1, 2, 8, partition_rule=[3, 1]).sizes == (3, 1)
    # 1F1B holds at most pp - stage microbatches of activations; GPipe all of them
    acts = LayerFacts([0.01] * 2, [0, 0], [100, 100])
    assert model_shape(acts, 1, 2, 8).memory_bytes == 200
    assert model_shape(acts, 1, 2, 8, schedule="gpipe").memory_bytes == 800


def test_decision_as_dict_is_plain_data():
    d = plan(4, EQUAL6, 64, 8, preferred=(2, 2), memory_bytes=HALF_FITS, transport="collective")
    assert d.as_dict() == {"wait": False, "reason": d.reason, "slots": 4, "dp": 2, "pp": 2, "partition": [3, 3],
                           "microbatches_per_replica": 4, "modelled_step_s": d.shape.step_s}
