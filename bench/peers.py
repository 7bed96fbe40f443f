"""relaytrain against its peers on one machine, in one run, side by side (issue 19, "Schedules
past 1F1B"):

- torch.distributed.pipelining, p = 2 processes over gloo with manual ``PipelineStage``s, each
  stage one chunk of the model: ``Schedule1F1B``; ``ScheduleInterleavedZeroBubble`` with one
  stage per process (ZB-H1: the backward split into input and weight gradients, the weight
  gradients filling the bubble); ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble``
  with v = 2 stages per process (loop placement: rank r holds stages r and r + p);
  ``ScheduleZBVZeroBubble`` (V placement: rank r holds stages r and 2p-1-r); ``ScheduleGPipe``
  with ``--torch-schedules ... gpipe``;
- relaytrain with p = 2 on its collective transport, its real ``JobScheduler`` and
  ``StageWorker``s: 1F1B, interleaved 1F1B (v = 2), ZB-H1 and ZB-V (``parallelism.schedule``,
  ``parallelism.stages_per_worker``); GPipe and the object-store transport on request
  (``--schedules``, ``--transports``);
- Ray Train v2 ``TorchTrainer`` with DDP on 2 workers against relaytrain dp = 2, pp = 1, at
  microbatches of 64 rows only (Ray Train's replicas take peers_spec's default microbatch);
- one process, one thread, microbatched (the base line); and again with glibc's malloc tuned as
  relaytrain's workers tune theirs (no page faults a step: the stricter base line, "efficiency, tuned");

for M in {4, 8, 16} microbatches of 16, 32 and 64 rows (``bench/peers_spec.py`` holds the model,
the MLP 1024-1024x8-10 of the issue's held-out comparison, which is 32 rows at M = 8).  Every
pipeline cuts the model into the same p x v chunks (``peers_spec.chunk_sizes``: what relaytrain's
balanced partition makes of these layers; p x v = 4: entries [0, 2) [2, 4) [4, 6) [6, 9)), and
relaytrain's own report of its chunks and their placement is checked against them before timing.

p = 2 only by default: ``--pp 4`` runs 4 processes (or Ray workers) per pipeline on the 2 cores,
which then time-share: while one waits in the schedule's bubble another computes, so the bubble
is hidden by contention and p = 4 figures from a 2-core machine say nothing about the schedules.

    make bench-peers                      # installs the `bench` extra, then runs the full bench
    .venv/bin/python bench/peers.py [--quick] [--ms 4 8 16] [--mbs 16 32 64] [--rounds 4] [--steps 4]

Every contestant first runs ``--check`` steps from the same initial parameters; their loss
sequences and then their parameters must agree with the single process's (to float
tolerance) or the bench stops and says where; the losses of every later step are checked
too.  (A relaytrain contestant that cannot run at all -- its engine does not know the
schedule yet -- is left out and listed as such in the report; one that trains differently stops
the bench.)  Then, for each (mbs, M), ``--rounds`` rounds run the contestants one after another
(the order rotates every round), each for 1 warm-up step plus ``--steps`` timed steps: 16 timed
steps per contestant and (mbs, M) by default (12 with ``--quick``, which runs mbs = 32, M = 8
only), one thread per worker.  A step's time is the wall time between the ends of two
consecutive steps as seen by the process that drives them (relaytrain: its scheduler, at each
step's metrics row; the others: the later of their ranks' ends, after the optimizer step), so
it holds everything a step costs, dispatch included.

The report, per (mbs, M): every contestant's step time (median, interquartile range) and the
minor page faults a step of its busiest process (from /proc/<pid>/stat around each round, its
warm-up step included; not for Ray Train's workers, whose processes the bench does not know);
relaytrain's best schedule against torch's best (torch's median over relaytrain's; goal >= 1.1);
relaytrain's measured bubble per schedule (the metrics row's ``bubble``; goal: ZB-H1's at most
half of 1F1B's at M = 8); the pipeline efficiency (one process's step time / p) / relaytrain's
step time (goal >= 0.8 at M = 8); and where the step of relaytrain's best schedule goes (compute
and waiting per worker, all-reduce, the deferred optimizer step, building the batch, and
dispatch, gather and the scheduler's own work).

While a contestant runs its turn, every other contestant's processes are stopped (SIGSTOP;
SIGCONT at its own turn): held at a step boundary, each of them still spends about 1% of a core
on Ray's own threads, which a pipeline using both cores would lose.  ``--pause-idle off`` leaves
them running (every run before 2026-12-04); ``--pause-idle ab`` times each contestant both ways
in every round and reports the two sets of figures side by side.

Writes bench/results/peers.json, peers.txt (the tables) and peers.png (step time against M, one
panel per microbatch size; ``--quick``: peers_quick.*).  The full run takes 20-45 minutes on
2 cores.
"""
from __future__ import annotations

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray starts its workers at nice 15 and the bench's own processes run at nice 0: on a shared
# machine that would hand the peers' processes priority over relaytrain's and Ray Train's.
os.environ.setdefault("RAY_worker_niceness", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import memory  # noqa: E402  (bench/memory.py: reading /proc)
import peers_spec  # noqa: E402

RESULTS = BENCH / "results"
RTOL, ATOL = 1e-4, 1e-6   # losses are O(0.1-1); float32 summation order moves them by ~1e-7
P_RTOL, P_ATOL = 1e-4, 2e-5  # parameters, as tests/test_engine.py holds relaytrain to plain PyTorch


def log(*a) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---------------------------------------------------------------- contestants

# relaytrain's schedules (parallelism.schedule) and torch's (bench/peers_procs.py: TORCH_SCHEDULES), as labelled
RELAY_LABELS = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "interleaved 1F1B v=2", "zb_h1": "ZB-H1",
                "zbv": "ZB-V"}
TORCH_LABELS = {"gpipe": "GPipe", "1f1b": "1F1B", "zb_h1": "InterleavedZeroBubble v=1 (ZB-H1)",
                "interleaved_1f1b": "Interleaved1F1B v=2", "interleaved_zb": "InterleavedZeroBubble v=2",
                "zbv": "ZBVZeroBubble (V)"}
RELAY_DEFAULT = ["1f1b", "interleaved_1f1b", "zb_h1", "zbv"]
TORCH_DEFAULT = ["1f1b", "zb_h1", "interleaved_1f1b", "interleaved_zb", "zbv"]
TORCH_CHUNKS = {"interleaved_1f1b": 2, "interleaved_zb": 2, "zbv": 2}


