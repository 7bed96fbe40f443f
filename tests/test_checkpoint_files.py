"""Checkpoints are atomic: a failed write leaves no partial checkpoint behind."""
import pytest
import torch

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
