"""Checkpoints on object storage: the same format and guarantees as on a local disk, on a real
S3 (moto's server over HTTP, tests/s3server.py) where there is no rename: parts go straight to
the final folder and the manifest, written last, is what makes a checkpoint complete."""
import json
import multiprocessing
import os
import socket
import time
from pathlib import Path

import pytest
import torch

from service import checkpoint, storage
from tests.test_checkpoint_files import CUTS, _same, _stage, _state, _trained, assert_loads_whole_and_by_name

EMPTY = {"state": {}, "groups": []}


def _bucket(url: str) -> str:
    return url[len("s3://"):].split("/", 1)[0]


def _names(found) -> list[str]:
    return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in found]


def test_save_load_and_keep(s3_server, s3_bucket):
    root = f"{s3_bucket}/runs/a"
    assert checkpoint.list_checkpoints(root) == [] and checkpoint.latest(root) is None
    for step in (2, 4, 6, 8):
        got = checkpoint.save(root, step, {"w": torch.full((2,), float(step))}, EMPTY, {"name": "x"}, keep=2)
        assert got == f"{root}/step-{step:08d}"
    assert checkpoint.list_checkpoints(root) == [f"{root}/step-00000006", f"{root}/step-00000008"]
    # the older ones are gone from the bucket, not just hidden
    assert s3_server.keys(_bucket(s3_bucket)) == [f"runs/a/step-0000000{s}/{f}" for s in (6, 8)
                                                  for f in ("meta.json", "part-00000-of-00001.pt")]
    state = checkpoint.load(root)
    assert state["step"] == 8 and state["model"]["w"].tolist() == [8.0, 8.0] and state["meta"]["name"] == "x"
    assert state["path"] == f"{root}/step-00000008"
    assert checkpoint.load(f"{root}/step-00000006/")["step"] == 6  # a trailing slash is the same folder
    assert checkpoint.resolve(root) == f"{root}/step-00000008" and checkpoint.step_of(root) == 8
    with pytest.raises(FileNotFoundError, match="no complete checkpoint at s3://"):
        checkpoint.resolve(f"{s3_bucket}/runs/none")


def test_parts_written_by_concurrent_processes_load_whole_and_by_name(s3_server, s3_bucket):
    state = _state(*_trained())
    root = f"{s3_bucket}/ck"
    folder = checkpoint.begin(root, 50)
    assert folder == f"{root}/step-00000050"  # no rename on S3: the final folder
    stages = [_stage(state, lo, hi) for lo, hi in CUTS]
    first = checkpoint.write_part(folder, 0, 4, **stages[0])
    fs, path = storage.fs_and_path(folder)
    assert [os.path.basename(p) for p in fs.ls(path)] == ["part-00000-of-00004.pt"]  # listed before the others
    # two fresh processes write the other parts at once (torch imported once, in the fork server)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["service.checkpoint"])
    with ctx.Pool(2) as pool:
        parts = pool.starmap(checkpoint.write_part,
                             [(folder, s, 4, st["model"], st["optim"]) for s, st in enumerate(stages) if s])
    assert checkpoint.list_checkpoints(root) == []  # every part, no manifest: not a checkpoint yet
    # this process sees what the others wrote (no stale listing) when finish checks the parts
    final = checkpoint.finish(root, folder, 50, [first] + parts[::-1], {"job_id": "j"})
    assert final == folder
    assert s3_server.keys(_bucket(s3_bucket)) == ["ck/step-00000050/meta.json"] + [
        f"ck/step-00000050/part-0000{s}-of-00004.pt" for s in range(4)]
    meta = json.loads(fs.cat_file(path + "/meta.json"))
    assert meta["format"] == 2 and meta["step"] == 50 and meta["job_id"] == "j"
    assert [p["file"] for p in meta["parts"]] == [f"part-0000{s}-of-00004.pt" for s in range(4)]
    assert all(p["bytes"] == fs.size(f"{path}/{p['file']}") for p in meta["parts"])

    assert_loads_whole_and_by_name(root, final, state)


