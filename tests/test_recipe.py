"""The training recipe on the engine (issue 16): learning-rate schedules, global-norm
clipping, activation checkpointing, bf16 and non-finite steps, against the one-process loop
of tests/reference.py, which has the same recipe."""
from __future__ import annotations

import json
import math

import pytest
import torch

from actors.runner import run_job
from service import schedules
from service.spec import parse_spec
from tests import reference

CLIP = 0.2  # below the gradients' norm on most steps: clipping must act


def recipe_spec(dp, pp, schedule, transport="collective", checkpoint=None, **training):
    return parse_spec({
        "name": f"recipe-{dp}x{pp}-{schedule}",
        "model": {"kind": "regression_mlp", "args": {"in_features": 16, "hidden": 32, "layers": 4}},
        "data": {"kind": "regression", "args": {"n": 256}},
        "loss": "mse",
        "optimizer": {"name": "adamw", "lr": 0.02, "weight_decay": 0.1,
                      "schedule": {"name": "cosine", "warmup_steps": 3, "min_lr": 0.002}},
        "training": {"global_batch_size": 64, "microbatch_size": 8, "steps": 10, "seed": 3,
                     "grad_clip_norm": CLIP, **training},
        "parallelism": {"dp": dp, "pp": pp, "schedule": schedule, "transport": transport},
        # another draw of the same problem; after steps 4, 8 and 10 (the last)
        "eval": {"every_steps": 4, "data": {"kind": "regression", "args": {"n": 160, "seed": 99}}, "batches": 2},
        **({"checkpoint": checkpoint} if checkpoint else {}),
    })


def rows_of(path):
    with open(path / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def assert_same_params(got: dict, want: dict, rtol=1e-4, atol=2e-5):
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("dp, pp, schedule, checkpointing, transport", [
    (1, 1, "1f1b", False, "collective"),
    (1, 2, "gpipe", True, "object_store"),  # no process group for activations: one for the norm
    (2, 2, "1f1b", True, "collective"),
    (1, 4, "gpipe", False, "collective"),
    (1, 4, "1f1b", True, "collective"),
])
def test_schedule_clipping_and_checkpointing_equal_one_process(ray_session, tmp_path, dp, pp, schedule, checkpointing,
                                                               transport):
    spec = recipe_spec(dp, pp, schedule, transport, activation_checkpointing=checkpointing)
    final = run_job(spec=spec, out=str(tmp_path), progress=False)
    assert final["state"] == "SUCCEEDED", final.get("error")
    want = reference.run(spec, microbatched=True)
    assert_same_params(torch.load(tmp_path / "model.pt"), want["params"])
    rows = rows_of(tmp_path)
    assert [r["loss"] for r in rows] == pytest.approx(want["losses"], rel=1e-4)
    assert [r["lr"] for r in rows] == pytest.approx(want["lr"], rel=1e-12)
    assert [r["grad_norm"] for r in rows] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert sum(g > CLIP for g in want["grad_norm"]) >= 6  # clipping acted on most steps
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    assert sorted(evals) == [4, 8, 10] == sorted(want["eval"])
    assert [evals[k] for k in (4, 8, 10)] == pytest.approx([want["eval"][k] for k in (4, 8, 10)], rel=1e-4)
    last = final["timelines"][-1]  # the last step's timeline shows the evaluation's forwards, every worker's
    assert last["step"] == 10
    m = spec.microbatches // dp
    for cell, acts in last["workers"].items():
        assert sum("E" in a[0] for a in acts) == 2 * m, cell
    assert rows[0]["lr"] == pytest.approx(0.02 / 3) and rows[-1]["lr"] == pytest.approx(0.002)


def poisoned_spec(pp: int, skip: bool, **over):
    # sample 64 is in step 3's batch (B = 32, no shuffle); PoisonSamples is layer 0: stage 0 only
    d = {
        "name": f"nonfinite-{pp}-{'skip' if skip else 'fail'}",
        "model": {"builder": "userpkg.nonfinite:model", "args": {"poison": [64]}},
        "data": {"builder": "userpkg.nonfinite:data", "args": {"n": 192}},
        "loss": "cross_entropy",
        "optimizer": {"name": "adam", "lr": 0.01},
        "training": {"global_batch_size": 32, "microbatch_size": 8, "steps": 5, "seed": 1, "shuffle": False,
                     "skip_nonfinite": skip},
        "parallelism": {"dp": 1, "pp": pp, "schedule": "1f1b", "transport": "collective"},
    }
    d.update(over)
    return parse_spec(d)


def test_a_non_finite_step_is_skipped_on_every_worker(ray_session, tmp_path):
    """...and moves no BatchNorm running statistics either: they had taken the step's NaN (the job
    succeeded with a model whose eval loss was NaN from then on)."""
    from tests.conftest import FIXTURES

    spec = poisoned_spec(2, skip=True, model={"builder": "userpkg.nonfinite:model",
                                              "args": {"poison": [64], "batch_norm": True}},
                         eval={"every_steps": 2, "data": {"builder": "userpkg.nonfinite:data", "args": {"n": 64}}},
                         # SGD: the bias before a BatchNorm has an exactly-zero true gradient, whose float
                         # noise Adam would scale up to lr-sized steps in any summation order
                         optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9})
    final = run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False)
    assert final["state"] == "SUCCEEDED", final.get("error")
    want = reference.run(spec, search=[str(FIXTURES)], microbatched=True)
    assert want["skipped"] == [3]
    got = torch.load(tmp_path / "model.pt")
    assert_same_params(got, want["params"])
    assert all(torch.isfinite(got[k]).all() for k in ("2.running_mean", "2.running_var"))
    assert int(got["2.num_batches_tracked"]) == 4  # 5 steps, one skipped (deferred: one update a step)
    rows = rows_of(tmp_path)
    assert [r.get("skipped", False) for r in rows] == [False, False, True, False, False]
    assert rows[2]["grad_norm"] is None and rows[2]["loss"] is None  # inf or nan: JSON has neither
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    assert list(evals) == [2, 4, 5] == sorted(want["eval"])
    assert [evals[k] for k in (2, 4, 5)] == pytest.approx([want["eval"][k] for k in (2, 4, 5)], rel=1e-4)
    assert all(math.isfinite(v) for v in evals.values())
    skipped = [e for e in final["events"] if e["type"] == "skipped_step"]
    assert [e["step"] for e in skipped] == [3] and "no parameter changed" in skipped[0]["message"]


