"""The engine on a real local Ray: parameters equal a plain PyTorch loop for every
(dp, pp, schedule, transport); activations held per stage as the schedule promises."""
from __future__ import annotations

import json
import os

import pytest
import torch

from actors.runner import run_job
from service.spec import load_spec, parse_spec
from tests import reference
from tests.conftest import FIXTURES


def regression_spec(dp, pp, schedule, transport, **over):
    d = {
        "name": f"eq-{dp}x{pp}-{schedule}-{transport}".replace("_", "-"),
        "model": {"kind": "regression_mlp", "args": {"in_features": 16, "hidden": 32, "layers": 4}},
        "data": {"kind": "regression", "args": {"n": 256}},
        "loss": "mse",
        "optimizer": {"name": "adam", "lr": 0.01},
        # 256 samples / 64 = 4 steps per epoch: 10 steps cross two epoch boundaries
        "training": {"global_batch_size": 64, "microbatch_size": 8, "steps": 10, "seed": 5, "shuffle": True},
        "parallelism": {"dp": dp, "pp": pp, "schedule": schedule, "transport": transport},
    }
    d.update(over)
    return parse_spec(d)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def assert_same_params(got: dict, want: dict):
    assert list(got) == list(want)  # the builder's keys, in its order
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=2e-5, msg=lambda m: f"{k}: {m}")


# With an nn.Sequential builder (built whole, each worker keeping its stage); the other shapes,
# schedules and transports run with a layer list in tests/test_large_models.py
CASES = [
    (1, 2, "1f1b", "object_store"),
    (2, 1, "gpipe", "object_store"),
    (2, 2, "1f1b", "collective"),
]


@pytest.mark.parametrize("dp, pp, schedule, transport", CASES)
def test_equals_plain_pytorch(ray_session, tmp_path, dp, pp, schedule, transport):
    spec = regression_spec(dp, pp, schedule, transport)
    final = run_job(spec=spec, out=str(tmp_path), progress=False)
    want, losses = reference.train(spec)
    got = torch.load(tmp_path / "model.pt")
    assert_same_params(got, want)

    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert [r["loss"] for r in rows] == pytest.approx(losses, rel=1e-4)
    for r in rows:
        assert r["dp"] == dp and r["pp"] == pp and 0 <= r["bubble"] <= 1 and r["samples_per_s"] > 0
    # live activations measured on the workers: 1F1B holds at most p - i, GPipe all of its M
    m = spec.microbatches // dp
    want_peak = [min(pp - i, m) for i in range(pp)] if schedule == "1f1b" else [m] * pp
    assert all(r["peak_live"] == want_peak for r in rows)
    assert final["state"] == "SUCCEEDED"
    kinds = [e["type"] for e in read_jsonl(tmp_path / "events.jsonl")]
    assert kinds[0] == "started" and "shape" in kinds and "finished" in kinds and kinds[-1] == "saved"
    assert [e["type"] for e in final["events"]] == kinds  # the report holds what the file does


def test_char_transformer_integer_inputs_collective(ray_session, tmp_path):
    spec = parse_spec({
        "name": "chars", "model": {"kind": "char_transformer", "args": {"dim": 32, "layers": 2, "context": 16}},
        "data": {"kind": "chars", "args": {"context": 16, "stride": 16}}, "loss": "cross_entropy",
        # SGD, not Adam: the key bias of attention has an exactly-zero true gradient, and
        # Adam would scale its float noise up to lr-sized steps in any summation order
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "training": {"global_batch_size": 16, "microbatch_size": 4, "steps": 4, "seed": 1},
        "parallelism": {"dp": 2, "pp": 2, "schedule": "1f1b", "transport": "collective", "partition": "balanced"},
    })
    run_job(spec=spec, out=str(tmp_path), progress=False)
    want, _ = reference.train(spec)
    assert_same_params(torch.load(tmp_path / "model.pt"), want)


