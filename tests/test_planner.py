"""The elastic planner's choices for a table of (alive slots, layers, B, microbatch size), without Ray."""
import dataclasses

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


# ---------------------------------------------------------------- every schedule's step and memory

from fractions import Fraction  # noqa: E402

from service import schedules  # noqa: E402
from service.planner import hop_seconds  # noqa: E402

# eight equal layers of 10 ms, 1 MiB of parameters and 100 bytes of activations each
EQUAL8 = LayerFacts([0.010] * 8, [MB] * 8, [100] * 8)
HOP = hop_seconds("collective", 100)


def units(schedule, pp, m, chunks=1):
    """The plan's makespan in units of one microbatch's forward + backward on one worker."""
    return float(Fraction(schedules.simulate(schedules.build(schedule, pp, m, chunks)).makespan) / 3)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_closed_form_is_what_the_simulation_gives(schedule):
    for pp in range(1, 5):
        for m in range(1, 7):
            plan = schedules.build(schedule, pp, m)
            assert schedules.simulate(plan).makespan == 3 * (m + pp - 1)
            want = [m] * pp if schedule == "gpipe" else [min(m, pp - i) for i in range(pp)]
            assert list(schedules.peak_in_flight(plan)) == want


def test_zb_h1_models_a_shorter_step_than_1f1b_at_the_same_memory():
    one = model_shape(EQUAL8, 1, 4, 8)
    zb = model_shape(EQUAL8, 1, 4, 8, schedule="zb_h1")
    assert one.step_s == pytest.approx((8 + 4 - 1) * (0.020 + 2 * HOP))  # the formula of old, unchanged
    assert zb.step_s == pytest.approx(units("zb_h1", 4, 8) * (0.020 + 2 * HOP))
    assert zb.step_s < one.step_s * 0.9  # the W fill most of 1F1B's bubble
    assert zb.memory_bytes == one.memory_bytes
    assert (zb.chunks, zb.placement, zb.sizes) == (1, "loop", (2, 2, 2, 2))


def test_where_workers_send_input_gradients_early_the_step_is_the_early_plans():
    """Every chunk with parameters holds a plain Linear: the workers send each input gradient
    before the weight gradients (actors/stage.py sends_early), and the planner times the plan
    as they run it: 1F1B at pp = 2, M = 8 takes 26/3 units (1/13 of it idle), not 9 (1/9)."""
    linear = dataclasses.replace(EQUAL8, linear_work=[(1.0, 1.0)] * 8)
    slot = 0.040 + HOP
    assert model_shape(EQUAL8, 1, 2, 8).step_s == pytest.approx(9 * slot)  # not known: the textbook plan
    assert model_shape(linear, 1, 2, 8).step_s == pytest.approx(26 / 3 * slot)
    early = schedules.simulate(schedules.sends_early(schedules.build("1f1b", 2, 8)))
    assert early.makespan == 26 and early.bubble == Fraction(1, 13)
    # the same order and the same activations held
    assert model_shape(linear, 1, 2, 8).memory_bytes == model_shape(EQUAL8, 1, 2, 8).memory_bytes
    # GPipe and interleaved too; ZB-H1 splits its backward anyway: unchanged
    for schedule, chunks in (("gpipe", 1), ("interleaved_1f1b", 2)):
        assert model_shape(linear, 1, 2, 8, schedule=schedule, chunks=chunks).step_s \
            < model_shape(EQUAL8, 1, 2, 8, schedule=schedule, chunks=chunks).step_s
    assert model_shape(linear, 1, 2, 8, schedule="zb_h1").step_s == model_shape(EQUAL8, 1, 2, 8, schedule="zb_h1").step_s
    # a chunk whose parameters sit in no plain Linear (layers 4-7 here) computes all its
    # gradients in one backward: the textbook plan
    half = dataclasses.replace(EQUAL8, linear_work=[(1.0, 1.0)] * 4 + [(0.0, 1.0)] * 4)
    assert model_shape(half, 1, 2, 8).step_s == pytest.approx(9 * slot)
    # ... and so does one whose Linears hold under 90% of its weight-gradient work (a Conv2d
    # stack before a Linear head: the convolutions' kernels are applied at every position), as
    # the workers weigh it (actors/deferred.py covered); 90% and over sends early
    for share, early in ((0.85, False), (0.9, True)):
        mixed = dataclasses.replace(EQUAL8, linear_work=[(1.0, 1.0)] * 4 + [(share, 1.0)] * 4)
        assert mixed.early([(0, 4), (4, 8)]) is early
        assert (model_shape(mixed, 1, 2, 8).step_s < 9 * slot - 1e-9) is early
    # ... unless those layers hold no parameters (activations, reshapes)
    stateless = dataclasses.replace(half, param_bytes=[MB] * 4 + [0] * 4, linear_work=[(1.0, 1.0)] * 4 + [(0.0, 0.0)] * 4)
    assert model_shape(stateless, 1, 2, 8, partition_rule=[5, 3]).step_s < model_shape(half, 1, 2, 8, partition_rule=[5, 3]).step_s
    # tensor parallelism, replicated stages, and the gradient sum during a GPU's backward: no early sends
    assert model_shape(linear, 1, 2, 8, tp=2).step_s == pytest.approx(model_shape(EQUAL8, 1, 2, 8, tp=2).step_s)
    gpu = dataclasses.replace(linear, gpu=True)
    assert model_shape(gpu, 1, 2, 8).step_s == pytest.approx(26 / 3 * slot)  # dp = 1: nothing to sum
    dp2 = model_shape(gpu, 2, 2, 16)
    assert dp2.step_s == pytest.approx(model_shape(EQUAL8, 2, 2, 16).step_s)