class Contestant:
    """A name, a group (``base``, ``pipeline`` or ``dp``), and run(n) -> n step records."""

    name: str
    group: str
    system: str = ""         # "single", "torch", "relaytrain" or "raytrain"
    schedule: Optional[str] = None
    transport: Optional[str] = None
    engine: Optional[str] = None
    peer: bool = False       # a system relaytrain is compared with
    pp = 1
    chunks = 1               # model chunks per pipeline worker

    def start(self) -> None: ...
    def ready(self) -> None: ...
    def run(self, n: int) -> list[dict]: ...
    def params(self) -> dict: ...   # the whole model's parameters, keyed as its state_dict
    def stop(self) -> None: ...

    def pids(self) -> list[int]:
        """Its processes on this machine, whose page faults the bench reads (none known: [])."""
        return []

    def all_pids(self) -> list[int]:
        """Every process of it the bench knows (``--pause-idle`` stops them between its turns)."""
        return self.pids()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the one process again with glibc's malloc tuned as relaytrain's workers tune theirs (actors/heap.py
# keep_freed: freed memory kept mapped, no page faults a step): its efficiency is the stricter one
TUNED = "single process, 1 thread, relaytrain's heap"


class Processes(Contestant):
    """The single process or torch.distributed.pipelining (bench/peers_procs.py)."""

    def __init__(self, name: str, group: str, kind: str, world: int, m: int, schedule: str = "1f1b",
                 mbs: int = peers_spec.MBS):
        self.name, self.group, self.kind, self.world, self.m, self.mbs = name, group, kind, world, m, mbs
        self.peer = kind == "torch_pp"
        self.system = "torch" if self.peer else "single"
        self.schedule = schedule if self.peer else None
        self.chunks = TORCH_CHUNKS.get(schedule, 1) if self.peer else 1
        self.pp = world
        self.procs, self.conns = [], []

    def start(self) -> None:
        import peers_procs

        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        port = _free_port()  # free when asked; another process may take it before rank 0 listens (ready)
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=peers_procs.serve, args=(child, self.kind, rank, self.world, port, self.m,
                                                           self.schedule or "1f1b", self.mbs), daemon=True)
            p.start()
            self.procs.append(p)
            self.conns.append(parent)

    def _answers(self, timeout: float) -> list:
        out = []
        for rank, c in enumerate(self.conns):
            if not c.poll(timeout):
                raise RuntimeError(f"{self.name}: rank {rank} did not answer within {timeout:.0f} s")
            kind, payload = c.recv()
            if kind == "error":
                raise RuntimeError(f"{self.name}: rank {rank} failed:\n{payload}")
            out.append(payload)
        return out

    def ready(self, tries: int = 3) -> None:
        """Waits for every rank to be up; where rank 0 found its port taken (``_free_port``'s
        race with the machine's other processes), starts them again on another."""
        for attempt in range(tries):
            try:
                self._answers(300)
                return
            except RuntimeError as e:
                if "EADDRINUSE" not in str(e) or attempt == tries - 1:
                    raise
                log(f"{self.name}: its port was taken before it listened; starting it again on another")
                self.stop()
                for p in self.procs:
                    p.join(10)
                    if p.is_alive():
                        p.kill()
                self.start()

    def run(self, n: int) -> list[dict]:
        for c in self.conns:
            c.send(("run", n))
        ranks = self._answers(600)
        out = []
        for i in range(n):
            steps = [r[i] for r in ranks]
            loss = next(s["loss"] for s in steps if s["loss"] is not None)
            rec = {"end": max(s["end"] for s in steps), "loss": loss, "bubble": None}
            span = max(s["pipe_end"] for s in steps) - min(s["start"] for s in steps)
            rec.update(span=span, busy=[s["busy"] for s in steps])
            if self.world > 1:
                rec["bubble"] = max(0.0, 1.0 - sum(s["busy"] for s in steps) / (self.world * span))
            out.append(rec)
        return out

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def params(self) -> dict:
        for c in self.conns:
            c.send(("params",))
        out = {}
        for part in self._answers(120):
            out.update(part)
        return out

    def stop(self) -> None:
        for c in self.conns:
            try:
                c.send(("stop",))
            except Exception:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        self.procs, self.conns = [], []


class RelayContestant(Contestant):
    system = "relaytrain"

    def __init__(self, name: str, group: str, spec, steps: int, engine: Optional[str] = None):
        from peers_relay import Relaytrain

        self.name, self.group = name + (f" [engine {engine}]" if engine else ""), group
        self.pp = spec.parallelism.pp
        self.schedule = spec.parallelism.schedule if self.pp > 1 else None
        self.chunks = getattr(spec.parallelism, "stages_per_worker", 1) or 1
        self.transport = spec.parallelism.transport
        self.weight_group = getattr(spec.parallelism, "weight_group", 1) or 1
        self.engine = engine
        self.job = Relaytrain(spec, steps, engine)

    def start(self) -> None:
        self.job.start()
        if self.job.engine:
            log(f"{self.name}: engine {self.job.where}")

    def run(self, n: int) -> list[dict]:
        return self.job.run(n)

    def params(self) -> dict:
        return self.job.params()

    def pids(self) -> list[int]:
        return self.job.pids()

    def all_pids(self) -> list[int]:
        return self.job.pids() + [self.job.scheduler_pid()]

    def stop(self) -> None:
        self.job.stop()


class RayTrainContestant(Contestant):
    NAME = "Ray Train TorchTrainer DDP, 2 workers"
    peer = True
    system = "raytrain"

    def __init__(self, trainer, m: int):
        self.name, self.group, self.trainer, self.m = self.NAME, "dp", trainer, m

    def ready(self) -> None:
        self.trainer.setup(self.m)

    def run(self, n: int) -> list[dict]:
        return [dict(r, bubble=None) for r in self.trainer.run(n)]

    def params(self) -> dict:
        return self.trainer.params()

    def all_pids(self) -> list[int]:
        return self.trainer.pids()


