#!/usr/bin/env python
"""Tensor-parallel (DTensor) research script: TP on a *subgroup* of a gloo world, CPU.

Usage:
    python tp_check.py                       # world=4 (2 DP x 2 TP), all checks
    python tp_check.py --world 2             # world=2 (1 DP x 2 TP), DP checks degenerate
    python tp_check.py --mesh-probe VARIANT  # only try one DeviceMesh construction variant
        VARIANT in: from_group, from_group_2d, init_device_mesh_2d, DeviceMesh_2d,
                    DeviceMesh_own_ranks, init_device_mesh_1d
    python tp_check.py --mesh-probe all      # run every probe, each in its own launch

Rank layout (world=4, tp=2): TP groups {0,1},{2,3}; DP groups {0,2},{1,3}.
Logs of the reference runs (torch 2.13, 2-core box): run_world4.log, probes_world4.log.
Main run ~35 s wall for 4 ranks (mostly 4x torch import); probes ~3 min (one probe hangs until its 40 s timeout).
"""
import argparse
import copy
import datetime
import math
import os
import socket
import subprocess
import sys
import time
import traceback

T_START = time.perf_counter()
import torch  # noqa: E402

T_TORCH = time.perf_counter()
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402

T_DIST = time.perf_counter()
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.parallel import (  # noqa: E402
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

T_TP = time.perf_counter()

D, N_HEADS, FFN, B, T = 64, 4, 256, 2, 8


# --------------------------------------------------------------------------- model
class Attn(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.head_dim = d // n_heads
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.last_info = None

    def forward(self, x):
        Bx, Tx, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        # local width after ColwiseParallel(use_local_output=True): q is a plain tensor
        n_heads_local = q.shape[-1] // self.head_dim
        self.last_info = (type(q).__name__, tuple(q.shape), n_heads_local)

        def split(t):
            return t.view(Bx, Tx, n_heads_local, self.head_dim).transpose(1, 2)

        q, k, v = split(q), split(k), split(v)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        mask = torch.ones(Tx, Tx, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(Bx, Tx, n_heads_local * self.head_dim)
        return self.out(y)


class MLP(nn.Module):
    def __init__(self, d, ffn):
        super().__init__()
        self.up = nn.Linear(d, ffn)
        self.act = nn.GELU()
        self.down = nn.Linear(ffn, d)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class Block(nn.Module):
    tp_plan = {
        "attn.q": "colwise",
        "attn.k": "colwise",
        "attn.v": "colwise",
        "attn.out": "rowwise",
        "mlp.up": "colwise",
        "mlp.down": "rowwise",
    }

    def __init__(self, d=D, n_heads=N_HEADS, ffn=FFN):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attn(d, n_heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d, ffn)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


STYLE = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def to_dtensor_plan(tp_plan, fused_attn_input=False):
    plan = {name: STYLE[kind]() for name, kind in tp_plan.items()}
    if fused_attn_input:
        # Turn attn's input into a Replicate DTensor ONCE, so q/k/v share one
        # from_local -> one backward all-reduce instead of three.
        plan["attn"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
        )
    return plan


def make_block(seed, dtype):
    torch.manual_seed(seed)
    return Block().to(dtype)


def make_tp_block(seed, dtype, mesh, **kw):
    m = make_block(seed, dtype)
    parallelize_module(m, mesh, to_dtensor_plan(Block.tp_plan, **kw))
    return m


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def maxdiff(a, b):
    return (full(a).detach() - b.detach()).abs().max().item()


# --------------------------------------------------------------------------- helpers
class Log:
    def __init__(self, rank, world):
        self.rank, self.world = rank, world
        self.fail = 0

    def p(self, *a, all_ranks=False):
        if all_ranks or self.rank == 0:
            print(f"[r{self.rank}]", *a, flush=True)

    def check(self, ok, msg, all_ranks=False):
        if not ok:
            self.fail += 1
        if (not ok) or all_ranks or self.rank == 0:
            print(f"[r{self.rank}] {'OK  ' if ok else 'FAIL'} {msg}", flush=True)


def build_groups(world, tp):
    """Every rank calls new_group for every group, same order (required by c10d)."""
    rank = dist.get_rank()
    tp_group = dp_group = None
    for s in range(0, world, tp):
        g = dist.new_group(list(range(s, s + tp)))
        if rank in range(s, s + tp):
            tp_group = g
    for j in range(tp):
        g = dist.new_group(list(range(j, world, tp)))
        if rank % tp == j:
            dp_group = g
    return tp_group, dp_group


def init_pg(rank, world, port, timeout_s=60):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


# --------------------------------------------------------------------------- comm counting
class FuncolCounter:
    """Monkeypatch torch.distributed._functional_collectives (what DTensor calls) to record sizes."""

    NAMES = [
        "all_reduce",
        "all_gather_tensor",
        "all_gather_tensor_autograd",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_autograd",
        "all_to_all_single",
        "broadcast",
    ]

    def __init__(self):
        import torch.distributed._functional_collectives as funcol

        self.funcol = funcol
        self.calls = []
        self.saved = {}

    def __enter__(self):
        for n in self.NAMES:
            if hasattr(self.funcol, n):
                orig = getattr(self.funcol, n)
                self.saved[n] = orig

                def wrap(*a, _n=n, _orig=orig, **k):
                    t = a[0]
                    self.calls.append((_n, tuple(t.shape), t.numel() * t.element_size(), t.dtype))
                    return _orig(*a, **k)

                setattr(self.funcol, n, wrap)
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(self.funcol, n, f)


# --------------------------------------------------------------------------- mesh probes
def probe_worker(rank, world, port, tp, variant):
    init_pg(rank, world, port, timeout_s=20)
    tp_group, dp_group = build_groups(world, tp)
    my_tp_ranks = dist.get_process_group_ranks(tp_group)
    t0 = time.perf_counter()
    try:
        if variant == "from_group":
            mesh = DeviceMesh.from_group(tp_group, "cpu", mesh_dim_names=("tp",))
        elif variant == "from_group_2d":
            layout = torch.arange(world).view(world // tp, tp)  # rows = TP groups, cols = DP groups
            mesh2 = DeviceMesh.from_group([dp_group, tp_group], "cpu", mesh=layout, mesh_dim_names=("dp", "tp"))
            mesh = mesh2["tp"]
        elif variant == "init_device_mesh_2d":
            mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]
        elif variant == "DeviceMesh_2d":
            mesh = DeviceMesh("cpu", torch.arange(world).view(world // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]
        elif variant == "DeviceMesh_own_ranks":
            mesh = DeviceMesh("cpu", my_tp_ranks, mesh_dim_names=("tp",))
        elif variant == "init_device_mesh_1d":
            mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        else:
            raise ValueError(variant)
        built = time.perf_counter() - t0
        # functional test: Partial -> Replicate all-reduce must only sum over the TP group
        g = mesh.get_group()
        x = torch.full((4,), float(rank + 1))
        dt = distribute_tensor(torch.zeros(4), mesh, [Replicate()], src_data_rank=None)
        from torch.distributed.tensor import Partial

        s = DTensor.from_local(x, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()
        expect = float(sum(r + 1 for r in my_tp_ranks))
        ok = bool((s == expect).all())
        print(
            f"[r{rank}] probe={variant} built in {built:.3f}s mesh={mesh} mesh.mesh={mesh.mesh.tolist()} "
            f"group_ranks={dist.get_process_group_ranks(g)} same_pg_as_mine={g is tp_group} "
            f"allreduce={s[0].item()} expect={expect} {'OK' if ok else 'WRONG'} dt={type(dt).__name__}",
            flush=True,
        )
    except Exception as e:  # noqa: BLE001
        print(f"[r{rank}] probe={variant} EXCEPTION {type(e).__name__}: {str(e)[:400]}", flush=True)
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        print(f"[r{rank}] teardown EXCEPTION {type(e).__name__}: {str(e)[:200]}", flush=True)


# --------------------------------------------------------------------------- main checks
def tp_worker(rank, world, port, tp):
    t0 = time.perf_counter()
    init_pg(rank, world, port)
    L = Log(rank, world)
    tp_group, dp_group = build_groups(world, tp)
    tp_ranks = dist.get_process_group_ranks(tp_group)
    dp_ranks = dist.get_process_group_ranks(dp_group)
    dp_rank, tp_rank = rank // tp, rank % tp
    n_dp = world // tp
    L.p(f"init_process_group + new_group x{world // tp + tp}: {time.perf_counter() - t0:.3f}s")

    # ---------------- Q1 mesh
    mesh = DeviceMesh.from_group(tp_group, "cpu", mesh_dim_names=("tp",))
    L.p(f"Q1 mesh={mesh} mesh.mesh={mesh.mesh.tolist()} get_group() is tp_group: {mesh.get_group() is tp_group}",
        all_ranks=True)

    results = {}
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-9)):
        tname = str(dtype).split(".")[-1]
        # ---------------- Q2 forward/backward equality
        ref = make_block(0, dtype)
        tpm = make_tp_block(0, dtype, mesh)
        torch.manual_seed(1000 + dp_rank)  # same input within a TP group, different across DP
        x = torch.randn(B, T, D, dtype=dtype)
        w_out = torch.randn(B, T, D, dtype=dtype)
        xr = x.clone().requires_grad_(True)
        xt = x.clone().requires_grad_(True)
        yr = ref(xr)
        yt = tpm(xt)
        (yr * w_out).sum().backward()
        (yt * w_out).sum().backward()
        if dtype == torch.float32:
            L.p(f"Q2 attn.q.weight type={type(tpm.attn.q.weight).__name__} placements={tpm.attn.q.weight.placements} "
                f"global={tuple(tpm.attn.q.weight.shape)} local={tuple(tpm.attn.q.weight.to_local().shape)}")
            L.p(f"Q2 attn.out.weight placements={tpm.attn.out.weight.placements} local={tuple(tpm.attn.out.weight.to_local().shape)};"
                f" attn.out.bias placements={tpm.attn.out.bias.placements}")
            L.p(f"Q2 q output inside attn (tp): type,shape,n_heads_local={tpm.attn.last_info}; ref={ref.attn.last_info}")
            L.p(f"Q2 block output type={type(yt).__name__} shape={tuple(yt.shape)}; x.grad type={type(xt.grad).__name__}")
        rel = ((yt - yr).abs().max() / yr.abs().max()).item()
        L.check(torch.allclose(yt, yr, rtol=tol, atol=tol), f"Q2[{tname}] forward matches single-process (max rel err {rel:.2e})")
        L.check(torch.allclose(xt.grad, xr.grad, rtol=tol, atol=tol),
                f"Q2[{tname}] input grad matches (max abs err {maxdiff(xt.grad, xr.grad):.2e})")
        rp = dict(ref.named_parameters())
        worst = 0.0
        for n, p in tpm.named_parameters():
            g = full(p.grad)
            ok = torch.allclose(g, rp[n].grad, rtol=tol, atol=tol)
            worst = max(worst, (g - rp[n].grad).abs().max().item())
            if not ok:
                L.check(False, f"Q2[{tname}] grad {n}")
        L.check(True, f"Q2[{tname}] all {len(rp)} param grads (full_tensor) match, worst abs err {worst:.2e}")

        # ---------------- Q3 params not in the plan
        if dtype == torch.float32:
            kinds = {n: ("DTensor" + str(tuple(p.placements)) if isinstance(p, DTensor) else "plain") for n, p in tpm.named_parameters()}
            L.p("Q3 param kinds: " + ", ".join(f"{n}={k}" for n, k in kinds.items()))
            L.p(f"Q3 ln1.weight.grad type={type(tpm.ln1.weight.grad).__name__}; attn.q.weight.grad type={type(tpm.attn.q.weight.grad).__name__} "
                f"placements={tpm.attn.q.weight.grad.placements}; attn.out.bias.grad placements={tpm.attn.out.bias.grad.placements}")
        plain = [n for n, p in tpm.named_parameters() if not isinstance(p, DTensor)]
        for n in plain:
            g = dict(tpm.named_parameters())[n].grad.contiguous()
            gs = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(gs, g, group=tp_group)
            same = all(torch.equal(gs[0], gi) for gi in gs)
            L.check(same, f"Q3[{tname}] {n}.grad bitwise identical across TP ranks {tp_ranks}", all_ranks=False)
        results[tname] = True

    # ---------------- Q6 DP gradient sum over local shards (float64 for tight tolerance)
    dtype = torch.float64
    ref = make_block(0, dtype)
    tpm = make_tp_block(0, dtype, mesh)

    def batch(step, d):
        torch.manual_seed(10_000 + 100 * step + d)
        return torch.randn(B, T, D, dtype=dtype), torch.randn(B, T, D, dtype=dtype)

    def ref_grads(model, step):
        model.zero_grad(set_to_none=True)
        for d in range(n_dp):  # single-process reference = sum of all DP replicas' losses / n_dp
            x, w = batch(step, d)
            ((model(x) * w).sum() / n_dp).backward()

    def dp_allreduce_grads(model):
        for p in model.parameters():
            g = p.grad
            local = g.to_local() if isinstance(g, DTensor) else g
            dist.all_reduce(local, group=dp_group)  # in-place on the shard
            # (loss already divided by n_dp)

    ref_grads(ref, 0)
    tpm.zero_grad(set_to_none=True)
    x, w = batch(0, dp_rank)
    ((tpm(x) * w).sum() / n_dp).backward()
    g = tpm.attn.q.weight.grad
    with torch.no_grad():
        shares_nograd = g.to_local().data_ptr() == g._local_tensor.data_ptr()
    shares_grad = g.to_local().data_ptr() == g._local_tensor.data_ptr()
    L.p(f"Q6 p.grad is {type(g).__name__} placements={g.placements}; to_local() shares storage with grad: "
        f"no_grad={shares_nograd} grad_enabled={shares_grad}; dp_group ranks={dp_ranks}")
    dp_allreduce_grads(tpm)
    rp = dict(ref.named_parameters())
    worst = max((full(p.grad) - rp[n].grad).abs().max().item() for n, p in tpm.named_parameters())
    L.check(worst < 1e-9, f"Q6 after dist.all_reduce(p.grad.to_local(), group=dp_group): all grads == single-process "
            f"full-batch grads (worst abs err {worst:.2e})", all_ranks=True)

    # ---------------- Q4 optimizers over several steps (with DP all-reduce)
    def train(model, opt, steps, start=0, tp_mode=True):
        for s in range(start, start + steps):
            if tp_mode:
                model.zero_grad(set_to_none=True)
                x, w = batch(s, dp_rank)
                ((model(x) * w).sum() / n_dp).backward()
                dp_allreduce_grads(model)
            else:
                ref_grads(model, s)
            opt.step()

    def split_groups(ps):
        ps = list(ps)
        return [{"params": [p for p in ps if isinstance(p, DTensor)]},
                {"params": [p for p in ps if not isinstance(p, DTensor)]}]

    for name, mk in (
        ("Adam", lambda ps: torch.optim.Adam(ps, lr=1e-2)),
        ("Adam(foreach=True)", lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True)),
        ("Adam(foreach=True, separate param_groups DTensor/plain)", lambda ps: torch.optim.Adam(split_groups(ps), lr=1e-2, foreach=True)),
        ("AdamW(wd=0.1)", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
        ("SGD(momentum)", lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)),
    ):
        ref = make_block(0, dtype)
        tpm = make_tp_block(0, dtype, mesh)
        try:
            t1 = time.perf_counter()
            train(ref, torch.optim.Adam(ref.parameters(), lr=1e-2) if name.startswith("Adam(") else mk(ref.parameters()),
                  4, tp_mode=False)
            train(tpm, mk(tpm.parameters()), 4)
            rp = dict(ref.named_parameters())
            worst = max((full(p) - rp[n]).abs().max().item() for n, p in tpm.named_parameters())
            L.check(worst < 1e-9, f"Q4 {name}: 4 steps, params == single-process (worst abs err {worst:.2e}, {time.perf_counter() - t1:.2f}s)")
        except Exception as e:  # noqa: BLE001
            expected = name == "Adam(foreach=True)"
            L.check(expected, f"Q4 {name}: {'EXPECTED PITFALL ' if expected else ''}{type(e).__name__}: {str(e)[:300]}")

    # grad-norm clipping on mixed DTensor/plain params (common pitfall)
    ref = make_block(0, dtype)
    tpm = make_tp_block(0, dtype, mesh)
    ref_grads(ref, 0)
    tpm.zero_grad(set_to_none=True)
    x, w = batch(0, dp_rank)
    ((tpm(x) * w).sum() / n_dp).backward()
    dp_allreduce_grads(tpm)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9).item()
    for fe in (None, False):
        try:
            n_ = torch.nn.utils.clip_grad_norm_(tpm.parameters(), 1e9, foreach=fe)
            L.p(f"Q4x clip_grad_norm_(foreach={fe}) on mixed params returned {type(n_).__name__}: {full(n_).item():.6f} vs ref {ref_norm:.6f}")
        except Exception as e:  # noqa: BLE001
            L.p(f"Q4x clip_grad_norm_(foreach={fe}) on mixed params FAILS: {type(e).__name__}: {str(e)[:200]}")

    def global_grad_norm(model):  # manual, works with the mix: sum of squares of *full* grads
        sq_sharded = torch.zeros((), dtype=torch.float64)
        sq_repl = torch.zeros((), dtype=torch.float64)
        for p in model.parameters():
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_shard() for pl in g.placements):
                sq_sharded += g.to_local().double().pow(2).sum()
            else:
                lg = g.to_local() if isinstance(g, DTensor) else g
                sq_repl += lg.double().pow(2).sum()
        dist.all_reduce(sq_sharded, group=tp_group)
        return (sq_sharded + sq_repl).sqrt()

    my_norm = global_grad_norm(tpm).item()
    L.check(abs(my_norm - ref_norm) < 1e-9 * ref_norm, f"Q4x manual global grad norm {my_norm:.6f} == ref {ref_norm:.6f}")

    # ---------------- Q5 state dict out/in, model + optimizer
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    ref = make_block(0, dtype)
    tpm = make_tp_block(0, dtype, mesh)
    opt_r = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt_t = torch.optim.Adam(tpm.parameters(), lr=1e-2)
    train(ref, opt_r, 3, tp_mode=False)
    train(tpm, opt_t, 3)
    ref_sd = ref.state_dict()

    # (a) manual full state dict: every TP rank must call full_tensor() (all-gather over TP group)
    t1 = time.perf_counter()
    full_sd = {k: full(v).detach().clone() for k, v in tpm.state_dict().items()}
    L.p(f"Q5a manual full sd: {len(full_sd)} keys, types={set(type(v).__name__ for v in full_sd.values())}, {time.perf_counter() - t1:.3f}s")
    L.check(all(torch.equal(full_sd[k], ref_sd[k]) or (full_sd[k] - ref_sd[k]).abs().max() < 1e-9 for k in ref_sd),
            "Q5a manual full sd == single-process state_dict", all_ranks=True)

    # (b) DCP get_model_state_dict(full_state_dict=True)
    for opts in (dict(full_state_dict=True), dict(full_state_dict=True, cpu_offload=True)):
        try:
            sd = get_model_state_dict(tpm, options=StateDictOptions(**opts))
            types = set(type(v).__name__ for v in sd.values())
            ok = len(sd) == 0 or all((sd[k] - ref_sd[k]).abs().max() < 1e-9 for k in ref_sd)
            L.p(f"Q5b get_model_state_dict({opts}): {len(sd)} keys types={types} equal_ref={ok}", all_ranks=True)
        except Exception as e:  # noqa: BLE001
            L.p(f"Q5b get_model_state_dict({opts}) EXC {type(e).__name__}: {str(e)[:300]}", all_ranks=True)

    # optimizer state: exp_avg type
    st = opt_t.state[tpm.attn.q.weight]
    L.p(f"Q5 Adam state for attn.q.weight: " + ", ".join(
        f"{k}={type(v).__name__}{tuple(v.placements) if isinstance(v, DTensor) else ''}" for k, v in st.items()))
    st = opt_t.state[tpm.ln1.weight]
    L.p(f"Q5 Adam state for ln1.weight: " + ", ".join(f"{k}={type(v).__name__}" for k, v in st.items()))

    # (c) manual full optimizer state dict out (keys = param index as in opt.state_dict())
    osd = opt_t.state_dict()
    full_osd = {
        "state": {i: {k: full(v).detach().clone() for k, v in s.items()} for i, s in osd["state"].items()},
        "param_groups": copy.deepcopy(osd["param_groups"]),
    }
    ref_osd = opt_r.state_dict()
    worst = max((full_osd["state"][i][k] - ref_osd["state"][i][k]).abs().max().item()
                for i in ref_osd["state"] for k in ("exp_avg", "exp_avg_sq"))
    L.check(worst < 1e-9, f"Q5c manual full optimizer state == single-process Adam state (worst {worst:.2e})")

    # continue-training oracle: one more step on the original
    def one_more_step(model, opt):
        train(model, opt, 1, start=3)
        return {n: full(p).detach().clone() for n, p in model.named_parameters()}

    # (d) manual load: full sd -> fresh parallelized model (different init) + fresh Adam
    def manual_load(model, opt, full_sd, full_osd):
        with torch.no_grad():
            for k, v in model.state_dict().items():  # params and buffers, live tensors
                if isinstance(v, DTensor):
                    # src_data_rank=None: slice locally, no comm (every rank holds full_sd)
                    v.to_local().copy_(distribute_tensor(full_sd[k], v.device_mesh, v.placements,
                                                         src_data_rank=None).to_local())
                else:
                    v.copy_(full_sd[k])
        params = [p for g in opt.param_groups for p in g["params"]]  # index order of opt.state_dict()
        sharded = {"state": {}, "param_groups": copy.deepcopy(full_osd["param_groups"])}
        for i, s in full_osd["state"].items():
            p = params[i]
            sharded["state"][i] = {
                k: (distribute_tensor(v, p.device_mesh, p.placements, src_data_rank=None)
                    if isinstance(p, DTensor) and v.dim() > 0 else v.clone())
                for k, v in s.items()
            }
        opt.load_state_dict(sharded)

    def fresh(seed=123):
        m = make_tp_block(seed, dtype, mesh)
        return m, torch.optim.Adam(m.parameters(), lr=1e-2)

    m2, o2 = fresh()
    manual_load(m2, o2, full_sd, full_osd)
    L.p(f"Q5d after manual load: q.weight still DTensor={isinstance(m2.attn.q.weight, DTensor)} "
        f"exp_avg type={type(o2.state[m2.attn.q.weight]['exp_avg']).__name__} step={o2.state[m2.attn.q.weight]['step']}")
    oracle = one_more_step(tpm, opt_t)
    got = one_more_step(m2, o2)
    worst = max((oracle[n] - got[n]).abs().max().item() for n in oracle)
    L.check(worst == 0.0, f"Q5d manual load (model+Adam) then 1 step == uninterrupted run (max diff {worst:.2e})", all_ranks=True)

    # (e) DCP set_model_state_dict / get+set_optimizer_state_dict with full_state_dict
    def clone_tree(d):
        if isinstance(d, dict):
            return {k: clone_tree(v) for k, v in d.items()}
        if isinstance(d, list):
            return [clone_tree(v) for v in d]
        return d.detach().clone() if torch.is_tensor(d) else copy.deepcopy(d)

    tpm_e, opt_e = fresh(0)
    train(tpm_e, opt_e, 3)
    fmsd = get_model_state_dict(tpm_e, options=StateDictOptions(full_state_dict=True))
    fosd = get_optimizer_state_dict(tpm_e, opt_e, options=StateDictOptions(full_state_dict=True))
    k0 = next(iter(fosd["state"]))
    L.p(f"Q5e get_optimizer_state_dict(full) keys are FQNs e.g. {k0!r}: "
        + ", ".join(f"{k}={type(v).__name__}{tuple(v.shape)}" for k, v in fosd["state"]["attn.q.weight"].items()))
    alias_m = fmsd["ln1.weight"].data_ptr() == tpm_e.ln1.weight.data_ptr()
    alias_o = fosd["state"]["ln1.weight"]["exp_avg"].data_ptr() == opt_e.state[tpm_e.ln1.weight]["exp_avg"].data_ptr()
    L.p(f"Q5e ALIASING: full model sd plain entries alias live params: {alias_m}; full optim sd plain entries alias live "
        f"Adam state: {alias_o}")
    saved_m, saved_o = clone_tree(fmsd), clone_tree(fosd)  # what you would torch.save()
    oracle = one_more_step(tpm_e, opt_e)
    for label, msd, osd_ in (("cloned (like torch.save/load)", clone_tree(saved_m), clone_tree(saved_o)),
                             ("aliased live dicts", None, None)):
        try:
            if msd is None:  # re-create the aliasing situation: take sds from a live model, keep training it
                tpm_e, opt_e = fresh(0)
                train(tpm_e, opt_e, 3)
                msd = get_model_state_dict(tpm_e, options=StateDictOptions(full_state_dict=True))
                osd_ = get_optimizer_state_dict(tpm_e, opt_e, options=StateDictOptions(full_state_dict=True))
            m3, o3 = fresh()
            msd_keys_types_before = {type(v).__name__ for v in msd.values()}
            set_model_state_dict(m3, msd, options=StateDictOptions(full_state_dict=True))
            set_optimizer_state_dict(m3, o3, osd_, options=StateDictOptions(full_state_dict=True))
            msd_types_after = {type(v).__name__ for v in msd.values()}
            if label.startswith("aliased"):
                one_more_step(tpm_e, opt_e)  # source keeps training -> mutates aliased Adam state
            got = one_more_step(m3, o3)
            diffs = {n: (oracle[n] - got[n]).abs().max().item() for n in oracle}
            worst = max(diffs.values())
            bad = sorted(n for n, v in diffs.items() if v > 0)
            L.check(worst == 0.0 or label.startswith("aliased"),
                    f"Q5e [{label}] set_model_state_dict+set_optimizer_state_dict(full) then 1 step vs uninterrupted: "
                    f"max diff {worst:.2e} differing={bad}; passed dict value types {msd_keys_types_before} -> "
                    f"{msd_types_after} (mutated in place!)")
        except Exception as e:  # noqa: BLE001
            L.check(False, f"Q5e [{label}]: {type(e).__name__}: {str(e)[:400]}")
            traceback.print_exc()

    # (f) broadcast_from_rank0: only global rank 0 has the full sd (fresh copy: set_* mutates its input)
    try:
        m4, o4 = fresh()
        src = clone_tree(saved_m) if rank == 0 else {}
        set_model_state_dict(m4, src, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        srco = clone_tree(saved_o) if rank == 0 else {}
        set_optimizer_state_dict(m4, o4, srco, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        worst = max((full(v) - saved_m[k]).abs().max().item() for k, v in m4.state_dict().items())
        got = one_more_step(m4, o4)
        worst2 = max((oracle[n] - got[n]).abs().max().item() for n in oracle)
        L.check(worst == 0.0 and worst2 == 0.0,
                f"Q5f set_model/optimizer_state_dict(full, broadcast_from_rank0=True), sd only on global rank 0: "
                f"model diff {worst:.2e}, after 1 step diff {worst2:.2e}", all_ranks=True)
    except Exception as e:  # noqa: BLE001
        L.check(False, f"Q5f broadcast_from_rank0: {type(e).__name__}: {str(e)[:300]}", all_ranks=True)

    # (g) pitfall: nn.Module.load_state_dict with plain full tensors into DTensor params
    try:
        m5, _ = fresh()
        m5.load_state_dict(full_sd)
        worst = max((full(v) - full_sd[k]).abs().max().item() for k, v in m5.state_dict().items())
        L.p(f"Q5g model.load_state_dict(full plain sd) into parallelized module: works, diff {worst:.2e}; "
            f"q.weight DTensor={isinstance(m5.attn.q.weight, DTensor)} local={tuple(m5.attn.q.weight.to_local().shape)}")
    except Exception as e:  # noqa: BLE001
        L.p(f"Q5g model.load_state_dict(full plain sd) into parallelized module FAILS: {type(e).__name__}: {str(e)[:250]}")

    # ---------------- Q7 memory
    m = make_tp_block(0, torch.float32, mesh)
    local_b = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in m.parameters())
    full_b = sum(p.numel() * p.element_size() for p in m.parameters())  # DTensor.numel() is global
    sharded_b = sum(p.to_local().numel() * p.element_size() for p in m.parameters()
                    if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements))
    L.p(f"Q7 fp32 block D={D} FFN={FFN}: full params {full_b} B, local per TP rank {local_b} B "
        f"({local_b / full_b:.3f} of full; sharded part {sharded_b} B, replicated part {local_b - sharded_b} B)", all_ranks=True)

    # ---------------- Q8 collectives per forward+backward
    from torch.distributed.tensor.debug import CommDebugMode

    act_bytes = B * T * D * 4
    for variant, kw in (("default plan", {}), ("plan + PrepareModuleInput(attn)", {"fused_attn_input": True})):
        m = make_tp_block(0, torch.float32, mesh, **kw)
        ref = make_block(0, torch.float32)
        torch.manual_seed(5)
        x = torch.randn(B, T, D)
        xr = x.clone().requires_grad_(True)
        x = x.clone().requires_grad_(True)
        m(x).sum().backward()  # warmup
        m.zero_grad(set_to_none=True)
        x.grad = None
        with FuncolCounter() as fc_f:
            cd = CommDebugMode()
            with cd:
                y = m(x)
            fwd_counts = dict(cd.get_comm_counts())
        with FuncolCounter() as fc_b:
            cd2 = CommDebugMode()
            with cd2:
                y.sum().backward()
            bwd_counts = dict(cd2.get_comm_counts())
        ref(xr).sum().backward()
        eq = torch.allclose(y, ref(xr.detach()), rtol=1e-5, atol=1e-5) and torch.allclose(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
        wq = all(torch.allclose(full(p.grad), r.grad, rtol=1e-5, atol=1e-5) for p, r in zip(m.parameters(), ref.parameters()))
        fb = sum(c[2] for c in fc_f.calls)
        bb = sum(c[2] for c in fc_b.calls)
        L.p(f"Q8 [{variant}] CommDebugMode fwd={ {str(k): v for k, v in fwd_counts.items()} } bwd={ {str(k): v for k, v in bwd_counts.items()} }")
        L.p(f"Q8 [{variant}] funcol fwd calls={[(c[0], c[1]) for c in fc_f.calls]} bytes={fb}")
        L.p(f"Q8 [{variant}] funcol bwd calls={[(c[0], c[1]) for c in fc_b.calls]} bytes={bb}")
        L.p(f"Q8 [{variant}] total {len(fc_f.calls)}+{len(fc_b.calls)} collectives, {fb + bb} B payload; Megatron: 2+2 all-reduces x "
            f"B*T*D*4={act_bytes} B = {4 * act_bytes} B; results still exact: {eq and wq}")
        # timing
        ts = []
        for _ in range(5):
            t1 = time.perf_counter()
            m(x).sum().backward()
            ts.append(time.perf_counter() - t1)
        tr = []
        for _ in range(5):
            t1 = time.perf_counter()
            ref(xr).sum().backward()
            tr.append(time.perf_counter() - t1)
        L.p(f"Q8 [{variant}] fwd+bwd time: TP {min(ts) * 1e3:.1f} ms vs single-process {min(tr) * 1e3:.1f} ms (tiny model)")

    # ---------------- init cost: parallelize_module src_data_rank=0 (scatter/broadcast from TP rank 0) vs None (local slice)
    for sdr in (0, None):
        m = make_block(0, torch.float32)
        dist.barrier(group=tp_group)
        t1 = time.perf_counter()
        parallelize_module(m, mesh, to_dtensor_plan(Block.tp_plan), src_data_rank=sdr)
        dt_ = time.perf_counter() - t1
        same = all(torch.equal(full(p), r) for p, r in zip(m.parameters(), make_block(0, torch.float32).parameters()))
        L.p(f"INIT parallelize_module(src_data_rank={sdr}): {dt_ * 1e3:.1f} ms, params == same-seed full model: {same}")

    # ---------------- pitfall demos
    # use_local_output=False on colwise -> q is DTensor with GLOBAL shape, view() by local heads breaks
    m = make_block(0, torch.float32)
    plan = to_dtensor_plan(Block.tp_plan)
    for n in ("attn.q", "attn.k", "attn.v"):
        plan[n] = ColwiseParallel(use_local_output=False)
    parallelize_module(m, mesh, plan)
    try:
        m(torch.randn(B, T, D))
        L.p(f"PITFALL use_local_output=False: forward ran, attn saw {m.attn.last_info}")
    except Exception as e:  # noqa: BLE001
        L.p(f"PITFALL use_local_output=False: q seen as {m.attn.last_info}; forward fails: {type(e).__name__}: {str(e)[:200]}")

    # distribute with src_data_rank=0 (default) when ranks have DIFFERENT inits -> TP rank 0's weights win
    torch.manual_seed(77 + rank)
    m = Block()
    parallelize_module(m, mesh, to_dtensor_plan(Block.tp_plan))  # default src_data_rank=0
    w_full = m.attn.q.weight.full_tensor()
    torch.manual_seed(77 + tp_ranks[0])
    L.check(torch.equal(w_full, Block().attn.q.weight), "src_data_rank=0 (default): sharded params come from TP-group rank 0 "
            "(scatter), so different per-rank inits are overridden", all_ranks=False)

    dist.barrier()
    L.p(f"worker total {time.perf_counter() - t0:.2f}s; failures on this rank: {L.fail}", all_ranks=True)
    dist.destroy_process_group()


# --------------------------------------------------------------------------- launcher
def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def launch(fn, world, args, timeout):
    ctx = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.time() + timeout
    try:
        while not ctx.join(timeout=1):
            if time.time() > deadline:
                print(f"LAUNCHER: timeout after {timeout}s -> terminating workers (hang)", flush=True)
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                for p in ctx.processes:
                    p.join(5)
                return False
    except Exception as e:  # noqa: BLE001
        print(f"LAUNCHER: worker failed: {e}", flush=True)
        return False
    return True


PROBES = ["from_group", "from_group_2d", "init_device_mesh_2d", "DeviceMesh_2d", "DeviceMesh_own_ranks", "init_device_mesh_1d"]

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--mesh-probe", default=None)
    ap.add_argument("--timeout", type=float, default=120)
    a = ap.parse_args()
    print(f"import times: torch {T_TORCH - T_START:.2f}s, torch.distributed {T_DIST - T_TORCH:.2f}s, "
          f"DeviceMesh+DTensor+tensor.parallel {T_TP - T_DIST:.2f}s  (torch {torch.__version__})", flush=True)
    if a.mesh_probe == "all":
        for v in PROBES:  # each probe in a separate launch (a hang must not poison the others)
            subprocess.run([sys.executable, __file__, "--world", str(a.world), "--tp", str(a.tp),
                            "--mesh-probe", v, "--timeout", "40"])
    elif a.mesh_probe:
        ok = launch(probe_worker, a.world, (a.world, free_port(), a.tp, a.mesh_probe), a.timeout)
        print(f"probe {a.mesh_probe}: launcher ok={ok}", flush=True)
    else:
        t = time.perf_counter()
        ok = launch(tp_worker, a.world, (a.world, free_port(), a.tp), a.timeout)
        print(f"main checks: launcher ok={ok}, wall {time.perf_counter() - t:.1f}s", flush=True)
