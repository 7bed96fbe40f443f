"""The schedules past 1F1B on a real local Ray: interleaved 1F1B (several model chunks per worker,
loop placement), ZB-H1 (each backward split into its input gradient B and its weight gradient W)
and ZB-V (2 chunks per worker in a V, split backward) equal a plain PyTorch loop for dp x pp in
(1,2), (2,2), (1,4) on both transports; each worker holds at run time exactly the activations the
schedule's plan holds; a resume in another shape and schedule ends where one run ends; and a
fixed-shape job's next step is already queued on the workers when a step ends."""
from __future__ import annotations

import json

import pytest
import torch

from actors.runner import run_job
from service import checkpoint, schedules, timeline
from service.spec import SpecError, parse_spec
from tests import reference
from tests.conftest import FIXTURES
from tests.test_engine import assert_same_params, read_jsonl

STEPS = 4


def spec_of(dp, pp, schedule, transport, *, steps=STEPS, **over):
    """An MLP with its ReLUs as entries of their own (11 entries: chunks with no parameters too)."""
    d = {
        "name": f"sch-{dp}x{pp}-{schedule}-{transport}".replace("_", "-"),
        "model": {"kind": "regression_mlp", "args": {"in_features": 16, "hidden": 32, "layers": 5,
                                                     "separate_activations": True}},
        "data": {"kind": "regression", "args": {"n": 256}},
        "loss": "mse",
        "optimizer": {"name": "adam", "lr": 0.01},
        "training": {"global_batch_size": 64, "microbatch_size": 8, "steps": steps, "seed": 5, "shuffle": True},
        "parallelism": {"dp": dp, "pp": pp, "schedule": schedule, "transport": transport, "partition": "uniform"},
    }
    for k, v in over.items():
        d[k] = {**d.get(k, {}), **v} if isinstance(v, dict) else v
    return parse_spec(d)


def run_like_one_process(spec, tmp_path) -> tuple[dict, list[dict]]:
    """Run ``spec`` with ``relaytrain run``'s engine; its parameters and losses must be the
    plain PyTorch loop's.  Returns the run's report and its metrics rows."""
    final = run_job(spec=spec, out=str(tmp_path), progress=False)
    want, losses = reference.train(spec)
    assert_same_params(torch.load(tmp_path / "model.pt"), want)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["loss"] for r in rows] == pytest.approx(losses, rel=1e-4)
    return final, rows


# every schedule at every shape, each schedule on both transports and each shape on both (the
# transports' own differences are covered shape by shape in tests/test_engine.py)
CASES = [(s, dp, pp, ("collective", "object_store")[(i + j) % 2])
         for i, s in enumerate(("interleaved_1f1b", "zb_h1", "zbv")) for j, (dp, pp) in enumerate(((1, 2), (2, 2), (1, 4)))]


