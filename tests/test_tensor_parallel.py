"""Tensor parallelism inside a stage (``parallelism.tp``) on a real local Ray: the built-in
GPT (its fused qkv split as a packed column-wise layer) and a user model written as users
write them, split over TP groups of 2 workers with DTensor over gloo, equal the one-process
loop at (dp, pp, tp) = (1, 1, 2), (1, 2, 2), (2, 1, 2) on both schedules, with the training
recipe, across a resume into another tp (checkpoints and the final model are whole tensors
by name), and bad input is refused before any actor starts with what to change."""
from __future__ import annotations

import pytest
import torch

from actors.runner import run_job
from service import checkpoint, timeline
from service.spec import SpecError, parse_spec
from tests import reference
from tests.test_engine import read_jsonl
from tests.test_large_models import GPT, assert_equal, gpt_spec, tokens  # noqa: F401 (fixture)


def tp_spec(tokens, dp, pp, tp, schedule="1f1b", transport="collective", steps=3, **over):
    spec = gpt_spec(tokens, dp, pp, schedule, transport, steps=steps, **over)
    d = spec.model_dump(mode="json")
    d["name"] = f"tp-{dp}x{pp}x{tp}-{schedule}"
    d["parallelism"]["tp"] = tp
    return parse_spec(d)


@pytest.mark.parametrize("dp, pp, schedule, transport", [
    (1, 1, "1f1b", "collective"),
    (1, 2, "1f1b", "collective"),
    (1, 2, "gpipe", "object_store"),
    (2, 1, "gpipe", "collective"),
])
def test_tensor_parallel_gpt_equals_one_process(ray_session, tmp_path, tokens, dp, pp, schedule, transport):
    spec = tp_spec(tokens, dp, pp, 2, schedule, transport)
    final = run_job(spec=spec, out=str(tmp_path), progress=False)
    want, losses = reference.train(spec)
    assert_equal(torch.load(tmp_path / "model.pt"), want)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["loss"] for r in rows] == pytest.approx(losses, rel=1e-9)
    assert rows[-1]["tp"] == 2
    # Megatron-LM's count: 2 all-reduces forward and 2 backward per block and microbatch, each of
    # microbatch x seq x d_model elements (float64); the GPT's 2 blocks spread over the stages
    blocks = [2] if pp == 1 else [1, 1]
    each = 4 * 16 * 32 * 8
    m = spec.microbatches // dp
    assert rows[-1]["tp_bytes"] == [b * m * 4 * each for b in blocks]
    assert rows[-1]["tp_collectives"] == [b * m * 4 for b in blocks]
    shape = next(e for e in read_jsonl(tmp_path / "events.jsonl") if e["type"] == "shape")
    assert shape["tp"] == 2 and "tp=2" in shape["message"]
    shape_dict = {k: v for k, v in shape.items() if k not in ("type", "message", "time")}
    entry = timeline.record(rows[-1]["step"], shape_dict, final["timelines"][-1]["workers"])  # as the store keeps it
    assert len(entry["workers"]) == dp * pp * 2
    # every worker ran its stage's plan (each TP rank the same), and the timeline view says which rank
    assert timeline.check(entry) == []
    lanes = timeline.view(entry)["lanes"]
    assert [(la["pp_rank"], la["tp_rank"]) for la in lanes if la["dp_rank"] == 0] == [(s, j) for s in range(pp)
                                                                                      for j in range(2)]


def test_interleaved_1f1b_on_tensor_parallel_stages(ray_session, tmp_path, tokens):
    """Two model chunks per worker (loop placement) at (1, 2, 2): each TP rank holds its slices of
    two chunks, and the job equals the one-process loop."""
    spec = tp_spec(tokens, 1, 2, 2, "interleaved_1f1b")
    run_job(spec=spec, out=str(tmp_path), progress=False)
    want, losses = reference.train(spec)
    assert_equal(torch.load(tmp_path / "model.pt"), want)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["loss"] for r in rows] == pytest.approx(losses, rel=1e-9)
    assert rows[-1]["tp_collectives"] == [spec.microbatches * 4] * 2  # one block in each stage's two chunks