def relay_spec(m: int, mbs: int, **kw):
    """peers_spec's job for relaytrain, or (None, why) when this engine does not take it.  A
    chunked schedule's spec names its p x v chunks; should the engine take only its balanced
    partition for those, that one (the chunks are compared after the first steps anyway)."""
    try:
        return peers_spec.spec(m, mbs=mbs, **kw), None
    except ValueError as e:
        why = str(e)
    if peers_spec.CHUNKS.get(kw.get("schedule", "1f1b"), 1) > 1 and kw.get("pp", 1) > 1:
        try:
            return peers_spec.spec(m, mbs=mbs, partition="balanced", **kw), None
        except ValueError:
            pass
    return None, why


def contestants(m: int, mbs: int, steps: int, raytrain, args) -> tuple[list[Contestant], list[dict]]:
    """The contestants of one (mbs, M), and those left out (with why)."""
    p = args.pp
    out: list[Contestant] = [Processes("single process, 1 thread", "base", "single", 1, m, mbs=mbs),
                             Processes(TUNED, "base", "single_heap", 1, m, mbs=mbs)]
    skipped: list[dict] = []
    if "pipeline" in args.which:
        for sched in args.torch_schedules:
            out.append(Processes(f"torch.pipelining {TORCH_LABELS[sched]}", "pipeline", "torch_pp", p, m, sched, mbs))
        for sched in args.schedules:
            for transport in args.transports:
                name = f"relaytrain {RELAY_LABELS[sched]} {transport}"
                spec, why = relay_spec(m, mbs, pp=p, schedule=sched, transport=transport)
                if spec is None:
                    log(f"!!! {name} left out: this engine does not take its spec: {why.splitlines()[0]}")
                    skipped.append({"contestant": name, "reason": why})
                else:
                    out.append(RelayContestant(name, "pipeline", spec, steps))
                k = m if args.weight_group == "all" else int(args.weight_group or 1)
                if sched in ("zb_h1", "zbv") and k > 1:  # the same schedule with its W's grouped
                    spec, why = relay_spec(m, mbs, pp=p, schedule=sched, transport=transport, weight_group=k)
                    if spec is not None:
                        out.append(RelayContestant(f"relaytrain {RELAY_LABELS[sched]} W x{min(k, m)} {transport}",
                                                   "pipeline", spec, steps))
    if "dp" in args.which:
        if mbs != peers_spec.MBS:
            pass  # Ray Train's replicas build peers_spec's default microbatch: the dp pair runs at that size only
        else:
            if raytrain is not None:
                out.append(RayTrainContestant(raytrain, m))
            out.append(RelayContestant("relaytrain dp=2 pp=1", "dp",
                                       peers_spec.spec(m, mbs=mbs, dp=2, transport="collective"), steps))
    if args.only:  # the single processes stay: the reference the others are checked against, and its tuned twin
        out = [c for c in out if c.group == "base" or any(o in c.name for o in args.only)]
    for folder in args.ab_engine or []:  # A/B: every relaytrain contestant again, on the engine in that folder
        out += [RelayContestant(c.name, c.group, c.job.spec, steps, folder) for c in out
                if isinstance(c, RelayContestant) and c.job.engine is None]
    return out, skipped


# ---------------------------------------------------------------- checks and rounds

def check_losses(seqs: dict[str, list[float]], what: str) -> float:
    """Every contestant's losses equal the single process's, to float tolerance; else stop."""
    ref_name = next(iter(seqs))
    ref = seqs[ref_name]
    worst = 0.0
    for name, seq in seqs.items():
        for i, (a, b) in enumerate(zip(seq, ref)):
            if a is None or abs(a - b) > RTOL * abs(b) + ATOL or a != a:
                lines = "\n".join(f"  {n}: {', '.join(f'{v:.7f}' for v in s)}" for n, s in seqs.items())
                raise SystemExit(f"peers: {what}: {name} lost {a!r} at step {i + 1} where {ref_name} lost {b:.7f} "
                                 f"(tolerance {RTOL:g} relative + {ATOL:g}); nothing is timed on different "
                                 f"training. Loss sequences:\n{lines}")
            worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
        if len(seq) != len(ref):
            raise SystemExit(f"peers: {what}: {name} ran {len(seq)} steps, {ref_name} {len(ref)}")
    return worst


def check_params(params: dict[str, dict], what: str) -> float:
    """Every contestant's parameters equal the single process's, to the tests' tolerance."""
    ref_name = next(iter(params))
    ref = params[ref_name]
    worst = 0.0
    for name, got in params.items():
        if set(got) != set(ref):
            raise SystemExit(f"peers: {what}: {name} holds parameters {sorted(set(got) ^ set(ref))} "
                             f"that {ref_name} does not, or lacks them")
        for k, r in ref.items():
            d = (got[k].double() - r.double()).abs()
            bad = d > P_ATOL + P_RTOL * r.double().abs()
            if bad.any() or not d.isfinite().all():
                raise SystemExit(f"peers: {what}: {name}'s parameter {k} differs from {ref_name}'s by up to "
                                 f"{d.max().item():.3g} (tolerance {P_RTOL:g} relative + {P_ATOL:g}); "
                                 "nothing is timed on different training")
            worst = max(worst, d.max().item())
    return worst


class Pause:
    """``--pause-idle``: the processes of every contestant but the one whose turn it is are
    stopped (SIGSTOP) and continued (SIGCONT) when their turn comes.  An idle contestant held
    at a step boundary is not idle to the CPU: each of its Ray processes spends about 1% of a
    core on Ray's own threads (2026-12-03: 12 idle relaytrain workers and 6 schedulers used
    4.9 core-seconds in 20 s, 12% of the 2 cores), which the contestant whose turn it is loses
    when it uses both cores and the one process, on one core, does not.  Stopped, they take
    nothing; a node running one job has no such neighbours."""

    def __init__(self):
        self.pids: dict[str, list[int]] = {}  # per contestant, once they are up (empty: nothing paused)
        self.stopped: set[str] = set()

    def turn(self, name: Optional[str]) -> None:
        """Contestant ``name`` runs, every other one is stopped (None: every one runs)."""
        import signal

        for who, ps in self.pids.items():
            stop = name is not None and who != name
            if stop == (who in self.stopped):
                continue
            for p in ps:
                try:
                    os.kill(p, signal.SIGSTOP if stop else signal.SIGCONT)
                except ProcessLookupError:
                    pass
            (self.stopped.add if stop else self.stopped.discard)(who)