def test_crash_between_parts_leaves_no_checkpoint(s3_server, s3_bucket):
    state = _state(*_trained())
    root = f"{s3_bucket}/ck"
    checkpoint.save(root, 1, **state, meta={})
    folder = checkpoint.begin(root, 2)
    checkpoint.write_part(folder, 0, 2, **_stage(state, 0, 2))  # the other stage died: no finish
    assert "ck/step-00000002/part-00000-of-00002.pt" in s3_server.keys(_bucket(s3_bucket))
    assert checkpoint.list_checkpoints(root) == [f"{root}/step-00000001"]
    assert checkpoint.latest(root) == f"{root}/step-00000001" and checkpoint.load(root)["step"] == 1

    # a manifest whose part is there but not whole (another size than it says): not complete
    fs, path = storage.fs_and_path(root)
    entry = checkpoint.write_part(f"{root}/step-00000003", 0, 1, **state)
    fs.pipe_file(f"{path}/step-00000003/meta.json", json.dumps(
        {"step": 3, "format": 2, "parts": [{**entry, "bytes": entry["bytes"] + 1}]}).encode())
    assert checkpoint.latest(root) == f"{root}/step-00000001"
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoint.resolve(f"{root}/step-00000003")

    # the next checkpoint with keep=1 removes the older one and the unfinished ones below it
    checkpoint.save(root, 4, **state, meta={}, keep=1)
    assert s3_server.keys(_bucket(s3_bucket)) == ["ck/step-00000004/meta.json", "ck/step-00000004/part-00000-of-00001.pt"]


def test_finish_checks_parts_and_sizes_and_removes_the_folder_on_error(s3_server, s3_bucket):
    state = _state(*_trained())
    root = f"{s3_bucket}/ck"
    folder = checkpoint.begin(root, 3)
    parts = [checkpoint.write_part(folder, s, 2, **_stage(state, *cut)) for s, cut in enumerate([(0, 2), (2, 5)])]
    with pytest.raises(ValueError, match=r"part-00001-of-00002.pt has \d+ bytes, its entry says 1$"):
        checkpoint.finish(root, folder, 3, [parts[0], {**parts[1], "bytes": 1}], {})
    assert s3_server.keys(_bucket(s3_bucket)) == [] and checkpoint.latest(root) is None

    folder = checkpoint.begin(root, 3)
    parts = [checkpoint.write_part(folder, s, 2, **_stage(state, *cut)) for s, cut in enumerate([(0, 2), (2, 5)])]
    storage.fs_and_path(folder)[0].rm(storage.fs_and_path(folder)[1] + "/part-00001-of-00002.pt")
    with pytest.raises(FileNotFoundError, match=f"{folder}/part-00001-of-00002.pt is missing"):
        checkpoint.finish(root, folder, 3, parts, {})
    assert s3_server.keys(_bucket(s3_bucket)) == []
    with pytest.raises(ValueError, match="not the one begin"):  # parts elsewhere than begin said
        checkpoint.finish(root, f"{root}/elsewhere", 3, parts, {})

    def broken_save(obj, f):
        f.write(b"half")
        raise OSError("disk full")

    folder = checkpoint.begin(root, 5)
    real_save, torch.save = torch.save, broken_save
    try:
        with pytest.raises(OSError, match="disk full"):
            checkpoint.write_part(folder, 0, 1, **state)
    finally:
        torch.save = real_save
    assert s3_server.keys(_bucket(s3_bucket)) == []  # what it wrote is removed


def test_a_checkpoint_of_the_same_step_written_again_replaces_it(s3_server, s3_bucket):
    a, b = _state(*_trained(0)), _state(*_trained(1))
    root = f"{s3_bucket}/ck"
    for step in (1, 2, 3):
        folder = checkpoint.begin(root, step)
        parts = [checkpoint.write_part(folder, s, 4, **_stage(a, lo, hi)) for s, (lo, hi) in enumerate(CUTS)]
        checkpoint.finish(root, folder, step, parts, {}, keep=2)
    folder = checkpoint.begin(root, 3)
    # begin removed step 3's manifest first, then its parts: the newest complete one is step 2
    assert checkpoint.latest(root) == f"{root}/step-00000002"
    assert s3_server.keys(_bucket(s3_bucket), "ck/step-00000003/") == []
    parts = [checkpoint.write_part(folder, s, 2, **_stage(b, lo, hi)) for s, (lo, hi) in enumerate([(0, 3), (3, 5)])]
    checkpoint.finish(root, folder, 3, parts, {}, keep=2)
    assert s3_server.keys(_bucket(s3_bucket), "ck/step-00000003/") == [
        "ck/step-00000003/meta.json", "ck/step-00000003/part-00000-of-00002.pt", "ck/step-00000003/part-00001-of-00002.pt"]
    assert _names(checkpoint.list_checkpoints(root)) == ["step-00000002", "step-00000003"]
    got = checkpoint.load(root)
    assert _same(got["model"], b["model"]) and len(got["meta"]["parts"]) == 2
    checkpoint.remove(f"{root}/step-00000002")
    assert checkpoint.list_checkpoints(root) == [f"{root}/step-00000003"]
    with pytest.raises(ValueError, match="a whole bucket"):
        checkpoint.remove(s3_bucket)