def test_where_only_the_last_backward_sends_early_the_step_is_that_plans():
    """Chunks whose weights are (nearly) not in plain Linears (under ``schedules.FEW_LINEARS`` of
    their weight-gradient work: F.linear layers, convolutions) split only each worker's last
    backward of the step (actors/stage.py _check_early), and the planner times that plan: 1F1B
    at pp = 2, M = 8 takes 26/3 units, as with every send early; at pp = 4, 32/3 against 11.
    Not with activation checkpointing (the workers keep that backward whole), nor where any chunk's
    Linears hold 10% or more (their own products follow the send: the textbook plan)."""
    none = dataclasses.replace(EQUAL8, linear_work=[(0.0, 1.0)] * 8)
    slot = 0.040 + HOP
    assert none.last_early([(0, 4), (4, 8)]) and not none.early([(0, 4), (4, 8)])
    assert model_shape(none, 1, 2, 8).step_s == pytest.approx(26 / 3 * slot)
    assert model_shape(none, 1, 4, 8).step_s == pytest.approx(32 / 33 * model_shape(EQUAL8, 1, 4, 8).step_s)
    assert model_shape(none, 1, 2, 8, schedule="gpipe").step_s == model_shape(EQUAL8, 1, 2, 8, schedule="gpipe").step_s
    assert model_shape(none, 1, 2, 8, schedule="zb_h1").step_s == model_shape(EQUAL8, 1, 2, 8, schedule="zb_h1").step_s
    checkpointed = dataclasses.replace(none, checkpointing=True)
    assert not checkpointed.last_early([(0, 4), (4, 8)])
    some = dataclasses.replace(EQUAL8, linear_work=[(0.0, 1.0)] * 4 + [(0.1, 1.0)] * 4)
    assert not some.last_early([(0, 4), (4, 8)]) and not some.early([(0, 4), (4, 8)])
    assert model_shape(some, 1, 2, 8).step_s == pytest.approx(9 * slot)
    assert not EQUAL8.last_early([(0, 4), (4, 8)])  # not known: the textbook plan