def test_a_resume_into_another_tp(ray_session, tmp_path, tokens):
    """(1, 2, 2) writes a checkpoint at step 2 (TP rank 0 of each stage writes the whole
    tensors by name), (1, 1, 1) resumes it to step 4 and writes one, and (2, 1, 2) resumes that
    to step 6: every hop equals one uninterrupted loop."""
    ckpt = tmp_path / "ckpt"
    runs = [((1, 2, 2), 2), ((1, 1, 1), 4), ((2, 1, 2), 6)]
    saved = None
    for k, ((dp, pp, tp), steps) in enumerate(runs):
        spec = tp_spec(tokens, dp, pp, tp, steps=steps, checkpoint={"every_steps": 2, "path": str(ckpt / str(k))})
        run_job(spec=spec, out=str(tmp_path / str(k)), progress=False, resume=str(saved) if saved else None)
        saved = checkpoint.list_checkpoints(ckpt / str(k))[-1]
        want, losses = reference.train(spec)
        assert_equal(torch.load(tmp_path / str(k) / "model.pt"), want)
        rows = read_jsonl(tmp_path / str(k) / "metrics.jsonl")
        assert [r["loss"] for r in rows][-2:] == pytest.approx(losses[-2:], rel=1e-9)
    parts = checkpoint.load(saved)["model"]
    assert parts["1.attn.qkv.weight"].shape == (96, 32)  # whole, by name, whatever tp wrote it


def test_the_training_recipe_on_tensor_parallel_stages(ray_session, tmp_path, tokens):
    """Clipping on the whole model's norm (split gradients' slices summed over the TP group,
    the replicated ones counted once), a warm-up and cosine rate, activation checkpointing
    (the recomputed forward repeats the layers' collectives) and the evaluation, at (1, 2, 2)."""
    spec = tp_spec(tokens, 1, 2, 2, steps=6, eval={"every_steps": 3, "batches": 1,
                                                  "data": {"kind": "tokens", "args": {"path": tokens, "seq_len": 16}}})
    d = spec.model_dump(mode="json")
    d["training"].update(grad_clip_norm=0.3, activation_checkpointing=True)
    d["optimizer"]["schedule"] = {"name": "cosine", "warmup_steps": 2, "min_lr": 0.001}
    spec = parse_spec(d)
    run_job(spec=spec, out=str(tmp_path), progress=False)
    want = reference.run(spec, microbatched=True)
    assert_equal(torch.load(tmp_path / "model.pt"), want["params"])
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["loss"] for r in rows] == pytest.approx(want["losses"], rel=1e-9)
    assert [r["grad_norm"] for r in rows] == pytest.approx(want["grad_norm"], rel=1e-9)
    assert sum(g > 0.3 for g in want["grad_norm"]) >= 5  # clipping acted
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    assert evals == pytest.approx(want["eval"], rel=1e-6)  # the reference sums eval losses in float32