def test_a_non_finite_step_fails_the_job_naming_it_without_skip_nonfinite(ray_session, tmp_path):
    from tests.conftest import FIXTURES

    from actors.runner import JobFailed

    with pytest.raises(JobFailed, match=r"step 3: the gradient norm is nan .*training\.skip_nonfinite: true"):
        run_job(spec=poisoned_spec(2, skip=False), spec_dir=FIXTURES, out=str(tmp_path), progress=False)
    assert [r["step"] for r in rows_of(tmp_path)] == [1, 2]  # the bad step was never committed


def test_bf16_losses_follow_the_one_process_bf16_loop(ray_session, tmp_path):
    spec = recipe_spec(1, 2, "1f1b", precision="bf16")
    final = run_job(spec=spec, out=str(tmp_path), progress=False)
    assert final["state"] == "SUCCEEDED", final.get("error")
    want = reference.run(spec, microbatched=True)
    rows = rows_of(tmp_path)
    # bf16 keeps 8 bits of mantissa: each rounding is up to 0.4%, and the pipeline's microbatch
    # sums round in another order than the one-process loop's; measured: within 0.1% here
    assert [r["loss"] for r in rows] == pytest.approx(want["losses"], rel=1e-2)
    got = torch.load(tmp_path / "model.pt")
    assert all(v.dtype == torch.float32 for v in got.values())  # master weights stay fp32
    assert_same_params(got, want["params"], rtol=2e-2, atol=2e-3)
    fp32 = reference.run(recipe_spec(1, 2, "1f1b"), microbatched=True)
    assert [r["loss"] for r in rows] != pytest.approx(fp32["losses"], rel=1e-6)  # autocast really ran
    # under autocast the backward is torch's whole one: the input gradient goes after the weights',
    # and the plan's bubble is the textbook 1F1B's
    assert not any(r.get("sends_early") for r in rows)
    m = spec.microbatches
    # (its last backward of a step splits torch's way: the rows report that plan, 1/13 at M = 8, not 1/9)
    assert rows[-1].get("last_sent_early") and rows[-1]["bubble_plan"] == pytest.approx(
        float(schedules.simulate(schedules.build("1f1b", 2, m), last_early=True).bubble))


