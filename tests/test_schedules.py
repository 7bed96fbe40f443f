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