def test_the_traced_facts_say_which_layers_hold_a_plain_linear():
    from actors.layerfacts import learn
    from service.spec import parse_spec

    spec = {"name": "lin", "model": {"kind": "mlp", "args": {"in_features": 64, "hidden": 32, "layers": 3,
                                                             "separate_activations": True}},
            "data": {"kind": "digits"}, "training": {"global_batch_size": 16, "microbatch_size": 8, "steps": 1},
            "parallelism": {"pp": 2}}
    facts = learn(parse_spec(spec), []).facts
    # Linear, ReLU, Linear, ReLU, Linear, ReLU, Linear: the activations hold no Linear (nor parameters)
    # each Linear's weight gradient is its 2 x rows x elements multiply-adds, its bias rows x width
    assert [mine == total > 0 for mine, total in facts.linear_work] == [True, False] * 3 + [True]
    assert facts.linear_work[0] == (2 * 8 * 64 * 32 + 8 * 32,) * 2  # microbatches of 8 rows
    assert facts.early([(0, 3), (3, 7)])
    bf16 = learn(parse_spec({**spec, "training": {**spec["training"], "precision": "bf16"}}), []).facts
    assert bf16.linear_work is None and not bf16.early([(0, 3), (3, 7)])
    # resources.gpus_per_worker unset: the scheduler says whether the cluster gave its workers GPUs; on GPUs
    # at dp > 1 the gradient sum starts during the backward, so the textbook plan is timed
    assert not facts.gpu and facts.early([(0, 3), (3, 7)], dp=2)
    on_gpus = learn(parse_spec(spec), [], gpu=True).facts
    assert on_gpus.gpu and not on_gpus.early([(0, 3), (3, 7)], dp=2) and on_gpus.early([(0, 3), (3, 7)], dp=1)
    told = {**spec, "resources": {"gpus_per_worker": 1}}
    assert learn(parse_spec(told), []).facts.gpu and not learn(parse_spec(told), [], gpu=False).facts.gpu
    # a layer that holds an nn.Linear for its weight and calls F.linear itself does not count: its
    # weight gradient is computed in the backward, before the send (as actors/stage.py finds too)
    from tests.conftest import FIXTURES

    functional = {**spec, "model": {"builder": "userpkg.models:functional_linears", "args": {"layers": 4}}}
    facts = learn(parse_spec(functional), [FIXTURES]).facts
    # Linear, 4 x FunctionalLinear, Linear: the middle layers' Linears never run their own forward
    assert [mine == total > 0 for mine, total in facts.linear_work] == [True] + [False] * 4 + [True]
    assert all(mine == 0 < total for mine, total in facts.linear_work[1:5])
    assert not facts.early([(0, 1), (1, 5), (5, 6)])  # the middle chunk's weights wait for nothing
    # two convolutions before a Linear head holding 93% of the chunk's weights: its Linears hold a
    # fifth of the chunk's weight-gradient work (a kernel runs at every position), as the workers
    # weigh it (tests/test_schedules_engine.py, the same model and cut), so 1F1B is the textbook plan
    convs = {**spec, "model": {"builder": "userpkg.models:convs_and_a_linear_head", "args": {}},
             "training": {**spec["training"], "microbatch_size": 16, "global_batch_size": 64}}
    facts = learn(parse_spec(convs), [FIXTURES]).facts
    mine, total = (sum(w[k] for w in facts.linear_work[3:10]) for k in (0, 1))
    assert 0.1 < mine / total < 0.3, facts.linear_work
    assert not facts.early([(0, 3), (3, 10)])


def test_interleaved_divides_the_bubble_by_v_and_pays_more_hops():
    one = model_shape(EQUAL8, 1, 4, 8)
    inter = model_shape(EQUAL8, 1, 4, 8, schedule="interleaved_1f1b", chunks=2)
    assert inter.sizes == (1,) * 8 and inter.chunks == 2 and inter.placement == "loop"
    assert inter.ranges(1) == [(1, 2), (5, 6)] and inter.layers_of(3) == {3, 7}
    # every chunk boundary crosses workers: 4 hops per microbatch on a middle worker, not 2
    assert inter.step_s == pytest.approx(units("interleaved_1f1b", 4, 8, 2) * (0.020 + 4 * HOP))
    assert units("interleaved_1f1b", 4, 8, 2) < 8 + (4 - 1) / 2 + 0.5 < units("1f1b", 4, 8)
    assert inter.step_s < one.step_s
    # with dear hops the extra boundaries cost more than the smaller bubble saves
    dear = LayerFacts([0.002] * 8, [0] * 8, [4 * MB] * 8)
    assert (model_shape(dear, 1, 4, 8, schedule="interleaved_1f1b", chunks=2, transport="object_store").step_s
            > model_shape(dear, 1, 4, 8, transport="object_store").step_s)


