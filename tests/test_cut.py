"""What a pipeline cuts through (issue 22), on a real local Ray: randomness inside a layer
(dropout) draws from ``forward_seed(seed, step, microbatch, layer)``, so a job's masks do not
depend on its shape and equal the one-process loop's (tests/reference.py seeds each entry the
same way); BatchNorm's running statistics move as the mode says, the same on every replica; skip
connections (relaytrain.skip) go straight from the stage that stashes them to the one that pops
them.  The BatchNorm CNN has dropout too, so its cases check the masks at (1,1), (2,1), (1,2),
(2,2) and across a resume in another shape."""
from __future__ import annotations

import json

import pytest
import torch

from actors.runner import run_job
from service.spec import parse_spec
from tests import reference
from tests.conftest import FIXTURES
from tests.test_engine import assert_same_params


def dropout_spec(dp, pp, *, p=0.1, schedule="1f1b", **training):
    return parse_spec({
        "name": f"dropout-{dp}x{pp}-{schedule}".replace("_", "-"),
        "model": {"builder": "userpkg.models:entries", "args": {"in_features": 64, "width": 32, "dropout": p}},
        "data": {"kind": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "training": {"global_batch_size": 32, "microbatch_size": 8, "steps": 3, "seed": 11, **training},
        "parallelism": {"dp": dp, "pp": pp, "schedule": schedule, "partition": "uniform"},
    })


@pytest.mark.parametrize("dp, pp, schedule, checkpointing", [(1, 2, "gpipe", True), (2, 2, "zb_h1", False)])
def test_dropout_masks_do_not_depend_on_the_shape(ray_session, tmp_path, dp, pp, schedule, checkpointing):
    """(1, 2) with activation checkpointing: the recomputed forward draws the same masks; (2, 2)
    under ZB-H1 (the other shapes: the BatchNorm cases below, whose CNN has dropout)."""
    spec = dropout_spec(dp, pp, schedule=schedule, activation_checkpointing=checkpointing)
    run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False, timeout=120)
    want = reference.run(spec, search=[FIXTURES], microbatched=True)
    assert_same_params(torch.load(tmp_path / "model.pt"), want["params"])
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["loss"] for r in rows] == pytest.approx(want["losses"], rel=1e-4)
    # the dropout acts: without it the losses are others
    plain = reference.run(dropout_spec(dp, pp, p=0.0), search=[FIXTURES], microbatched=True)
    assert [r["loss"] for r in rows][1:] != pytest.approx(plain["losses"][1:], rel=1e-3)


def bn_spec(dp, pp, mode, schedule="1f1b", steps=3, **over):
    d = {
        "name": f"bn-{mode}-{dp}x{pp}-{schedule}".replace("_", "-"),
        "model": {"builder": "userpkg.models:cnn_bn"},
        "data": {"kind": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "training": {"global_batch_size": 32, "microbatch_size": 8, "steps": steps, "seed": 4, "batch_norm": mode},
        "parallelism": {"dp": dp, "pp": pp, "schedule": schedule, "partition": "uniform"},
    }
    for k, v in over.items():
        d[k] = {**d.get(k, {}), **v}
    return parse_spec(d)


def buffers(params: dict) -> dict:
    return {k: v for k, v in params.items() if "running_" in k or "num_batches" in k}


@pytest.mark.parametrize("mode, dp, pp, schedule", [
    ("deferred", 1, 1, "1f1b"), ("deferred", 1, 2, "gpipe"), ("deferred", 2, 2, "1f1b"),
    ("microbatch", 2, 1, "gpipe"), ("microbatch", 2, 2, "1f1b")])
def test_batch_norm_buffers_equal_one_process_in_every_shape(ray_session, tmp_path, mode, dp, pp, schedule):
    """A CNN with BatchNorm2d and BatchNorm1d (one with momentum None): parameters, losses and
    the three buffers of every BatchNorm equal the one-process reference of the mode."""
    spec = bn_spec(dp, pp, mode, schedule)
    run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False, timeout=120)
    want = reference.run(spec, search=[FIXTURES], microbatched=True)
    got = torch.load(tmp_path / "model.pt")
    assert_same_params(got, want["params"])
    assert len(buffers(got)) == 9
    # one update per step (deferred) or per microbatch (microbatch), over all replicas' microbatches
    per_step = 1 if mode == "deferred" else spec.microbatches
    assert int(got["2.num_batches_tracked"]) == 3 * per_step  # after 3 steps
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["loss"] for r in rows] == pytest.approx(want["losses"], rel=1e-4)


