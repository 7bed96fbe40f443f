"""Models larger than one worker (issue 15): layer lists built only where they train, tied
parameters across stages, token data read by index, checkpoints and the final model written
per stage.  Every run equals the one-process rebuild (tests/reference.py) in float64."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from actors.runner import run_job
from service import checkpoint, schedules
from service.spec import parse_spec
from tests import reference
from tests.conftest import FIXTURES
from tests.test_engine import read_jsonl

GPT = {"kind": "gpt", "args": {"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_heads": 4, "n_layers": 2,
                               "dtype": "float64"}}
HEAD = "4.weight"  # the GPT's head (layer n_layers + 2), tied to 0.tok.weight


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens") / "train.bin"
    np.random.default_rng(0).integers(0, 64, 16 * 17 * 12).astype(np.uint16).tofile(path)
    return str(path)


def gpt_spec(tokens, dp, pp, schedule="1f1b", transport="object_store", steps=4, model=GPT, **over):
    d = {"name": f"gpt-{dp}x{pp}-{schedule}-{transport}".replace("_", "-"), "model": model,
         "data": {"kind": "tokens", "args": {"path": tokens, "seq_len": 16}}, "loss": "cross_entropy",
         "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.1},
         "training": {"global_batch_size": 16, "microbatch_size": 4, "steps": steps, "seed": 3},
         "parallelism": {"dp": dp, "pp": pp, "schedule": schedule, "transport": transport}}
    d.update(over)
    return parse_spec(d)


def assert_equal(got: dict, want: dict, tol=1e-9):
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=tol, atol=tol, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("dp, pp, schedule, transport", [
    (1, 1, "1f1b", "object_store"),
    (1, 2, "gpipe", "collective"),
    (2, 2, "1f1b", "collective"),
    (2, 2, "gpipe", "object_store"),
    (1, 4, "1f1b", "object_store"),
    (1, 4, "gpipe", "collective"),
])
def test_gpt_layer_list_equals_the_one_process_rebuild(ray_session, tmp_path, tokens, dp, pp, schedule, transport):
    spec = gpt_spec(tokens, dp, pp, schedule, transport)
    final = run_job(spec=spec, out=str(tmp_path), progress=False)
    want, losses = reference.train(spec)
    got = torch.load(tmp_path / "model.pt")
    assert_equal(got, want)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, spec.training.steps + 1))
    assert [r["loss"] for r in rows] == [m["loss"] for m in final["metrics"]] == pytest.approx(losses, rel=1e-9)
    for r in rows:
        assert r["dp"] == dp and r["pp"] == pp and 0 <= r["bubble"] <= 1 and r["samples_per_s"] > 0
    # live activations measured on the workers: 1F1B holds at most p - i, GPipe all of its M
    m = spec.microbatches // dp
    assert all(r["peak_live"] == ([min(pp - i, m) for i in range(pp)] if schedule == "1f1b" else [m] * pp)
               for r in rows)
    kinds = [e["type"] for e in read_jsonl(tmp_path / "events.jsonl")]
    assert final["state"] == "SUCCEEDED" and kinds[0] == "started" and "shape" in kinds and "finished" in kinds
    # the tie is one parameter: both names hold the same values after every step's update
    assert torch.equal(got["0.tok.weight"], got[HEAD])
    # the final model: one safetensors shard per stage, written by that stage, and the index
    index = json.loads((tmp_path / "model" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{s + 1:05d}-of-{pp:05d}.safetensors" for s in range(pp)]
    loaded = {}
    for f in files:
        loaded.update(load_file(tmp_path / "model" / f))
    assert_equal({k: loaded[k] for k in index["metadata"]["order"]}, got, tol=0)  # model.pt is made of them


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_code_nobody_here_wrote_transformers_gpt2_blocks(ray_session, tmp_path, tokens, schedule):
    """GPT-2's projections are transformers' Conv1D: the workers compute their weight products
    themselves, after the input gradient is sent (actors/deferred.py), so 1F1B's rows report the
    early sends' plan and ZB-H1 keeps those products for W without trying torch's split (no
    ``weight_split`` event); the numbers are one process's."""
    model = {"builder": "userpkg.layerlist:hf_gpt2", "args": {"vocab": 64, "d": 32, "heads": 4, "layers": 2,
                                                               "context": 16}}
    spec = gpt_spec(tokens, 1, 2, schedule, model=model, transport="collective")
    final = run_job(spec=spec, out=str(tmp_path), progress=False, spec_dir=FIXTURES)
    want, _ = reference.train(spec, search=[FIXTURES])
    assert_equal(torch.load(tmp_path / "model.pt"), want)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) == spec.training.steps
    if schedule == "1f1b":
        assert all(r.get("sends_early") for r in rows)
        assert rows[-1]["bubble_plan"] == pytest.approx(1 / 7)  # p = 2, M = 4, F = B = W: 1/7 idle, not 1/5
    else:
        assert not [e for e in final["events"] if e["type"] == "weight_split"]


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_code_nobody_here_wrote_transformers_llama_blocks_in_two_chunks_a_worker(ray_session, tmp_path, tokens,
                                                                                 schedule):
    """transformers' LlamaDecoderLayers (random init, rotary embedding, grouped-query attention,
    RMSNorm) cut into 4 model chunks on 2 workers: interleaved 1F1B's loop placement and ZB-V's V,
    whose W's hold the Linear products.  The numbers are one process's, each worker holds the
    activations the plan holds, and the newest step ran in the plan's order."""
    model = {"builder": "userpkg.layerlist:hf_llama",
             "args": {"vocab": 64, "d": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "layers": 3, "context": 16}}
    spec = gpt_spec(tokens, 1, 2, schedule, model=model,
                    parallelism={"dp": 1, "pp": 2, "schedule": schedule, "transport": "collective"})
    final = run_job(spec=spec, out=str(tmp_path), progress=False, spec_dir=FIXTURES)
    want, losses = reference.train(spec, search=[FIXTURES])
    assert_equal(torch.load(tmp_path / "model.pt"), want)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["loss"] for r in rows] == pytest.approx(losses, rel=1e-9)
    plan = schedules.build(schedule, 2, spec.microbatches, 2)
    assert all(r["peak_live"] == schedules.peak_in_flight(plan) for r in rows)
    shape = next(e for e in final["events"] if e["type"] == "shape")
    assert shape["stages_per_worker"] == 2 and len(shape["partition"]) == 4
    tl = final["timelines"][-1]["workers"]
    for s in range(2):
        assert [a for a, _, _ in tl[f"w0.{s}"]] == [f"{a.stage}{a.kind}{a.mb}" for a in plan.order[s]]
    assert any("W" in a for lane in tl.values() for a, _, _ in lane) == (schedule == "zbv")
    assert not [e for e in final["events"] if e["type"] == "weight_split"]  # no chunk tried torch's split


