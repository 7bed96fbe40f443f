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
    shape = next(e for e in read_jsonl(tmp_path / "events.jsonl") if e["type"] == "shape")
    plan = rp.plan(schedule, replicas, m, rp.relative(shape["stage_costs"]))
    # each stage's workers held at most what the plan holds
    peaks = plan.peak_in_flight()
    for s in range(len(replicas)):
        assert rows[-1]["peak_live"][s] == max(peaks[rp.slot_of(replicas, s, j)] for j in range(replicas[s]))
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


def test_replicas_auto_runs_the_planners_choice_and_equals_plain_pytorch(ray_session, tmp_path):
    """``replicas: auto`` with pp = 3 workers and a heavy 5th entry (declared costs): the
    planner models 1x3 (stages at the heavy layer's pace) against 1x2 with the heavy half on 2
    workers, takes the faster, says so in the shape event, and the job equals plain PyTorch."""
    spec = spec_of(1, 3, "1f1b", "object_store")
    d = spec.model_dump(mode="json")
    d["name"] = "rep-auto"
    d["parallelism"].update(replicas="auto", partition="balanced",
                            layer_costs_ms=[0.1, 0.01, 0.1, 0.01, 4, 0.01, 0.1, 0.01, 0.1, 0.01, 0.1])
    spec = parse_spec(d)
    run_job(spec=spec, out=str(tmp_path), progress=False)
    shape = next(e for e in read_jsonl(tmp_path / "events.jsonl") if e["type"] == "shape")
    assert shape["replicas"] == [2, 1] and shape["partition"] == [5, 6]
    assert "parallelism.replicas auto: 1x2 replicas [2,1] is the fastest" in shape["message"]
    assert "pp only 1x3" in shape["message"]
    want, losses = reference.train(spec)
    assert_same_params(torch.load(tmp_path / "model.pt"), want)
    assert [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == pytest.approx(losses, rel=1e-4)


def test_transformers_gpt2_blocks_on_a_replicated_middle_stage(ray_session, tmp_path):
    """Code nobody here wrote: transformers' GPT-2 blocks (random init, float64) as the middle
    stage on 2 workers, the embedding and the head tied across stages 0 and 2; equal to the
    one-process loop.  A replicated stage that holds the tie is refused at start, saying why."""
    import numpy as np

    from actors.runner import JobFailed
    from tests.conftest import FIXTURES
    from tests.test_large_models import gpt_spec

    tokens = tmp_path / "train.bin"
    np.random.default_rng(0).integers(0, 64, 16 * 17 * 12).astype(np.uint16).tofile(tokens)
    model = {"builder": "userpkg.layerlist:hf_gpt2", "args": {"vocab": 64, "d": 32, "heads": 4, "layers": 2,
                                                               "context": 16}}
    spec = gpt_spec(str(tokens), 1, 3, model=model, transport="collective",
                    parallelism={"dp": 1, "pp": 3, "partition": [1, 2, 2], "replicas": [1, 2, 1]})
    run_job(spec=spec, out=str(tmp_path / "a"), progress=False, spec_dir=FIXTURES)
    want, losses = reference.train(spec, search=[FIXTURES])
    assert_same_params(torch.load(tmp_path / "a" / "model.pt"), want)
    assert [r["loss"] for r in read_jsonl(tmp_path / "a" / "metrics.jsonl")] == pytest.approx(losses, rel=1e-9)
    tied = gpt_spec(str(tokens), 1, 3, model=model, transport="collective",
                    parallelism={"dp": 1, "pp": 3, "partition": [1, 2, 2], "replicas": [2, 1, 1]})
    with pytest.raises(JobFailed) as e:
        run_job(spec=tied, out=str(tmp_path / "b"), progress=False, spec_dir=FIXTURES)
    assert "ties parameters across pipeline stages" in str(e.value) and "give those stages 1 replica" in str(e.value)


def test_the_training_recipe_on_replicated_stages_equals_one_process(ray_session, tmp_path):
    """Clipping on the whole model's gradient norm (each replicated stage counted once), a
    warm-up and cosine rate, activation checkpointing and the evaluation (each replica
    evaluates its own microbatches) on ``[1, 2, 1]``: equal to the one-process loop."""
    from tests.test_recipe import CLIP, recipe_spec

    spec = recipe_spec(1, 3, "1f1b", "collective", activation_checkpointing=True)
    d = spec.model_dump(mode="json")
    d["name"] = "rep-recipe"
    d["parallelism"]["replicas"] = [1, 2, 1]
    spec = parse_spec(d)
    run_job(spec=spec, out=str(tmp_path), progress=False)
    want = reference.run(spec, microbatched=True)
    assert_same_params(torch.load(tmp_path / "model.pt"), want["params"])
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["loss"] for r in rows] == pytest.approx(want["losses"], rel=1e-4)
    assert [r["grad_norm"] for r in rows] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert sum(g > CLIP for g in want["grad_norm"]) >= 6
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    assert sorted(evals) == [4, 8, 10] == sorted(want["eval"])
    assert [evals[k] for k in (4, 8, 10)] == pytest.approx([want["eval"][k] for k in (4, 8, 10)], rel=1e-4)


@pytest.mark.parametrize("mode, replicas", [("deferred", [1, 2]), ("microbatch", [2, 1])])
def test_batch_norm_buffers_on_replicated_stages_equal_one_process(ray_session, tmp_path, mode, replicas):
    """A user's CNN with BatchNorm2d and BatchNorm1d (and dropout): a replicated stage's workers
    each see their microbatches, and the buffers move as one process's do (deferred: once per
    step over the whole batch; microbatch: once per microbatch, in order)."""
    from tests.conftest import FIXTURES
    from tests.test_cut import bn_spec, buffers

    spec = bn_spec(1, 2, mode, parallelism={"replicas": replicas})
    run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False, timeout=120)
    want = reference.run(spec, search=[FIXTURES], microbatched=True)
    got = torch.load(tmp_path / "model.pt")
    assert_same_params(got, want["params"])
    assert len(buffers(got)) == 9
    assert int(got["2.num_batches_tracked"]) == 3 * (1 if mode == "deferred" else spec.microbatches)
    assert [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == pytest.approx(want["losses"], rel=1e-4)


@pytest.mark.parametrize("replicas, schedule, transport", [([1, 2, 1], "1f1b", "collective"),
                                                            ([2, 1, 2], "gpipe", "object_store")])
def test_skips_to_and_from_replicated_stages(ray_session, tmp_path, replicas, schedule, transport):
    """A U-Net (relaytrain.skip) whose skips leave and reach replicated stages: each skip tensor
    goes from the replica that ran its microbatch's stash to the one that pops it, and its
    gradient back; equal to the one-process loop."""
    from tests.conftest import FIXTURES
    from tests.test_cut import check_unet, unet_spec

    spec = unet_spec(1, 3, schedule, transport, parallelism={"replicas": replicas})
    run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False, timeout=120)
    check_unet(spec, tmp_path)
    shape = next(e for e in read_jsonl(tmp_path / "events.jsonl") if e["type"] == "shape")
    assert shape["replicas"] == replicas and shape.get("portals")