def run_cell(m: int, mbs: int, args, raytrain) -> list[dict]:
    """One (mbs, M): start the contestants, check they train alike, time them in rounds.  One
    result, or with ``--pause-idle ab`` two: every round runs each contestant once with the
    others stopped and once with them idle (which first alternating by round), each set of
    figures its own result (``idle``: "stopped" / "running")."""
    settings = {"off": [False], "on": [True], "ab": [True, False]}[args.pause_idle]
    steps_total = args.check + args.rounds * len(settings) * (1 + args.steps)
    cs, skipped = contestants(m, mbs, steps_total, raytrain, args)
    started = list(cs)
    tag = f"mbs={mbs} M={m}"
    log(f"{tag}: starting {len(cs)} contestants (load {load()})")
    t0 = time.time()

    def leave_out(c: Contestant, e: BaseException) -> None:
        """A relaytrain contestant that cannot run (an engine without its schedule): reported, not timed."""
        if not isinstance(c, RelayContestant):
            raise e
        log(f"!!! {tag}: {c.name} left out: it failed: {str(e).strip().splitlines()[-1][:300]}")
        skipped.append({"contestant": c.name, "reason": str(e)})
        cs.remove(c)

    idle = Pause()
    try:
        for c in list(cs):
            try:
                c.start()
            except Exception as e:
                leave_out(c, e)
        for c in list(cs):
            try:
                c.ready()
            except Exception as e:
                leave_out(c, e)
        t_ready = time.time() - t0
        losses = {c.name: [] for c in cs}
        # the same steps from the same parameters: the loss sequences must agree first
        for c in list(cs):
            try:
                recs = c.run(args.check)
            except Exception as e:
                leave_out(c, e)
                continue
            losses[c.name] += [r["loss"] for r in recs]
        losses = {c.name: losses[c.name] for c in cs}
        worst = check_losses(losses, f"{tag}, the first {args.check} steps")
        dparam = check_params({c.name: c.params() for c in cs}, f"{tag}, after {args.check} steps")
        shapes = check_chunks(cs, tag)
        log(f"{tag}: {len(cs)} contestants up and agreeing after {args.check} steps (largest relative loss "
            f"difference {worst:.1e}, largest parameter difference {dparam:.1e}) after {time.time() - t0:.0f} s "
            f"(up in {t_ready:.0f} s)")
        kinds = ("times", "bubbles", "plans", "extra", "faults")  # per setting, per contestant
        got = {stop: {k: {c.name: [] for c in cs} for k in kinds} for stop in settings}
        pids = {c.name: c.pids() for c in cs}
        if args.pause_idle != "off":
            idle.pids = {c.name: c.all_pids() for c in cs}
        for r in range(args.rounds):
            order = cs[r % len(cs):] + cs[:r % len(cs)]
            for stop, c in [(stop, c) for stop in (settings if r % 2 == 0 else settings[::-1]) for c in order]:
                times, bubbles, plans, extra, faults = (got[stop][k] for k in kinds)
                idle.turn(c.name if stop else None)
                f0 = [memory.proc_faults(p) for p in pids[c.name]]
                recs = c.run(1 + args.steps)
                f1 = [memory.proc_faults(p) for p in pids[c.name]]
                if f0 and None not in f0 + f1:  # per process and step, this round (its warm-up step included)
                    faults[c.name].append(max(b - a for a, b in zip(f0, f1)) / len(recs))
                losses[c.name] += [x["loss"] for x in recs]
                ends = [x["end"] for x in recs]
                times[c.name] += [b - a for a, b in zip(ends, ends[1:])]
                bubbles[c.name] += [x["bubble"] for x in recs[1:] if x.get("bubble") is not None]
                plans[c.name] += [x["bubble_plan"] for x in recs[1:] if x.get("bubble_plan") is not None]
                keep = ("scheduler_wall_s", "work_span_s", "allreduce_s", "workers", "dispatched", "span", "busy")
                extra[c.name] += [dict({k: x[k] for k in keep if k in x}, previous_end=a["end"],
                                       previous_workers=a.get("workers")) for a, x in zip(recs, recs[1:])]
            log(f"{tag}: round {r + 1}/{args.rounds} done (load {load()})")
        worst = check_losses(losses, f"{tag}, all {len(losses[cs[0].name])} steps")
    finally:
        idle.turn(None)  # every process running again before the stops
        for c in started:
            try:
                c.stop()
            except Exception as e:
                log(f"stopping {c.name}: {e}")
    out = []
    for stop in settings:
        res = _cell_result(cs, m, mbs, args, shapes, losses, **got[stop])
        if len(settings) > 1:
            res["idle"] = "stopped" if stop else "running"
        out.append(dict(res, max_rel_loss_diff=worst, max_param_diff_after_check=dparam, left_out=skipped,
                        seconds=time.time() - t0))
    log(f"{tag}: done in {time.time() - t0:.0f} s; largest relative loss difference {worst:.1e}")
    return out


def _cell_result(cs: list, m: int, mbs: int, args, shapes: dict, losses: dict, times: dict, bubbles: dict,
                 plans: dict, extra: dict, faults: dict) -> dict:
    """One (mbs, M)'s rows, each contestant's figures from its timed steps, and its summary."""
    rows = []
    for c in cs:
        ts = sorted(times[c.name])
        q1, med, q3 = _quartiles(ts)
        row = {"contestant": c.name, "system": c.system, "schedule": c.schedule, "transport": c.transport,
               "engine": c.engine, "group": c.group, "weight_group": getattr(c, "weight_group", 1),
               "peer": c.peer, "M": m, "mbs": mbs, "B": m * mbs, "pp": c.pp,
               "chunks": c.chunks, "step_s": med, "q1_s": q1, "q3_s": q3, "iqr_s": q3 - q1,
               "samples_per_s": m * mbs / med, "timed_steps": len(ts),
               "bubble": statistics.median(bubbles[c.name]) if bubbles[c.name] else None,
               "bubble_plan": statistics.median(plans[c.name]) if plans[c.name] else None,
               "faults_per_step": statistics.median(faults[c.name]) if faults[c.name] else None,
               "times_s": times[c.name], "losses": losses[c.name]}
        if c.name in shapes:
            row["shape"] = shapes[c.name]
        if extra[c.name] and "workers" in extra[c.name][0]:
            row["relaytrain"] = _relay_breakdown(extra[c.name], med)
        elif extra[c.name] and "span" in extra[c.name][0]:  # the processes: compute per rank, and the rest
            ex = extra[c.name]
            span = statistics.median(e["span"] for e in ex)
            row["breakdown"] = {"span_s": span, "outside_span_s": med - span,
                                "busy_s": [statistics.median(e["busy"][r] for e in ex)
                                           for r in range(len(ex[0]["busy"]))]}
        rows.append(row)
    single = rows[0]["step_s"]
    tuned = next((r["step_s"] for r in rows if r["contestant"] == TUNED), None)
    for row in rows:
        if row["system"] == "torch" and row["bubble_plan"] is None:
            # the textbook plan: torch's schedules send an input gradient after the whole backward
            # (relaytrain's own 1F1B rows carry the plan of what its workers ran, schedules.sends_early)
            row["bubble_plan"] = _plan_bubble(row["schedule"], row["pp"], m, row["chunks"])
        if row["group"] == "pipeline":
            row["efficiency"] = single / row["pp"] / row["step_s"]
            if tuned is not None:
                row["efficiency_tuned"] = tuned / row["pp"] / row["step_s"]
        peers = [r for r in rows if r["peer"] and r["group"] == row["group"]]
        if peers and row["group"] != "base":
            best = min(peers, key=lambda r: r["step_s"])
            row["vs_best_peer"] = best["step_s"] / row["step_s"]
            row["best_peer"] = best["contestant"]
    return {"M": m, "mbs": mbs, "pp": args.pp, "rows": rows, "summary": summarize(rows, args.pp, m)}