@pytest.mark.parametrize("schedule, dp, pp, transport", CASES)
def test_every_schedule_equals_plain_pytorch(ray_session, tmp_path, schedule, dp, pp, transport):
    spec = spec_of(dp, pp, schedule, transport)
    final, rows = run_like_one_process(spec, tmp_path)
    # the activations each worker held at once, counted as its actions ran: the plan's peak
    v = spec.parallelism.chunks
    plan = schedules.build(schedule, pp, spec.microbatches // dp, v)
    assert all(r["peak_live"] == schedules.peak_in_flight(plan) for r in rows)
    assert 0 < rows[-1]["bubble_plan"] < 1
    shape = next(e for e in read_jsonl(tmp_path / "events.jsonl") if e["type"] == "shape")
    assert shape["stages_per_worker"] == v and len(shape["partition"]) == pp * v
    # the measured order of the newest step is the plan's: W actions where the plan has them
    tl = final["timelines"][-1]["workers"]
    for (r, s) in [(r, s) for r in range(dp) for s in range(pp)]:
        got = [a for a, _, _ in tl[f"w{r}.{s}"]]
        m = spec.microbatches // dp
        assert got == [f"{a.stage}{a.kind}{r * m + a.mb}" for a in plan.order[s]]
    assert any("W" in a for lane in tl.values() for a, _, _ in lane) == (schedule in schedules.SPLIT)


@pytest.mark.parametrize("schedule, dp, pp, transport, group", [
    ("zb_h1", 1, 2, "collective", 3),     # groups of 3, 3 and 2 of the 8 microbatches
    ("zbv", 2, 2, "object_store", 8),     # more than a replica's 4 microbatches: all of them at once
])
def test_weight_gradients_in_groups_equal_plain_pytorch(ray_session, tmp_path, schedule, dp, pp, transport, group):
    """parallelism.weight_group: each group's W's run together where the plan puts them (one
    product per Linear over the group's rows); the numbers are still one process's, each
    worker holds the grouped plan's activations, and the timeline shows the grouped order."""
    spec = spec_of(dp, pp, schedule, transport, parallelism={"weight_group": group})
    final, rows = run_like_one_process(spec, tmp_path)
    m = spec.microbatches // dp
    plan = schedules.build(schedule, pp, m, spec.parallelism.chunks, group)
    ungrouped = schedules.build(schedule, pp, m, spec.parallelism.chunks)
    assert plan.order != ungrouped.order
    assert all(r["peak_live"] == schedules.peak_in_flight(plan) for r in rows)
    assert rows[-1]["bubble_plan"] == pytest.approx(float(schedules.simulate(plan).bubble))
    shape = next(e for e in read_jsonl(tmp_path / "events.jsonl") if e["type"] == "shape")
    assert shape["weight_group"] == group
    tl = final["timelines"][-1]
    for (r, s) in [(r, s) for r in range(dp) for s in range(pp)]:
        got = [a for a, _, _ in tl["workers"][f"w{r}.{s}"]]
        assert got == [f"{a.stage}{a.kind}{r * m + a.mb}" for a in plan.order[s]]
        # a group ran as one: its W boxes share its time equally, each starting where the one before ended
        boxes = tl["workers"][f"w{r}.{s}"]
        runs = [boxes[i:i + 2] for i in range(len(boxes) - 1)
                if boxes[i][0][1] == boxes[i + 1][0][1] == "W" and boxes[i][0][0] == boxes[i + 1][0][0]]
        assert runs
        for (_, _, end), (_, start, _) in runs:
            assert start == pytest.approx(end, abs=2e-6)
    # the timeline page's entry (as the service stores it) knows the grouping: its check and view agree
    entry = timeline.record(tl["step"], shape, tl["workers"])
    assert entry["weight_group"] == group and timeline.check(entry) == []
    view = timeline.view(entry)
    assert view["weight_group"] == group and 0 < view["utilization_plan"] < 1
    assert f'data-weight-group="{group}"' in timeline.render_svg(view)  # the web page's tooltip reads it


TRIED = 1 + len(schedules.SPLIT_TRIAL)  # the steps a split schedule takes to choose how each chunk splits
# (the choice goes with the next step call; the call of step TRIED + 1 was sent while step TRIED ran)


def _split_job(tmp_path, builder: str, args: dict, partition: list) -> tuple:
    """A zb_h1 job on 1 x 2 with ``builder``'s model, run until its choice after the trial of the
    two splits is in force: its last step's timeline lane of worker w0.1, its ``weight_split`` events, and the spec; the
    numbers equal one process's."""
    d = spec_of(1, 2, "zb_h1", "collective", steps=TRIED + 2, parallelism={"partition": partition}).model_dump(mode="json")
    # M = 4: the bubble a split fills (a microbatch's B at the ends) is a larger share of the step
    d.update(model={"builder": builder, "args": args}, data={"kind": "digits"}, loss="cross_entropy")
    d["training"]["microbatch_size"] = 16
    spec = parse_spec(d)
    assert spec.microbatches == 4
    final = run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False, timeout=120)
    want = reference.run(spec, search=[FIXTURES], microbatched=True)
    assert_same_params(torch.load(tmp_path / "model.pt"), want["params"])
    tl = final["timelines"][-1]
    assert tl["step"] == TRIED + 2
    events = [e for e in final["events"] if e["type"] == "weight_split"]
    return tl["workers"]["w0.1"], events, spec