# ---------------------------------------------------------------- checking a URL before a job starts


def _refused(url: str, *match: str) -> str:
    start = time.monotonic()
    with pytest.raises(ValueError) as e:
        storage.check_url(url)
    took = time.monotonic() - start
    assert took < 5, f"check_url({url!r}) took {took:.1f}s"
    for m in match:
        assert m in str(e.value), f"{m!r} not in {str(e.value)!r}"
    return str(e.value)


def test_check_url_says_what_to_do(s3_server, s3_bucket, tmp_path, monkeypatch):
    storage.check_url(f"{s3_bucket}/ck")  # fine: nothing raised
    storage.check_url(tmp_path / "new" / "ck")
    storage.check_url(f"file://{tmp_path}")

    _refused("foo://x", "checkpoint.path 'foo://x': unknown storage scheme 'foo'; use a local folder, "
                        "file:///path, s3://bucket/prefix")
    _refused("s3://no-such-bucket/ck", "checkpoint.path 's3://no-such-bucket/ck': bucket 'no-such-bucket' "
                                       f"does not exist at {s3_server.endpoint}; create it first")
    (tmp_path / "file").write_text("x")
    _refused(str(tmp_path / "file"), "is a file, not a folder")

    # nothing listens on that port: answered at once, naming the endpoint
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
    _refused(f"{s3_bucket}/ck", f"cannot reach the storage endpoint {closed}", "AWS_ENDPOINT_URL")
    # one that takes the connection and never answers: given up after the check's short timeout
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(4)
        silent = f"http://127.0.0.1:{mute.getsockname()[1]}"
        monkeypatch.setenv("AWS_ENDPOINT_URL", silent)
        _refused(f"{s3_bucket}/ck", f"cannot reach the storage endpoint {silent}", "timeout")


def test_check_url_refused_credentials(s3_auth_server, monkeypatch):
    server, bucket, keys = s3_auth_server
    key, secret = keys["allowed"]
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    storage.check_url(f"s3://{bucket}/ck")  # a key the server knows
    checkpoint.save(f"s3://{bucket}/ck", 1, {"w": torch.ones(1)}, EMPTY, {})
    assert checkpoint.load(f"s3://{bucket}/ck")["step"] == 1

    how = "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    msg = _refused(f"s3://{bucket}/ck", f"{server.endpoint} refused the credentials for bucket {bucket!r}",
                   "SignatureDoesNotMatch", how, "AWS_ENDPOINT_URL", "never from the spec")
    assert "wrong" not in msg  # a secret is never shown
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWN000000000")
    _refused(f"s3://{bucket}/ck", "refused the credentials", "InvalidAccessKeyId", how)
    with pytest.raises(PermissionError):  # and so does the storage itself, loudly (not "no checkpoint")
        checkpoint.latest(f"s3://{bucket}/ck")
    # a key the server knows, of a user allowed nothing
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", keys["denied"][0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", keys["denied"][1])
    _refused(f"s3://{bucket}/ck", f"{server.endpoint} denied these credentials access to bucket {bucket!r}",
             "AccessDenied", "s3:ListBucket", how)


# ---------------------------------------------------------------- the same code on a local disk


