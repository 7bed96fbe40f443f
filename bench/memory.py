"""Peak resident memory of every process of a relaytrain job, next to its share of the model.

    .venv/bin/python bench/memory.py [--quick] [--budget-gib 20] [--no-largest] [--from-json PATH]

Trains the built-in GPT (float32, AdamW, tokens from a random uint16 file) for 2 steps at
pp = 4 (dp = 1) and at dp x pp = 2 x 2, at sizes where parameters + gradients + Adam state
are several GiB, and reads every process's VmRSS / VmHWM from /proc/<pid>/status while the job
runs (every 0.1 s; the workers and the scheduler are found by their Ray actor names, and each
tells its pid and cell through ``__ray_call__``).  For each worker it prints

    share = base                                       VmHWM of an empty StageWorker actor
          + 16 B x (parameters of its layers)          fp32 parameters, gradients, 2 Adam slots
          + peak live microbatches x activation bytes  of one microbatch through its layers

next to the measured peak (VmHWM) and peak / share.  The activation bytes of one microbatch
come from the shapes (``activation_bytes``: the tensors autograd saves in each layer, written
out from service/builtins/gpt.py, checked against a saved-tensor hook on real layers).  The
scheduler's peak is shown at several model sizes: it never builds a layer, so it must not grow.
The full run also trains size A with user-side settings that remove two transients (fused
AdamW, glibc's mmap threshold fixed at 1 MiB), and the one-process loop at size A.

Then it looks for the largest GPT (d_model 1536, more blocks) whose processes together stay
within a memory budget (default 20 GiB, lowered to MemAvailable - 5 GiB: the machine is
shared), at pp = 4 and in one process (a plain nn.Sequential + AdamW loop, in a subprocess),
from size A's measured peaks, and verifies each with one real run (a guard stops a run whose
processes pass the budget, or when the machine's MemAvailable falls below 1.5 GiB).  It also
projects the largest pp = 4 model whose fullest worker alone fits the budget (a machine per
worker).  ``--quick``: smaller models, no tiny, tuned or largest runs (the sizes projected).

Prints markdown tables and writes bench/results/memory.json and memory.txt (memory_quick.*).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"

GiB, MiB = 2**30, 2**20
STATE_BYTES = 16  # a float32 parameter's bytes: itself, its gradient, Adam's exp_avg and exp_avg_sq
NAMESPACE = "relaytrain"
MIN_AVAILABLE = 1.5 * GiB  # a run is stopped when the machine's MemAvailable falls below this


def state_bytes(param_bytes: int) -> int:
    """Parameters + gradients + two Adam slots of ``param_bytes`` of (float32) parameters."""
    return 4 * param_bytes


# ---------------------------------------------------------------- reading /proc

def proc_status(pid: int) -> dict | None:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of ``pid`` in bytes (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(rest.split()[0]) * 1024
    return out if "VmHWM" in out else None


def proc_faults(pid: int) -> int | None:
    """Minor page faults of ``pid`` so far (/proc/<pid>/stat, field 10; None once it is gone):
    each is a 4 KiB page the kernel zero-filled and mapped on its first touch."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2:].split()[7])  # fields from 3 on, after "(comm)"


# A 1x2 MLP job whose steps free and ask for the same blocks (tests/test_memory.py's page-fault
# test, bench/heap_growth.py): the model's args, rows a microbatch, microbatches.
REUSE_CASES = {
    # 2 x 4 MiB of weight gradients a stage: glibc's own threshold would keep them, on one thread
    "4MiB": ({"in_features": 1024, "hidden": 1024, "layers": 4, "out_features": 10}, 64, 4),
    # a 10 MiB and a 25 MiB weight gradient, near the top of what the heap keeps (32 MiB): on a
    # thread's own arena (64 MiB heaps, unmapped when they empty) they were faulted in again
    "25MiB": ({"in_features": 1024, "hidden": 2560, "layers": 2, "out_features": 10}, 16, 2),
}


def reuse_spec(case: str, name: str, steps: int, runtime_env: dict | None = None):
    """The job of ``REUSE_CASES[case]``: 1F1B over gloo, SGD with momentum, no checkpoints."""
    from service.spec import parse_spec

    model, rows, m = REUSE_CASES[case]
    return parse_spec({
        "name": name,
        "model": {"kind": "mlp", "args": model},
        "data": {"kind": "regression", "args": {"n": 256, "in_features": model["in_features"], "out_features": 10}},
        "loss": "mse", "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "training": {"global_batch_size": rows * m, "microbatch_size": rows, "steps": steps, "seed": 0},
        "parallelism": {"dp": 1, "pp": 2, "schedule": "1f1b", "transport": "collective"},
        "checkpoint": {"every_steps": 0},
        "runtime_env": runtime_env or {},
    })