def _boxes(lane: list, m: int) -> tuple:
    """The lengths of the lane's W boxes and of its B boxes (one of each per microbatch)."""
    ws = [t1 - t0 for a, t0, t1 in lane if a[1] == "W"]
    bs = [t1 - t0 for a, t0, t1 in lane if a[1] == "B"]
    assert len(ws) == len(bs) == m
    return ws, bs


def test_weight_gradients_of_layers_that_call_f_linear_wait_for_w(ray_session, tmp_path):
    """A layer that keeps an nn.Linear for its parameters and calls F.linear itself: its chunk
    holds Linears whose forward never runs, so the workers' own Linear products cannot be its
    W.  The job tries both splits of the backward in its first steps and keeps torch's, where its
    weight gradients wait for W and fill the bubble: after the trial each W takes the layers'
    weight-gradient time, each B none of it, and an event says so with both timings; the
    numbers are one process's."""
    ms, layers = 10.0, 4
    lane, events, spec = _split_job(tmp_path, "userpkg.models:functional_linears",
                                    {"layers": layers, "weight_grad_ms": ms}, [3, 3])
    per_stage = layers // 2 * ms / 1e3  # the weight-gradient time of each worker's FunctionalLinears
    ws, bs = _boxes(lane, spec.microbatches)
    assert min(ws) >= 0.9 * per_stage and max(bs) < 0.5 * per_stage, (ws, bs)
    [e] = events
    assert e["kept"] == "torch" and e["chunks"] == {"w0.1": [1]} and e["step"] == TRIED, e
    assert e["torch_s"] < e["own_s"]
    assert e["message"].startswith("after trying both splits of the backward, w0.1 chunk 1 (its Linears hold ")
    assert "keeps torch's split of the backward, every weight gradient in W: the fastest step took" in e["message"]


def _user_model_job(tmp_path, base, builder: str, args: dict, **over) -> tuple:
    """``base`` (a ``spec_of``) with userpkg's model ``builder`` (``args``) on the digits, and
    ``over`` merged in, run: its parameters must be one process's.  (The spec, the run's report,
    its metrics rows, the one-process reference.)"""
    d = base.model_dump(mode="json")
    d.update(model={"builder": f"userpkg.models:{builder}", "args": args}, data={"kind": "digits"},
             loss="cross_entropy")
    for k, v in over.items():
        d[k] = {**d.get(k, {}), **v} if isinstance(v, dict) else v
    spec = parse_spec(d)
    final = run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False, timeout=120)
    want = reference.run(spec, search=[FIXTURES], microbatched=True)
    assert_same_params(torch.load(tmp_path / "model.pt"), want["params"])
    return spec, final, read_jsonl(tmp_path / "metrics.jsonl"), want


def test_1f1b_of_layers_that_call_f_linear_reports_the_plan_it_runs(ray_session, tmp_path):
    """1F1B over layers that keep an nn.Linear and call F.linear: nothing is left for after the
    send, so each backward sends its input gradient once all its weight gradients are done, and
    the first step's row reports textbook 1F1B's plan (1/3 at p = 2, M = 2), not the early
    sends' (which they reported before: the paced bench's 1F1B read 7.7% at M = 8 where it ran
    11.1%'s plan); worker 0 waits for worker 1's backward with its three layers' weight
    gradients (10 ms each).  Its Linear head holds 5% of the chunk's weight-gradient work, so
    from the second step the chunk defers nothing and runs as one without plain Linears: its
    last backward of a step splits torch's way, its input gradient goes first, and worker 0's
    last backward (10 ms) runs beside worker 1's weight gradients (30 ms), not after them; those
    rows say so (``last_sent_early``) and report that plan's bubble (1/4)."""
    ms = 10.0
    spec, final, rows, _ = _user_model_job(tmp_path, spec_of(1, 2, "1f1b", "collective", steps=3,
                                                             parallelism={"partition": [2, 4]}),
                                           "functional_linears", {"layers": 4, "width": 64, "weight_grad_ms": ms},
                                           training={"microbatch_size": 32})
    assert spec.microbatches == 2
    assert not any(r.get("sends_early") for r in rows)
    assert [bool(r.get("last_sent_early")) for r in rows] == [False, True, True]
    assert [r["bubble_plan"] for r in rows] == pytest.approx([1 / 3, 1 / 4, 1 / 4])
    # the timeline page's entry of step 3, as the service stores it (actors/record.py commit), says so too
    shape = next(e for e in read_jsonl(tmp_path / "events.jsonl") if e["type"] == "shape")
    view = timeline.view(timeline.record(3, {**shape, "last_sent_early": True}, final["timelines"][-1]["workers"]))
    assert view["last_sent_early"] and view["utilization_plan"] == pytest.approx(3 / 4)
    assert 'data-last-sent-early="1"' in timeline.render_svg(view)
    lanes = final["timelines"][-1]["workers"]  # step 3 (torch's split pays a one-time start-up in step 2)
    first_b = next(t0 for a, t0, _ in lanes["w0.0"] if a == "0B0")
    its_b = next((t0, t1) for a, t0, t1 in lanes["w0.1"] if a == "1B0")
    # the send waits for its FunctionalLinears' weight gradients: worker 0 starts 0B0 no sooner
    assert first_b >= its_b[0] + 2 * ms / 1e3, (first_b - its_b[0], its_b)
    # ... but the step's last backward splits torch's way: its input gradient goes before the
    # weight gradients, which worker 0's last backward does not wait for (with the Linears'
    # products deferred it started after worker 1's whole box)
    first_last = next(t0 for a, t0, _ in lanes["w0.0"] if a == "0B1")
    its_last = next((t0, t1) for a, t0, t1 in lanes["w0.1"] if a == "1B1")
    assert first_last <= its_last[1] - 1.5 * ms / 1e3, (its_last[1] - first_last, its_last)