@pytest.mark.parametrize("mode", ["deferred", "global"])
def test_batch_norm_modes_differ_and_a_resume_in_another_shape_carries_the_buffers(ray_session, tmp_path, mode):
    """2x2 for 2 steps with a checkpoint, resumed at 1x3 (the stages' boundaries move): the
    buffers come through the checkpoint and the run ends where one process ends."""
    from service import checkpoint

    ckpt = tmp_path / "ckpt"
    schedule = "gpipe" if mode == "global" else "1f1b"
    first = bn_spec(2, 2, mode, schedule, steps=4, checkpoint={"every_steps": 2, "path": str(ckpt)})
    run_job(spec=first, spec_dir=FIXTURES, out=str(tmp_path / "a"), progress=False, timeout=120)
    step2 = next(p for p in checkpoint.list_checkpoints(ckpt) if checkpoint.step_of(p) == 2)
    second = bn_spec(1, 3, mode, schedule, steps=4, checkpoint={"every_steps": 0, "path": str(ckpt)})
    run_job(spec=second, spec_dir=FIXTURES, out=str(tmp_path / "b"), progress=False, timeout=120, resume=str(step2))
    want = reference.run(second, search=[FIXTURES], microbatched=True)
    assert_same_params(torch.load(tmp_path / "b" / "model.pt"), want["params"])
    # the modes are different semantics: the microbatch mode's buffers are others
    other = reference.run(bn_spec(1, 3, "microbatch", steps=4), search=[FIXTURES], microbatched=True)
    assert not torch.allclose(other["params"]["2.running_var"], want["params"]["2.running_var"], rtol=1e-3)


def test_a_batch_norm_mode_that_does_not_exist_is_refused_with_the_modes_there_are():
    from service.spec import SpecError

    with pytest.raises(SpecError) as e:
        bn_spec(1, 1, "sync")
    assert "training.batch_norm: Input should be 'microbatch', 'deferred' or 'global'" in str(e.value)


# ---- training.batch_norm: global (actors/globalnorm.py)

def global_spec(dp, pp, builder="resnet_bn", steps=3, **over):
    d = {
        "name": f"bn-global-{builder}-{dp}x{pp}".replace("_", "-"),
        "model": {"builder": f"userpkg.models:{builder}"},
        "data": {"kind": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "training": {"global_batch_size": 32, "microbatch_size": 8, "steps": steps, "seed": 4, "batch_norm": "global"},
        "parallelism": {"dp": dp, "pp": pp, "partition": "uniform"},
    }
    for k, v in over.items():
        d[k] = {**d.get(k, {}), **v}
    return parse_spec(d)


@pytest.mark.parametrize("dp, pp, checkpointing", [(1, 2, True), (2, 2, False)])
def test_global_batch_norm_is_one_process_on_the_whole_batch(ray_session, tmp_path, dp, pp, checkpointing):
    """A ResNet with BatchNorms inside the user's blocks: every sample normalised with the whole
    global batch's statistics across microbatches and replicas, forward and backward, so the run
    equals plain PyTorch on the whole batch at once (no microbatches at all).  Its stages hold
    their microbatches at each BatchNorm, and the timeline still shows GPipe's actions in order."""
    from service import timeline

    spec = global_spec(dp, pp, training={"activation_checkpointing": checkpointing})
    assert spec.parallelism.schedule == "gpipe"  # global's default schedule
    final = run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False, timeout=120)
    # one forward and backward of the whole batch (without checkpointing, whose recomputation
    # would move plain PyTorch's running statistics twice; relaytrain recomputes no BatchNorm)
    want = reference.run(global_spec(dp, pp), search=[FIXTURES])
    got = torch.load(tmp_path / "model.pt")
    assert_same_params(got, want["params"])
    assert int(got["2.bn1.num_batches_tracked"]) == 3 and len(buffers(got)) == 15
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["loss"] for r in rows] == pytest.approx(want["losses"], rel=1e-4)
    shape = next(json.loads(x) for x in open(tmp_path / "events.jsonl") if json.loads(x)["type"] == "shape")
    assert timeline.check(timeline.record(3, shape, final["timelines"][-1]["workers"])) == []
    # and it is not what the microbatches' own statistics give
    other = reference.run(global_spec(dp, pp, training={"batch_norm": "deferred"}), search=[FIXTURES], microbatched=True)
    assert not torch.allclose(other["params"]["5.weight"], want["params"]["5.weight"], rtol=1e-3)