def test_zbv_places_chunks_in_a_v_and_turns_without_a_hop():
    zbv = model_shape(EQUAL8, 1, 2, 8, schedule="zbv", chunks=2)
    assert zbv.placement == "v" and zbv.sizes == (2, 2, 2, 2)
    assert zbv.ranges(0) == [(0, 2), (6, 8)] and zbv.ranges(1) == [(2, 4), (4, 6)]
    # worker 1 holds chunks 1 and 2: the turn between them is local, so 2 hops each, not 3
    assert zbv.step_s == pytest.approx(units("zbv", 2, 8, 2) * (0.040 + 2 * HOP))
    inter = model_shape(EQUAL8, 1, 2, 8, schedule="interleaved_1f1b", chunks=2)
    assert inter.step_s == pytest.approx(units("interleaved_1f1b", 2, 8, 2) * (0.040 + 3 * HOP))
    assert zbv.step_s < model_shape(EQUAL8, 1, 2, 8).step_s
    with pytest.raises(ValueError, match="zbv places 2 model chunks"):
        model_shape(EQUAL8, 1, 2, 8, schedule="zbv")
    with pytest.raises(ValueError, match="1f1b places 1 model chunk"):
        model_shape(EQUAL8, 1, 2, 8, chunks=2)


@pytest.mark.parametrize("schedule, pp, chunks", [
    ("gpipe", 4, 1), ("1f1b", 4, 1), ("zb_h1", 4, 1), ("interleaved_1f1b", 4, 2), ("interleaved_1f1b", 2, 4),
    ("zbv", 4, 2), ("zbv", 2, 2)])