def test_user_code_from_spec_folder(ray_session, tmp_path):
    """Builders imported from the spec's folder, shipped to the workers as working_dir;
    a map-style Dataset; SGD with momentum; explicit layer counts."""
    path = os.path.join(FIXTURES, "user_job.yaml")
    spec = load_spec(path)
    spec = spec.model_copy(update={"parallelism": spec.parallelism.model_copy(update={"partition": [1, 4]})})
    run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False)
    want, _ = reference.train(spec, search=[FIXTURES])
    assert_same_params(torch.load(tmp_path / "model.pt"), want)
    shape = next(e for e in read_jsonl(tmp_path / "events.jsonl") if e["type"] == "shape")
    assert shape["partition"] == [1, 4]


def test_torchvision_style_inplace_relus_channels_last_on_2x2(ray_session, tmp_path):
    """ReLU(inplace=True) entries, one of them first on stage 1, and channels_last weights
    under data parallelism with torch's fused SGD (relaytrain's default): the gradient sum's
    buffers keep each weight's layout, so the parameters and BatchNorm buffers equal one process."""
    spec = parse_spec({
        "name": "tv-style", "model": {"builder": "userpkg.models:torchvision_style"},
        "data": {"kind": "digits_images"}, "loss": "cross_entropy",
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "training": {"global_batch_size": 32, "microbatch_size": 8, "steps": 3, "seed": 3},
        "parallelism": {"dp": 2, "pp": 2, "schedule": "zb_h1", "partition": [5, 4]},
    })
    run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False)
    want, _ = reference.train(spec, search=[FIXTURES], microbatched=True)  # BatchNorm: per microbatch
    assert_same_params(torch.load(tmp_path / "model.pt"), want)


@pytest.mark.parametrize("shared_memory_sum", ["1", "0"], ids=["shm-sum", "gloo-sum"])
def test_parameters_no_replica_used_are_left_alone_as_in_one_process(ray_session, tmp_path, shared_memory_sum):
    """Unused heads (a pooler nobody calls) under data parallelism with AdamW's weight decay:
    the gradient sum gave them zeros, which the optimizer stepped (decayed 0.9976x over 8 steps,
    found with GPT-2 blocks); one process gives them no gradient and leaves them alone."""
    spec = parse_spec({
        "name": "unused", "model": {"builder": "userpkg.models:with_unused_head"}, "data": {"kind": "digits"},
        "loss": "cross_entropy", "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.1},
        "training": {"global_batch_size": 32, "microbatch_size": 8, "steps": 3, "seed": 5},
        "parallelism": {"dp": 2, "pp": 2, "partition": [2, 2]},
        "runtime_env": {"env_vars": {"RELAYTRAIN_SHM_ALLREDUCE": shared_memory_sum}},
    })
    run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False)
    got = torch.load(tmp_path / "model.pt")
    want, _ = reference.train(spec, search=[FIXTURES])
    assert_same_params(got, want)  # the poolers too: the one process never steps them
    assert {k for k in got if "pooler" in k} == {"1.pooler.weight", "1.pooler.bias", "2.pooler.weight",
                                                 "2.pooler.bias"}


@pytest.mark.parametrize("transport", ["collective", "object_store"])
def test_token_ids_across_the_cut_train_and_equal_one_process(ray_session, tmp_path, transport):
    """A decoder's first layer shifts the token ids and the cut falls after it: stage 1's input
    is integers, which have no gradient, so none is sent back and none is waited for (it hung)."""
    spec = parse_spec({
        "name": "ids-cut", "model": {"builder": "userpkg.models:shifted_tokens"},
        "data": {"kind": "chars", "args": {"context": 8, "stride": 8}}, "loss": "cross_entropy",
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "training": {"global_batch_size": 16, "microbatch_size": 4, "steps": 3, "seed": 2},
        "parallelism": {"dp": 1, "pp": 2, "schedule": "zb_h1", "partition": [1, 3], "transport": transport},
    })
    run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False, timeout=60)
    want, _ = reference.train(spec, search=[FIXTURES])
    assert_same_params(torch.load(tmp_path / "model.pt"), want)