def test_1f1b_of_convolutions_keeps_a_linear_head_s_products_deferred(ray_session, tmp_path):
    """Convolutions before a Linear head that holds a fifth of the last chunk's weight-gradient
    work: under 90%, so the rows report textbook 1F1B's plan, but over 10%, so the head's
    products stay deferred after each send (on a CPU torch's split of the convolutions costs
    more than the send it brings forward saves: a CNN's 1F1B ran 5-10% slower with it);
    the numbers are one process's."""
    # worker 0 holds the input Linear only, worker 1 both convolutions and the head
    ms = 10.0  # each convolution's weight gradient
    spec, final, rows, _ = _user_model_job(tmp_path, spec_of(1, 2, "1f1b", "collective", steps=3,
                                                             parallelism={"partition": [2, 8]}),
                                           "convs_and_a_linear_head", {"weight_grad_ms": ms})
    assert not any(r.get("sends_early") for r in rows) and [r["bubble_plan"] for r in rows] == pytest.approx([1 / 9] * 3)
    # its last backward runs whole but the head's product, which follows the send: worker 0's
    # last backward starts after worker 1's convolution gradients (10 ms each)
    lanes = final["timelines"][-1]["workers"]
    last = spec.microbatches - 1
    first_last = next(t0 for a, t0, _ in lanes["w0.0"] if a == f"0B{last}")
    its_last = next((t0, t1) for a, t0, t1 in lanes["w0.1"] if a == f"1B{last}")
    assert first_last >= its_last[0] + 1.8 * ms / 1e3, (first_last - its_last[0], its_last)


@pytest.mark.parametrize("transport", ["collective", "object_store"])
def test_1f1b_replicas_of_f_linear_layers_split_their_last_backward_and_sum_every_gradient(ray_session, tmp_path,
                                                                                            transport):
    """2 x 2 1F1B over layers that call F.linear: from the second step the last chunk's last
    backward of a step splits torch's way (its Linear head holds 5% of the chunk's weight-gradient
    work; torch's W writes its weight gradients outside autograd's accumulation), and the
    replicas still sum every weight's gradient: the numbers are one process's."""
    *_, rows, want = _user_model_job(tmp_path, spec_of(2, 2, "1f1b", transport, steps=3, parallelism={"partition": [2, 4]}),
                                     "functional_linears", {"layers": 4, "width": 64, "weight_grad_ms": 0.0})
    assert [r["loss"] for r in rows] == pytest.approx(want["losses"], rel=1e-5)