@pytest.mark.parametrize("model, dp, pp, transport", [("cnn_bn", 2, 2, "collective"), ("unet", 1, 3, "object_store")])
def test_global_batch_norm_with_dropout_and_skips(ray_session, tmp_path, model, dp, pp, transport):
    """The CNN's dropout masks stay each microbatch's own (its BatchNorms see the whole batch);
    the U-Net's bottleneck BatchNorm waits for every microbatch while both skips jump over it."""
    spec = global_spec(dp, pp, model, parallelism={"transport": transport},
                       **({"model": {"args": {"batch_norm": True}}} if model == "unet" else {}))
    run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False, timeout=120)
    want = reference.run(spec, search=[FIXTURES], microbatched=True)  # tests/reference.py forward_together
    assert_same_params(torch.load(tmp_path / "model.pt"), want["params"])
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["loss"] for r in rows] == pytest.approx(want["losses"], rel=1e-4)


def test_global_batch_norm_refuses_a_schedule_that_cannot_wait_for_the_batch():
    from service.spec import SpecError

    with pytest.raises(SpecError) as e:
        global_spec(1, 2, parallelism={"schedule": "1f1b"})
    assert ("training.batch_norm: global normalises every sample with the whole batch's statistics, so a stage "
            "holding a BatchNorm must see all its microbatches there before any goes on, which "
            "parallelism.schedule 1f1b does not allow: set schedule: gpipe (or leave it out), or use batch_norm: "
            "deferred") in str(e.value)


# ---- skip connections across stages (portals)

def unet_spec(dp, pp, schedule="1f1b", transport="collective", steps=3, **over):
    d = {
        "name": f"unet-{dp}x{pp}-{schedule}-{transport}".replace("_", "-"),
        "model": {"builder": "userpkg.models:unet"},  # 9 entries: the outer skip 2 -> 7, the inner 3 -> 6
        "data": {"kind": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "training": {"global_batch_size": 32, "microbatch_size": 8, "steps": steps, "seed": 2},
        "parallelism": {"dp": dp, "pp": pp, "schedule": schedule, "transport": transport, "partition": "uniform"},
    }
    for k, v in over.items():
        d[k] = {**d.get(k, {}), **v}
    return parse_spec(d)


def check_unet(spec, out):
    want = reference.run(spec, search=[FIXTURES], microbatched=True)
    assert_same_params(torch.load(out / "model.pt"), want["params"])
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [r["loss"] for r in rows] == pytest.approx(want["losses"][rows[0]["step"] - 1:], rel=1e-4)
    return rows


@pytest.mark.parametrize("dp, pp, schedule, transport", [
    (1, 2, "1f1b", "collective"), (1, 3, "1f1b", "object_store"),
    (2, 2, "gpipe", "object_store"), (1, 2, "zbv", "collective")])
def test_skips_across_stages_go_straight_to_their_popper(ray_session, tmp_path, dp, pp, schedule, transport):
    """A U-Net-like model with two nested skips equals its one-process run; with pp = 3 the
    outer skip (layer 2 -> 7) jumps from stage 0 to stage 2: stage 1 receives no skip bytes,
    stage 2 receives both skips, and the gradients go straight back."""
    spec = unet_spec(dp, pp, schedule, transport)
    final = run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False, timeout=120)
    rows = check_unet(spec, tmp_path)
    # the timeline draws each skip sent between workers (the shape event lists the portals)
    from service import timeline

    shape = next(json.loads(x) for x in open(tmp_path / "events.jsonl") if json.loads(x)["type"] == "shape")
    drawn = timeline.view(timeline.record(3, shape, final["timelines"][-1]["workers"]))["portals"]
    if pp == 3 and schedule != "zbv":
        assert {(q["skip"], q["from"][-1], q["to"][-1]) for q in drawn} == {("enc", "0", "2"), ("enc", "1", "2")}
    got = rows[-1]["received_bytes"]
    m = spec.microbatches // dp
    # outer skip 8 x 32 floats, inner 8 x 16, per microbatch
    outer, inner = 8 * 32 * 4 * m, 8 * 16 * 4 * m
    if pp == 3 and schedule != "zbv":  # stages [0-2], [3-5], [6-8]
        assert got[1].get("skip", 0) == 0 and got[2]["skip"] == outer + inner
        assert got[0]["skipgrad"] == outer and got[1]["skipgrad"] == inner
    elif pp == 2 and schedule != "zbv":  # [0-4], [5-8]: both skips cross the one boundary
        assert got[1]["skip"] == outer + inner and got[0]["skipgrad"] == outer + inner
    else:  # ZB-V: chunks [0-2] [3-4] [5-6] [7-8], worker 0 holds the first and the last, worker 1 the
        # middle two: each skip starts and ends on one worker and is handed over in memory
        assert all("skip" not in g and "skipgrad" not in g for g in got), got