@pytest.mark.parametrize("form", ["str", "file-url", "path"])
def test_local_roots_through_the_same_code(tmp_path, form):
    root = {"str": str(tmp_path), "file-url": f"file://{tmp_path}", "path": tmp_path}[form]
    state = _state(*_trained())
    for step in (1, 2):
        folder = checkpoint.begin(root, step)
        assert isinstance(folder, Path) and folder.name.startswith(f".tmp-step-0000000{step}-")  # renamed later
        parts = [checkpoint.write_part(folder, s, 4, **_stage(state, lo, hi)) for s, (lo, hi) in enumerate(CUTS)]
        assert checkpoint.finish(root, folder, step, parts, {}, keep=1) == tmp_path / f"step-0000000{step}"
    assert checkpoint.list_checkpoints(root) == [tmp_path / "step-00000002"]
    assert sorted(os.listdir(tmp_path)) == ["step-00000002"]
    got = checkpoint.load(root)
    assert got["path"] == str(tmp_path / "step-00000002") and _same(got["model"], state["model"])
    assert storage.is_local(root) and storage.fs_and_path(root)[1] == str(tmp_path)
    checkpoint.remove(checkpoint.latest(root))
    assert os.listdir(tmp_path) == []


def test_another_fsspec_protocol_takes_the_remote_path():
    """``memory://`` (one process only) stands for any storage without rename that fsspec has."""
    root = f"memory://ckpt-{os.getpid()}-{time.monotonic_ns()}/ck"
    state = _state(*_trained())
    for step in (1, 2, 3):
        assert checkpoint.save(root, step, **state, meta={}, keep=2) == f"{root}/step-0000000{step}"
    assert checkpoint.list_checkpoints(root) == [f"{root}/step-00000002", f"{root}/step-00000003"]
    assert _same(checkpoint.load(root)["model"], state["model"])
    storage.check_url(root)


def test_storage_helpers():
    assert storage.join("s3://b/ck/", "step-00000001", "meta.json") == "s3://b/ck/step-00000001/meta.json"
    assert storage.join("s3://b", "x") == "s3://b/x" and storage.join(Path("/a"), "b") == Path("/a/b")
    assert storage.join("/a", "b") == "/a/b" and storage.join("file:///a", "b") == "file:///a/b"
    assert storage.is_local("/a") and storage.is_local(Path("a")) and storage.is_local("file:///a")
    assert not storage.is_local("s3://b/a") and not storage.is_local("memory://a")
    fs, path = storage.fs_and_path("s3://b/ck/")
    assert path == "b/ck" and "s3" in fs.protocol
    assert storage.fs_and_path("file:///tmp/x")[1] == "/tmp/x"
    assert "s3://bucket/prefix" in storage.usable()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_jobs_sharing_a_folder_restart_and_prune_among_their_own_checkpoints(where, tmp_path, request):
    """Two `relaytrain run` jobs with one checkpoint.path: the second restarted from the first's
    step 60 (steps 21-60 never ran, yet it SUCCEEDED) and deleted its own steps 10 and 20 as it
    wrote them, since keep counted the other job's newer ones (found by a user trial)."""
    root = str(tmp_path / "ck") if where == "local" else f"{request.getfixturevalue('s3_bucket')}/shared"
    w = lambda s: {"w": torch.full((2,), float(s))}  # noqa: E731
    for step in (40, 50, 60):
        checkpoint.save(root, step, w(step), EMPTY, {"job_id": "p"}, keep=3)
    for step in (10, 20):
        checkpoint.save(root, step, w(step), EMPTY, {"job_id": "q"}, keep=3)
    assert _names(checkpoint.list_checkpoints(root, "q")) == ["step-00000010", "step-00000020"]
    assert _names(checkpoint.list_checkpoints(root, "p")) == ["step-00000040", "step-00000050", "step-00000060"]
    assert _names([checkpoint.latest(root, "q")]) == ["step-00000020"]
    assert _names([checkpoint.latest(root)]) == ["step-00000060"]  # `--resume` of the folder: the newest of any
    assert checkpoint.latest(root, "r") is None
    for step in (30, 70):  # q goes on: its own oldest goes, p's stay
        checkpoint.save(root, step, w(step), EMPTY, {"job_id": "q"}, keep=3)
    assert _names(checkpoint.list_checkpoints(root, "q")) == ["step-00000020", "step-00000030", "step-00000070"]
    assert _names(checkpoint.list_checkpoints(root, "p")) == ["step-00000040", "step-00000050", "step-00000060"]