def test_convolutions_before_a_linear_head_leave_their_weight_gradients_for_w(ray_session, tmp_path):
    """Two Conv2d layers and a Linear head, a conv on each worker: the head holds 93% of the last
    chunk's weights but a fifth of its weight-gradient work (a kernel is applied at every
    position of the image).  The convolutions' gradients take 25 ms of device time each; left in
    B, the stage before waits for them.  The job tries both splits and keeps torch's: each W
    takes the convolution's time, each B none of it; the numbers are one process's.  (Weighed by
    weight elements, the chunk kept the Linears' own products as its W, and each B took the
    convolution's 10 ms.)"""
    ms = 25.0  # (at 10 ms, one fresh-clone run of two kept the Linears' products: the trial's steps differ by less than a loaded machine's noise)
    lane, events, spec = _split_job(tmp_path, "userpkg.models:convs_and_a_linear_head", {"weight_grad_ms": ms}, [3, 7])
    ws, bs = _boxes(lane, spec.microbatches)
    assert min(ws) >= 0.9 * ms / 1e3 and max(bs) < 0.5 * ms / 1e3, (ws, bs)
    [e] = events
    assert e["kept"] == "torch" and 0.1 < e["cover"]["w0.1"][0] < 0.3, e


def test_a_chunk_whose_split_costs_more_than_it_fills_keeps_its_whole_backward(ray_session, tmp_path):
    """Convolutions whose backward takes 10 ms per pass (on a CPU, torch's split of a
    convolution costs more than one whole backward): split in two, each pays twice, more than
    the bubble the split would fill.  The job tries both and keeps the Linears' own products,
    with the convolution's gradients in B: after the trial each B takes one pass, each W none;
    the numbers are one process's."""
    ms = 10.0
    lane, events, spec = _split_job(tmp_path, "userpkg.models:paced_convs", {"backward_ms": ms}, [3, 7])
    ws, bs = _boxes(lane, spec.microbatches)
    assert min(bs) >= 0.9 * ms / 1e3 and max(ws) < 0.5 * ms / 1e3, (ws, bs)
    [e] = events
    assert e["kept"] == "own" and e["own_s"] < 0.98 * e["torch_s"], e
    assert "keeps the Linears' own weight products in W and the other weight gradients in B" in e["message"]


def test_a_resume_in_another_shape_and_schedule_ends_where_one_run_ends(ray_session, tmp_path):
    """ZB-V on 1x2 (chunks 0 and 3 on worker 0) writes a checkpoint; interleaved 1F1B on 2x2 with
    chunks on other workers resumes from it and ends equal to one uninterrupted loop."""
    ckpt = tmp_path / "ckpt"
    first = spec_of(1, 2, "zbv", "collective", steps=3, checkpoint={"every_steps": 3, "path": str(ckpt)})
    run_job(spec=first, out=str(tmp_path / "a"), progress=False)
    [saved] = checkpoint.list_checkpoints(ckpt)
    second = spec_of(2, 2, "interleaved_1f1b", "object_store", steps=6,
                     checkpoint={"every_steps": 0, "path": str(ckpt)})
    final = run_job(spec=second, out=str(tmp_path / "b"), progress=False, resume=str(saved))
    want, losses = reference.train(second)
    assert_same_params(torch.load(tmp_path / "b" / "model.pt"), want)
    assert [m["loss"] for m in final["metrics"]] == pytest.approx(losses[3:], rel=1e-4)


def test_the_next_step_is_queued_before_the_step_ends(ray_session, tmp_path):
    """On a fixed shape the call of step s + 1 reaches a worker while step s runs: the worker
    starts it the moment step s ends (no scheduler round trip between them), except where a
    checkpoint is due (the state is read between the two steps)."""
    spec = spec_of(1, 2, "1f1b", "collective", steps=8,
                   checkpoint={"every_steps": 4, "path": str(tmp_path / "ckpt")})
    final = run_job(spec=spec, out=str(tmp_path), progress=False)
    rows = final["metrics"]
    queued = [r["step"] for r in rows if r.get("queued_early")]
    # steps 2-4 and 6-8 were sent while the step before ran; 5 waited for the checkpoint of step 4
    assert queued == [2, 3, 4, 6, 7, 8]
    # the model's Linears send each input gradient before their weight gradients: the plan's
    # bubble is that of 1F1B run so (1/13 at p = 2, M = 8), not the textbook 1/9
    assert all(r["sends_early"] for r in rows)
    assert rows[-1]["bubble_plan"] == pytest.approx(1 / 13)
    want, _ = reference.train(spec)
    assert_same_params(torch.load(tmp_path / "model.pt"), want)


