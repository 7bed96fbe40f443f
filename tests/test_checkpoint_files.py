"""Checkpoints are atomic: a failed write leaves no partial checkpoint behind. Each stage writes
its own part, keyed by name, and any cut of the layers reads back the names it holds."""
import json
import multiprocessing
import os
import time

import pytest
import torch
from torch import nn

from actors.state import clone, layer_of, load_optimizer_state, optimizer_state_by_name, subset_state
from service import checkpoint


def test_save_load_and_keep(tmp_path):
    for step in (2, 4, 6, 8):
        checkpoint.save(tmp_path, step, {"w": torch.full((2,), float(step))}, {"state": {}, "groups": []},
                        {"name": "x"}, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-00000006", "step-00000008"]
    state = checkpoint.load(tmp_path)
    assert state["step"] == 8 and state["model"]["w"].tolist() == [8.0, 8.0] and state["meta"]["name"] == "x"
    assert checkpoint.load(tmp_path / "step-00000006")["step"] == 6


def test_failed_write_leaves_previous_checkpoint(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 1, {"w": torch.zeros(1)}, {"state": {}, "groups": []}, {})

    def broken_save(obj, f):
        f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tmp_path, 2, {"w": torch.ones(1)}, {"state": {}, "groups": []}, {})
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]
    assert checkpoint.latest(tmp_path).name == "step-00000001"


def test_incomplete_folder_is_ignored(tmp_path):
    (tmp_path / "step-00000009").mkdir()
    (tmp_path / "step-00000009" / "state.pt").write_bytes(b"partial")
    assert checkpoint.latest(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoint.resolve(tmp_path)


# ---------------------------------------------------------------- format 2: one part per stage

CUTS = [(0, 1), (1, 2), (2, 4), (4, 5)]  # four stages' layers [lo, hi)


def _trained(seed: int = 0, tie: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model with a buffer (BatchNorm) after one Adam step."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 16))
    if tie:
        model[4].weight = model[0].weight
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randint(0, 16, (12,))
    nn.functional.cross_entropy(model(x), x).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    names = [n for n, _ in model.named_parameters()]
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": clone(optimizer_state_by_name(opt, names))}


def _stage(state: dict, lo: int, hi: int) -> dict:
    return subset_state(state, set(range(lo, hi)))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _write_parts(root, step: int, state: dict, cuts=CUTS) -> tuple:
    folder = checkpoint.begin(root, step)
    parts = [checkpoint.write_part(folder, s, len(cuts), **_stage(state, lo, hi)) for s, (lo, hi) in enumerate(cuts)]
    return folder, parts


def _save_parts(root, step: int, state: dict, cuts=CUTS, keep: int = 3):
    folder, parts = _write_parts(root, step, state, cuts)
    return checkpoint.finish(root, folder, step, parts, {}, keep=keep)


def test_parts_written_by_concurrent_processes_load_whole_and_by_name(tmp_path):
    state = _state(*_trained())
    folder = checkpoint.begin(tmp_path, 50)
    assert folder.parent == tmp_path and folder.name.startswith(".tmp-step-00000050-") and folder.is_dir()
    # fresh processes, as with spawn, but torch is imported once (in the server), not four times
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["service.checkpoint"])
    with ctx.Pool(4) as pool:
        stages = [_stage(state, lo, hi) for lo, hi in CUTS]
        parts = pool.starmap(checkpoint.write_part,
                             [(folder, s, 4, st["model"], st["optim"]) for s, st in enumerate(stages)])
    final = checkpoint.finish(tmp_path, folder, 50, parts[::-1], {"job_id": "j"})
    assert final == tmp_path / "step-00000050" and not folder.exists()
    assert sorted(os.listdir(final)) == ["meta.json"] + [f"part-0000{s}-of-00004.pt" for s in range(4)]
    meta = json.loads((final / "meta.json").read_text())
    assert meta["format"] == 2 and meta["step"] == 50 and meta["job_id"] == "j"
    assert [p["file"] for p in meta["parts"]] == [f"part-0000{s}-of-00004.pt" for s in range(4)]
    assert meta["parts"][1]["model"] == ["1.weight", "1.bias"] and meta["parts"][1]["optim"] == ["1.weight", "1.bias"]
    assert meta["parts"][2]["model"][-1] == "2.num_batches_tracked"

    assert_loads_whole_and_by_name(tmp_path, final, state)


def assert_loads_whole_and_by_name(root, final, state: dict) -> None:
    """The newest checkpoint under ``root`` (``final``, step 50 of job "j") holds ``state``: read
    whole, and by name for another cut (only those entries)."""
    got = checkpoint.load(root)
    assert got["step"] == 50 and got["path"] == str(final) and got["meta"]["job_id"] == "j"
    assert list(got["model"]) == list(state["model"]) and _same(got["model"], state["model"])
    assert _same(got["optim"], state["optim"])
    assert checkpoint.names_in(root) == list(state["model"])

    wanted = lambda n: layer_of(n) in (2, 3, 4)  # noqa: E731  another cut: layers [2, 5)
    sub = checkpoint.load(final, names=wanted)
    assert _same(sub["model"], {k: v for k, v in state["model"].items() if wanted(k)})
    assert _same(sub["optim"]["state"], {k: v for k, v in state["optim"]["state"].items() if wanted(k)})
    assert sub["optim"]["groups"] == state["optim"]["groups"]
    assert set(checkpoint.load(final, names={"1.bias", "4.weight"})["model"]) == {"1.bias", "4.weight"}


def test_load_by_name_opens_only_the_parts_holding_them(tmp_path, monkeypatch):
    state = _state(*_trained())
    final = _save_parts(tmp_path, 7, state)
    (final / "part-00003-of-00004.pt").write_bytes(b"not a part")  # layer 4's part: unreadable
    opened = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: opened.append(os.path.basename(f)) or real_load(f, *a, **k))
    got = checkpoint.load(final, names=lambda n: layer_of(n) == 1)
    assert opened == ["part-00001-of-00004.pt"]
    assert _same(got["model"], {"1.weight": state["model"]["1.weight"], "1.bias": state["model"]["1.bias"]})
    assert set(got["optim"]["state"]) == {"1.weight", "1.bias"}
    assert checkpoint.names_in(final) == list(state["model"]) and opened == ["part-00001-of-00004.pt"]
    with pytest.raises(Exception):
        checkpoint.load(final, names={"4.bias"})