def check_chunks(cs: list[Contestant], tag: str) -> dict[str, dict]:
    """relaytrain's pipelines run the chunks torch's stages hold (peers_spec.chunk_sizes, placed
    as the schedule places them), or the bench stops: their step times would not compare."""
    shapes = {}
    for c in cs:
        if not isinstance(c, RelayContestant) or c.pp < 2:
            continue
        got = c.job.shape()
        shapes[c.name] = got
        v = peers_spec.CHUNKS.get(c.schedule, 1)
        want = {"sizes": peers_spec.chunk_sizes(c.pp * v), "chunks": v,
                "placement": peers_spec.PLACEMENT.get(c.schedule, "loop")}
        if any(got[k] != w for k, w in want.items()):
            raise SystemExit(f"peers: {tag}: {c.name} runs chunks {got['sizes']}, {got['chunks']} per worker, "
                             f"{got['placement']} placement, where torch's stages hold {want['sizes']}, "
                             f"{want['chunks']} per worker, {want['placement']} placement: nothing is timed on "
                             "different cuts of the model")
    return shapes


def summarize(rows: list[dict], p: int, m: int) -> dict:
    """relaytrain's best schedule against torch's best, its bubbles, its efficiency, and where the
    best one's step goes (this engine's relaytrain pipelines only, not an A/B engine's)."""
    relay = [r for r in rows if r["system"] == "relaytrain" and r["group"] == "pipeline" and not r["engine"]]
    torch_rows = [r for r in rows if r["system"] == "torch"]
    single = next(r for r in rows if r["system"] == "single")
    tuned = next((r for r in rows if r["contestant"] == TUNED), None)
    out: dict = {"single_s": single["step_s"], **({"tuned_s": tuned["step_s"]} if tuned else {})}
    pick = lambda r: {"contestant": r["contestant"], "schedule": r["schedule"], "step_s": r["step_s"]}  # noqa: E731
    if relay:
        best = min(relay, key=lambda r: r["step_s"])
        out["relay_best"] = pick(best)
        out["efficiency"] = single["step_s"] / p / best["step_s"]
        if tuned:
            out["efficiency_tuned"] = tuned["step_s"] / p / best["step_s"]
        out["where"] = best.get("relaytrain")
    if torch_rows:
        out["torch_best"] = pick(min(torch_rows, key=lambda r: r["step_s"]))
    if relay and torch_rows:
        out["ratio"] = out["torch_best"]["step_s"] / out["relay_best"]["step_s"]
    out["bubbles"] = {r["schedule"]: r["bubble"] for r in relay
                      if r["transport"] == "collective" and r.get("weight_group", 1) == 1}
    b = out["bubbles"]
    if b.get("zb_h1") is not None and b.get("1f1b"):
        out["zb_h1_over_1f1b"] = b["zb_h1"] / b["1f1b"]
    return out


def _plan_bubble(schedule: Optional[str], pp: int, m: int, chunks: int = 1) -> Optional[float]:
    """The schedule's ideal bubble as relaytrain models it (None for a schedule it does not have)."""
    from service import schedules

    if schedule is None:
        return None
    for args in ((schedule, pp, m, chunks), (schedule, pp, m)) if chunks > 1 else ((schedule, pp, m),):
        try:
            return float(schedules.simulate(schedules.build(*args)).bubble)
        except Exception:
            continue
    return None


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[1], q[2]


def _relay_breakdown(extra: list[dict], median_step: float) -> dict:
    """Where a relaytrain step's time goes, medians over the timed steps, along the path that
    sets the pace (the first stage of replica 0, which starts the pipeline, and the scheduler).

    Per worker: its compute (``busy_s``), its waiting inside the schedule (``waiting_s``: from
    its first compute to the end of its schedule, less the compute), and what it does after the
    schedule (``worker_allreduce_s``: the all-reduce, the gradient norm).  Between two steps, on
    the first worker: waiting for the next step's call after it ended the step before
    (``call_wait_s``: the gather, the commit and the dispatch on the critical path; about 0 when
    the scheduler queued the call early), applying the deferred optimizer step (``optimizer_s``)
    and building the microbatches (``batch_s``).  ``worker_span_s`` is the workers' span from the
    first compute to the last return; ``dispatch_gather_s`` the rest of the step: step time -
    span - optimizer - batch (the scheduler's work and the calls, where they are not hidden).
    ``between_steps_s`` (the scheduler's own work between a step's row and the next step's
    dispatch) and ``return_s`` (the last worker's end to the row) are the scheduler's view."""
    med = lambda xs: statistics.median(list(xs))  # noqa: E731
    ws = list(extra[0]["workers"])
    w0 = ws[0]
    out = {"between_steps_s": med(e["dispatched"] - e["previous_end"] for e in extra),
           "worker_span_s": med(e["work_span_s"] for e in extra),
           "return_s": med(e["dispatched"] + e["scheduler_wall_s"] - max(w["end"] for w in e["workers"].values())
                           for e in extra),
           "allreduce_s": med(e["allreduce_s"] for e in extra),
           "busy_s": {w: med(e["workers"][w]["busy"] for e in extra) for w in ws},
           "waiting_s": {w: med(e["workers"][w]["pipe_end"] - e["workers"][w]["start"] - e["workers"][w]["busy"]
                                for e in extra) for w in ws},
           "worker_allreduce_s": {w: med(e["workers"][w]["allreduce_s"] or 0.0 for e in extra) for w in ws}}
    if extra[0]["workers"][w0].get("called") is not None:  # (an older engine in an A/B run has no such marks)
        def begun(e):  # the first worker takes up the step: its call came and the step before ended there
            return max(e["workers"][w0]["called"], e["previous_workers"][w0]["end"])
        out.update(call_wait_s=med(max(0.0, e["workers"][w0]["called"] - e["previous_workers"][w0]["end"])
                                   for e in extra),
                   optimizer_s=med(e["workers"][w0]["settled"] - begun(e) for e in extra),
                   batch_s=med(e["workers"][w0]["start"] - e["workers"][w0]["settled"] for e in extra))
    out["outside_workers_s"] = median_step - out["worker_span_s"]
    out["dispatch_gather_s"] = out["outside_workers_s"] - out.get("optimizer_s", 0.0) - out.get("batch_s", 0.0)
    return out


