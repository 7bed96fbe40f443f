"""data.kind=tokens: exact samples from a memory-mapped token file, never loaded whole."""
import os
import pickle

import numpy as np
import pytest
import torch

from service.datasets import TokenFile, resolve_path, tokens
from service.spec import SpecError


def write(path, values, dtype="uint16"):
    path.parent.mkdir(parents=True, exist_ok=True)
    np.asarray(values, dtype=dtype).tofile(path)
    return str(path)


@pytest.fixture
def tiny(tmp_path):
    """Tokens 0..20 as uint16 with seq_len 4: (21 - 1) // 4 = 5 samples."""
    return tokens(write(tmp_path / "t.bin", range(21)), seq_len=4)


def test_exact_samples(tiny):
    assert isinstance(tiny, TokenFile) and len(tiny) == 5
    x, y = tiny[0]
    assert x.dtype == y.dtype == torch.int64
    assert x.tolist() == [0, 1, 2, 3] and y.tolist() == [1, 2, 3, 4]
    x, y = tiny[1]
    assert x.tolist() == [4, 5, 6, 7] and y.tolist() == [5, 6, 7, 8]
    x, y = tiny[4]  # the last sample ends on the last token
    assert x.tolist() == [16, 17, 18, 19] and y.tolist() == [17, 18, 19, 20]


def test_tokens_left_over_are_not_a_sample(tmp_path):
    ds = tokens(write(tmp_path / "t.bin", range(24)), seq_len=4)  # 23 // 4 = 5; tokens 21..23 unused
    assert len(ds) == 5 and ds[4][1].tolist() == [17, 18, 19, 20]


def test_out_of_range(tiny):
    for bad in (5, -1):
        with pytest.raises(IndexError, match=r"sample index -?\d is out of range: .*t\.bin has samples 0\.\.4"):
            tiny[bad]
    with pytest.raises(IndexError, match="sample index 7 is out of range"):
        tiny.inputs(torch.tensor([0, 7]))
    assert [x.tolist() for x, _ in tiny][-1] == [16, 17, 18, 19]  # iteration stops at the IndexError


def test_uint32_ids_above_uint16(tmp_path):
    ds = tokens(write(tmp_path / "t.bin", range(70_000, 70_021), "uint32"), seq_len=4, dtype="uint32")
    x, y = ds[2]
    assert x.tolist() == [70_008, 70_009, 70_010, 70_011] and y.tolist() == [70_009, 70_010, 70_011, 70_012]
    assert ds.targets([4]).tolist() == [[70_017, 70_018, 70_019, 70_020]]


def test_inputs_and_targets_equal_stacked_items(tiny):
    for idx in (torch.tensor([3, 0, 4, 3]), [1], torch.tensor([], dtype=torch.long)):
        pairs = [tiny[int(i)] for i in idx]
        x, y = tiny.inputs(idx), tiny.targets(idx)
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (len(idx), 4)
        if pairs:
            assert torch.equal(x, torch.stack([p[0] for p in pairs]))
            assert torch.equal(y, torch.stack([p[1] for p in pairs]))


def test_pickle_carries_no_data(tmp_path):
    ds = tokens(write(tmp_path / "t.bin", range(1000, 1000 + 4001)), seq_len=100)
    before = ds[7]  # opens the map
    blob = pickle.dumps(ds)
    assert len(blob) < 400 and np.arange(1000, 1100, dtype="<u2").tobytes()[:8] not in blob
    back = pickle.loads(blob)
    assert back._map is None and len(back) == 40
    assert all(torch.equal(a, b) for a, b in zip(back[7], before))
    assert back._map is not None  # opened again, lazily, in the new owner


def test_relative_path_through_search(tmp_path, monkeypatch):
    a, b, here = tmp_path / "a", tmp_path / "b", tmp_path / "here"
    write(a / "data" / "t.bin", range(21))
    write(b / "data" / "t.bin", range(100, 121))
    write(here / "data" / "t.bin", range(200, 221))
    monkeypatch.chdir(here)
    assert resolve_path("data/t.bin", [str(tmp_path / "none"), str(a), str(b)]) == (a / "data" / "t.bin").resolve()
    assert tokens("data/t.bin", 4, search=[str(b), str(a)])[0][0].tolist() == [100, 101, 102, 103]
    assert tokens("data/t.bin", 4, search=[str(tmp_path)])[0][0].tolist() == [200, 201, 202, 203]  # then cwd
    assert os.path.isabs(tokens("data/t.bin", 4).path)  # shipped to other processes as an absolute path