def test_crash_between_parts_leaves_no_checkpoint(tmp_path):
    state = _state(*_trained())
    checkpoint.save(tmp_path, 1, **state, meta={})
    folder = checkpoint.begin(tmp_path, 2)
    checkpoint.write_part(folder, 0, 2, **_stage(state, 0, 2))  # the other stage died: no finish
    # written in place (as on object storage) but the manifest never came: not complete either
    (tmp_path / "step-00000003").mkdir()
    checkpoint.write_part(tmp_path / "step-00000003", 0, 1, **state)
    # a manifest naming a part that is not there
    (tmp_path / "step-00000004").mkdir()
    (tmp_path / "step-00000004" / "meta.json").write_text(json.dumps(
        {"step": 4, "format": 2, "parts": [{"file": "part-00000-of-00001.pt", "model": [], "optim": []}]}))
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-00000001"]
    assert checkpoint.load(tmp_path)["step"] == 1

    # begin removes temporary folders more than an hour old, not fresh ones
    fresh = checkpoint.begin(tmp_path, 5)
    hour_ago = time.time() - 3700
    os.utime(folder, (hour_ago, hour_ago))
    checkpoint.begin(tmp_path, 6)
    assert not folder.exists() and fresh.exists()


def test_finish_checks_the_parts_and_removes_the_folder_on_error(tmp_path):
    state = _state(*_trained())
    folder, parts = _write_parts(tmp_path, 3, state)
    with pytest.raises(ValueError, match="not parts 0..3"):
        checkpoint.finish(tmp_path, folder, 3, parts[:3], {})
    assert not folder.exists() and checkpoint.latest(tmp_path) is None

    folder, parts = _write_parts(tmp_path, 3, state)
    os.remove(folder / parts[1]["file"])
    with pytest.raises(FileNotFoundError, match="part-00001-of-00004.pt is missing"):
        checkpoint.finish(tmp_path, folder, 3, parts, {})
    assert os.listdir(tmp_path) == []