@pytest.mark.parametrize("builder, args, pp", [
    ("userpkg.layerlist:hf_llama", {"vocab": 64, "d": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "layers": 2}, 2),
])
def test_code_nobody_here_wrote_transformers_llama_blocks(ray_session, tmp_path, tokens, builder, args, pp):
    """transformers' Llama decoder layers (grouped-query attention, rotary embedding, RMSNorm,
    SwiGLU), random init, split by transformers' own ``base_model_tp_plan`` at (1, 2, 2)."""
    from tests.conftest import FIXTURES

    spec = tp_spec(tokens, 1, pp, 2, model={"builder": builder, "args": args})
    run_job(spec=spec, out=str(tmp_path), progress=False, spec_dir=FIXTURES)
    want, losses = reference.train(spec, search=[FIXTURES])
    assert_equal(torch.load(tmp_path / "model.pt"), want, tol=1e-5)  # float32
    assert [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == pytest.approx(losses, rel=1e-5)


def test_a_users_blocks_with_buffers_and_activations_of_their_own(ray_session, tmp_path):
    """A user's feed-forward blocks (a buffer, a plan) with Tanh entries between them, cut so a
    stage ends on a Tanh, at (2, 2, 2) over the object store: equal to the one-process loop."""
    from tests.conftest import FIXTURES

    spec = parse_spec({
        "name": "tp-user-mlp", "model": {"builder": "userpkg.layerlist:tp_mlp", "args": {"dtype": "float32"}},
        "data": {"kind": "regression", "args": {"n": 128, "in_features": 16}}, "loss": "mse",
        "optimizer": {"name": "adam", "lr": 0.01},
        "training": {"global_batch_size": 32, "microbatch_size": 8, "steps": 3, "seed": 2},
        "parallelism": {"dp": 2, "pp": 2, "tp": 2, "transport": "object_store", "partition": [3, 5]}})
    run_job(spec=spec, out=str(tmp_path), progress=False, spec_dir=FIXTURES)
    want, losses = reference.train(spec, search=[FIXTURES])
    assert_equal(torch.load(tmp_path / "model.pt"), want, tol=1e-5)  # float32
    assert [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == pytest.approx(losses, rel=1e-5)


# ---------------------------------------------------------------- bad input, before any actor starts


def _user_spec(kind: str, tp: int = 2, **par):
    return parse_spec({
        "name": "tp-bad", "model": {"builder": "userpkg.layerlist:tp_bad", "args": {"kind": kind}},
        "data": {"kind": "regression", "args": {"n": 64, "in_features": 16}}, "loss": "mse",
        "training": {"global_batch_size": 16, "microbatch_size": 8, "steps": 1},
        "parallelism": {"tp": tp, **par}})


@pytest.mark.parametrize("kind, tp, says", [
    ("names_nothing", 2, "tp_plan names 'mlp.up', which is not a submodule of the layer; its Linear submodules "
                         "are ['up']"),
    ("unknown_style", 2, "tp_plan['up'] is 'diagonal'; the styles are colwise, rowwise, packed_colwise, "
                         "replicated_with_grad_allreduce"),
    ("zero_parts", 2, "tp_packed must be a dict from submodule name to its number of packed parts (an integer >= 1"),
    ("odd_heads", 2, "q holds 3 attention heads of 4 features, which parallelism.tp=2 does not divide"),
    ("odd_heads", 5, "q has 12 output features, which parallelism.tp=5 does not divide"),
])
def test_bad_plans_are_refused_on_the_meta_device(kind, tp, says):
    from service.loading import preflight
    from tests.conftest import FIXTURES

    with pytest.raises(SpecError) as e:
        preflight(_user_spec(kind, tp), [FIXTURES])
    assert says in str(e.value) and "layer 1" in str(e.value)


def test_a_model_without_any_plan_is_refused(tokens):
    from service.loading import preflight

    spec = parse_spec({"name": "tp-none", "model": {"kind": "regression_mlp"}, "data": {"kind": "regression"},
                       "loss": "mse", "training": {"global_batch_size": 16, "microbatch_size": 8, "steps": 1},
                       "parallelism": {"tp": 2}})
    with pytest.raises(SpecError, match="no layer of the model has a tp_plan"):
        preflight(spec, [])


def test_the_gpt_with_heads_tp_does_not_divide_is_refused(tokens):
    from service.loading import preflight

    spec = tp_spec(tokens, 1, 1, 8, model={"kind": "gpt", "args": {**GPT["args"], "d_model": 48, "n_heads": 6}})
    with pytest.raises(SpecError) as e:
        preflight(spec, [])
    assert "attn.qkv holds 6 attention heads of 8 features, which parallelism.tp=8 does not divide" in str(e.value)


@pytest.mark.parametrize("par, extra, says", [
    ({"replicas": [1, 2], "pp": 2}, {}, "parallelism.tp 2 and parallelism.replicas cannot be combined"),
    ({"schedule": "zb_h1", "pp": 2}, {}, "parallelism.tp 2 runs with schedule 1f1b, gpipe or interleaved_1f1b, not zb_h1"),
    ({"tp": 0}, {}, "greater than or equal to 1"),
])
def test_tp_with_what_it_cannot_combine_is_refused(tokens, par, extra, says):
    d = tp_spec(tokens, 1, 1, 2).model_dump(mode="json")
    d["parallelism"].update(par)
    d.update(extra)
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert says in str(e.value)



def _headnorm_spec(summed: bool):
    return parse_spec({
        "name": f"tp-headnorm-{summed}".lower(),
        "model": {"builder": "userpkg.layerlist:tp_headnorm", "args": {"summed": summed, "dtype": "float32"}},
        "data": {"kind": "regression", "args": {"n": 64, "in_features": 16}}, "loss": "mse",
        "optimizer": {"name": "adam", "lr": 0.01},
        "training": {"global_batch_size": 16, "microbatch_size": 8, "steps": 3, "seed": 4},
        "parallelism": {"tp": 2}})


def test_a_parameter_on_split_activations_is_summed_or_refused(ray_session, tmp_path):
    """A per-head LayerNorm after a column-wise layer sees only its rank's heads: marked
    ``replicated_with_grad_allreduce`` its gradient is summed over the TP group and the job
    equals one process; unmarked, the first step fails and names it."""
    from actors.runner import JobFailed
    from tests.conftest import FIXTURES

    spec = _headnorm_spec(True)
    run_job(spec=spec, out=str(tmp_path / "a"), progress=False, spec_dir=FIXTURES)
    want, losses = reference.train(spec, search=[FIXTURES])
    assert_equal(torch.load(tmp_path / "a" / "model.pt"), want, tol=1e-5)
    with pytest.raises(JobFailed) as e:
        run_job(spec=_headnorm_spec(False), out=str(tmp_path / "b"), progress=False, spec_dir=FIXTURES)
    assert "got different gradients for 1.norm.weight" in str(e.value)
    assert "replicated_with_grad_allreduce" in str(e.value)
