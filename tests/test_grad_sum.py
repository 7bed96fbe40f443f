"""How a stage's replicas sum their gradients (actors/collectives.py), with two or three gloo
processes and no Ray: GradBuckets sums exactly what one flat all-reduce sums, launched during
the last backward (overlap, as on GPUs) or after it (CPU workers), with one bucket or many;
SharedMemorySum (replicas on one node) sums what gloo sums."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp


def _replica(rank: int, port: int, overlap: bool, bucket_bytes: int, out) -> None:
    import torch.distributed as dist

    from actors.collectives import GradBuckets

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                    torch.nn.ReLU(), torch.nn.Linear(16, 3))
        model[2].bias.requires_grad_(False)  # a frozen parameter is left alone
        xs = torch.randn(2, 3, 4, 8, generator=torch.Generator().manual_seed(rank))  # this replica's 3 microbatches
        # reference: accumulate, then one flat SUM all-reduce
        for x in xs[0]:
            model(x).square().mean().backward()
        ref = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        flat = torch.cat([g.reshape(-1) for g in ref])
        dist.all_reduce(flat)
        off = 0
        for i, g in enumerate(ref):
            ref[i] = flat[off:off + g.numel()].view_as(g)
            off += g.numel()
        model.zero_grad(set_to_none=True)
        buckets = GradBuckets(list(model.parameters()), None, bucket_bytes, overlap)
        for _ in range(2):  # twice: the buffers are zeroed and reattached each step
            model.zero_grad(set_to_none=True)
            buckets.attach()
            for j, x in enumerate(xs[0]):
                if j == len(xs[0]) - 1:
                    buckets.arm()
                model(x).square().mean().backward()
            during_backward = buckets._next  # buckets launched before finish()
            buckets.finish()
            got = [p.grad for p in model.parameters() if p.requires_grad]
            ok = all(torch.equal(a, b) for a, b in zip(got, ref)) and model[2].bias.grad is None
        buckets.close()
        out.put((rank, ok, len(buckets.buckets), during_backward))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("bucket_bytes", [256, 1 << 20])
def test_buckets_sum_like_one_flat_all_reduce(overlap, bucket_bytes):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_replica, args=(r, port, overlap, bucket_bytes, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert [ok for _, ok, _, _ in results] == [True, True]
    n_buckets = results[0][2]
    assert n_buckets == 1 if bucket_bytes == 1 << 20 else n_buckets > 1
    assert [r[3] for r in results] == [n_buckets if overlap else 0] * 2


def _shm_replica(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    from actors.collectives import SharedMemorySum

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        shm = SharedMemorySum.create(list(model.parameters()), None, rank, world, "node-a", "test")
        sums = []
        for step in range(3):  # the slots alternate: three steps use both and the first again
            model.zero_grad(set_to_none=True)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).square().mean().backward()
            ref = [p.grad.clone() for p in model.parameters()]
            for g in ref:
                dist.all_reduce(g)
            shm.finish()
            sums.append([p.grad.clone() for p in model.parameters()])
            exact = all(torch.equal(a, b) for a, b in zip(sums[-1], ref))
            close = all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(sums[-1], ref))
            if not (exact if world == 2 else close):
                out.put((rank, False, None))
                return
        shm.close()
        other = SharedMemorySum.create(list(model.parameters()), None, rank, world, f"node-{rank}", "test")
        out.put((rank, other is None, torch.cat([g.reshape(-1) for g in sums[-1]])))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_sum_equals_gloo(world):
    """Replicas on one node sum through /dev/shm: exactly gloo's sum for 2, the same sum on every
    replica for more; replicas on different nodes get None (they use gloo); no file is left."""
    import glob

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_shm_replica, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted((out.get(timeout=120) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(30)
    assert [ok for _, ok, _ in results] == [True] * world
    assert all(torch.equal(results[0][2], r[2]) for r in results)  # replicas stay bit-identical
    assert not glob.glob("/dev/shm/relaytrain-test-*")