@pytest.mark.parametrize("pp", [2, 4])
def test_a_tie_across_stages_equals_one_shared_parameter(ray_session, tmp_path, pp):
    """Attention blocks with residuals, uneven MLP entries, a GELU and a reshape as entries of their
    own, a persistent buffer, and the head tied to the embedding, cut into 2 and 4 stages."""
    spec = parse_spec({
        "name": f"tied-{pp}", "model": {"builder": "userpkg.layerlist:attention_stack"},
        "data": {"kind": "chars", "args": {"context": 16, "stride": 16}}, "loss": "cross_entropy",
        "optimizer": {"name": "adam", "lr": 0.003}, "training": {"global_batch_size": 16, "microbatch_size": 4,
                                                                "steps": 4, "seed": 11},
        "parallelism": {"dp": 1, "pp": pp, "transport": "collective"}})
    run_job(spec=spec, out=str(tmp_path), progress=False, spec_dir=FIXTURES)
    want, _ = reference.train(spec, search=[FIXTURES])
    got = torch.load(tmp_path / "model.pt")
    assert_equal(got, want)
    head = f"{max(int(k.split('.')[0]) for k in want)}.weight"
    assert torch.equal(got["0.tok.weight"], got[head])


def test_resume_from_a_per_stage_checkpoint_in_another_shape(ray_session, tmp_path, tokens):
    """2x2 writes a checkpoint part per stage; a 1x4 run resumes from it (each worker reading only its
    own layers) and ends where an uninterrupted run ends."""
    ckpt = tmp_path / "ckpt"
    first = gpt_spec(tokens, 2, 2, steps=3, checkpoint={"every_steps": 3, "path": str(ckpt)})
    run_job(spec=first, out=str(tmp_path / "a"), progress=False)
    [saved] = checkpoint.list_checkpoints(ckpt)
    meta = json.loads((saved / "meta.json").read_text())
    assert [p["file"] for p in meta["parts"]] == ["part-00000-of-00002.pt", "part-00001-of-00002.pt"]
    assert set(meta["parts"][0]["model"]).isdisjoint(meta["parts"][1]["model"])
    second = gpt_spec(tokens, 1, 4, steps=6, checkpoint={"every_steps": 0, "path": str(ckpt)})
    final = run_job(spec=second, out=str(tmp_path / "b"), progress=False, resume=str(saved))
    want, losses = reference.train(second)
    assert_equal(torch.load(tmp_path / "b" / "model.pt"), want)
    assert [m["loss"] for m in final["metrics"]] == pytest.approx(losses[3:], rel=1e-9)
    kinds = [e["type"] for e in read_jsonl(tmp_path / "b" / "events.jsonl")]
    assert "resumed" in kinds
