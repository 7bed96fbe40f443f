"""Schedules as data: string in, string out, no Ray."""
from fractions import Fraction

import pytest

from service import schedules as S
from api.cli import main


def test_gpipe_plan_as_text():
    assert str(S.gpipe(2, 3)) == "0F0 0F1 0F2 0B0 0B1 0B2\n1F0 1F1 1F2 1B0 1B1 1B2"


def test_1f1b_plan_as_text():
    assert str(S.one_f_one_b(3, 4)) == (
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3\n"
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3\n"
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"
    )


def test_action_round_trip():
    for text in ["0F0", "1B3", "12F105"]:
        assert str(S.Action.parse(text)) == text
    with pytest.raises(ValueError, match="write it like '1F3'"):
        S.Action.parse("F1")


def test_from_text_round_trip():
    plan = S.one_f_one_b(4, 6)
    assert str(S.Schedule.from_text(str(plan))) == str(plan)


@pytest.mark.parametrize("m, util", [(1, Fraction(1, 4)), (4, Fraction(4, 7)), (8, Fraction(8, 11))])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_utilization_4_stages_backward_twice_forward(name, m, util):
    t = S.simulate(S.build(name, 4, m), backward_cost=2)
    assert t.utilization == util
    assert t.bubble == Fraction(3, m + 3)  # (p-1)/(M+p-1)


def test_grid_1f1b_2_stages():
    grid = S.render_grid(S.one_f_one_b(2, 3), backward_cost=1)
    assert grid.splitlines()[1:3] == [
        "stage 0  0F0 0F1     0B0 0F2 0B1     0B2",
        "stage 1      1F0 1B0 1F1 1B1 1F2 1B2",
    ]
    assert grid.splitlines()[-1].endswith("bubble=25.0%  utilization=75.0%")


def test_backward_spans_cells():
    grid = S.render_grid(S.gpipe(2, 1), backward_cost=2).splitlines()
    assert grid[1] == "stage 0  0F0             0B0 0B0"
    assert grid[2] == "stage 1      1F0 1B0 1B0"


@pytest.mark.parametrize("p, m", [(1, 1), (2, 5), (4, 4), (4, 2), (3, 9)])
def test_peak_in_flight(p, m):
    assert S.peak_in_flight(S.one_f_one_b(p, m)) == [min(p - i, m) for i in range(p)]
    assert S.peak_in_flight(S.gpipe(p, m)) == [m] * p


def test_validation_catches_backward_before_forward():
    bad = S.Schedule.from_text("0B0 0F0\n1F0 1B0")
    with pytest.raises(S.ScheduleError, match="0B0 comes before 0F0"):
        S.simulate(bad)


def test_validation_catches_missing_and_repeated():
    with pytest.raises(S.ScheduleError, match=r"missing \['0B1'\]"):
        S.simulate(S.Schedule("x", 2, 2, S.Schedule.from_text("0F0 0F1 0B0\n1F0 1F1 1B0 1B1").order))
    with pytest.raises(S.ScheduleError, match="repeats 0B0"):
        S.simulate(S.Schedule("x", 2, 2, S.Schedule.from_text("0F0 0F1 0B0 0B0 0B1\n1F0 1F1 1B0 1B1").order))


def test_validation_catches_cross_stage_deadlock_and_marks_cells():
    # stage 1 wants microbatch 1 first, stage 0 will not send it before getting 0B0 back
    bad = S.Schedule.from_text("0F0 0B0 0F1 0B1\n1F1 1B1 1F0 1B0")
    with pytest.raises(S.ScheduleError) as e:
        S.simulate(bad)
    msg = str(e.value)
    assert "plan deadlocks" in msg and "0B0 waits for 1B0" in msg and "1F1 waits for 0F1" in msg
    assert "stage 1: [1F1] 1B1 1F0 1B0" in msg


def test_unknown_schedule_and_sizes():
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        S.build("zb", 2, 2)
    with pytest.raises(ValueError, match="at least 1 microbatch"):
        S.build("1f1b", 2, 0)