# ---------------------------------------------------------------- output

def _ms(x: Optional[float]) -> str:
    return "" if x is None else f"{x * 1e3:.0f}"


def _pct(x: Optional[float]) -> str:
    return "" if x is None else f"{x:.1%}"


def _faults(x: Optional[float]) -> str:
    return "" if x is None else f"{x:,.0f}"


def _m(res: dict) -> str:
    """A result's M, and with ``--pause-idle ab`` whether the other contestants were stopped."""
    return f"{res['M']} (others {res['idle']})" if "idle" in res else str(res["M"])


def table(results: list[dict]) -> str:
    lines = ["| contestant | mbs | M | step time median (ms) | IQR (ms) | samples/s | vs best peer | pipeline "
             "efficiency | measured bubble | plan bubble | page faults a step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for r in res["rows"]:
            vs = f"{r['vs_best_peer']:.2f}" if "vs_best_peer" in r else ""
            eff = f"{r['efficiency']:.2f}" if "efficiency" in r else ""
            lines.append(f"| {r['contestant']} | {r['mbs']} | {_m(res)} | {_ms(r['step_s'])} | {_ms(r['iqr_s'])} | "
                         f"{r['samples_per_s']:.0f} | {vs} | {eff} | {_pct(r['bubble'])} | {_pct(r['bubble_plan'])} | "
                         f"{_faults(r.get('faults_per_step'))} |")
    return "\n".join(lines)


def _goal(ok: bool) -> str:
    return "met" if ok else "MISSED"


def summary_tables(results: list[dict], schedules: list[str]) -> str:
    """relaytrain's best against torch's best per (mbs, M), its bubbles and efficiency, and
    where its best schedule's step goes."""
    if not any("relay_best" in res["summary"] or "torch_best" in res["summary"] for res in results):
        return ""  # (no pipelines in this run)
    p = results[0]["pp"]
    heads = " | ".join(f"bubble {RELAY_LABELS[s]}" for s in schedules)
    lines = [f"relaytrain's best schedule against torch.distributed.pipelining's best (torch's median / relaytrain's; "
             f"goal >= 1.1 everywhere), pipeline efficiency = (one process's step / {p}) / relaytrain's best step "
             f"(goal >= 0.8 at M = 8; 'tuned': against the one process with relaytrain's heap settings, "
             f"glibc keeping freed memory as relaytrain's workers do), relaytrain's measured bubble per schedule "
             f"(goal: ZB-H1's <= half of 1F1B's at M = 8):", "",
             f"| mbs | M | relaytrain best | ms | torch best | ms | ratio | pipeline efficiency | efficiency, tuned | "
             f"{heads} | ZB-H1 / 1F1B bubble |", "|---|---|---|---|---|---|---|---|---|" + "---|" * len(schedules) + "---|"]
    for res in results:
        s = res["summary"]
        rb, tb = s.get("relay_best"), s.get("torch_best")
        ratio = f"{s['ratio']:.2f} ({_goal(s['ratio'] >= 1.1)})" if "ratio" in s else ""
        eff = ""
        if "efficiency" in s:
            eff = f"{s['efficiency']:.2f}" + (f" ({_goal(s['efficiency'] >= 0.8)})" if res["M"] == 8 else "")
        eff_t = f"{s['efficiency_tuned']:.2f}" if "efficiency_tuned" in s else ""
        zb = ""
        if "zb_h1_over_1f1b" in s:
            zb = f"{s['zb_h1_over_1f1b']:.2f}" + (f" ({_goal(s['zb_h1_over_1f1b'] <= 0.5)})" if res["M"] == 8 else "")
        bub = " | ".join(_pct(s["bubbles"].get(x)) for x in schedules)
        lines.append(f"| {res['mbs']} | {_m(res)} | {rb['contestant'].removeprefix('relaytrain ') if rb else ''} | "
                     f"{_ms(rb['step_s']) if rb else ''} | "
                     f"{tb['contestant'].removeprefix('torch.pipelining ') if tb else ''} | "
                     f"{_ms(tb['step_s']) if tb else ''} | {ratio} | {eff} | {eff_t} | {bub} | {zb} |")
    lines += ["", "Where the step of relaytrain's best schedule goes (medians, ms; per worker w<replica>.<stage>: its "
              "compute, and its waiting inside the schedule from its first compute to the end of its schedule; "
              "after the schedule: the all-reduce and gradient norm, the slowest worker's; on the first worker "
              "between steps: the deferred optimizer step and building the batch; 'dispatch + gather': the rest "
              "of the step, step - workers' span - optimizer - batch, i.e. the scheduler's work and the calls where "
              "they are not hidden behind the workers' compute (below 0: the next step began on the first worker "
              "before the last worker ended this one); 'call wait': the first worker idle between its end "
              "of one step and the next step's call):", "",
              "| mbs | M | schedule | step | compute per worker | waiting per worker | after the schedule | "
              "deferred optimizer step | building the batch | dispatch + gather | call wait |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        s = res["summary"]
        w, rb = s.get("where"), s.get("relay_best")
        if not w or not rb:
            continue
        per = lambda d: ", ".join(f"{k} {v * 1e3:.0f}" for k, v in d.items())  # noqa: E731
        lines.append(f"| {res['mbs']} | {_m(res)} | {rb['contestant'].removeprefix('relaytrain ')} | "
                     f"{_ms(rb['step_s'])} | {per(w['busy_s'])} | {per(w['waiting_s'])} | {_ms(w['allreduce_s'])} | "
                     f"{_ms(w.get('optimizer_s'))} | {_ms(w.get('batch_s'))} | {_ms(w['dispatch_gather_s'])} | "
                     f"{_ms(w.get('call_wait_s'))} |")
    left = [(res["mbs"], res["M"], x["contestant"]) for res in results for x in res.get("left_out", [])]
    if left:
        names = sorted({n for _, _, n in left})
        lines += ["", "Left out (could not run on this engine; see the JSON's left_out for why): " + "; ".join(names)]
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    """Per microbatch size: step time against M (top) and relaytrain's best against torch's best
    and its pipeline efficiency (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if any("idle" in res for res in results):  # --pause-idle ab: the figures with the others stopped
        results = [res for res in results if res.get("idle") == "stopped"]
    sizes = sorted({res["mbs"] for res in results})
    names = list(dict.fromkeys(r["contestant"] for res in results for r in res["rows"]
                               if r["group"] in ("base", "pipeline")))
    fig, axes = plt.subplots(2, len(sizes), figsize=(max(8, 6 * len(sizes)), 9), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2]})
    for col, mbs in enumerate(sizes):
        cells = [res for res in results if res["mbs"] == mbs]
        ms = [res["M"] for res in cells]
        top, bottom = axes[0][col], axes[1][col]
        for k, name in enumerate(names):
            pts = [(res["M"], r) for res in cells for r in res["rows"] if r["contestant"] == name]
            if not pts:
                continue
            sys_ = pts[0][1]["system"]
            style = dict(linestyle={"torch": "--", "relaytrain": "-"}.get(sys_, ":"),
                         marker="o" if sys_ == "relaytrain" else "s", color=f"C{k % 10}", label=name)
            top.errorbar([m for m, _ in pts], [r["step_s"] * 1e3 for _, r in pts], capsize=3, **style,
                         yerr=[[(r["step_s"] - r["q1_s"]) * 1e3 for _, r in pts],
                               [(r["q3_s"] - r["step_s"]) * 1e3 for _, r in pts]])
        xs = [res["M"] for res in cells if "ratio" in res["summary"]]
        bottom.plot(xs, [res["summary"]["ratio"] for res in cells if "ratio" in res["summary"]], "o-", color="C0",
                    label="relaytrain best vs torch best (torch / relaytrain)")
        xs = [res["M"] for res in cells if "efficiency" in res["summary"]]
        bottom.plot(xs, [res["summary"]["efficiency"] for res in cells if "efficiency" in res["summary"]], "s-",
                    color="C1", label="relaytrain pipeline efficiency (single / p / step)")
        xs = [res["M"] for res in cells if "efficiency_tuned" in res["summary"]]
        bottom.plot(xs, [res["summary"]["efficiency_tuned"] for res in cells if "efficiency_tuned" in res["summary"]],
                    "s--", color="C2", label="the same against the single process with relaytrain's heap")
        bottom.axhline(1.1, color="C0", linewidth=0.8, linestyle=":")
        bottom.axhline(0.8, color="C1", linewidth=0.8, linestyle=":")
        bottom.axhline(1.0, color="k", linewidth=0.6)
        for ax in (top, bottom):
            ax.set_xlim(min(ms) / 1.3, max(ms) * 1.3)  # (also when a panel has nothing: --which dp)
            ax.set_xscale("log", base=2)
            ax.set_xticks(ms, [str(m) for m in ms])
            ax.grid(True, alpha=0.3)
        top.set_ylabel("step time (ms), median; bars: interquartile range")
        top.set_title(f"microbatch {mbs} rows, p = {results[0]['pp']}")
        top.legend(fontsize=7)
        bottom.set_xlabel(f"microbatches per step M (global batch {mbs} M)")
        bottom.set_ylabel("ratio (dotted: goals 1.1 and 0.8)")
        bottom.legend(fontsize=7)
    import textwrap

    fig.suptitle(textwrap.fill(f"{peers_spec.DESCRIPTION}; 2 cores, one thread per worker",
                               int(15 * max(8, 6 * len(sizes)))), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="mbs = 32, M = 8 only (the issue's held-out size), 3 rounds")
    ap.add_argument("--ms", type=int, nargs="+", default=None, help="microbatch counts (default 4 8 16)")
    ap.add_argument("--mbs", type=int, nargs="+", default=None, help="microbatch rows (default 16 32 64)")
    ap.add_argument("--pp", type=int, default=2, help="pipeline workers (default 2; 4 on 2 cores time-shares, see "
                    "the docstring)")
    ap.add_argument("--schedules", nargs="+", default=RELAY_DEFAULT, choices=list(RELAY_LABELS),
                    help=f"relaytrain's schedules (default {' '.join(RELAY_DEFAULT)})")
    ap.add_argument("--weight-group", default="all", metavar="K",
                    help="also run relaytrain's ZB-H1 and ZB-V with parallelism.weight_group K (their W's in "
                         "groups of K microbatches); 'all' (the default): every microbatch of the step; 1: not")
    ap.add_argument("--torch-schedules", nargs="+", default=TORCH_DEFAULT, choices=list(TORCH_LABELS),
                    help=f"torch.distributed.pipelining's (default {' '.join(TORCH_DEFAULT)}; zb_h1 is "
                    "ScheduleInterleavedZeroBubble with one stage per process, interleaved_zb with two)")
    ap.add_argument("--transports", nargs="+", default=["collective"], choices=["collective", "object_store"],
                    help="relaytrain's transports for its pipelines (default collective)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per (mbs, M) (default 4; --quick 3)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per contestant per round (default 4)")
    ap.add_argument("--check", type=int, default=3, help="steps whose losses are compared before timing")
    ap.add_argument("--which", nargs="+", default=["pipeline", "dp"], choices=["pipeline", "dp"])
    ap.add_argument("--only", nargs="+", help="only the contestants whose name holds one of these words "
                    "(and the single process); for development")
    ap.add_argument("--ab-engine", metavar="DIR", nargs="+", help="also run every relaytrain contestant on the engine "
                    "(actors/, service/) in DIR, e.g. `git archive HEAD~1 actors service | tar -x -C DIR`: "
                    "before/after figures of an engine change from one interleaved run (each contestant's "
                    "scheduler is checked to import from DIR)")
    ap.add_argument("--pause-idle", nargs="?", const="on", choices=["on", "off", "ab"], default="on",
                    help="on (the default since 2026-12-04): stop (SIGSTOP) every contestant's processes but those "
                    "of the one whose turn it is, so idle contestants' Ray threads take no CPU from it; off: leave "
                    "them running, as before; ab: every round times each contestant both ways (which first "
                    "alternating by round), reported as two sets of figures")
    ap.add_argument("--no-raytrain", action="store_true", help="leave Ray Train out (it needs the bench extra)")
    ap.add_argument("--out", default=None, help="path prefix of the results (.json/.txt/.png; default "
                    "bench/results/peers, with --quick bench/results/peers_quick)")
    args = ap.parse_args()
    args.out = os.path.abspath(args.out or RESULTS / ("peers_quick" if args.quick else "peers"))
    args.ab_engine = [os.path.abspath(d) for d in args.ab_engine or []]
    ms = args.ms or ([8] if args.quick else [4, 8, 16])
    sizes = args.mbs or ([32] if args.quick else list(peers_spec.MBS_ALL))
    args.rounds = args.rounds or (3 if args.quick else 4)
    if args.pp < 2 or peers_spec.LAYERS < args.pp * 2:
        raise SystemExit(f"peers: --pp {args.pp}: give 2 .. {peers_spec.LAYERS // 2}")
    if "dp" in args.which and peers_spec.MBS not in sizes:
        log(f"the data-parallel pair (Ray Train, relaytrain dp=2) runs at microbatch {peers_spec.MBS} only: "
            "not in this run")
    import ray
    import torch

    from actors.scheduler import JobScheduler  # noqa: F401  (the engine imports before Ray starts)

    load_start = load()
    log(f"load average at start {load_start} (2 cores); mbs in {sizes}, M in {ms}, p = {args.pp}; "
        f"{args.rounds} rounds x {args.steps} timed steps")
    t_start = time.time()
    if args.ab_engine:
        # Ray puts the driver's working directory first on its workers' sys.path: from the
        # checkout, every worker would import this checkout's engine, whatever PYTHONPATH says
        import tempfile

        os.chdir(tempfile.mkdtemp(prefix="peers-ab-"))
    # logical slots: every contestant's workers stay placed between their rounds (idle, not spinning)
    ray.init(address="local", num_cpus=64, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    import peers_raytrain
    import peers_relay

    ray.cloudpickle.register_pickle_by_value(peers_relay)  # the bench's modules are not on the workers' path
    ray.cloudpickle.register_pickle_by_value(peers_raytrain)
    raytrain = None
    results = []
    try:
        wanted = not args.only or any(o in RayTrainContestant.NAME for o in args.only)
        if "dp" in args.which and not args.no_raytrain and wanted and peers_spec.MBS in sizes:
            try:
                import ray.train  # noqa: F401
            except ImportError as e:
                raise SystemExit(f"peers: Ray Train cannot be imported ({e}): `make bench-peers` installs the "
                                 "`bench` extra (or pip install -c constraints.txt -e '.[bench]'); "
                                 "--no-raytrain leaves it out") from None
            raytrain = peers_raytrain.RayTrainDDP(2)
            raytrain.start()
        for mbs in sizes:
            for m in ms:
                results += run_cell(m, mbs, args, raytrain)
                # each size's figures are kept as soon as they are in: a later failure loses only its own
                write(results, args, ms, sizes, load_start, t_start, final=False)
    finally:
        if raytrain is not None:
            raytrain.stop()
        ray.shutdown()
    write(results, args, ms, sizes, load_start, t_start, final=True)


def write(results: list, args, ms: list, sizes: list, load_start, t_start: float, final: bool) -> None:
    """The table (.txt), every figure (.json) and, at the end, the plot (.png); before the end
    the text's header says how many sizes are in."""
    import ray
    import torch

    load_end = load()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join(t for t in (table(results), summary_tables(results, args.schedules)) if t)
    header = (f"{peers_spec.DESCRIPTION}; p = {args.pp}; {args.rounds} interleaved rounds x {args.steps} timed steps "
              f"per contestant and (mbs, M); one thread per worker; 2 cores; load average {load_start} at start, "
              f"{load_end} at end; {time.time() - t_start:.0f} s; {time.strftime('%Y-%m-%d')}")
    header += {"off": "; idle contestants left running (--pause-idle off)", "on": "; idle contestants stopped",
               "ab": "; each round with the idle contestants stopped and running (--pause-idle ab)"}[args.pause_idle]
    if not final:
        header += f"; PARTIAL: {len(results)} of {len(ms) * len(sizes)} sizes so far"
    else:
        print("\n" + header + "\n\n" + text)
    out.with_suffix(".txt").write_text(header + "\n\n" + text + "\n")
    out.with_suffix(".json").write_text(json.dumps({
        "time": time.time(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": time.time() - t_start,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "ray": ray.__version__},
        "load_average": {"start": load_start, "end": load_end},
        "config": {"model": peers_spec.DESCRIPTION, "ms": ms, "mbs": sizes, "pp": args.pp,
                   "chunks": {v: peers_spec.chunk_sizes(args.pp * v) for v in (1, 2)},
                   "schedules": args.schedules, "torch_schedules": args.torch_schedules,
                   "transports": args.transports, "rounds": args.rounds, "timed_steps_per_round": args.steps,
                   "check_steps": args.check, "rtol": RTOL, "atol": ATOL, "pause_idle": args.pause_idle},
        "results": results, "complete": final}, indent=1))
    if not final:
        return
    try:
        plot(results, out.with_suffix(".png"))
    except ImportError as e:
        log(f"no plot ({e}); `make bench-peers` installs matplotlib")
    except Exception as e:  # the table and the JSON are written: a plot's trouble does not lose them
        log(f"no plot: {type(e).__name__}: {e}")
    log(f"wrote {out.with_suffix('.json')}, .txt and .png in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
