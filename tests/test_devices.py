"""Which device a worker trains on (actors/worker.py ``device_for``), without Ray: with
``resources.gpus_per_worker`` unset the scheduler asks Ray for a GPU per worker when the cluster
has one per worker (actors/workergroup.py), and the worker must then train on it, over NCCL."""
from actors.worker import device_for


def test_an_unset_gpus_per_worker_follows_what_ray_gave_the_worker():
    assert device_for(None, [0], cuda=True).type == "cuda"   # a GPU cluster: the scheduler asked for one
    assert device_for(None, [], cuda=True).type == "cpu"     # a GPU node, but the worker got none
    assert device_for(None, [], cuda=False).type == "cpu"    # this machine


def test_a_set_gpus_per_worker_is_what_counts():
    assert device_for(1, [0], cuda=True).type == "cuda"
    assert device_for(0, [0], cuda=True).type == "cpu"       # told to use none
    assert device_for(0.5, [0], cuda=True).type == "cuda"    # a share of a GPU
    assert device_for(1, [0], cuda=False).type == "cpu"      # asked for, but this process sees no CUDA device