def test_cli_schedule_prints_grid_and_utilization(capsys):
    assert main(["schedule", "--stages", "4", "--microbatches", "8", "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("stage 0  0F0 0F1 0F2 0F3")
    assert out[-1].endswith("bubble=27.3%  utilization=72.7%")
    assert main(["schedule", "--stages", "4", "--microbatches", "1", "--schedule", "gpipe"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("utilization=25.0%")
    assert main(["schedule", "--stages", "4", "--microbatches", "4", "--schedule", "gpipe"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("utilization=57.1%")


def test_cli_schedule_bad_input(capsys):
    assert main(["schedule", "--stages", "0", "--microbatches", "4"]) == 2
    assert "at least 1 stage" in capsys.readouterr().err
    # a column per unit of the costs: 1000000 drew 5 million columns (15 s, 258 MB), 1e308 never ended
    for costs, says in [(["--backward-cost", "10000"], "the grid would be 50005 columns wide"),
                        (["--backward-cost", "1e308", "--weight-cost", "1e308"], "the grid would be over a million columns wide"),
                        (["--backward-cost", "0"], "--backward-cost must be more than 0"),
                        (["--weight-cost", "-1", "--schedule", "zb_h1"], "--weight-cost must be more than 0"),
                        (["--backward-cost", "inf"], "--backward-cost must be a number like 2, 1.5 or 3/2; got 'inf'"),
                        (["--stage-costs", "5,1"], "--stage-costs orders the plan of replicated stages: give --replicas too"),
                        (["--replicas", "1,2", "--stage-costs", "1/0,1"], "--stage-costs takes numbers separated by commas")]:
        assert main(["schedule", "--stages", "2", "--microbatches", "4", *costs]) == 2, costs
        assert says in capsys.readouterr().err, costs
    # a long plan at plain costs: too long to draw, said as such (not the costs' fault)
    assert main(["schedule", "--stages", "4", "--microbatches", "700"]) == 2
    assert "columns wide, more than the 2000 drawn: fewer microbatches or stages draw it" in capsys.readouterr().err
    assert main(["schedule", "--stages", "4", "--microbatches", "500"]) == 0  # 1509 columns: drawn


@pytest.mark.parametrize("args, says", [
    (["--timeout", "0"], "argument --timeout: must be more than 0 (and finite), got 0"),
    (["--timeout", "-1"], "argument --timeout: must be more than 0 (and finite), got -1"),
    (["--timeout", "soon"], "argument --timeout: 'soon' is not a number"),
    (["--local-cpus", "-3"], "argument --local-cpus: must be more than 0 (and finite), got -3"),
    (["--local-cpus", "2.5"], "argument --local-cpus: '2.5' is not an integer")])
def test_cli_run_bad_options_are_refused_before_anything_starts(tmp_path, capsys, args, says):
    """--timeout 0 failed the job's first worker after 46 C++ frames (DistNetworkError: timed out
    after 0ms), --local-cpus -3 printed Ray's traceback; both exit 1 (found by a user trial)."""
    with pytest.raises(SystemExit) as e:
        main(["run", str(tmp_path / "job.yaml"), "--out", str(tmp_path / "out"), *args])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"relaytrain run: error: {says}"
    assert not (tmp_path / "out").exists()


# --- chunked and split schedules: interleaved_1f1b, zb_h1, zbv ------------------------------

F = Fraction(1)
CASES = [("gpipe", p, m, 1) for p, m in [(1, 1), (3, 5)]] + [("1f1b", p, m, 1) for p, m in [(1, 3), (4, 2), (4, 8)]] + [
    ("zb_h1", p, m, 1) for p, m in [(1, 2), (2, 1), (2, 5), (4, 3), (4, 8), (5, 16)]] + [
    ("interleaved_1f1b", p, m, v) for p, m, v in [(2, 4, 1), (2, 4, 2), (4, 8, 2), (4, 2, 2), (4, 9, 3), (3, 7, 4),
                                                  (1, 3, 2), (4, 16, 2)]] + [
    ("zbv", p, m, 2) for p, m in [(1, 1), (2, 1), (2, 3), (3, 4), (4, 7), (4, 8), (5, 12)]]


def _rows_by_hand(name, p, m, v):
    """What each worker must run, worked out without the module's validation: its virtual
    stages (ZB-V: i and 2p-1-i; the others: i, i+p, ...), F and B (and W, split) of each microbatch."""
    kinds = "FBW" if name in ("zb_h1", "zbv") else "FB"
    stages = [[i, 2 * p - 1 - i] if name == "zbv" else [i + k * p for k in range(v)] for i in range(p)]
    return [{f"{vs}{k}{j}" for vs in mine for k in kinds for j in range(m)} for mine in stages]


@pytest.mark.parametrize("name, p, m, v", CASES)
@pytest.mark.parametrize("costs", [(2, None), (1, 1), (2, 1)])
def test_every_plan_is_complete_and_respects_dependencies(name, p, m, v, costs):
    plan = S.build(name, p, m, v)
    assert (plan.stages, plan.microbatches, plan.chunks, plan.virtual) == (p, m, v, p * v)
    for row, want in zip(plan.order, _rows_by_hand(name, p, m, v)):
        texts = [str(a) for a in row]
        assert len(texts) == len(set(texts)) and set(texts) == want
    t = S.simulate(plan, *costs)
    for row in plan.order:
        for a in row:
            if a.kind in "BW":  # F before B before W of each (chunk, microbatch)
                before = S.Action(a.stage, "F" if a.kind == "B" else "B", a.mb)
                assert t.end[before] <= t.start[a]
            for d in S.dependencies(a, plan.virtual):  # across workers too
                assert t.end[d] <= t.start[a], f"{a} starts before {d} ends"
        for x, y in zip(row, row[1:]):  # one action at a time, in the plan's order
            assert t.end[x] <= t.start[y]


def test_dependencies_of_w_and_of_chunked_b():
    assert S.dependencies(S.Action.parse("3W2"), 4) == [S.Action(3, "B", 2)]
    assert S.dependencies(S.Action.parse("3B2"), 8) == [S.Action(3, "F", 2), S.Action(4, "B", 2)]
    assert S.dependencies(S.Action.parse("7B2"), 8) == [S.Action(7, "F", 2)]
    assert S.dependencies(S.Action.parse("4F1"), 8) == [S.Action(3, "F", 1)]


def test_w_action_round_trip_and_placement():
    assert str(S.Action.parse("1W3")) == "1W3" and S.Action.parse("1W3").kind == "W"
    plan = S.build("zbv", 3, 5, 2)
    assert plan.where == "v" and {a.stage for a in plan.order[0]} == {0, 5}
    assert {a.stage for a in S.build("interleaved_1f1b", 3, 6, 2).order[0]} == {0, 3}
    assert str(S.Schedule.from_text(str(plan), "zbv").order) == str(plan.order)
    assert S.Schedule.from_text(str(plan), "zbv").chunks == 2


def test_interleaved_with_one_chunk_is_1f1b():
    plan = S.build("interleaved_1f1b", 4, 6, 1)
    assert plan.name == "interleaved_1f1b" and plan.chunks == 1
    assert plan.order == S.one_f_one_b(4, 6).order


# Idle time per worker (makespan - busy), exact, against the papers' formulas.  F = 1 (one
# microbatch's forward through a worker's whole share), B the input gradient, W the weight
# gradient; an unsplit schedule's backward takes B + W.

@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8, 16])
@pytest.mark.parametrize("b, w", [(Fraction(1), Fraction(1)), (Fraction(2), Fraction(1)), (Fraction(1, 2), Fraction(1, 2))])
def test_idle_formulas(p, m, b, w):
    def idle(name, v=1):
        got = set(S.idle_per_worker(S.simulate(S.build(name, p, m, v), b, w)))
        assert len(got) == 1, f"{name}: workers idle differently: {got}"
        return got.pop()

    assert idle("1f1b") == (p - 1) * (F + b + w)
    # Qi et al. 2024 (ZB-H1, Figure 3 top): ZB-H1 idles (p-1)(T_F + T_B - T_W) (here W <= F)
    assert idle("zb_h1") == (p - 1) * (F + b - w)
    # Narayanan et al. 2021, section 2.2.2: interleaving v chunks divides the bubble by v
    for v in (2, 3):
        assert idle("interleaved_1f1b", v) == (p - 1) * (F + b + w) / v
    if b == w == F:
        # ZB-V at T_F = T_B = T_W, M >= 2p-1: no worker stalls between its first and its last
        # action (the paper's "zero bubble", steps overlapping through optimizer post validation);
        # what makespan - busy still counts is the start-up skew, p-1 chunk forwards (F/2 each)
        t = S.simulate(S.build("zbv", p, m, 2), b, w)
        if m >= 2 * p - 1:
            assert set(S.idle_per_worker(t)) == {(p - 1) * F / 2}
            assert set(S.stall_per_worker(t)) == {0}
            assert [lo for lo, _ in t.spans] == [i * F / 2 for i in range(p)]  # a parallelogram
        else:  # p=4, M=4: too few microbatches to fill the V; still no worse than ZB-H1
            assert max(S.idle_per_worker(t)) <= idle("zb_h1")


def test_zb_h1_idle_when_w_exceeds_f():
    # outside the paper's case (W > F) the deferred W's no longer hide: (p-1) B per worker
    for p, m in [(2, 4), (4, 8)]:
        t = S.simulate(S.build("zb_h1", p, m), backward_cost=1, weight_cost=2)
        assert set(S.idle_per_worker(t)) == {(p - 1) * 1}


@pytest.mark.parametrize("p, m, v", [(4, 9, 2), (4, 6, 3), (3, 7, 2), (4, 13, 4)])
def test_interleaved_any_microbatch_count(p, m, v):
    # torch needs M to be a multiple of its round count (M // p); here the rounds may differ
    # by one microbatch, and the idle is still 1F1B's / v (any M >= p)
    t = S.simulate(S.build("interleaved_1f1b", p, m, v))
    assert set(S.idle_per_worker(t)) == {Fraction(3 * (p - 1), v)}


def test_microbatch_groups():
    assert [list(g) for g in S.microbatch_groups(8, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [len(g) for g in S.microbatch_groups(9, 4)] == [5, 4]
    assert [len(g) for g in S.microbatch_groups(3, 4)] == [3]


# Live activations: +1 at F, -1 at W (split) or B (unsplit), per (chunk, microbatch).

@pytest.mark.parametrize("p, m", [(1, 1), (2, 5), (4, 4), (4, 2), (3, 9), (4, 16)])
def test_zb_h1_peak_memory_is_1f1bs(p, m):
    # Qi et al. 2024 (ZB-H1): ZB-H1 keeps 1F1B's peak memory, p microbatches (1F1B's
    # worker 0); worker i defers i W's, so every worker now reaches it
    assert S.peak_in_flight(S.zb_h1(p, m)) == [min(p, m)] * p
    assert max(S.peak_in_flight(S.zb_h1(p, m))) == max(S.peak_in_flight(S.one_f_one_b(p, m)))
    assert S.peak_activation_fraction(S.one_f_one_b(p, m)) == S.peak_in_flight(S.one_f_one_b(p, m))


@pytest.mark.parametrize("p, v", [(2, 2), (4, 2), (4, 3), (3, 4)])
@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_interleaved_peak_memory(p, v, rounds):
    # worker r holds its warm-up's chunks plus one: 2(p-1-r) + (v-1)p + 1 (M a multiple of p);
    # on worker 0 that is p + (p-1)/v microbatches of its whole share, Korthikanti et al. 2022
    # ("Reducing Activation Recomputation in Large Transformer Models": the interleaved
    # schedule's first stage holds p(1 + (p-1)/(pv)) microbatches' activations)
    m = rounds * p
    plan = S.build("interleaved_1f1b", p, m, v)
    assert S.peak_in_flight(plan) == [min(2 * (p - 1 - r) + (v - 1) * p + 1, m * v) for r in range(p)]
    assert S.peak_activation_fraction(plan)[0] == min(p + Fraction(p - 1, v), m)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_zbv_peak_memory(p):
    # ZB-V (Qi et al., arXiv 2401.10241 section 6; the zero-bubble README's table: activation
    # memory 1x of 1F1B's): 2p chunks =
    # p microbatches of the whole share on every worker (the V balances it), M >= 2p-1
    for m in (2 * p - 1, 2 * p + 3):
        plan = S.build("zbv", p, m, 2)
        assert S.peak_in_flight(plan) == [2 * p] * p
        assert S.peak_activation_fraction(plan) == [p] * p


# The papers' figures as grids (p=4, M=8).  How they were checked: the per-worker orders are
# those torch.distributed.pipelining 2.13 generates (test_orders_match_torch below:
# ScheduleInterleaved1F1B, "implementing" Narayanan et al.; ScheduleInterleavedZeroBubble on
# one stage per rank, whose W lags B by the rank, = ZB-H1; ScheduleZBVZeroBubble, the same
# algorithm as the zero-bubble repository's handcrafted get_zb_v_schedule, which prints
# p=4, M=8); the timing is our simulation of those orders; and the figures' properties are
# tested above: warm-up forwards (1F1B's p-1-i for ZB-H1, (v-1)p + 2(p-1-i) interleaved,
# 2(p-i)-1 on the down chunk for ZB-V), the idle totals (p-1)(F+B-W), (p-1)(F+B)/v and
# ZB-V's parallelogram.  Not compared cell by cell with the papers' images (not available here).

ZB_H1_4x8 = """\
stage 0  0F0 0F1 0F2 0F3             0B0 0W0 0F4 0B1 0W1 0F5 0B2 0W2 0F6 0B3 0W3 0F7 0B4 0W4 0B5 0W5 0B6 0W6 0B7 0W7
stage 1      1F0 1F1 1F2         1B0 1F3 1B1 1W0 1F4 1B2 1W1 1F5 1B3 1W2 1F6 1B4 1W3 1F7 1B5 1W4 1B6 1W5 1B7 1W6 1W7
stage 2          2F0 2F1     2B0 2F2 2B1 2F3 2B2 2W0 2F4 2B3 2W1 2F5 2B4 2W2 2F6 2B5 2W3 2F7 2B6 2W4 2B7 2W5 2W6 2W7
stage 3              3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3W0 3F4 3B4 3W1 3F5 3B5 3W2 3F6 3B6 3W3 3F7 3B7 3W4 3W5 3W6 3W7
zb_h1: stages=4 microbatches=8 chunks=1 F=1 B=1 W=1  bubble=11.1%  utilization=88.9%"""

# Narayanan et al. 2021, Figure 4 (lower): backward = 2 x forward, one cell = a chunk's forward
INTERLEAVED_4x8 = """\
stage 0  0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6             4B0 4B0 0F7 4B1 4B1     4F4 4B2 4B2 4F5 4B3 4B3 4F6 0B0 0B0 4F7 0B1 0B1 0B2 0B2     0B3 0B3     4B4 4B4     4B5 4B5     4B6 4B6     4B7 4B7 0B4 0B4 0B5 0B5 0B6 0B6 0B7 0B7
stage 1      1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 1F4         5B0 5B0 1F5 5B1 5B1 1F6 5B2 5B2 1F7 5B3 5B3 5F4 1B0 1B0 5F5 1B1 1B1 5F6 1B2 1B2 5F7 1B3 1B3     5B4 5B4     5B5 5B5     5B6 5B6     5B7 5B7 1B4 1B4 1B5 1B5 1B6 1B6 1B7 1B7
stage 2          2F0 2F1 2F2 2F3 6F0 6F1 6F2     6B0 6B0 6F3 6B1 6B1 2F4 6B2 6B2 2F5 6B3 6B3 2F6 2B0 2B0 2F7 2B1 2B1 6F4 2B2 2B2 6F5 2B3 2B3 6F6 6B4 6B4 6F7 6B5 6B5     6B6 6B6     6B7 6B7 2B4 2B4 2B5 2B5 2B6 2B6 2B7 2B7
stage 3              3F0 3F1 3F2 3F3 7F0 7B0 7B0 7F1 7B1 7B1 7F2 7B2 7B2 7F3 7B3 7B3 3F4 3B0 3B0 3F5 3B1 3B1 3F6 3B2 3B2 3F7 3B3 3B3 7F4 7B4 7B4 7F5 7B5 7B5 7F6 7B6 7B6 7F7 7B7 7B7 3B4 3B4 3B5 3B5 3B6 3B6 3B7 3B7
interleaved_1f1b: stages=4 microbatches=8 chunks=2 F=1 B=2  bubble=15.8%  utilization=84.2%"""

# ZB-V, p=4, M=8 (the zero-bubble repository's figure and get_zb_v_schedule(4, 8)); worker i
# holds chunks i and 7-i; one cell = a chunk's F, B or W (F = B = W)
ZBV_4x8 = """\
stage 0  0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7B0 7W0 7F1 7B1 7W1 7F2 7B2 7W2 7F3 7B3 7W3 0F7 0B0 0W0 7F4 7B4 7W4 0B1 0W1 7F5 7B5 7W5 0B2 0W2 7F6 7B6 7W6 0B3 0W3 7F7 7B7 7W7 0B4 0W4 0B5 0W5 0B6 0W6 0B7 0W7
stage 1      1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6B0 6W0 6F2 6B1 6W1 6F3 6B2 6W2 1F6 1B0 1W0 6F4 6B3 6W3 1F7 1B1 1W1 6F5 6B4 6W4 1B2 1W2 6F6 6B5 6W5 1B3 1W3 6F7 6B6 6W6 1B4 6B7 1B5 1W4 1B6 1W5 1B7 1W6 6W7 1W7
stage 2          2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5B0 5W0 5F3 5B1 5W1 2F5 2B0 2W0 5F4 5B2 5W2 2F6 2B1 2W1 5F5 5B3 5W3 2F7 2B2 2W2 5F6 5B4 5W4 2B3 2W3 5F7 5B5 5W5 2B4 5B6 2B5 5B7 2B6 2W4 2B7 2W5 5W6 5W7 2W6 2W7
stage 3              3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4B0 4W0 3F4 3B0 3W0 4F4 4B1 4W1 3F5 3B1 3W1 4F5 4B2 4W2 3F6 3B2 3W2 4F6 4B3 4W3 3F7 3B3 3W3 4F7 4B4 4W4 3B4 4B5 3B5 4B6 3B6 4B7 3B7 3W4 4W5 4W6 4W7 3W5 3W6 3W7
zbv: stages=4 microbatches=8 chunks=2 F=1 B=1 W=1  bubble=5.9%  utilization=94.1%"""


@pytest.mark.parametrize("args, want", [(("zb_h1", 4, 8, 1), ZB_H1_4x8),
                                        (("interleaved_1f1b", 4, 8, 2), INTERLEAVED_4x8),
                                        (("zbv", 4, 8, 2), ZBV_4x8)])
def test_grids_of_the_papers_figures(args, want):
    assert S.render_grid(S.build(*args), backward_cost=2).splitlines()[1:] == want.splitlines()


def test_grid_small_zb_h1_with_half_cells():
    # backward_cost 1, no weight cost: B = W = 1/2, so a cell is half a forward
    assert S.render_grid(S.zb_h1(2, 3), backward_cost=1) == (
        "         0   1   2   3   4   5   6   7   8   9   10  11  12  13\n"
        "stage 0  0F0 0F0 0F1 0F1     0B0 0W0 0F2 0F2 0B1 0W1     0B2 0W2\n"
        "stage 1          1F0 1F0 1B0 1F1 1F1 1B1 1W0 1F2 1F2 1B2 1W1 1W2\n"
        "zb_h1: stages=2 microbatches=3 chunks=1 F=1 B=1/2 W=1/2  bubble=14.3%  utilization=85.7%"
    )


def test_weight_cost_in_an_unsplit_schedule_joins_the_backward():
    a = S.simulate(S.one_f_one_b(3, 5), backward_cost=1, weight_cost=2)
    b = S.simulate(S.one_f_one_b(3, 5), backward_cost=3)
    assert a.makespan == b.makespan and a.busy == b.busy
    assert S.render_grid(S.one_f_one_b(2, 2), 1, 2).splitlines()[-1].startswith("1f1b: stages=2 microbatches=2 chunks=1 F=1 B=3")


def _torch_order(cls, p, m, v):
    """torch's per-rank order (its _calculate_single_rank_operations, no process group: the
    object gets only the attributes the generator reads), its I (input backward) as our B."""
    s = object.__new__(cls)
    s.pp_group_size, s._n_microbatches, s.n_local_stages, s.num_stages = p, m, v, p * v
    s.number_of_rounds = max(1, m // p)
    s.microbatches_per_round = m // s.number_of_rounds
    kind = {"F": "F", "I": "B", "B": "B", "W": "W"}
    return [" ".join(f"{a.stage_index}{kind[a.computation_type.value]}{a.microbatch_index}"
                     for a in s._calculate_single_rank_operations(r) if a is not None) for r in range(p)]


def test_orders_match_torch():
    T = pytest.importorskip("torch.distributed.pipelining.schedules")
    checked = 0
    for p in range(1, 6):
        for m in range(1, 13):
            torch_defined = m % max(1, m // p) == 0  # torch's interleaved schedules need it
            ours = lambda *a: str(S.build(*a)).splitlines()  # noqa: E731
            if torch_defined:
                for v in (2, 3):
                    assert ours("interleaved_1f1b", p, m, v) == _torch_order(T.ScheduleInterleaved1F1B, p, m, v)
                assert ours("zb_h1", p, m) == _torch_order(T.ScheduleInterleavedZeroBubble, p, m, 1)
            assert ours("zbv", p, m, 2) == _torch_order(T.ScheduleZBVZeroBubble, p, m, 2)
            checked += 1
    assert checked == 60


def test_validation_of_split_plans():
    with pytest.raises(S.ScheduleError, match="0W0 comes before 0B0"):
        S.simulate(S.Schedule.from_text("0F0 0W0 0B0\n1F0 1B0 1W0", "zb_h1"))
    with pytest.raises(S.ScheduleError, match=r"must run F, B and W .* missing \['1W0'\]"):
        S.simulate(S.Schedule.from_text("0F0 0B0 0W0\n1F0 1B0", "zb_h1"))
    with pytest.raises(S.ScheduleError, match=r"missing \['0W0'\]"):  # a W anywhere makes the plan split
        S.simulate(S.Schedule.from_text("0F0 0B0\n1F0 1B0 1W0"))
    with pytest.raises(S.ScheduleError, match=r"unexpected \['0F0'\]"):  # zbv: worker 1 holds chunks 1 and 2
        S.simulate(S.Schedule("zbv", 2, 1, S.Schedule.from_text("0F0 3F0 3B0 3W0 0B0 0W0\n0F0 1F0 2F0 2B0 2W0 1B0 1W0").order, 2))


def test_chunked_deadlock_is_reported():
    # worker 0 wants 2F0 (needs 1F0 from worker 1) before sending 0F0 that 1F0 needs
    bad = S.Schedule("interleaved_1f1b", 2, 1, S.Schedule.from_text("2F0 0F0 2B0 0B0\n1F0 3F0 3B0 1B0").order, 2)
    with pytest.raises(S.ScheduleError) as e:
        S.simulate(bad)
    assert "plan deadlocks" in str(e.value) and "2F0 waits for 1F0" in str(e.value)
    assert "stage 0: [2F0] 0F0 2B0 0B0" in str(e.value)


def test_bad_schedule_names_and_chunk_counts():
    with pytest.raises(ValueError, match="unknown schedule 'zb_h2': use one of gpipe, 1f1b, interleaved_1f1b, zb_h1, zbv"):
        S.build("zb_h2", 4, 8)
    with pytest.raises(ValueError, match=r"^zbv needs stages_per_worker 2 \(its V placement puts 2 chunks on each "
                                         r"worker\); got 3$"):
        S.build("zbv", 4, 8, 3)
    with pytest.raises(ValueError, match="zbv needs stages_per_worker 2"):
        S.build("zbv", 4, 8)
    for name in ("gpipe", "1f1b", "zb_h1"):
        with pytest.raises(ValueError, match=f"{name} puts 1 chunk on each worker; got stages_per_worker 2"):
            S.build(name, 4, 8, 2)
    with pytest.raises(ValueError, match="interleaved_1f1b needs stages_per_worker >= 1; got 0"):
        S.build("interleaved_1f1b", 4, 8, 0)
    with pytest.raises(ValueError, match="at least 1 microbatch"):
        S.build("zbv", 2, 0, 2)
    with pytest.raises(ValueError, match="weight cost must be positive"):
        S.simulate(S.zb_h1(2, 2), backward_cost=1, weight_cost=0)


def test_cli_schedule_new_schedules(capsys):
    assert main(["schedule", "--schedule", "zb_h1", "--stages", "4", "--microbatches", "8",
                 "--backward-cost", "1", "--weight-cost", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == ZB_H1_4x8.splitlines()
    assert main(["schedule", "--schedule", "zbv", "--stages", "4", "--microbatches", "8"]) == 0  # 2 chunks implied
    assert capsys.readouterr().out.splitlines()[-1] == ZBV_4x8.splitlines()[-1]
    assert main(["schedule", "--schedule", "interleaved_1f1b", "--stages", "4", "--microbatches", "8",
                 "--stages-per-worker", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == INTERLEAVED_4x8.splitlines()


@pytest.mark.parametrize("argv, message", [
    (["--schedule", "zbv", "--stages-per-worker", "3"],
     "relaytrain schedule: zbv needs stages_per_worker 2 (its V placement puts 2 chunks on each worker); got 3"),
    (["--schedule", "zb_h1", "--stages-per-worker", "2"],
     "relaytrain schedule: zb_h1 puts 1 chunk on each worker; got stages_per_worker 2"),
    (["--schedule", "zb_h1", "--weight-cost", "1/0"],
     "relaytrain schedule: --weight-cost must be a number like 2, 1.5 or 3/2; got '1/0'"),
])
def test_cli_schedule_bad_chunks_and_costs(capsys, argv, message):
    assert main(["schedule", "--stages", "4", "--microbatches", "8", *argv]) == 2
    assert capsys.readouterr().err.startswith(message)


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2)])
@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_sends_early_keeps_the_order_and_memory_and_shrinks_the_idle(name, v, p, m):
    """A schedule as relaytrain's workers run it where each backward sends its input gradient
    before its weight gradients: every B followed at once by its W, the order and the
    activations held unchanged, never more idle than the schedule (less wherever a stage waits
    for the one after it), and never less than ZB-H1, whose W's go where the bubble was."""
    plan = S.build(name, p, m, v)
    early = S.sends_early(plan)
    assert [[a for a in acts if a.kind != "W"] for acts in early.order] == [list(acts) for acts in plan.order]
    for acts in early.order:
        for i, a in enumerate(acts):
            if a.kind == "B":
                assert acts[i + 1] == S.Action(a.stage, "W", a.mb)
    assert S.peak_in_flight(early) == S.peak_in_flight(plan)
    t_plan, t_early = S.simulate(plan, 2), S.simulate(early, 2)  # B and W each half of the backward
    assert t_early.bubble < t_plan.bubble
    if name == "1f1b":
        assert t_early.bubble >= S.simulate(S.build("zb_h1", p, m), 2).bubble
    assert S.sends_early(S.build("zb_h1", p, m)) == S.build("zb_h1", p, m)  # split already: as it is


def test_sends_early_1f1b_against_zb_h1_at_p2():
    """The figures behind issue 19's ZB-H1 goal at p = 2 (F = B = W): 1F1B idles 1/9 of the step,
    1F1B with early sends (what relaytrain runs) 1/13, ZB-H1 1/25, so ZB-H1's bubble is 0.36 of
    the textbook 1F1B's but 0.52 of relaytrain's own."""
    one, zb = S.build("1f1b", 2, 8), S.build("zb_h1", 2, 8)
    assert S.simulate(one, 2).bubble == Fraction(1, 9)
    assert S.simulate(S.sends_early(one), 2).bubble == Fraction(1, 13)
    assert S.simulate(zb, 2).bubble == Fraction(1, 25)
    assert str(S.sends_early(S.build("1f1b", 2, 2))) == "0F0 0F1 0B0 0W0 0B1 0W1\n1F0 1B0 1W0 1F1 1B1 1W1"


def test_last_early_lets_the_stage_before_start_its_last_backward_at_the_send():
    """1F1B, GPipe and interleaved as relaytrain's workers run chunks whose weights are not in
    plain Linears (``F.linear`` layers, convolutions): only each worker's last backward of the
    step splits (torch's way) and sends its input gradient before its weight gradients.  In
    1F1B the stage before then starts its own last backward at that send: p = 2, M = 8 idles
    1/13 (as with every send early), p = 4 a quarter, against 3/11 for the textbook plan and 1/5
    with every send early; GPipe's and interleaved's stage before is still busy then (no gain);
    a split schedule is timed as it is."""
    one = S.build("1f1b", 4, 8)
    t, last = S.simulate(one, 2), S.simulate(one, 2, last_early=True)
    assert (t.bubble, last.bubble, S.simulate(S.sends_early(one), 2).bubble) == (Fraction(3, 11), Fraction(1, 4),
                                                                               Fraction(1, 5))
    assert S.simulate(S.build("1f1b", 2, 8), 2, last_early=True).bubble == Fraction(1, 13)
    assert S.last_backwards(one) == {S.Action(i, "B", 7) for i in range(4)}
    for i in range(1, 4):  # the stage before starts its last backward once B (half the backward) has run
        assert last.start[S.Action(i - 1, "B", 7)] >= last.start[S.Action(i, "B", 7)] + 1
        assert t.start[S.Action(i - 1, "B", 7)] == t.end[S.Action(i, "B", 7)]
    # ... at once where it is free: stage 2 after stage 3 (stages 1 and 0 are still busy then)
    assert last.start[S.Action(2, "B", 7)] == last.start[S.Action(3, "B", 7)] + 1
    assert last.busy == t.busy  # the same work, the same order
    for name, v in (("gpipe", 1), ("interleaved_1f1b", 2)):
        plan = S.build(name, 4, 8, v)
        assert S.simulate(plan, 2, last_early=True).bubble == S.simulate(plan, 2).bubble
    zb = S.build("zb_h1", 4, 8)
    assert S.simulate(zb, 2, last_early=True).bubble == S.simulate(zb, 2).bubble


def test_cli_schedule_last_sent_early(capsys):
    assert main(["schedule", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--last-sent-early"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == ("1f1b (each worker's last input gradient sent early): stages=4 microbatches=8 chunks=1 F=1 B=2  "
                       "bubble=25.0%  utilization=75.0%")  # the textbook plan: 27.3%
    assert main(["schedule", "--schedule", "1f1b", "--stages", "2", "--microbatches", "8", "--last-sent-early",
                 "--sends-early"]) == 2
    assert capsys.readouterr().err.strip() == (
        "relaytrain schedule: --sends-early sends every input gradient early, --last-sent-early only each worker's "
        "last one of the step: give one of them")
    assert main(["schedule", "--schedule", "zbv", "--stages", "2", "--microbatches", "8", "--last-sent-early"]) == 2
    assert "zbv splits its backward into B and W already; --last-sent-early" in capsys.readouterr().err


def test_cli_schedule_sends_early(capsys):
    assert main(["schedule", "--schedule", "1f1b", "--stages", "2", "--microbatches", "3", "--sends-early"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == "stage 0 0F0 0F1 0B0 0W0 0F2 0B1 0W1 0B2 0W2".split()
    assert out[-1] == ("1f1b (input gradients sent early): stages=2 microbatches=3 chunks=1 F=1 B=1 W=1  "
                       "bubble=18.2%  utilization=81.8%")  # the textbook plan: 25.0%
    assert main(["schedule", "--schedule", "1f1b", "--stages", "2", "--microbatches", "8", "--sends-early"]) == 0
    assert "bubble=7.7%" in capsys.readouterr().out.splitlines()[-1]
    assert main(["schedule", "--schedule", "zb_h1", "--stages", "2", "--microbatches", "8", "--sends-early"]) == 2
    assert capsys.readouterr().err.strip() == ("relaytrain schedule: zb_h1 splits its backward into B and W already; "
                                               "--sends-early is for gpipe, 1f1b and interleaved_1f1b")


# --- W's in groups (parallelism.weight_group) ----------------------------------------------

def test_weight_groups_string_in_string_out():
    """Each chunk's W's, k at a time, stand where the group's last W stood (ZB-H1, p = 2, M = 4, k = 2)."""
    assert str(S.build("zb_h1", 2, 4)) == ("0F0 0F1 0B0 0W0 0F2 0B1 0W1 0F3 0B2 0W2 0B3 0W3\n"
                                           "1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1F3 1B3 1W2 1W3")
    assert str(S.build("zb_h1", 2, 4, 1, 2)) == ("0F0 0F1 0B0 0F2 0B1 0W0 0W1 0F3 0B2 0B3 0W2 0W3\n"
                                                 "1F0 1B0 1F1 1B1 1F2 1B2 1W0 1W1 1F3 1B3 1W2 1W3")
    # ZB-V, all of a replica's 4 microbatches in one group: each chunk's W's together, after its last B
    zbv = S.build("zbv", 2, 4, 2, 4)
    assert str(zbv).splitlines()[0] == ("0F0 0F1 0F2 3F0 3B0 3F1 3B1 0F3 0B0 3F2 3B2 0B1 3F3 3B3 "
                                        "3W0 3W1 3W2 3W3 0B2 0B3 0W0 0W1 0W2 0W3")
    assert S.build("zb_h1", 2, 4, 1, 1) == S.build("zb_h1", 2, 4)
    assert S.build("zb_h1", 2, 4, 1, 9) == S.build("zb_h1", 2, 4, 1, 4)  # more than M: all of them


@pytest.mark.parametrize("name, v", [("zb_h1", 1), ("zbv", 2)])
@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (4, 8), (4, 16)])
@pytest.mark.parametrize("k", [2, 3, 8])
def test_weight_groups_keep_every_action_and_dependency(name, v, p, m, k):
    plain, grouped = S.build(name, p, m, v), S.build(name, p, m, v, k)
    for before, after in zip(plain.order, grouped.order):
        assert sorted(before) == sorted(after)                                   # the same actions
        assert [a for a in before if a.kind != "W"] == [a for a in after if a.kind != "W"]  # F, B untouched
        for c in {a.stage for a in after}:                                       # each chunk's W's, k at a time
            ws = [a for a in after if a.kind == "W" and a.stage == c]
            assert ws == [a for a in before if a.kind == "W" and a.stage == c]  # in their order
            pos = [i for i, a in enumerate(after) if a in ws]
            for g in range(0, len(ws), k):
                run = pos[g:g + k]
                assert run == list(range(run[0], run[0] + len(run)))             # standing together
                # where the group's last W stood: after as many F's and B's
                last = ws[min(g + k, len(ws)) - 1]
                fb = lambda order: sum(a.kind != "W" for a in order)  # noqa: E731
                assert fb(after[:pos[g]]) == fb(before[:before.index(last)])
    S.simulate(grouped, 1, 1)  # every dependency still holds (it raises otherwise)
    assert all(g >= q for g, q in zip(S.peak_in_flight(grouped), S.peak_in_flight(plain)))


def test_weight_groups_at_p2_m8():
    """ZB-H1's W's grouped lose its plan's edge over relaytrain's 1F1B (both 1/13 idle at
    F = B = W), and hold the group's microbatches until its W's; ZB-V keeps its 1/49 with all
    of its W's grouped."""
    assert S.simulate(S.build("zb_h1", 2, 8), 1, 1).bubble == Fraction(1, 25)
    for k in (2, 4, 8):
        assert S.simulate(S.build("zb_h1", 2, 8, 1, k), 1, 1).bubble == Fraction(1, 13)
    assert S.peak_in_flight(S.build("zb_h1", 2, 8, 1, 4)) == [5, 5]
    assert S.peak_in_flight(S.build("zb_h1", 2, 8, 1, 8)) == [8, 8]
    for k in (1, 4, 8):
        assert S.simulate(S.build("zbv", 2, 8, 2, k), 1, 1).bubble == Fraction(1, 49)


def test_weight_groups_bad_input(capsys):
    with pytest.raises(ValueError, match="weight_group 2 needs a schedule with W actions .* not 1f1b"):
        S.build("1f1b", 2, 8, 1, 2)
    with pytest.raises(ValueError, match="at least 1 microbatch; got 0"):
        S.group_weights(S.build("zb_h1", 2, 8), 0)
    assert main(["schedule", "--schedule", "zb_h1", "--stages", "2", "--microbatches", "4", "--weight-group", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == "stage 0 0F0 0F1 0B0 0F2 0B1 0W0 0W1 0F3 0B2 0B3 0W2 0W3".split()
    assert out[-1].startswith("zb_h1 (W's in groups of 2): stages=2 microbatches=4")
    assert main(["schedule", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--weight-group", "2"]) == 2
    assert "needs a schedule with W actions (zb_h1 or zbv), not 1f1b" in capsys.readouterr().err
    assert main(["schedule", "--schedule", "zb_h1", "--stages", "2", "--microbatches", "4", "--weight-group", "0"]) == 2
    assert "--weight-group must be at least 1; got 0" in capsys.readouterr().err


def test_after_the_trial_the_faster_split_is_kept_and_torch_s_unless_the_own_products_win_by_the_margin():
    """choose_split on the trial's step times (s): the fastest step of each split counts
    (the trial's first step, torch's split paying a one-time start-up, is not among them); the own products must be 2%
    faster, or the split the schedule means stays.  The event's text says which and why."""
    from actors.record import weight_split_message

    tried = {"torch": [0.398, 0.1796], "own": [0.199, 0.203]}  # the F.linear job of the engine tests
    assert S.choose_split(tried) == "torch"
    assert S.choose_split({"torch": [0.386, 0.1977], "own": [0.1115, 0.1089]}) == "own"  # paced convolutions
    assert S.choose_split({"torch": [0.100, 0.101], "own": [0.0985, 0.099]}) == "torch"  # 1.5% is not enough
    assert S.choose_split({"torch": [0.100], "own": [0.0975]}) == "own"
    counted = S.SPLIT_TRIAL[S.SPLIT_WARM:]
    assert S.SPLIT_TRIAL[0] == "torch" and counted.count("own") == counted.count("torch") == 3
    text = weight_split_message("torch", 0.199, 0.1796, {"w0.1": {"chunks": [1], "cover": [0.238]},
                                                       "w0.2": {"chunks": [2, 5], "cover": [0.0, 0.5]}})
    assert text == ("after trying both splits of the backward, w0.1 chunk 1 (its Linears hold 24% of its "
                    "weight-gradient work), w0.2 chunk 2 (its Linears hold 0% of its weight-gradient work), "
                    "w0.2 chunk 5 (its Linears hold 50% of its weight-gradient work) keep torch's split of the "
                    "backward, every weight gradient in W: the fastest step took 179.6 ms so, 199.0 ms with only "
                    "the Linears' weight products in W")
