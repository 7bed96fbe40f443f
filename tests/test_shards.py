"""The final model as safetensors shards and an index, loadable without relaytrain."""
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from service import shards


def _model(tie: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 16))
    if tie:
        model[4].weight = model[0].weight
    return model


def _stages(state: dict, cuts) -> list[dict]:
    return [{k: v for k, v in state.items() if lo <= int(k.split(".", 1)[0]) < hi} for lo, hi in cuts]


def _layers(state: dict) -> list[int]:
    return [int(k.split(".", 1)[0]) for k in state]


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _publish(folder, state: dict, cuts=((0, 1), (1, 2), (2, 4), (4, 5)), metadata=None) -> list[dict]:
    entries = [shards.write_shard(folder, s, len(cuts), part) for s, part in enumerate(_stages(state, cuts))]
    shards.write_index(folder, entries, metadata)
    return entries


def test_shards_and_index_round_trip(tmp_path):
    state = _model().state_dict()
    entries = _publish(tmp_path, state, metadata={"job_id": "j"})
    assert shards.shard_name(0, 4) == "model-00001-of-00004.safetensors"
    assert sorted(os.listdir(tmp_path)) == [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)] + [
        "model.safetensors.index.json"]
    assert entries[1] == {"file": "model-00002-of-00004.safetensors", "names": ["1.weight", "1.bias"], "bytes": 288}
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": sum(t.nbytes for t in state.values()), "job_id": "j"}
    assert list(index["weight_map"]) == sorted(state)
    assert index["weight_map"]["2.running_var"] == "model-00003-of-00004.safetensors"

    got = shards.load(tmp_path)
    assert _equal(got, dict(state)) and _layers(got) == sorted(_layers(got))  # in the model's layer order
    fresh = _model()
    fresh.load_state_dict(got)

    sub = shards.load(tmp_path, names={"1.bias", "4.weight"})
    assert _equal(sub, {k: state[k] for k in ("1.bias", "4.weight")})


def test_load_by_name_reads_only_the_shards_holding_them(tmp_path):
    state = _model().state_dict()
    _publish(tmp_path, state)
    (tmp_path / "model-00001-of-00004.safetensors").write_bytes(b"not a shard")
    got = shards.load(tmp_path, names=lambda n: n.startswith("4."))
    assert _equal(got, {k: state[k] for k in ("4.weight", "4.bias")})
    with pytest.raises(Exception):
        shards.load(tmp_path, names={"0.weight"})


def test_loads_without_relaytrain(tmp_path):
    state = _model().state_dict()
    _publish(tmp_path, state)
    # as a user would: the index, then every shard with plain safetensors
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    whole = {}
    for file in sorted(set(index["weight_map"].values())):
        whole.update(load_file(tmp_path / file))
    assert _equal(whole, dict(state))
    # as transformers does: json and safe_open, tensor by tensor, and the shards say format "pt"
    lazy = {}
    for name, file in index["weight_map"].items():
        with safe_open(tmp_path / file, framework="pt", device="cpu") as f:
            assert f.metadata() == {"format": "pt"}
            lazy[name] = f.get_tensor(name)
    assert _equal(lazy, dict(state))
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(whole)
    assert _equal(model.state_dict(), dict(state))


def test_tied_name_in_two_shards_maps_to_the_first_and_counts_once(tmp_path):
    state = _model().state_dict()
    first, last = _stages(state, [(0, 2), (2, 5)])
    last["0.weight"] = state["0.weight"]  # the last stage holds the tied embedding too
    entries = [shards.write_shard(tmp_path, 0, 2, first), shards.write_shard(tmp_path, 1, 2, last)]
    shards.write_index(tmp_path, entries[::-1])
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["0.weight"] == "model-00001-of-00002.safetensors"
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in state.values())
    assert _equal(shards.load(tmp_path), dict(state))


def test_shared_storage_views_and_non_contiguous_tensors(tmp_path):
    model = _model(tie=True)
    state = model.state_dict()
    assert state["0.weight"].data_ptr() == state["4.weight"].data_ptr()
    base = torch.arange(12.0).reshape(3, 4)
    tensors = {**state, "view.rows": base[1:], "view.whole": base, "view.t": base.t(), "param": model[1].weight}
    entry = shards.write_shard(tmp_path, 0, 1, tensors)
    assert entry["bytes"] == sum(t.nbytes for t in tensors.values())
    shards.write_index(tmp_path, [entry])
    got = shards.load(tmp_path)
    assert _equal(got, {k: v.detach().contiguous() for k, v in tensors.items()})
    got["0.weight"].add_(1)
    assert not torch.equal(got["0.weight"], got["4.weight"])  # loaded as two tensors
    assert tensors["view.whole"][1, 0] == 4.0  # writing did not change the caller's tensors


def test_dtypes_are_kept(tmp_path):
    model = _model().to(torch.bfloat16)
    state = model.state_dict()
    entry = shards.write_shard(tmp_path, 0, 1, state)
    shards.write_index(tmp_path, [entry])
    got = shards.load(tmp_path)
    assert got["1.weight"].dtype == torch.bfloat16 and got["2.num_batches_tracked"].dtype == torch.int64
    assert _equal(got, dict(state))
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["metadata"]["total_size"] == sum(
        t.nbytes for t in state.values())


def test_single_file_without_index_and_model_pt(tmp_path):
    state = _model().state_dict()
    one = tmp_path / "one"
    one.mkdir()
    from safetensors.torch import save_file
    save_file(dict(state), one / "model.safetensors")
    assert _equal(shards.load(one), dict(state))
    assert _equal(shards.load(one, names={"1.bias"}), {"1.bias": state["1.bias"]})

    _publish(tmp_path / "sharded", state)
    path = shards.to_model_pt(tmp_path / "sharded", tmp_path / "model.pt")
    assert path == tmp_path / "model.pt" and sorted(os.listdir(tmp_path)) == ["model.pt", "one", "sharded"]
    whole = torch.load(path, weights_only=True)
    assert _equal(whole, dict(state)) and _layers(whole) == sorted(_layers(whole))
    with pytest.raises(FileNotFoundError, match="no model.safetensors.index.json or model.safetensors"):
        shards.load(tmp_path)
