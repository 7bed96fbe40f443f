"""What a pipeline cuts through (issue 22), on a real local Ray: randomness inside a layer
(dropout) draws from ``forward_seed(seed, step, microbatch, layer)``, so a job's masks do not
depend on its shape and equal the one-process loop's (tests/reference.py seeds each entry the
same way)."""
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


@pytest.mark.parametrize("dp, pp, schedule, checkpointing", [
    (1, 1, "1f1b", False), (2, 1, "1f1b", False), (1, 2, "gpipe", True), (2, 2, "zb_h1", False)])
def test_dropout_masks_do_not_depend_on_the_shape(ray_session, tmp_path, dp, pp, schedule, checkpointing):
    """(1, 2) with activation checkpointing: the recomputed forward draws the same masks."""
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
    ("deferred", 1, 1, "1f1b"), ("deferred", 2, 1, "1f1b"), ("deferred", 1, 2, "gpipe"), ("deferred", 2, 2, "1f1b"),
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
    assert int(got["2.num_batches_tracked"]) == 3 * per_step
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["loss"] for r in rows] == pytest.approx(want["losses"], rel=1e-4)


def test_batch_norm_modes_differ_and_a_resume_in_another_shape_carries_the_buffers(ray_session, tmp_path):
    """2x2 for 2 steps with a checkpoint, resumed at 1x2 (the stages' boundaries move): the
    buffers come through the checkpoint and the run ends where one process ends."""
    from service import checkpoint

    ckpt = tmp_path / "ckpt"
    first = bn_spec(2, 2, "deferred", steps=4, checkpoint={"every_steps": 2, "path": str(ckpt)})
    run_job(spec=first, spec_dir=FIXTURES, out=str(tmp_path / "a"), progress=False, timeout=120)
    step2 = next(p for p in checkpoint.list_checkpoints(ckpt) if checkpoint.step_of(p) == 2)
    second = bn_spec(1, 3, "deferred", steps=4, checkpoint={"every_steps": 0, "path": str(ckpt)})
    run_job(spec=second, spec_dir=FIXTURES, out=str(tmp_path / "b"), progress=False, timeout=120, resume=str(step2))
    want = reference.run(second, search=[FIXTURES], microbatched=True)
    assert_same_params(torch.load(tmp_path / "b" / "model.pt"), want["params"])
    # the modes are different semantics: the microbatch mode's buffers are others
    other = reference.run(bn_spec(1, 3, "microbatch", steps=4), search=[FIXTURES], microbatched=True)
    assert not torch.allclose(other["params"]["2.running_var"], want["params"]["2.running_var"], rtol=1e-3)


def test_a_batch_norm_mode_that_is_not_built_is_refused_with_the_modes_there_are():
    from service.spec import SpecError

    with pytest.raises(SpecError) as e:
        bn_spec(1, 1, "global")
    assert "training.batch_norm: Input should be 'microbatch' or 'deferred'" in str(e.value)
