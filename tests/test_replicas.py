"""Replicated stages (``parallelism.replicas``, PipeDream's 1F1B-RR) on a real local Ray: a
stage run by several workers, microbatch k on its replica k mod r, equals a plain PyTorch loop
(parameters and every step's loss) on both schedules and both transports, with data
parallelism around it, across a resume into a shape without replicas, and under
``replicas: auto``; each worker runs the plan's order and holds at most the plan's
activations; bad input is refused before any actor starts."""
from __future__ import annotations

import pytest
import torch

from actors.runner import run_job
from service import checkpoint
from service import replicas as rp
from service.spec import SpecError, parse_spec
from tests import reference
from tests.test_engine import assert_same_params, read_jsonl
from tests.test_schedules_engine import spec_of

STEPS = 3


def replicated(dp, pp, replicas, schedule="1f1b", transport="collective", **over):
    spec = spec_of(dp, pp, schedule, transport, steps=over.pop("steps", STEPS), **over)
    return parse_spec({**spec.model_dump(mode="json"), "name": f"rep-{dp}x{'-'.join(map(str, replicas))}-{schedule}",
                       "parallelism": {**spec.parallelism.model_dump(mode="json"), "replicas": replicas}})


CASES = [(1, [1, 2, 1], "1f1b", "collective"), (1, [1, 2, 1], "gpipe", "object_store"),
         (2, [2, 1], "1f1b", "object_store"), (1, [1, 3], "gpipe", "collective")]


@pytest.mark.parametrize("dp, replicas, schedule, transport", CASES)
def test_replicated_stages_equal_plain_pytorch(ray_session, tmp_path, dp, replicas, schedule, transport):
    spec = replicated(dp, len(replicas), replicas, schedule, transport)
    final = run_job(spec=spec, out=str(tmp_path), progress=False)
    want, losses = reference.train(spec)
    assert_same_params(torch.load(tmp_path / "model.pt"), want)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["loss"] for r in rows] == pytest.approx(losses, rel=1e-4)
    m = spec.microbatches // dp
    plan = rp.plan(schedule, replicas, m)
    # each stage's workers held at most what the plan holds
    peaks = plan.peak_in_flight()
    for s in range(len(replicas)):
        assert rows[-1]["peak_live"][s] == max(peaks[rp.slot_of(replicas, s, j)] for j in range(replicas[s]))
    shape = next(e for e in read_jsonl(tmp_path / "events.jsonl") if e["type"] == "shape")
    assert shape["replicas"] == replicas and "workers per stage" in shape["message"]
    # every worker ran its list of the plan, each microbatch on replica k mod r of its stage
    tl = final["timelines"][-1]["workers"]
    assert len(tl) == dp * sum(replicas)
    for r in range(dp):
        for slot in range(sum(replicas)):
            got = [a for a, _, _ in tl[f"w{r}.{slot}"]]
            assert got == [f"{a.stage}{a.kind}{r * m + a.mb}" for a in plan.order[slot]]


def test_a_resume_from_replicated_stages_into_a_plain_pipeline(ray_session, tmp_path):
    """[1, 2, 1] writes a checkpoint (replica 0 of each stage writes its part); a 1x2 job
    without replicas resumes from it and ends equal to one uninterrupted loop."""
    ckpt = tmp_path / "ckpt"
    first = replicated(1, 3, [1, 2, 1], steps=2, checkpoint={"every_steps": 2, "path": str(ckpt)})
    run_job(spec=first, out=str(tmp_path / "a"), progress=False)
    [saved] = checkpoint.list_checkpoints(ckpt)
    second = spec_of(1, 2, "1f1b", "collective", steps=4, checkpoint={"every_steps": 0, "path": str(ckpt)})
    run_job(spec=second, out=str(tmp_path / "b"), progress=False, resume=str(saved))
    want, losses = reference.train(second)
    assert_same_params(torch.load(tmp_path / "b" / "model.pt"), want)
    rows = read_jsonl(tmp_path / "b" / "metrics.jsonl")
    assert [r["loss"] for r in rows][-2:] == pytest.approx(losses[-2:], rel=1e-4)


@pytest.mark.parametrize("over, says", [
    ({"replicas": [1, 2]}, "lists 2 replica counts but pp is 3"),
    ({"replicas": [1, 0, 1]}, "parallelism.replicas[1] is 0"),
    ({"replicas": [1, 2, 1], "schedule": "zb_h1"}, "runs with schedule 1f1b or gpipe"),
    ({"replicas": [1, 9, 1]}, "a replica would have nothing to do"),
])
def test_bad_replicas_are_refused_with_what_to_change(over, says):
    d = spec_of(1, 3, "1f1b", "collective").model_dump(mode="json")
    d["parallelism"].update(over)
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert says in str(e.value)