def test_a_resume_in_another_shape_follows_the_schedule_and_equals_one_process(ray_session, tmp_path):
    from service import checkpoint

    ckpt = tmp_path / "ckpt"
    first = recipe_spec(2, 2, "1f1b", checkpoint={"every_steps": 5, "path": str(ckpt)})
    run_job(spec=first, out=str(tmp_path / "a"), progress=False)
    step5 = next(p for p in checkpoint.list_checkpoints(ckpt) if checkpoint.step_of(p) == 5)
    second = recipe_spec(1, 4, "gpipe", checkpoint={"every_steps": 0, "path": str(ckpt)}, activation_checkpointing=True)
    final = run_job(spec=second, out=str(tmp_path / "b"), progress=False, resume=str(step5))
    want = reference.run(second, microbatched=True)
    assert_same_params(torch.load(tmp_path / "b" / "model.pt"), want["params"])
    rows = final["metrics"]
    assert [r["step"] for r in rows] == list(range(6, 11))
    assert [r["lr"] for r in rows] == pytest.approx(want["lr"][5:], rel=1e-12)  # the schedule went on from step 6
    assert [r["grad_norm"] for r in rows] == pytest.approx(want["grad_norm"][5:], rel=1e-4)
    assert {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r} == pytest.approx(
        {k: v for k, v in want["eval"].items() if k > 5}, rel=1e-4)


def padded_spec(dp: int, pp: int, mbs: int, schedule: str = "1f1b"):
    return parse_spec({
        "name": f"padded-{dp}x{pp}-{mbs}", "model": {"builder": "userpkg.padded:model"},
        "data": {"builder": "userpkg.padded:data"}, "loss": "cross_entropy",
        "optimizer": {"name": "sgd", "lr": 0.5, "momentum": 0.9},
        "training": {"global_batch_size": 16, "microbatch_size": mbs, "steps": 4, "seed": 3, "shuffle": True},
        "eval": {"every_steps": 2, "data": {"builder": "userpkg.padded:data", "args": {"n": 32, "seed": 1}}},
        "parallelism": {"dp": dp, "pp": pp, "schedule": schedule, "transport": "collective"}})


@pytest.mark.parametrize("dp, pp, mbs, schedule", [(2, 2, 2, "1f1b"), (1, 2, 4, "zb_h1")])
def test_padded_targets_train_on_the_mean_over_the_batchs_counted_tokens(ray_session, tmp_path, dp, pp, mbs, schedule):
    """Targets of -100 (HF-style padding) are not counted by cross entropy: each microbatch's mean
    over its own counted tokens, scaled by mbs / B, weighed a microbatch of 19 counted tokens as
    one of 44, so the objective changed with the microbatch size and was not what one process
    computes on the whole batch (found by a user trial with GPT-2 blocks). The loss is now the
    mean over the global batch's counted tokens, in every shape and microbatch size."""
    from tests.conftest import FIXTURES

    spec = padded_spec(dp, pp, mbs, schedule)
    whole = reference.run(padded_spec(1, 1, 16), search=[str(FIXTURES)])  # one forward of each batch
    for mbs in (2, 4):  # the one-process microbatched loop: the same objective
        again = reference.run(padded_spec(1, 1, mbs), search=[str(FIXTURES)], microbatched=True)
        assert again["losses"] == pytest.approx(whole["losses"], rel=1e-12)
        assert_same_params(again["params"], whole["params"])
    final = run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False)
    assert final["state"] == "SUCCEEDED", final.get("error")
    assert_same_params(torch.load(tmp_path / "model.pt"), whole["params"])
    rows = rows_of(tmp_path)
    assert [r["loss"] for r in rows] == pytest.approx(whole["losses"], rel=1e-10)
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    assert [evals[s] for s in (2, 4)] == pytest.approx([whole["eval"][s] for s in (2, 4)], rel=1e-10)