@pytest.mark.parametrize("over, says", [
    ({"schedule": "zbv", "stages_per_worker": 3}, "zbv places exactly 2 model chunks"),
    ({"schedule": "1f1b", "stages_per_worker": 2}, "needs a schedule that places several model chunks"),
    ({"schedule": "interleaved_1f1b", "stages_per_worker": 2, "partition": [3, 3, 3]}, "one layer count per model chunk"),
    ({"schedule": "1f1b", "weight_group": 4}, "weight_group 4 groups the W actions .* set schedule zb_h1 or zbv"),
    ({"schedule": "zb_h1", "weight_group": 0}, "weight_group"),
])
def test_bad_schedule_fields_say_what_to_change(over, says):
    with pytest.raises(SpecError, match=says):
        spec_of(1, 2, "1f1b", "collective", parallelism={"dp": 1, "pp": 2, **over})


def test_more_chunks_than_layers_is_refused_before_any_actor_starts(tmp_path):
    from service.loading import preflight

    spec = spec_of(1, 4, "interleaved_1f1b", "collective", parallelism={"stages_per_worker": 3})
    with pytest.raises(SpecError, match=r"12 chunks of at least one layer, but it has only 11 layers"):
        preflight(spec, [])
    spec = spec_of(1, 2, "zb_h1", "collective", training={"activation_checkpointing": True})
    with pytest.raises(SpecError, match="use 1f1b or interleaved_1f1b with checkpointing"):
        preflight(spec, [])
    assert json.dumps(spec.model_dump(mode="json"))  # the spec itself is fine


def test_a_chunk_whose_output_is_a_view_splits_its_backward(ray_session, tmp_path):
    """A user's model with an nn.Unflatten entry, cut so a middle chunk ends with it (its output a
    view of its input): ZB-V's split backward runs it, and the result equals one process."""
    from tests.conftest import FIXTURES

    spec = parse_spec({
        "name": "zbv-view", "model": {"builder": "userpkg.models:entries", "args": {"dtype": "float64"}},
        "data": {"kind": "digits"}, "loss": "cross_entropy", "optimizer": {"name": "sgd", "lr": 0.05},
        "training": {"global_batch_size": 32, "microbatch_size": 8, "steps": 3, "seed": 2},
        "parallelism": {"dp": 1, "pp": 2, "schedule": "zbv", "partition": [2, 7, 3, 4]}})
    run_job(spec=spec, spec_dir=FIXTURES, out=str(tmp_path), progress=False, record=False)
    want, _ = reference.train(spec, search=[FIXTURES])
    assert_same_params(torch.load(tmp_path / "model.pt"), want)


def test_replicas_that_try_torchs_split_sum_its_weight_gradients(ray_session, tmp_path):
    """ZB-V on 2x2 with a user's layers that call F.linear: their chunks try torch's split of
    the backward from step 2 (``schedules.SPLIT_TRIAL``), whose W writes ``.grad`` outside
    autograd.  Every step equals one process.  (Each replica took those weights for unused this
    step and dropped their gradients: found by a user trial, a 2x2 ZB-V GPT whose last stage was
    not updated from step 2, half the one-process gradient norm.)"""
    # and each of those layers holds a Linear it never calls: no gradient, so AdamW's weight decay
    # leaves it alone in one process (a W that noted every weight of a gradient bucket as used
    # gave them zero gradients, which the decay then shrank: a review)
    *_, rows, want = _user_model_job(tmp_path, spec_of(2, 2, "zbv", "collective", steps=4,
                                                       parallelism={"partition": [2, 1, 1, 2]}),
                                     "functional_linears", {"layers": 4, "weight_grad_ms": 0.0, "unused": True},
                                     optimizer={"name": "adamw", "lr": 0.01, "weight_decay": 0.1})
    assert [r["loss"] for r in rows] == pytest.approx(want["losses"], rel=1e-5)
    assert [r["grad_norm"] for r in rows] == pytest.approx(want["grad_norm"], rel=1e-5)