def message(**kwargs) -> str:
    with pytest.raises(SpecError) as e:
        tokens(**kwargs)
    return str(e.value)


def test_missing_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert message(path="nope.bin", seq_len=4, search=["/spec/dir"]) == (
        f"data.kind=tokens: no file 'nope.bin' (looked in /spec/dir, {tmp_path}); "
        "check args.path, or give an absolute path")
    assert message(path="/no/such/t.bin", seq_len=4) == (
        "data.kind=tokens: no file '/no/such/t.bin' (looked in /no/such/t.bin); "
        "check args.path, or give an absolute path")


def test_bad_dtype(tmp_path):
    assert message(path=write(tmp_path / "t.bin", range(21)), seq_len=4, dtype="int32") == (
        "data.kind=tokens: dtype 'int32' is not supported; use uint16 (vocabularies up to 65536) or uint32")


def test_size_not_whole_tokens(tmp_path):
    (tmp_path / "t.bin").write_bytes(b"\0" * 1001)
    assert message(path=str(tmp_path / "t.bin"), seq_len=4) == (
        f"data.kind=tokens: {tmp_path / 't.bin'} is 1001 bytes, not a whole number of uint16 tokens "
        "(2 bytes each); is dtype right?")
    (tmp_path / "u.bin").write_bytes(b"\0" * 1002)
    assert message(path=str(tmp_path / "u.bin"), seq_len=4, dtype="uint32") == (
        f"data.kind=tokens: {tmp_path / 'u.bin'} is 1002 bytes, not a whole number of uint32 tokens "
        "(4 bytes each); is dtype right?")


def test_shorter_than_one_sample(tmp_path):
    path = write(tmp_path / "t.bin", range(4))
    assert message(path=path, seq_len=4) == (
        f"data.kind=tokens: {path} holds 4 tokens, fewer than one sample needs (seq_len + 1 = 5); "
        "lower seq_len or give a longer file")
    assert len(tokens(path, seq_len=3)) == 1


def test_bad_seq_len_and_path(tmp_path):
    path = write(tmp_path / "t.bin", range(21))
    for bad in (0, -3, 2.5, "4", True):
        assert message(path=path, seq_len=bad) == (
            f"data.kind=tokens: seq_len is {bad!r}; give a whole number of tokens per sample, at least 1")
    assert message(path="", seq_len=4) == (
        "data.kind=tokens: path is ''; give the token file's path (absolute, or relative to the spec's folder)")


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        kb = next(line for line in f if line.startswith("VmRSS:")).split()[1]
    return int(kb) * 1024


def test_large_file_is_not_read_whole(tmp_path, tiny):
    n, seq_len = 50_000_000, 1024  # 100 MB of uint16
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        for start in range(0, n, 5_000_000):  # in chunks, so writing it does not raise the baseline
            (np.arange(start, start + 5_000_000) % 65_536).astype("<u2").tofile(f)
    assert path.stat().st_size == 2 * n
    warm = torch.tensor([0, 4])  # first-use costs of numpy/torch code paths, outside the measurement
    tiny.inputs(warm), tiny.targets(warm), [tiny[int(i)] for i in warm]

    before = rss_bytes()
    ds = tokens(str(path), seq_len=seq_len)
    idx = torch.tensor([0, 17, 20_000, len(ds) - 1])
    x, y = ds.inputs(idx), ds.targets(idx)
    items = [ds[int(i)] for i in idx]
    grown = rss_bytes() - before

    assert len(ds) == (n - 1) // seq_len
    expect = (idx[:, None] * seq_len + torch.arange(seq_len + 1)) % 65_536
    assert torch.equal(x, expect[:, :-1]) and torch.equal(y, expect[:, 1:])
    assert all(torch.equal(a, b) for (a, _), b in zip(items, expect[:, :-1]))
    # Reading it whole costs ~95 MiB. The kernel maps the pages around each one touched (fault-around,
    # large page-cache folios of up to 2 MiB), so a few MiB per place read, whatever the file's size.
    assert grown < path.stat().st_size / 8, f"resident memory grew by {grown / 2**20:.1f} MiB"
