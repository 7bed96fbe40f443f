"""Replicated stages as pure logic (service/replicas.py, the planner's replica shapes, the spec,
``relaytrain schedule --replicas`` and ``relaytrain plan``), without Ray."""
from __future__ import annotations

import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from service import planner, replicas as rp
from service.schedules import ScheduleError, one_f_one_b, peak_in_flight

ROOT = Path(__file__).resolve().parent.parent


# every replica has a microbatch (the spec refuses fewer microbatches than a stage's replicas)
PLANS = [(name, reps, m) for name in rp.SCHEDULES
         for reps in [(1, 2, 1), (2, 1), (1, 3), (3,), (1, 2, 3, 1), (2, 2), (1, 1, 1)]
         for m in [1, 2, 3, 4, 7, 8, 16] if m >= max(reps)]


@pytest.mark.parametrize("name, reps, m", PLANS)
def test_every_plan_runs_each_microbatch_once_on_its_replica_without_deadlock(name, reps, m):
    for costs in (None, [1 + s for s in range(len(reps))], [2 if s == len(reps) // 2 else 1 for s in range(len(reps))]):
        p = rp.plan(name, reps, m, costs)
        rp.check_orders(reps, m, p.order)  # F and B of its microbatches (k mod r), F first, no deadlock
        for slot, acts in enumerate(p.order):
            s, j = rp.stage_of(reps, slot)
            assert all(a.stage == s and a.mb % reps[s] == j for a in acts)
            cap = m if name == "gpipe" else rp.in_flight_cap(reps, s) + 1  # one more where it shortens the step
            assert p.peak_in_flight()[slot] <= cap
            if name == "gpipe":  # all forwards, then all backwards
                kinds = "".join(a.kind for a in acts)
                assert kinds == "F" * (len(acts) // 2) + "B" * (len(acts) // 2)


def test_one_replica_each_keeps_one_f_one_bs_bounds():
    """Without replicated stages the cap is 1F1B's p - s and the step is 1F1B's (m + p - 1) x 3."""
    for pp, m in [(2, 4), (3, 8), (4, 8)]:
        p = rp.plan("1f1b", (1,) * pp, m)
        assert [rp.in_flight_cap((1,) * pp, s) for s in range(pp)] == [pp - s for s in range(pp)]
        assert p.makespan == 3 * (m + pp - 1)
        assert p.peak_in_flight() == peak_in_flight(one_f_one_b(pp, m))


def test_the_seed_articles_case_a_middle_stage_twice_as_slow():
    """Stage costs 1, 2, 1 at M = 8: pp = 3 runs at the middle stage's pace (52 units, as plain
    1F1B's order); with the middle stage on 2 workers the step takes 33 (1.58x), as GPipe's."""
    from service.schedules import dependencies, one_f_one_b

    plain = rp.plan("1f1b", (1, 1, 1), 8, [1, 2, 1])
    rep = rp.plan("1f1b", (1, 2, 1), 8, [1, 2, 1])
    assert (plain.makespan, rep.makespan) == (52, 33)
    assert plain.makespan / rep.makespan >= Fraction(3, 2)
    assert rp.plan("gpipe", (1, 2, 1), 8, [1, 2, 1]).makespan == 33
    # PipeDream's in-flight cap: as many microbatches as the workers from the stage on, shared by its
    # replicas; stage 0 keeps one more, which shortens the step from 36 units to 33
    assert [rp.in_flight_cap((1, 2, 1), s) for s in range(3)] == [4, 2, 1]
    assert rep.peak_in_flight() == [5, 2, 2, 1]
    # plain 1F1B's own order takes the same 52 units on these costs
    end: dict = {}
    order = one_f_one_b(3, 8).order
    pos, free = [0, 0, 0], [0, 0, 0]
    while any(p < len(o) for p, o in zip(pos, order)):
        for i, o in enumerate(order):
            while pos[i] < len(o) and all(d in end for d in dependencies(o[pos[i]], 3)):
                a = o[pos[i]]
                t0 = max([free[i]] + [end[d] for d in dependencies(a, 3)])
                end[a] = free[i] = t0 + [1, 2, 1][a.stage] * (1 if a.kind == "F" else 2)
                pos[i] += 1
    assert max(end.values()) == 52


def test_the_grid_reads_one_row_per_worker():
    text = rp.render_grid(rp.plan("1f1b", (1, 2, 1), 4, [1, 2, 1]))
    rows = text.splitlines()
    assert [r.split()[1] for r in rows[1:5]] == ["0.0", "1.0", "1.1", "2.0"]
    assert rows[2].split()[2:4] == ["1F0", "1F0"]  # stage 1's forward lasts 2 cells
    assert "makespan=21" in rows[-1] and "peak in flight=[4, 2, 2, 1]" in rows[-1]


def test_a_plan_that_skips_or_deadlocks_is_refused():
    good = rp.plan("1f1b", (1, 2), 2).order
    with pytest.raises(ScheduleError, match="does not run exactly"):
        rp.check_orders((1, 2), 2, [good[0], good[2], good[1]])  # replicas swapped: microbatches on the wrong one
    stuck = (good[0][::-1], good[1], good[2])  # stage 0 runs its backwards first
    with pytest.raises(ScheduleError):
        rp.check_orders((1, 2), 2, stuck)
    with pytest.raises(ValueError, match="1f1b, not 'zb_h1'|gpipe, 1f1b, not 'zb_h1'"):
        rp.plan("zb_h1", (1, 2), 4)
    with pytest.raises(ValueError, match="every stage needs at least 1 worker"):
        rp.plan("1f1b", (1, 0), 4)


def test_slots_are_numbered_stage_by_stage():
    reps = (1, 3, 2)
    assert [rp.stage_of(reps, i) for i in range(rp.width(reps))] == [(0, 0), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]
    assert [rp.slot_of(reps, s, j) for s, j in [(0, 0), (1, 2), (2, 1)]] == [0, 3, 5]
    assert rp.heaviest_first([1, 2, 1], 4) == (1, 2, 1)
    assert rp.heaviest_first([1, 4, 1], 6) == (1, 4, 1)
    assert rp.heaviest_first([3, 1], 5) == (4, 1)


def facts(seconds):
    n = len(seconds)
    return planner.LayerFacts(seconds=seconds, param_bytes=[1 << 20] * n, activation_bytes=[1 << 14] * n)


def test_the_planner_models_replicas_and_auto_chooses_among_stages_replicas_and_dp():
    f = facts([0.01, 0.01, 0.04, 0.01, 0.01])  # the middle layer: 2x the stages around it
    plain = planner.model_shape(f, 1, 3, 8, partition_rule=[2, 1, 2])
    rep = planner.model_shape(f, 1, 3, 8, partition_rule=[2, 1, 2], replicas=(1, 2, 1))
    assert rep.replicas == (1, 2, 1) and rep.workers == 4 and rep.width == 4
    assert plain.step_s / rep.step_s > 1.4
    assert planner.model_shape(f, 1, 3, 8, replicas=(1, 1, 1)).replicas == ()  # all ones: a plain pipeline
    shapes = {s.label(): s for s in planner.replica_shapes(f, 1, 4, 8)}
    assert {"4x1", "1x3 replicas [1,2,1]", "1x4"} <= set(shapes)
    best, why = planner.choose_replicas(f, 1, 4, 8)
    assert best.label() == "4x1" and "pp only 1x4" in why and "dp only 4x1" in why
    # a model too big for one worker: no dp only; a pipeline whose heavy layer's stage is replicated wins
    best, _ = planner.choose_replicas(f, 1, 4, 8, memory_bytes=planner.model_shape(f, 1, 2, 8).memory_bytes * 1.01)
    heavy = next(s for s, (lo, hi) in enumerate(best.bounds) if lo <= 2 < hi)
    assert best.replicas and best.reps[heavy] > 1 and best.step_s < shapes["1x4"].step_s / 1.4


def test_after_a_lost_replica_the_planner_keeps_the_partition():
    f = facts([0.01, 0.01, 0.04, 0.01, 0.01])
    before = planner.model_shape(f, 1, 3, 8, partition_rule=[2, 1, 2], replicas=(1, 2, 1))
    d = planner.plan(3, f, 64, 8, preferred=(1, 3, (1, 2, 1)), replicas=[1, 2, 1], previous=before, min_gain=0.5)
    assert d.shape.key == (1, 3) and d.shape.sizes == (2, 1, 2) and "no state moves" in d.reason
    # with its 4 workers back, the spec's shape is preferred again
    d = planner.plan(4, f, 64, 8, preferred=(1, 3, (1, 2, 1)), replicas=[1, 2, 1], min_gain=0.5)
    assert d.shape.key == (1, 3, (1, 2, 1))


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "api.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_the_schedule_command_prints_a_replicated_grid_and_refuses_bad_counts():
    out = run_cli("schedule", "--stages", "3", "--microbatches", "4", "--replicas", "1,2,1", "--stage-costs", "1,2,1")
    assert out.returncode == 0, out.stderr
    assert "stage 1.1" in out.stdout and "makespan=21" in out.stdout
    bad = run_cli("schedule", "--stages", "3", "--microbatches", "4", "--replicas", "1,2")
    assert bad.returncode == 2 and "--replicas gives 2 counts for --stages 3" in bad.stderr
    bad = run_cli("schedule", "--stages", "2", "--microbatches", "4", "--replicas", "1,x")
    assert bad.returncode == 2 and "numbers separated by commas" in bad.stderr


def test_the_plan_command_shows_the_choice_beside_pp_only_and_dp_only(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: plan-me\n"
        "model: {kind: mlp, args: {in_features: 64, hidden: 128, layers: 3}}\n"
        "data: {kind: digits}\n"
        "training: {global_batch_size: 64, microbatch_size: 8, steps: 1}\n"
        "parallelism: {dp: 1, pp: 4, replicas: auto, layer_costs_ms: [1, 1, 4, 1]}\n")
    out = run_cli("plan", str(spec))
    assert out.returncode == 0, out.stderr
    assert "(the spec's, replicas: auto runs this" in out.stdout and "pp only" in out.stdout and "dp only" in out.stdout
    # a spec with its own shape: that one is marked the spec's, the fastest what auto would run
    # (the fastest was marked "chosen" beside a spec that ran another shape: a user trial)
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(spec.read_text().replace("replicas: auto, ", ""))
    out = run_cli("plan", str(fixed))
    assert out.returncode == 0, out.stderr
    [mine] = [ln for ln in out.stdout.splitlines() if "the spec's" in ln]
    assert mine.startswith("1x4 ") and "pp only" in mine and "replicas: auto runs this" not in mine, out.stdout
    assert sum("replicas: auto runs this" in ln for ln in out.stdout.splitlines()) == 1
    assert "parallelism.replicas auto:" in out.stdout
    # the built-in MLP's weights are plain Linears: its plain pipelines are timed with early sends
    assert "plain pipelines timed with each input gradient sent before the weight gradients" in out.stdout
    bf16 = tmp_path / "bf16.yaml"
    bf16.write_text(spec.read_text().replace("steps: 1}", "steps: 1, precision: bf16}"))
    out = run_cli("plan", str(bf16))
    assert out.returncode == 0, out.stderr
    assert "parallelism.replicas auto:" in out.stdout and "sent before the weight gradients" not in out.stdout
    bad = run_cli("plan", str(spec), "--workers", "0")
    assert bad.returncode == 2 and "--workers must be at least 1" in bad.stderr
    spec.write_text(spec.read_text().replace("replicas: auto", "replicas: [1, 2]"))
    bad = run_cli("plan", str(spec))
    assert bad.returncode == 2 and "lists 2 replica counts but pp is 4" in bad.stderr


def test_a_joining_worker_goes_to_the_bottleneck_stage():
    """An elastic job running 1x3 (its middle stage twice as slow) sees a free slot: the policy
    grows it to [1, 2, 1], the extra worker on the slow stage."""
    from service import elastic_policy as policy
    from service.spec import parse_spec

    spec = parse_spec({
        "name": "grow", "model": {"kind": "mlp", "args": {"layers": 4}}, "data": {"kind": "digits"},
        "training": {"global_batch_size": 64, "microbatch_size": 8, "steps": 100},
        "parallelism": {"dp": 1, "pp": 3, "replicas": "auto", "partition": [2, 1, 2],
                        "layer_costs_ms": [1, 1, 4, 1, 1]},
        "resources": {"memory_per_worker_mb": 0.5},  # the whole model does not fit one worker: no dp
        "elastic": {"enabled": True, "min_workers": 1, "max_workers": 4}})
    f = planner.LayerFacts(seconds=[c / 1e3 for c in spec.parallelism.layer_costs_ms],
                           param_bytes=[66_048, 33_024, 33_024, 33_024, 1_290], activation_bytes=[4096] * 5)
    now = planner.model_shape(f, 1, 3, 8, partition_rule=[2, 1, 2])
    d = policy.decide(policy.Situation(kept=3, free=1, current=now.key, step_s=now.step_s, steps_left=10_000,
                                       previous=now), spec, f)
    assert isinstance(d, policy.Reshape) and not d.forced and d.more_workers(3) == 1
    heavy = next(s for s, (lo, hi) in enumerate(d.shape.bounds) if lo <= 2 < hi)  # the stage of the 4 ms layer
    assert d.shape.replicas and d.shape.reps[heavy] > 1


@pytest.mark.parametrize("reps, costs", [((1, 2, 1), (1, 2, 1)), ((1, 1, 1), (1, 2, 1)), ((1, 1), (1, 1)),
                                         ((1, 3), (1, 3)), ((2, 1, 1), (2, 1, 1)), ((1, 2, 2, 1), (1, 2, 2, 1))])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_the_planners_closed_form_follows_the_simulated_plans(reps, costs, m):
    """The planner models a replicated pipeline in closed form (it weighs many shapes); it stays
    within 15% of the simulated 1F1B plan the workers run (F + B = 3 x the forward's cost)."""
    sim = float(rp.plan("1f1b", reps, m, costs).makespan)
    model = rp.modelled_step([3 * c for c in costs], reps, m)
    assert model == pytest.approx(sim, rel=0.15)