def test_finish_replaces_a_checkpoint_of_the_same_step_and_keeps_the_newest(tmp_path):
    a, b = _state(*_trained(0)), _state(*_trained(1))
    for step in (1, 2, 3):
        _save_parts(tmp_path, step, a, keep=2)
    _save_parts(tmp_path, 3, b, cuts=[(0, 3), (3, 5)], keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000002", "step-00000003"]
    assert _same(checkpoint.load(tmp_path)["model"], b["model"])
    assert len(checkpoint.load(tmp_path)["meta"]["parts"]) == 2


def test_tied_parameter_in_two_parts(tmp_path):
    model, opt = _trained(tie=True)
    state = _state(model, opt)
    assert "4.weight" in state["model"] and "4.weight" not in state["optim"]["state"]  # one parameter
    # the last stage holds its own copy of the tied parameter under the first stage's name too
    first, last = _stage(state, 0, 2), _stage(state, 2, 5)
    last["model"]["0.weight"] = state["model"]["0.weight"].clone()
    last["optim"]["state"]["0.weight"] = {k: v.clone() for k, v in state["optim"]["state"]["0.weight"].items()}
    folder = checkpoint.begin(tmp_path, 4)
    parts = [checkpoint.write_part(folder, 0, 2, **first), checkpoint.write_part(folder, 1, 2, **last)]
    checkpoint.finish(tmp_path, folder, 4, parts, {})
    got = checkpoint.load(tmp_path)
    assert _same(got["model"], state["model"]) and _same(got["optim"], state["optim"])
    assert checkpoint.names_in(tmp_path).count("0.weight") == 1

    last["model"]["0.weight"] += 1  # copies that differ are a bug, not a tie
    folder = checkpoint.begin(tmp_path, 5)
    parts = [checkpoint.write_part(folder, 0, 2, **first), checkpoint.write_part(folder, 1, 2, **last)]
    with pytest.raises(ValueError, match="'0.weight' is in part-00000-of-00002.pt and part-00001-of-00002.pt"):
        checkpoint.finish(tmp_path, folder, 5, parts, {})
    assert not folder.exists() and checkpoint.latest(tmp_path).name == "step-00000004"


def _shift(name: str, by: int) -> str:
    """The name of a state key in a model whose layers start ``by`` later ('1.weight', -1 -> '0.weight')."""
    layer, rest = name.split(".", 1)
    return f"{int(layer) + by}.{rest}"


def test_adam_state_round_trips_into_another_cut(tmp_path):
    model, opt = _trained()
    saved = _state(model, opt)
    _save_parts(tmp_path, 1, saved)
    # a stage of another shape, holding layers [1, 5), resumes from it
    fresh, _ = _trained(seed=9)
    stage = nn.Sequential(*list(fresh)[1:])
    got = checkpoint.load(tmp_path, names=lambda n: layer_of(n) >= 1)
    stage.load_state_dict({_shift(k, -1): v for k, v in got["model"].items()})
    stage_opt = torch.optim.Adam(stage.parameters(), lr=0.5)
    load_optimizer_state(stage_opt, [_shift(n, 1) for n, _ in stage.named_parameters()], got["optim"])
    assert stage_opt.param_groups[0]["lr"] == 1e-2
    # one more step on both ends in the same state
    h = torch.randn(12, 8)
    for m, o in ((nn.Sequential(*list(model)[1:]), opt), (stage, stage_opt)):
        m(h).square().mean().backward()
        o.step()
    assert _same(stage.state_dict(), {_shift(k, -1): v for k, v in model.state_dict().items() if layer_of(k) >= 1})
    assert _same(list(stage_opt.state_dict()["state"].values()), list(opt.state_dict()["state"].values())[1:])
    # tensors were memory-mapped: stepping on them did not change the files
    assert _same(checkpoint.load(tmp_path)["optim"], saved["optim"])


def test_old_format_still_loads(tmp_path):
    state = _state(*_trained())
    old = tmp_path / "step-00000012"
    old.mkdir()
    torch.save({"step": 12, **state}, old / "state.pt")
    (old / "meta.json").write_text(json.dumps({"step": 12, "time": 0.0, "name": "x"}))
    assert checkpoint.latest(tmp_path) == old and checkpoint.resolve(old) == old
    got = checkpoint.load(tmp_path)
    assert got["step"] == 12 and got["meta"]["name"] == "x" and _same(got["model"], state["model"])
    assert _same(got["optim"], state["optim"])
    assert checkpoint.names_in(old) == list(state["model"])
    sub = checkpoint.load(old, names={"2.running_mean", "2.weight"})
    assert set(sub["model"]) == {"2.running_mean", "2.weight"} and set(sub["optim"]["state"]) == {"2.weight"}
    # a new checkpoint beside it is newer and prunes it
    checkpoint.save(tmp_path, 13, **state, meta={}, keep=1)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-00000013"]


def test_a_checkpoint_a_lost_worker_could_not_write_is_not_counted_as_a_storage_failure():
    """A node crash seen first by the checkpoint's calls (the step's own failure came after):
    "failed (1 in a row, ...); training goes on" was written, and counted against
    checkpoint.max_failures, though the storage was fine and the job was about to restart."""
    import ray.exceptions

    from actors.checkpoints import CheckpointWriter
    from actors.failures import JobFailure
    from service.spec import parse_spec
    from tests.test_api import small_spec

    class Record:
        def __init__(self):
            self.events = []

        def event(self, kind, message, **fields):
            self.events.append((kind, message, fields))

    spec = parse_spec(small_spec("ckpt-lost", checkpoint={"every_steps": 5, "max_failures": 2, "fail_after_s": 0}))
    record = Record()
    writer = CheckpointWriter(None, None, spec, record, {}, timeout=1.0)
    for step in (5, 10, 15):
        writer._failed(step, ray.exceptions.ActorUnavailableError("The actor is temporarily unavailable: RpcError", None))
    assert writer.failures == 0
    assert [m.split(" (")[0] for _, m, _ in record.events] == [
        f"checkpoint of step {s} not completed: a worker was lost while it was written" for s in (5, 10, 15)]
    assert "ActorUnavailableError: The actor None is unavailable" in record.events[0][1]
    writer._failed(20, OSError("the bucket timed out"))  # the storage: counted
    assert writer.failures == 1 and record.events[-1][1].endswith("OSError: the bucket timed out; training goes on")
    with pytest.raises(JobFailure, match="2 checkpoints in a row could not be written"):
        writer._failed(25, OSError("the bucket timed out"))


def test_checkpoints_that_fail_for_less_than_fail_after_s_do_not_end_the_job_and_a_hanging_one_says_so():
    """A job writing a checkpoint every few seconds failed after 37 s of storage outage (3 fast
    failures in a row), its restarts unused; and a storage that hung said nothing for minutes (a
    user trial).  Now max_failures ends the job only once the failures have lasted
    checkpoint.fail_after_s, and a checkpoint still being written after slow_after_s says so, once."""
    from actors.checkpoints import CheckpointWriter
    from actors.failures import JobFailure
    from service.spec import parse_spec
    from tests.test_api import small_spec

    class Record:
        def __init__(self):
            self.events = []

        def event(self, kind, message, **fields):
            self.events.append((kind, message, fields))

    spec = parse_spec(small_spec("ckpt-blip", checkpoint={"every_steps": 5, "max_failures": 3, "fail_after_s": 60,
                                                          "slow_after_s": 30}))
    record, now = Record(), [1000.0]
    writer = CheckpointWriter(None, "s3://b/x", spec, record, {}, timeout=1.0)
    writer.clock = lambda: now[0]
    for t in (0, 5, 10, 15, 50):  # five fast failures within 50 s: training goes on
        now[0] = 1000.0 + t
        writer._failed(t, OSError("Could not connect to the endpoint URL"))
    assert writer.failures == 5
    assert record.events[-1][1] == ("checkpoint of step 50 failed (5 in a row over 50 s, the job fails at 3 and 60 s): "
                                    "OSError: Could not connect to the endpoint URL; training goes on")
    assert record.events[-1][2]["failing_s"] == 50.0
    now[0] = 1061.0
    with pytest.raises(JobFailure) as e:
        writer._failed(61, OSError("Could not connect to the endpoint URL"))
    assert str(e.value) == ("6 checkpoints in a row could not be written to s3://b/x over 61 s (checkpoint.max_failures "
                            "is 3, checkpoint.fail_after_s 60); the last: OSError: Could not connect to the endpoint URL")
    assert record.events[-1][1].endswith("; the job stops: checkpoint.max_failures is reached")
    # one that is written starts the count again
    writer.failures, writer.failing_since = 0, None
    now[0] = 2000.0
    writer._failed(70, OSError("down"))
    assert writer.failing_since == 2000.0
    # a checkpoint that hangs: said once, after slow_after_s
    flight = {"step": 75, "t0": 2000.0}
    writer.written = (45, "s3://b/x/step-00000045")
    for t in (10, 31, 40, 90):
        now[0] = 2000.0 + t
        writer._say_if_slow(flight)
    slow = [(m, f) for k, m, f in record.events if k == "checkpoint_slow"]
    assert slow == [("checkpoint of step 75 is still being written after 31 s (checkpoint.slow_after_s is 30): the "
                     "storage at s3://b/x is slow or does not answer; training goes on, and the newest complete "
                     "checkpoint is step 45", {"step": 75, "seconds": 31.0})]


def test_a_checkpoint_due_while_the_previous_is_being_written_is_taken_at_the_next_boundary(ray_session, tmp_path):
    """One checkpoint is written at a time: one due (step 10) while step 5's is still being
    written is taken at the first step boundary after that one ends, says which step asked for
    it, and is the one a restart finds; the next due one (15) is on time again."""
    import threading

    import ray

    from actors.checkpoints import CheckpointWriter
    from service.spec import parse_spec
    from tests.test_api import small_spec

    @ray.remote(max_concurrency=4)
    class Part:  # a stage's worker of replica 0: its part is written once the test lets it
        def __init__(self):
            self.gates = {}

        def _gate(self, step):
            return self.gates.setdefault(step, threading.Event())

        def save_part(self, folder, step):
            self.folder = folder
            return 0.001

        def let(self, step):
            self._gate(step).set()

        def part_written(self, step):
            self._gate(step).wait(60)
            entry = checkpoint.write_part(self.folder, 0, 1, {"w": torch.full((3,), float(step))}, {"state": {}, "groups": []})
            return {**entry, "copy_s": 0.0}

    class Shape:
        pp, tp = 1, 1

        @staticmethod
        def slot(s, j):
            return s

    class Group:
        shape, workers = Shape(), {(0, 0): Part.remote()}

    class Record:
        def __init__(self):
            self.events = []

        def event(self, kind, message, **fields):
            self.events.append({"type": kind, "message": message, **fields})

    part = Group.workers[(0, 0)]
    spec = parse_spec(small_spec("ckpt-late", 1000, checkpoint={"every_steps": 5, "path": str(tmp_path), "keep": 5}))
    record = Record()
    writer = CheckpointWriter(Group(), str(tmp_path), spec, record, {"job": "ckpt-late"}, timeout=60)
    for step in range(1, 12):  # step 5's part is not written yet when step 10 asks for one
        writer.after_commit(step)
    assert writer.flight["step"] == 5 and writer.owed == 10 and record.events == []
    ray.get(part.let.remote(5))
    deadline = time.monotonic() + 30
    while writer.flight is not None:  # step 5's written, with no step boundary meanwhile (a slow step)
        assert time.monotonic() < deadline, "step 5's checkpoint was never written"
        time.sleep(0.02)
        writer.poll()
    assert writer.owed == 10
    step = 12
    writer.after_commit(step)  # the first boundary after step 5's is written starts the owed one
    step += 1
    late = writer.flight["step"]
    assert late == 12 and writer.flight["asked"] == 10 and writer.owed is None
    ray.get([part.let.remote(k) for k in (late, 15)])
    deadline = time.monotonic() + 30
    while writer.flight is not None:  # written while no boundary comes (a slow step)
        assert time.monotonic() < deadline, "the late checkpoint was never written"
        time.sleep(0.02)
        writer.poll()
    for k in range(step, 16):
        writer.after_commit(k)
    writer.poll(block=True)
    written = [e for e in record.events if e["type"] == "checkpoint"]
    assert [(e["step"], e["asked_at"]) for e in written[:3]] == [(5, 5), (late, 10), (15, 15)]
    assert written[1]["message"].endswith("(due at step 10; the previous one was still being written)")
    assert "due at" not in written[0]["message"] + written[2]["message"]
    assert len(written) == 3 and [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(tmp_path)] == [5, late, 15]
    assert checkpoint.load(written[1]["path"])["model"]["w"].tolist() == [float(late)] * 3