def test_memory_is_the_plans_peak_of_held_activations(schedule, pp, chunks):
    # parameters: 1 MiB a layer x (2 + 2 Adam slots); activations: 100 bytes a layer and microbatch
    facts = LayerFacts([0.01] * 8, [MB] * 8, [100] * 8)
    s = model_shape(facts, 1, pp, 8, schedule=schedule, chunks=chunks)
    built = schedules.build(schedule, pp, 8, chunks)
    held = schedules.peak_in_flight(built)  # (chunk, microbatch) pairs: chunk-sized parts of the worker's share
    assert [float(f) for f in schedules.peak_activation_fraction(built)] == pytest.approx([h / chunks for h in held])
    share = 8 // pp  # layers per worker
    assert s.memory_bytes == max(share * MB * 4 + -(-h * share * 100 // chunks) for h in held)
    if schedule == "gpipe":
        assert s.memory_bytes == share * MB * 4 + 8 * share * 100
    elif schedule == "1f1b":
        assert s.memory_bytes == share * MB * 4 + pp * share * 100


def test_plan_passes_chunks_and_needs_a_layer_per_virtual_stage():
    d = plan(4, EQUAL6, 64, 8, preferred=(1, 2), schedule="interleaved_1f1b", chunks=2)
    assert d.shape.chunks == 2 and len(d.shape.sizes) == 2 * d.shape.pp and sum(d.shape.sizes) == 6
    assert all(s.pp * 2 <= 6 for s in d.considered)
    assert max(s.pp for s in d.considered) == 3  # 4 workers x 2 chunks would need 8 layers
    d = plan(4, EQUAL6, 64, 8, preferred=(2, 2), schedule="zbv", chunks=2, memory_bytes=HALF_FITS)
    assert d.shape.placement == "v" and d.shape.pp >= 2
    with pytest.raises(ValueError, match="zbv places 2 model chunks"):
        plan(4, EQUAL6, 64, 8, preferred=(2, 2), schedule="zbv")


def test_a_portal_between_workers_costs_a_hop_and_the_poppers_memory():
    """A skip of 1 MiB from layer 0 to layer 3: across workers at pp = 2 (one more hop on
    each end, the popper holds it), inside one worker at pp = 1 (free)."""
    from service.planner import LayerFacts, model_shape

    plain = LayerFacts([0.01] * 4, [1000] * 4, [4096] * 4)
    skip = LayerFacts([0.01] * 4, [1000] * 4, [4096] * 4, skips=[(0, 3, 2**20)])
    two, two_skip = (model_shape(f, 1, 2, 4, partition_rule=[2, 2]) for f in (plain, skip))
    assert two_skip.step_s > two.step_s
    # 1F1B: the last worker holds one microbatch at a time, and with it one skip tensor
    assert 2**20 < two_skip.memory_bytes <= 2**20 + two.memory_bytes
    one, one_skip = (model_shape(f, 1, 1, 4) for f in (plain, skip))
    assert one_skip.step_s == one.step_s and one_skip.memory_bytes == one.memory_bytes


@pytest.mark.parametrize("gathers, units", [
    ((), 8 + 4 - 1),                       # plain GPipe: m + pp - 1
    ((0,), 8 + (8 + 3 - 1)),               # stage 0 gathers: it, then stages 1-3 as a pipeline
    ((2,), (8 + 2 - 1) + 8 + 8),           # stages 0-1, then 2 alone, then 3 alone
    ((0, 1, 2, 3), 4 * 8),                 # every stage gathers: no overlap at all
])
def test_global_batch_norm_cuts_gpipe_into_segments_that_run_one_after_another(gathers, units):
    """training.batch_norm: global: a stage holding a BatchNorm (one layer per stage here) sends
    nothing on until all m microbatches reached it, forward and backward."""
    from service.planner import gathered_units

    facts = LayerFacts([0.01] * 4, [1000] * 4, [4096] * 4, gathers=frozenset(gathers))
    shape = model_shape(facts, 1, 4, 8, schedule="gpipe")
    assert gathered_units(8, [i in gathers for i in range(4)]) == units
    assert shape.step_s == pytest.approx(units * (0.01 + 2 * hop_seconds("collective", 4096)), rel=1e-9)


def test_an_elastic_tp_job_keeps_its_tp_and_plans_dp_x_pp_over_whole_groups():
    """With parallelism.tp every shape keeps the job's tp: dp x pp x tp workers over the slots
    (which count whole TP groups: actors/cluster.py), the preferred and the current shape named
    with their tp; fewer slots than one group wait, saying why."""
    d = plan(8, EQUAL6, 64, 8, preferred=(1, 2, 2), memory_bytes=HALF_FITS, tp=2, transport="collective")
    assert d.shape.tp == 2 and d.shape.workers % 2 == 0 and d.shape.workers <= 8
    # a TP rank holds half of a stage, so the whole model fits one group (without TP it needs 2 stages: 4x2)
    assert d.reason.startswith("fastest modelled shape for 8 slots: 4x1x2 (tp)"), d.reason
    one = plan(2, EQUAL6, 64, 8, preferred=(1, 2, 2), memory_bytes=HALF_FITS, tp=2)
    assert (one.shape.dp, one.shape.pp, one.shape.tp) == (1, 1, 2)
    # 5 slots hold 2 groups: at most 4 workers
    assert plan(5, EQUAL6, 64, 8, preferred=(1, 1, 2), tp=2).shape.workers == 4
    kept = plan(4, EQUAL6, 64, 8, preferred=(1, 2, 2), current=(1, 2, 2), tp=2, min_gain=5.0)
    assert kept.shape.key == (1, 2, 2) and kept.reason.startswith("kept 1x2x2 (tp)")
    wait = plan(1, EQUAL6, 64, 8, preferred=(1, 1, 2), tp=2)
    assert wait.wait and wait.reason == ("waiting for workers: 1 slot alive in whole tensor-parallel groups, the job "
                                         "needs a group of parallelism.tp=2 workers on one node")


def test_free_slots_count_whole_tp_groups_per_node():
    from actors.cluster import NodeView

    view = NodeView(alive={"a", "b", "c"}, draining={}, free={"a": {"CPU": 3.0}, "b": {"CPU": 1.0}, "c": {"CPU": 2.0}},
                    time=0.0)
    assert view.free_slots(1.0, 0.0) == 6
    assert view.free_slots(1.0, 0.0, group=2) == 4  # a: one group (and a CPU left over), b: none, c: one
    assert view.free_slots(1.0, 0.0, exclude={"c"}, group=2) == 2


def test_a_stage_whose_parameters_and_gradients_exceed_every_node_is_refused_saying_what_to_change():
    from service.planner import too_big_for_any_node

    GiB = 2**30
    facts = LayerFacts([0.01] * 4, [GiB, 3 * GiB, GiB, 0], [0] * 4)  # layer 1: 3 GiB of parameters
    shape = model_shape(facts, 1, 2, 4)  # balanced by cost: layers 0-1 and 2-3
    why = too_big_for_any_node(facts, shape, 6 * GiB)
    assert why == ("the model cannot fit on this cluster's nodes in shape 1x2: the worker holding layers 0-1 needs at "
                   "least 8.0 GiB for their parameters and gradients alone (before optimizer state and activations), "
                   "and the largest node offers 6.0 GiB (Ray's memory resource); raise parallelism.pp (or tp) to "
                   "split the model over more workers, or make it smaller")
    assert too_big_for_any_node(facts, shape, 8 * GiB) is None  # only a certain misfit
    assert too_big_for_any_node(facts, model_shape(facts, 1, 4, 4), 6 * GiB) is None  # 6 GiB for layer 1 alone
    assert too_big_for_any_node(facts, shape, 0) is None  # no node known: nothing to say