def proc_pss(pid: int) -> int | None:
    """Proportional set size (shared pages divided among their users): sums to the real footprint."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (Ray's daemons and workers when ``root`` started Ray)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def meminfo(key: str) -> int:
    """A field of /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_hwm(pid: int) -> bool:
    """Set ``pid``'s VmHWM back to its current RSS (Linux clear_refs 5)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _whoami(actor) -> dict:
    """Run inside a job's actor through ``__ray_call__``: its pid, its niceness and, for a
    worker, its cell."""
    import os as _os

    cell = getattr(actor, "cell", None)
    me = {"pid": _os.getpid(), "nice": _os.getpriority(_os.PRIO_PROCESS, 0),
          "malloc_env": _os.environ.get("MALLOC_MMAP_THRESHOLD_")}
    if cell is None:
        return {**me, "cell": None}
    return {**me, "cell": [cell.dp_rank, cell.pp_rank], "layers": list(cell.layers)}


def ship_by_value() -> None:
    """Let Ray send this module's functions (``_whoami``, ``_warm``) to actors by value: an
    actor cannot import bench/memory.py (when a test imports it, it is not ``__main__``)."""
    mod = sys.modules.get(_whoami.__module__)
    if mod is not None and mod.__name__ != "__main__":
        import ray.cloudpickle

        ray.cloudpickle.register_pickle_by_value(mod)


def ask(handle):
    """A ref to ``_whoami`` of the actor ``handle``."""
    ship_by_value()
    return handle.__ray_call__.remote(_whoami)


class Sampler(threading.Thread):
    """Samples the memory of a running job's actors (found by name) and of every process of
    this driver's tree (every ``pss_every`` samples; 0: never), every ``interval`` seconds, until
    ``stop``.  With ``limit`` (bytes of summed PSS) it SIGKILLs the job's workers when the tree
    passes it (a guard, not the OOM killer)."""

    def __init__(self, job_prefix: str, interval: float = 0.1, pss_every: int = 5, limit: float | None = None,
                 min_available: float | None = None):
        super().__init__(daemon=True, name="memory-sampler")
        self.prefix = f"relaytrain:{job_prefix}".lower()
        self.interval, self.pss_every, self.limit = interval, pss_every, limit
        self.min_available = min_available  # the machine is shared: stop before others run short
        self.actors: dict[str, dict] = {}      # actor name -> {pid, cell, layers, kind}
        self.series: dict[int, list] = {}      # pid -> [(t, rss, hwm, anon, shmem)]
        self.faults: dict[int, list] = {}      # pid -> [(t, minor page faults so far)]
        self.hwm: dict[int, int] = {}
        self.total: list = []                  # (t, summed PSS of the tree)
        self.guard_fired = False
        self._halt = threading.Event()
        self._pending: dict[str, object] = {}

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def _discover(self) -> None:
        import ray

        try:
            named = ray.util.list_named_actors(all_namespaces=True)
        except Exception:
            return
        for entry in named:
            name = entry["name"] if isinstance(entry, dict) else entry
            if not name.lower().startswith(self.prefix):
                continue
            known = self.actors.get(name)
            if known and (known["kind"] == "scheduler" or known.get("cell")):
                continue
            ref = self._pending.get(name)
            if ref is None:
                try:
                    h = ray.get_actor(name, namespace=NAMESPACE)
                    self._pending[name] = ask(h)
                except Exception:
                    pass
                continue
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                del self._pending[name]
                try:
                    info = ray.get(ref)
                except Exception:
                    continue
                info["kind"] = "scheduler" if name.endswith(":scheduler") else "worker"
                self.actors[name] = info

    def run(self) -> None:
        k = 0
        me = os.getpid()
        while not self._halt.is_set():
            if k % 5 == 0:
                self._discover()
            now = time.time()
            for info in list(self.actors.values()):
                pid = info["pid"]
                st = proc_status(pid)
                if st is None:
                    continue
                self.hwm[pid] = max(self.hwm.get(pid, 0), st["VmHWM"])
                self.series.setdefault(pid, []).append(
                    (round(now, 3), st["VmRSS"], st["VmHWM"], st.get("RssAnon", 0), st.get("RssShmem", 0)))
                flt = proc_faults(pid)
                if flt is not None:
                    self.faults.setdefault(pid, []).append((now, flt))
            if self.pss_every and k % self.pss_every == 0:
                total = sum(p or 0 for p in map(proc_pss, descendants(me)))
                self.total.append((round(now, 3), total))
                if self.limit and total > self.limit:
                    self._fire(f"its processes passed {self.limit / GiB:.1f} GiB")
            if self.min_available and k % 2 == 0 and meminfo("MemAvailable") < self.min_available:
                self._fire(f"the machine had less than {self.min_available / GiB:.1f} GiB available")
            k += 1
            self._halt.wait(self.interval)

    def _fire(self, why: str) -> None:
        """Stop the job: SIGKILL its workers (processes of this driver's Ray)."""
        if self.guard_fired:
            return
        self.guard_fired = why
        for info in self.actors.values():
            if info["kind"] == "worker":
                try:
                    os.kill(info["pid"], signal.SIGKILL)
                except OSError:
                    pass

    def workers(self) -> list[dict]:
        """Every worker seen: pid, cell (from its actor name when it did not say), its layers
        [lo, hi) when it said them (else None), peak (the largest VmHWM read)."""
        out = []
        for name, info in self.actors.items():
            m = re.search(r":w(\d+)\.(\d+)(-\d+)?$", name)
            if info["kind"] == "worker" and m:
                cell = info.get("cell") or [int(m.group(1)), int(m.group(2))]
                out.append({**info, "cell": cell, "layers": info.get("layers"), "name": name,
                            "peak": self.hwm.get(info["pid"], 0)})
        return sorted(out, key=lambda w: tuple(w["cell"]))

    def scheduler(self) -> dict | None:
        for name, info in self.actors.items():
            if info["kind"] == "scheduler":
                return {**info, "name": name, "peak": self.hwm.get(info["pid"], 0)}
        return None

    def peak_total(self) -> int:
        return max((t for _, t in self.total), default=0)

    def idle_total(self) -> int:
        """The tree's PSS at the first sample, before the job's actors started."""
        return self.total[0][1] if self.total else 0


# ---------------------------------------------------------------- the model's figures

def gpt_layers(args: dict) -> list[dict]:
    """Each layer of the built-in GPT ``args``: kind and parameter bytes (built on the meta
    device by the engine's own recipe, so a tied pair counts once per layer that holds it)."""
    from service.builtins.gpt import gpt

    made = gpt(**args)
    out = []
    import torch

    with torch.device("meta"):
        for make in made["layers"]:
            layer = make()
            sizes = [p.numel() * p.element_size() for p in layer.parameters()]
            out.append({"kind": type(layer).__name__, "param_bytes": sum(sizes), "largest": max(sizes, default=0)})
    return out


def activation_bytes(args: dict, mbs: int, lo: int, hi: int) -> int:
    """Bytes one microbatch leaves alive on a stage holding layers [lo, hi) until its backward,
    from the shapes (float32, b = mbs, T = seq_len, d = d_model, h = n_heads, r = mlp_ratio,
    V = vocab): what autograd saves in each layer, written out from service/builtins/gpt.py
    (the layer's input is counted as the previous layer's output; checked by ``check_activations``)::

        stage input (pp_rank > 0)  b*T*d                     the received activation, in the stash
        Embedding                  b*T*d + 2*b*T (int64 ids)  its output
        Block                      (8 + 2r)*b*T*d + 4*b*T + b*h*T
                                   ln1 out, qkv out (3: q, k, v are views of it), attention
                                   out (already (b, T, d) in memory: its reshape is a view),
                                   x + attn, ln2 out, fc out (r), GELU out (r), block out;
                                   LayerNorm mean/rstd, attention log-sum-exp
        final LayerNorm            b*T*d + 2*b*T
        Head + loss                b*T*V + 2*b*T             log_softmax's output (the logits
                                   themselves are freed), the targets

    times 4 bytes (float32; int64 ids count as two).  The backward's transients (the gradients of
    these, and b*T*V twice more at the head) are not included: they live one layer at a time."""
    b, t, d = mbs, args["seq_len"], args["d_model"]
    h, r, v = args["n_heads"], args.get("mlp_ratio", 4), args["vocab_size"]
    n_layers = args["n_layers"]
    floats = b * t * d if lo > 0 else 2 * b * t
    for i in range(lo, hi):
        if i == 0:
            floats += b * t * d + 2 * b * t
        elif i <= n_layers:
            floats += (8 + 2 * r) * b * t * d + 4 * b * t + b * h * t
        elif i == n_layers + 1:
            floats += b * t * d + 2 * b * t
        else:
            floats += b * t * v + 2 * b * t
    return 4 * floats


_CHECK = r'''
import json, sys
import torch
from torch.nn import functional as F
sys.path.insert(0, sys.argv[1])
from service.builtins.gpt import gpt
args, mbs = json.loads(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
layers = gpt(**args)["layers"]
n = args["n_layers"]
def saved(fn, inp, params):
    seen = {}
    skip = {p.untyped_storage().data_ptr() for p in params} | {inp.untyped_storage().data_ptr()}
    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(inp)
    if out.dim() > 0:
        seen[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
    return sum(seen.values())
T, d, V = args["seq_len"], args["d_model"], args["vocab_size"]
ids = torch.randint(0, V, (mbs, T))
emb = layers[0]()
res = {"Embedding": saved(emb, ids, list(emb.parameters())) + ids.numel() * 8}
del emb
blk = layers[1]()
x = torch.randn(mbs, T, d, requires_grad=True)
res["Block"] = saved(blk, x, list(blk.parameters()))
del blk
ln, head = layers[n + 1](), layers[n + 2]()
res["LayerNorm"] = saved(ln, x, list(ln.parameters()))
y = torch.randint(0, V, (mbs, T))
def head_loss(z):
    logits = head(z)
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
res["Head+loss"] = saved(head_loss, x, list(head.parameters())) + y.numel() * 8
print(json.dumps(res))
'''


def check_activations(args: dict, mbs: int) -> dict:
    """Bytes autograd saves for one microbatch in each kind of layer, counted by a saved-tensor
    hook on real layers (unique storages, parameters and the layer's input left out, its output
    in), in a subprocess so this process's memory is not touched; beside ``activation_bytes``'s."""
    r = subprocess.run([sys.executable, "-c", _CHECK, str(ROOT), json.dumps(args), str(mbs)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return {"error": r.stderr[-1000:]}
    got = json.loads(r.stdout.strip().splitlines()[-1])
    n = args["n_layers"]
    formula = {"Embedding": activation_bytes(args, mbs, 0, 1),
               "Block": activation_bytes(args, mbs, 1, 2) - 4 * mbs * args["seq_len"] * args["d_model"],
               "LayerNorm": activation_bytes(args, mbs, n + 1, n + 2) - 4 * mbs * args["seq_len"] * args["d_model"],
               "Head+loss": activation_bytes(args, mbs, n + 2, n + 3) - 4 * mbs * args["seq_len"] * args["d_model"]}
    return {k: {"hook": got[k], "formula": formula[k]} for k in got}


def param_count(args: dict) -> int:
    from service.builtins.gpt import param_count as count

    return count(args["vocab_size"], args["seq_len"], args["d_model"], args["n_layers"],
                 args.get("mlp_ratio", 4), args.get("tie_embeddings", True))


# ---------------------------------------------------------------- one job, measured

def write_tokens(path: Path, vocab: int, n: int) -> None:
    import numpy as np

    if not path.exists() or path.stat().st_size != 2 * n:
        np.random.default_rng(0).integers(0, vocab, size=n, dtype=np.uint16).tofile(path)


# user-side settings that shrink the transients (see the README): fused AdamW (no temporaries
# in its step) and glibc returning freed blocks above 1 MiB at once
TUNED = {"optimizer": {"name": "adamw", "lr": 1e-4, "fused": True},
         "runtime_env": {"env_vars": {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}}}


def gpt_spec(name: str, args: dict, dp: int, pp: int, mbs: int, batch: int, steps: int, tokens: Path,
             tuned: bool = False):
    from service.spec import parse_spec

    return parse_spec({
        "name": name, "model": {"kind": "gpt", "args": args},
        "data": {"kind": "tokens", "args": {"path": str(tokens), "seq_len": args["seq_len"], "dtype": "uint16"}},
        "loss": "cross_entropy", "optimizer": {"name": "adamw", "lr": 1e-4},
        "training": {"global_batch_size": batch, "microbatch_size": mbs, "steps": steps, "seed": 0},
        "parallelism": {"dp": dp, "pp": pp, "schedule": "1f1b", "transport": "collective"},
        **(TUNED if tuned else {}),
    })


def _warm(actor) -> int:
    """Inside an unconfigured StageWorker: what any worker runs before it holds a layer (an
    optimizer, one forward and backward of a stand-in layer)."""
    import os as _os

    import torch as _torch

    from service.loading import build_optimizer

    layer = _torch.nn.Linear(8, 8)
    opt = build_optimizer(actor.spec, layer.parameters())
    layer(_torch.randn(2, 8)).sum().backward()
    opt.step()
    return _os.getpid()


def _learn(sched) -> int:
    """Inside a JobScheduler actor: the pre-flight and layer profile a job's scheduler has run
    first (in a Ray task: actors/layerfacts.py), and what comes back of it."""
    import os as _os

    from actors import layerfacts

    layerfacts.learn_for_job(sched.spec, [])
    return _os.getpid()


def measure_base(spec) -> dict:
    """The bases, from two actors started together for ``spec`` (a tiny model):

    - ``bare`` / ``base``: VmHWM of an empty worker, a StageWorker actor (it imports torch, Ray
      and the engine) that holds no layer, before / after it made an optimizer and ran a
      stand-in step;
    - ``scheduler``: VmHWM of a JobScheduler actor that had the pre-flight and the layer profile
      of ``spec`` run (imports, meta trace, machine-speed probe: in a task), but no job."""
    import ray

    from actors.scheduler import JobScheduler
    from actors.worker import StageWorker

    ship_by_value()
    opts = {"num_cpus": 0, "max_concurrency": 4, "namespace": NAMESPACE}
    spec_dict = spec.model_dump(mode="json")
    scratch = tempfile.mkdtemp(prefix="relaytrain-memory-base-")  # its model folder (never written)
    w = ray.remote(StageWorker).options(**opts).remote("memory-base", spec_dict, [], 300.0)
    s = ray.remote(JobScheduler).options(**opts).remote("memory-base", spec_dict, [], model_dir=scratch)
    try:
        pid = ray.get(ask(w), timeout=180)["pid"]
        time.sleep(0.3)
        bare = proc_status(pid)["VmHWM"]
        _, sched_pid = ray.get([w.__ray_call__.remote(_warm), s.__ray_call__.remote(_learn)], timeout=180)
        time.sleep(0.3)
        return {"bare": bare, "base": proc_status(pid)["VmHWM"], "scheduler": proc_status(sched_pid)["VmHWM"]}
    finally:
        ray.kill(w)
        ray.kill(s)
        shutil.rmtree(scratch, ignore_errors=True)


def phases(series: list, timeline: dict | None) -> dict:
    """Peak RSS sampled before the worker's first action, during its steps, and after."""
    if not series:
        return {}
    if not timeline:
        return {"all": max(s[1] for s in series)}
    t_first, t_last = timeline
    out = {}
    for key, keep in (("configure", lambda t: t < t_first), ("steps", lambda t: t_first <= t <= t_last),
                      ("after", lambda t: t > t_last)):
        vals = [s[1] for s in series if keep(s[0])]
        out[key] = max(vals) if vals else None
    shm = [s[4] for s in series]
    out["shmem_max"] = max(shm) if shm else 0
    return out


def run_measured(label: str, args: dict, dp: int, pp: int, mbs: int, batch: int, steps: int, tokens: Path,
                 base: int, limit: float | None = None, tuned: bool = False) -> dict:
    """Train one job and measure its processes; each worker's share beside its peak."""
    import uuid

    from actors.runner import JobFailed, run_job

    name = f"mem-{label}-{uuid.uuid4().hex[:6]}".lower()
    spec = gpt_spec(name, args, dp, pp, mbs, batch, steps, tokens, tuned)
    reset_hwm(os.getpid())
    sampler = Sampler(name, interval=0.1, limit=limit, min_available=MIN_AVAILABLE)
    sampler.start()
    t0 = time.time()
    error = None
    try:
        with tempfile.TemporaryDirectory(prefix="relaytrain-memory-") as out:
            final = run_job(spec=spec, out=out, progress=False, record=False)
    except JobFailed as e:
        final, error = e.result or {"metrics": [], "timelines": []}, str(e)
    finally:
        sampler.stop()
    wall = time.time() - t0
    if sampler.guard_fired:
        error = f"stopped by the memory guard: {sampler.guard_fired}"
    layers = gpt_layers(args)
    metrics = final.get("metrics", [])
    live = metrics[-1]["peak_live"] if metrics else [min(pp - s, batch // mbs // dp) for s in range(pp)]
    bounds = shape_bounds(final.get("events", []))
    spans: dict = {}
    for entry in final.get("timelines", []):
        for cell, acts in entry["workers"].items():
            if acts:
                a, b = spans.get(cell, (float("inf"), 0.0))
                spans[cell] = (min(a, acts[0][1]), max(b, acts[-1][2]))
    rows = []
    for w in sampler.workers():
        r, s = w["cell"]
        lo, hi = w["layers"] or bounds[s]
        pbytes = sum(layer["param_bytes"] for layer in layers[lo:hi])
        act = live[s] * activation_bytes(args, mbs, lo, hi)
        share = base + state_bytes(pbytes) + act
        rows.append({"process": f"worker {r}.{s}", "layers": [lo, hi - 1], "pid": w["pid"], "malloc_env": w.get("malloc_env"),
                     "kinds": _kinds(layers[lo:hi]), "params": pbytes // 4, "state": state_bytes(pbytes),
                     "live": live[s], "activations": act, "base": base, "share": share, "peak": w["peak"],
                     "ratio": w["peak"] / share, "phases": phases(sampler.series.get(w["pid"], []),
                                                                  spans.get(f"w{r}.{s}"))})
    sched = sampler.scheduler()
    driver = proc_status(os.getpid())["VmHWM"]
    times = [m["step_time_s"] for m in metrics]
    series = {str(row["pid"]): _thin(sampler.series.get(row["pid"], [])) for row in rows}
    return {"label": label, "tuned": tuned, "args": args, "dp": dp, "pp": pp, "mbs": mbs, "batch": batch, "steps": steps,
            "params": param_count(args), "workers": rows, "scheduler_peak": sched["peak"] if sched else None,
            "driver_peak": driver, "total_peak": sampler.peak_total(), "idle_total": sampler.idle_total(), "step_times": times, "wall_s": wall,
            "error": error, "series": series}


def shape_bounds(events: list[dict]) -> list[tuple[int, int]]:
    """Each stage's [lo, hi) from a job's last ``shape`` event (its partition)."""
    sizes = next((e["partition"] for e in reversed(events) if e.get("type") == "shape"), [])
    out, lo = [], 0
    for n in sizes:
        out.append((lo, lo + n))
        lo += n
    return out


def _kinds(layers: list[dict]) -> str:
    out: list[list] = []
    for layer in layers:
        name = {"Embedding": "emb", "Block": "block", "LayerNorm": "ln", "Head": "head"}.get(layer["kind"], layer["kind"])
        if out and out[-1][0] == name:
            out[-1][1] += 1
        else:
            out.append([name, 1])
    return " + ".join(f"{k} blocks" if n == "block" else n for n, k in out)


def _thin(series: list, every: float = 0.5) -> list:
    out, last = [], -1e9
    for s in series:
        if s[0] - last >= every:
            out.append([s[0], s[1] // MiB, s[4] // MiB])
            last = s[0]
    return out


# ---------------------------------------------------------------- the one-process loop

_ONE = r'''
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from service.loading import build_data, build_loss, build_model, build_optimizer
from service.sampling import step_indices
from service.spec import parse_spec
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
spec = parse_spec(json.loads(sys.argv[2]))
torch.set_num_threads(int(sys.argv[3]))
stand_in = torch.nn.Linear(8, 8)
o = build_optimizer(spec, stand_in.parameters())
stand_in(torch.randn(2, 8)).sum().backward(); o.step()
base = hwm()
model = build_model(spec)               # the whole model: nn.Sequential, the tie one parameter
opt = build_optimizer(spec, model.parameters())
samples, loss_fn = build_data(spec), build_loss(spec)
t = spec.training
times = []
for g in range(t.steps):
    t0 = time.perf_counter()
    idx = step_indices(g, len(samples), t.global_batch_size, t.seed, t.shuffle)
    x, y = samples.batch(idx)
    opt.zero_grad(set_to_none=True)
    for xm, ym in zip(x.split(t.microbatch_size), y.split(t.microbatch_size)):
        (loss_fn(model(xm), ym) * (len(xm) / len(x))).backward()
    opt.step()
    times.append(time.perf_counter() - t0)
print(json.dumps({"base": base, "peak": hwm(), "step_times": times,
                  "params": sum(p.numel() for p in model.parameters())}))
'''


def run_one_process(label: str, args: dict, mbs: int, batch: int, steps: int, tokens: Path, base: int,
                    limit: float | None = None, threads: int = 2) -> dict:
    """The plain loop in a subprocess (nn.Sequential + AdamW, microbatches accumulated), its
    memory sampled from here; SIGKILLed if its PSS passes ``limit``."""
    spec = gpt_spec(f"one-{label}", args, 1, 1, mbs, batch, steps, tokens)
    proc = subprocess.Popen([sys.executable, "-c", _ONE, str(ROOT), json.dumps(spec.model_dump(mode="json")),
                             str(threads)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    series, peak_pss, killed = [], 0, False
    t0 = time.time()
    while proc.poll() is None:
        st, pss = proc_status(proc.pid), proc_pss(proc.pid)
        if st:
            series.append((round(time.time(), 3), st["VmRSS"], st["VmHWM"], st.get("RssAnon", 0), 0))
        peak_pss = max(peak_pss, pss or 0)
        low = meminfo("MemAvailable") < MIN_AVAILABLE
        if ((limit and pss and pss > limit) or low) and not killed:
            proc.kill()
            killed = "the machine ran low" if low else f"its memory passed {limit / GiB:.1f} GiB"
        time.sleep(0.1)
    out, err = proc.communicate()
    wall = time.time() - t0
    if proc.returncode != 0:
        return {"label": label, "args": args, "params": param_count(args), "error":
                f"stopped by the memory guard: {killed}" if killed else err[-1500:], "wall_s": wall,
                "total_peak": peak_pss}
    res = json.loads(out.strip().splitlines()[-1])
    pbytes = 4 * res["params"]
    act = activation_bytes(args, mbs, 0, args["n_layers"] + 3)  # one microbatch at a time
    share = res["base"] + state_bytes(pbytes) + act
    return {"label": label, "args": args, "params": res["params"], "base": res["base"], "peak": res["peak"],
            "state": state_bytes(pbytes), "activations": act, "share": share, "ratio": res["peak"] / share,
            "step_times": res["step_times"], "wall_s": wall, "total_peak": peak_pss, "error": None,
            "series": _thin(series)}


# ---------------------------------------------------------------- the largest model

_COSTS: dict = {}


def stage_bounds(spec) -> list[tuple[int, int]]:
    """The partition the engine picks for the GPT ``spec`` (its pre-flight trace and balanced
    rule).  Every block has the same cost, so the trace of a one-block model is traced once and
    its block's cost repeated: the same costs the engine's trace of the deep model gives."""
    from actors import layerfacts
    from service import partition

    args = dict(spec.model.args)
    n = args["n_layers"]
    key = json.dumps({**args, "n_layers": 0}, sort_keys=True)
    if key not in _COSTS:
        one = spec.model_copy(update={"model": spec.model.model_copy(update={"args": {**args, "n_layers": 1}})})
        _COSTS[key] = layerfacts.learn(one, []).facts.seconds
    emb, block, ln, head = _COSTS[key]
    sizes = partition.choose(spec.parallelism.partition, n + 3, spec.parallelism.pp, [emb] + [block] * n + [ln, head])
    out, lo = [], 0
    for k in sizes:
        out.append((lo, lo + k))
        lo += k
    return out


def predict_pp(run_a: dict, args: dict, spec, mbs: int, base: int) -> dict:
    """Every process's peak for ``spec`` at pp = 4, from run A: each stage's peak is its share
    plus the excess its stage had at size A (that excess is transients sized by the largest
    parameter, the tied one, which do not grow with the depth), and the processes outside the
    workers (the driver, Ray's daemons, the scheduler) as measured around run A.  The excess is
    scaled by d_model (the tied parameter is vocab x d_model) when the widths differ."""
    scale = args["d_model"] / run_a["args"]["d_model"]
    extra = [scale * max(w["peak"] - w["share"], 0) for w in run_a["workers"]]
    layers = gpt_layers(args)
    peaks = []
    for s, (lo, hi) in enumerate(stage_bounds(spec)):
        state = state_bytes(sum(x["param_bytes"] for x in layers[lo:hi]))
        act = min(4 - s, spec.microbatches) * activation_bytes(args, mbs, lo, hi)
        peaks.append(base + state + act + extra[s])
    rest = run_a["idle_total"] + (run_a["scheduler_peak"] or 0)
    return {"worker_peaks": peaks, "rest": rest, "total": sum(peaks) + rest}


def predict_one(run_one: dict, args: dict, mbs: int) -> dict:
    """The one-process loop's peak for ``args``: its share plus its excess at size A (scaled
    by d_model, as ``predict_pp``)."""
    extra = args["d_model"] / run_one["args"]["d_model"] * max(run_one["peak"] - run_one["share"], 0)
    state = state_bytes(4 * param_count(args))
    act = activation_bytes(args, mbs, 0, args["n_layers"] + 3)
    return {"total": run_one["base"] + state + act + extra}


def largest(family: dict, fits, start: int = 2, stop: int = 512) -> int | None:
    """The largest n_layers of ``family`` for which ``fits(args)`` (fits is monotone in the
    depth): doubling, then bisection."""
    ok = lambda n: fits({**family, "n_layers": n})  # noqa: E731
    if not ok(start):
        return None
    lo, hi = start, start * 2
    while hi < stop and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, stop)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


# ---------------------------------------------------------------- tables

def _g(x) -> str:
    return "" if x is None else f"{x / GiB:.2f}"


def _m(x) -> str:
    return "" if x is None else f"{x / MiB:.0f}"


def table_processes(runs: list[dict], one: dict | None) -> str:
    lines = ["| run | process | layers | params (M) | state (GiB) | live mb x act. (MiB) | base (MiB) | share (GiB) "
             "| peak (GiB) | peak / share | peak RSS configure / steps / after (GiB) | shmem (GiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        tag = (f"{run['label']}: dp {run['dp']} x pp {run['pp']}, {run['params'] / 1e6:.0f} M params"
               + (", fused AdamW + MALLOC_MMAP_THRESHOLD_" if run.get("tuned") else ""))
        for w in run["workers"]:
            ph = w["phases"]
            lines.append(
                f"| {tag} | {w['process']} | {w['layers'][0]}-{w['layers'][1]} ({w['kinds']}) | {w['params'] / 1e6:.1f} "
                f"| {_g(w['state'])} | {w['live']} x {w['activations'] / max(w['live'], 1) / MiB:.0f} | {_m(w['base'])} "
                f"| {_g(w['share'])} | {_g(w['peak'])} | **{w['ratio']:.2f}** "
                f"| {_g(ph.get('configure'))} / {_g(ph.get('steps'))} / {_g(ph.get('after', ph.get('final')))} | {_g(ph.get('shmem_max'))} |")
            tag = ""
        lines.append(f"|  | scheduler | none |  |  |  |  |  | {_g(run['scheduler_peak'])} |  |  |  |")
        lines.append(f"|  | driver (run_job) | none |  |  |  |  |  | {_g(run['driver_peak'])} |  |  |  |")
        lines.append(f"|  | all processes (summed PSS) |  |  |  |  |  |  | {_g(run['total_peak'])} |  |  |  |")
    if one and not one.get("error"):
        lines.append(f"| {one['label']}: one process, {one['params'] / 1e6:.0f} M params | the loop | all "
                     f"| {one['params'] / 1e6:.1f} | {_g(one['state'])} | 1 x {one['activations'] / MiB:.0f} "
                     f"| {_m(one['base'])} | {_g(one['share'])} | {_g(one['peak'])} | **{one['ratio']:.2f}** |  |  |")
    return "\n".join(lines)


def table_scheduler(runs: list[dict], preflight_only: int | None = None) -> str:
    lines = ["| model | params | dp x pp | scheduler peak (MiB) | driver peak (MiB) |", "|---|---|---|---|---|"]
    if preflight_only:
        lines.append(f"| tiny, pre-flight only (a JobScheduler actor, no job) | {param_count(TINY) / 1e6:,.1f} M |  "
                     f"| {_m(preflight_only)} |  |")
    for run in runs:
        a = run["args"]
        lines.append(f"| {run['label']} (d {a['d_model']}, {a['n_layers']} blocks, vocab {a['vocab_size']})"
                     f"{', tuned' if run.get('tuned') else ''} "
                     f"| {run['params'] / 1e6:,.1f} M | {run['dp']} x {run['pp']} | {_m(run['scheduler_peak'])} "
                     f"| {_m(run['driver_peak'])} |")
    return "\n".join(lines)


def table_largest(rows: list[dict], budget: float) -> str:
    lines = [f"| loop | blocks | params | state (GiB) | predicted (GiB) | measured, all processes (GiB) "
             f"| largest process (GiB) | step times (s) | within {budget / GiB:.1f} GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        run = r.get("run") or {}
        big = max((w["peak"] for w in run.get("workers", [])), default=run.get("peak"))
        times = ", ".join(f"{t:.1f}" for t in run.get("step_times", []))
        ok = ("projected, not run" if not run else "stopped: " + run["error"][:60] if run.get("error")
              else "yes" if run["total_peak"] <= budget else "NO")
        pred = _g(r["predicted"]) + (" (fullest worker)" if r.get("per_worker") else "")
        lines.append(f"| {r['loop']} | {r['n_layers']} | {r['params'] / 1e9:.3f} B | {_g(STATE_BYTES * r['params'])} "
                     f"| {pred} | {_g(run.get('total_peak'))} | {_g(big)} | {times} | {ok} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- main

TINY = {"vocab_size": 96, "seq_len": 32, "d_model": 64, "n_heads": 4, "n_layers": 6}
# A: several GiB of state at pp = 4; B: smaller, for dp x pp = 2 x 2, which holds the model twice
# on this one machine (and its shared-memory gradient sum four times more: see the README)
SIZE_A = {"vocab_size": 50304, "seq_len": 64, "d_model": 1536, "n_heads": 12, "n_layers": 8}
SIZE_B = {"vocab_size": 50304, "seq_len": 64, "d_model": 1024, "n_heads": 16, "n_layers": 6}
SIZE_B_QUICK = {"vocab_size": 50304, "seq_len": 32, "d_model": 1024, "n_heads": 16, "n_layers": 4}
FAMILY = {"vocab_size": 50304, "seq_len": 32, "d_model": 1536, "n_heads": 12}  # the largest: more blocks
MBS, BATCH, STEPS = 1, 4, 2


def per_worker_row(run_a: dict, budget: float, base: int, tokens: Path) -> dict | None:
    """The largest pp = 4 GPT whose fullest worker alone stays within ``budget``: what four
    machines like this one, a worker each, could train (projected from run A, not run)."""
    def spec_of(a):
        return gpt_spec("largest", a, 1, 4, MBS, BATCH, STEPS, tokens)

    def fullest(a):
        return max(predict_pp(run_a, a, spec_of(a), MBS, base)["worker_peaks"])

    n = largest(FAMILY, lambda a: fullest(a) <= 0.92 * budget)
    if n is None:
        return None
    a = {**FAMILY, "n_layers": n}
    return {"loop": "relaytrain pp = 4, each worker on its own machine like this one", "n_layers": n,
            "params": param_count(a), "predicted": fullest(a), "per_worker": True, "args": a}


def measure(args, budget: float, tokens: Path) -> dict:
    import ray

    size_b = SIZE_B_QUICK if args.quick else SIZE_B
    ray.init(address="local", num_cpus=16, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        base = measure_base(gpt_spec("base", TINY, 1, 4, MBS, BATCH, STEPS, tokens))
        print(f"empty worker: {base['bare'] / MiB:.0f} MiB after its imports, {base['base'] / MiB:.0f} MiB after "
              f"making an optimizer and a stand-in step (the base); a scheduler that pre-flighted a tiny model: "
              f"{base['scheduler'] / MiB:.0f} MiB", flush=True)
        check = check_activations(size_b if args.quick else SIZE_A, MBS)
        print("activation bytes per microbatch, formula / saved-tensor hook:",
              {k: f"{v['formula'] / MiB:.2f} / {v['hook'] / MiB:.2f} MiB" for k, v in check.items()
               if isinstance(v, dict)}, flush=True)
        plan = [("B", size_b, 1, 4, False), ("B", size_b, 2, 2, False)]
        if not args.quick:
            plan = [("tiny", TINY, 1, 4, False), *plan, ("A", SIZE_A, 1, 4, False), ("A", SIZE_A, 1, 4, True)]
        runs = []
        for label, a, dp, pp, tuned in plan:
            runs.append(run_measured(label, a, dp, pp, MBS, BATCH, STEPS, tokens, base["base"], tuned=tuned))
            r = runs[-1]
            print(f"{label} {dp}x{pp}{' tuned' if tuned else ''}: {r['wall_s']:.0f} s, steps "
                  f"{[round(t, 1) for t in r['step_times']]} s, peaks {[round(w['peak'] / GiB, 2) for w in r['workers']]} "
                  f"GiB, peak/share {[round(w['ratio'], 2) for w in r['workers']]}"
                  f"{', ' + r['error'] if r['error'] else ''}", flush=True)
        ref = size_b if args.quick else SIZE_A
        one = run_one_process("B" if args.quick else "A", ref, MBS, BATCH, STEPS, tokens, base["base"])
        print(f"one process {one['label']}: {one['wall_s']:.0f} s, peak {_g(one.get('peak'))} GiB"
              f"{', ' + one['error'] if one.get('error') else ''}", flush=True)

        big_rows = []
        run_a = runs[0] if args.quick else runs[3]  # the pp = 4 run at the one-process loop's size
        if not args.no_largest and not run_a["error"] and not one.get("error"):
            target = 0.92 * budget

            def spec_of(a):
                return gpt_spec("largest", a, 1, 4, MBS, BATCH, STEPS, tokens)

            n_pp = largest(FAMILY, lambda a: predict_pp(run_a, a, spec_of(a), MBS, base["base"])["total"] <= target)
            n_one = largest(FAMILY, lambda a: predict_one(one, a, MBS)["total"] <= target)
            for loop, n in (("relaytrain pp = 4", n_pp), ("one process", n_one)):
                if n is None:
                    continue
                a = {**FAMILY, "n_layers": n}
                relay = loop.startswith("relay")
                pred = (predict_pp(run_a, a, spec_of(a), MBS, base["base"]) if relay else predict_one(one, a, MBS))
                row = {"loop": loop, "n_layers": n, "params": param_count(a), "predicted": pred["total"], "args": a}
                if not args.quick:
                    row["run"] = (run_measured("largest", a, 1, 4, MBS, BATCH, STEPS, tokens, base["base"], limit=budget)
                                  if relay else
                                  run_one_process("largest", a, MBS, BATCH, STEPS, tokens, base["base"], limit=budget))
                    print(f"{loop}, {n} blocks: {row['run']['wall_s']:.0f} s, all processes "
                          f"{_g(row['run']['total_peak'])} GiB{', ' + row['run']['error'] if row['run'].get('error') else ''}",
                          flush=True)
                big_rows.append(row)
            extra = per_worker_row(run_a, budget, base["base"], tokens)
            if extra:
                big_rows.append(extra)
    finally:
        ray.shutdown()
    return {"base": base, "activation_check": check, "runs": runs, "one_process": one, "largest": big_rows}


def render(res: dict) -> str:
    quick, base = res["quick"], res["base"]
    sizes = "; ".join(f"size {k} = d_model {a['d_model']}, {a['n_layers']} blocks, vocab {a['vocab_size']}, "
                      f"seq_len {a['seq_len']}" for k, a in sorted({r["label"]: r["args"] for r in res["runs"]}.items())
                      if k != "tiny")
    text = [f"GPT float32, AdamW, microbatch {MBS}, global batch {BATCH}, {STEPS} steps, 1F1B, collective transport; "
            f"{sizes}; the head is tied to the embedding (the first and the last stage hold a copy each). "
            f"share = base + 16 B x parameters of its layers + live microbatches x activation bytes of one; "
            f"base = {base['base'] / MiB:.0f} MiB (VmHWM of an empty StageWorker; {base['bare'] / MiB:.0f} MiB before "
            f"its optimizer and stand-in step). peak = VmHWM from /proc. configure / steps / after = the largest RSS "
            f"sampled (every 0.1 s) before the worker's first action, from its first to its last action, and after "
            f"it (the last step's tied-gradient sum and update, the model written). shmem: RssShmem.\n",
            table_processes(res["runs"] + [r["run"] for r in res["largest"] if r.get("run", {}).get("workers")],
                            res["one_process"]), "",
            "Scheduler (and driver) peak by model size:\n",
            table_scheduler(res["runs"] + [r["run"] for r in res["largest"] if r.get("run", {}).get("workers")],
                            base.get("scheduler")), ""]
    if res["largest"]:
        text += [f"Largest GPT (d_model {FAMILY['d_model']}, vocab {FAMILY['vocab_size']}, seq_len {FAMILY['seq_len']}, "
                 f"more blocks) whose processes together stay within {res['budget'] / GiB:.1f} GiB "
                 f"({'projected from size B, not run' if quick else 'projected from size A, then run'}; MemAvailable "
                 f"at start {res['mem_available'] / GiB:.1f} GiB):\n", table_largest(res["largest"], res["budget"]), ""]
    text.append(f"bench time: {res['wall_s'] / 60:.1f} min ({'--quick' if quick else 'full'}); load average "
                f"{res['load_start']:.1f} at the start, {res['load_end']:.1f} at the end (2 cores, shared)")
    return "\n".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller models; the largest sizes projected, not run")
    ap.add_argument("--budget-gib", type=float, default=20.0,
                    help="memory the largest models may use, all processes (lowered to MemAvailable - 5 GiB)")
    ap.add_argument("--no-largest", action="store_true", help="skip the largest-model search")
    ap.add_argument("--from-json", metavar="PATH", help="print the tables of a saved result again, run nothing")
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="relaytrain-memory-") as work:
        tokens = Path(work) / "tokens.bin"
        write_tokens(tokens, 96, 1 << 18)  # ids below every vocabulary used here
        _main(args, tokens)


def _main(args, tokens: Path) -> None:
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        if res["largest"] and not any(r.get("per_worker") for r in res["largest"]):
            run_a = next(r for r in res["runs"] if r["label"] == ("B" if res["quick"] else "A") and r["pp"] == 4
                         and not r.get("tuned"))
            extra = per_worker_row(run_a, res["budget"], res["base"]["base"], tokens)
            if extra:
                res["largest"].append(extra)
        out = render(res)
        print(out)
        Path(args.from_json).write_text(json.dumps(res, indent=1, default=str))
        Path(args.from_json).with_suffix(".txt").write_text(out + "\n")
        return
    t_start, load_start = time.time(), os.getloadavg()[0]
    avail = meminfo("MemAvailable")
    budget = min(args.budget_gib * GiB, avail - 5 * GiB)  # others share the machine
    res = measure(args, budget, tokens)
    res.update(time=time.time(), quick=args.quick, wall_s=time.time() - t_start, load_start=load_start,
               load_end=os.getloadavg()[0], budget=budget, mem_available=avail)
    out = render(res)
    print()
    print(out)
    name = "memory_quick" if args.quick else "memory"
    (RESULTS / f"{name}.txt").write_text(out + "\n")
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