def test_a_skip_inside_one_stage_stays_local_and_a_resume_moves_the_cut(ray_session, tmp_path):
    """pp = 2 with the cut after layer 7: both skips stay inside stage 0 (nothing crosses
    but the activations).  The checkpoint then resumes at pp = 3, where the cut falls between
    each stash and its pop."""
    from service import checkpoint

    ckpt = tmp_path / "ckpt"
    first = unet_spec(1, 2, steps=4, parallelism={"partition": [8, 1]},
                      checkpoint={"every_steps": 2, "path": str(ckpt)})
    run_job(spec=first, spec_dir=FIXTURES, out=str(tmp_path / "a"), progress=False, timeout=120)
    rows = [json.loads(x) for x in open(tmp_path / "a" / "metrics.jsonl")]
    assert set(rows[-1]["received_bytes"][1]) == {"act"} and set(rows[-1]["received_bytes"][0]) == {"grad"}
    step2 = next(p for p in checkpoint.list_checkpoints(ckpt) if checkpoint.step_of(p) == 2)
    second = unet_spec(1, 3, steps=4, checkpoint={"every_steps": 0, "path": str(ckpt)})
    run_job(spec=second, spec_dir=FIXTURES, out=str(tmp_path / "b"), progress=False, timeout=120, resume=str(step2))
    check_unet(second, tmp_path / "b")


@pytest.mark.parametrize("model, says", [
    ("userpkg.models:unet_unpopped", "skip 'enc' is stashed by layer 2 and never popped: add a layer that pops it"),
    ("userpkg.models:unet_twice", "skip 'enc' is stashed twice in one namespace (layers 2 and 3): give each use of "
                                  "the layer its own Namespace"),
])
def test_skips_that_do_not_add_up_are_refused_before_any_actor_starts(tmp_path, model, says):
    from service.loading import preflight
    from service.spec import SpecError

    with pytest.raises(SpecError) as e:
        preflight(unet_spec(1, 2, model={"builder": model}), search=[FIXTURES])
    assert says in str(e.value)


@pytest.mark.parametrize("pp, schedule", [(3, "1f1b"), (2, "interleaved_1f1b")])
def test_skips_with_activation_checkpointing(ray_session, tmp_path, pp, schedule):
    """Every layer recomputed in backward, the skippable ones with the pops of their first
    forward (relaytrain.skip.recomputable): the run equals the one-process run (without
    checkpointing: the same arithmetic), with its skips still crossing stages."""
    spec = unet_spec(1, pp, schedule, training={"activation_checkpointing": True})
    run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False, timeout=120)
    rows = check_unet(unet_spec(1, pp, schedule), tmp_path)
    assert rows[-1]["received_bytes"][-1]["skip"] > 0
