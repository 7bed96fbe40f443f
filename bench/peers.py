"""relaytrain against its peers on one machine, in one run, side by side:

- torch.distributed.pipelining ``Schedule1F1B`` and ``ScheduleGPipe`` (2 processes, gloo,
  manual ``PipelineStage``s) against relaytrain 1F1B and GPipe with p = 2 on each transport;
- Ray Train v2 ``TorchTrainer`` with DDP on 2 workers against relaytrain dp = 2, pp = 1;
- one process, one thread, microbatched (the base line);

for M in {4, 8, 16} microbatches of 64 samples (``bench/peers_spec.py`` holds the model).

    make bench-peers                      # installs the `bench` extra, then runs the full bench
    .venv/bin/python bench/peers.py [--quick] [--ms 4 8 16] [--rounds 6] [--steps 5]

Every contestant first runs ``--check`` steps from the same initial parameters; their loss
sequences and then their parameters must agree with the single process's (to float
tolerance) or the bench stops and says where; the losses of every later step are checked
too.  Then, for each M, ``--rounds`` rounds run the contestants one after another (the order
rotates every round), each for 1 warm-up step plus ``--steps`` timed steps: 30 timed steps
per contestant and M by default (20 with ``--quick``, which runs M = 8 only), one thread per
worker.  A step's time is the wall time between the ends of two consecutive steps as seen
by the process that drives them (relaytrain: its scheduler, at each step's metrics row; the
others: the later of their ranks' ends, after the optimizer step), so it holds everything a
step costs, dispatch included.

Writes bench/results/peers.json, peers.txt (the table) and peers.png (step time against M;
``--quick``: peers_quick.*).
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

import peers_spec  # noqa: E402

RESULTS = BENCH / "results"
RTOL, ATOL = 1e-4, 1e-6   # losses are O(0.1-1); float32 summation order moves them by ~1e-7
P_RTOL, P_ATOL = 1e-4, 2e-5  # parameters, as tests/test_engine.py holds relaytrain to plain PyTorch


def log(*a) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---------------------------------------------------------------- contestants

class Contestant:
    """A name, a group (``base``, ``pipeline`` or ``dp``), and run(n) -> n step records."""

    name: str
    group: str
    peer: bool = False       # a system relaytrain is compared with
    pp = 1

    def start(self) -> None: ...
    def ready(self) -> None: ...
    def run(self, n: int) -> list[dict]: ...
    def params(self) -> dict: ...   # the whole model's parameters, keyed as its state_dict
    def stop(self) -> None: ...


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes(Contestant):
    """The single process or torch.distributed.pipelining (bench/peers_procs.py)."""

    def __init__(self, name: str, group: str, kind: str, world: int, m: int, schedule: str = "1f1b"):
        self.name, self.group, self.kind, self.world, self.m, self.schedule = name, group, kind, world, m, schedule
        self.peer = kind == "torch_pp"
        self.pp = world
        self.procs, self.conns = [], []

    def start(self) -> None:
        import peers_procs

        ctx = mp.get_context("spawn")
        port = _free_port()
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=peers_procs.serve, args=(child, self.kind, rank, self.world, port, self.m,
                                                           self.schedule), daemon=True)
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

    def ready(self) -> None:
        self._answers(300)

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
    def __init__(self, name: str, group: str, spec, steps: int, engine: Optional[str] = None):
        from peers_relay import Relaytrain

        self.name, self.group = name + (f" [engine {engine}]" if engine else ""), group
        self.pp = spec.parallelism.pp
        self.job = Relaytrain(spec, steps, engine)

    def start(self) -> None:
        self.job.start()
        if self.job.engine:
            log(f"{self.name}: engine {self.job.where}")

    def run(self, n: int) -> list[dict]:
        return self.job.run(n)

    def params(self) -> dict:
        return self.job.params()

    def stop(self) -> None:
        self.job.stop()


class RayTrainContestant(Contestant):
    NAME = "Ray Train TorchTrainer DDP, 2 workers"
    peer = True

    def __init__(self, trainer, m: int):
        self.name, self.group, self.trainer, self.m = self.NAME, "dp", trainer, m

    def ready(self) -> None:
        self.trainer.setup(self.m)

    def run(self, n: int) -> list[dict]:
        return [dict(r, bubble=None) for r in self.trainer.run(n)]

    def params(self) -> dict:
        return self.trainer.params()


def contestants(m: int, steps: int, raytrain, which: set[str], only: Optional[list[str]] = None,
                engines: Optional[list[str]] = None) -> list[Contestant]:
    S = peers_spec.spec
    out: list[Contestant] = [Processes("single process, 1 thread", "base", "single", 1, m)]
    if "pipeline" in which:
        for sched, label in (("1f1b", "1F1B"), ("gpipe", "GPipe")):
            out.append(Processes(f"torch.pipelining {label}", "pipeline", "torch_pp", 2, m, sched))
        for sched, label in (("1f1b", "1F1B"), ("gpipe", "GPipe")):
            for transport in ("collective", "object_store"):
                out.append(RelayContestant(f"relaytrain {label} {transport}", "pipeline",
                                           S(m, pp=2, schedule=sched, transport=transport), steps))
    if "dp" in which:
        if raytrain is not None:
            out.append(RayTrainContestant(raytrain, m))
        out.append(RelayContestant("relaytrain dp=2 pp=1", "dp", S(m, dp=2, transport="collective"), steps))
    if only:  # the single process stays: it is the reference the others are checked against
        out = [out[0]] + [c for c in out[1:] if any(o in c.name for o in only)]
    for folder in engines or []:  # A/B: every relaytrain contestant again, on the engine in that folder
        out += [RelayContestant(c.name, c.group, c.job.spec, steps, folder) for c in out
                if isinstance(c, RelayContestant) and c.job.engine is None]
    return out


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


def run_m(m: int, args, raytrain) -> dict:
    steps_total = args.check + args.rounds * (1 + args.steps)
    cs = contestants(m, steps_total, raytrain, set(args.which), args.only, args.ab_engine)
    log(f"M={m}: starting {len(cs)} contestants (load {load()})")
    t0 = time.time()
    try:
        for c in cs:
            c.start()
        for c in cs:
            c.ready()
        losses = {c.name: [] for c in cs}
        # the same steps from the same parameters: the loss sequences must agree first
        for c in cs:
            recs = c.run(args.check)
            losses[c.name] += [r["loss"] for r in recs]
        worst = check_losses(losses, f"M={m}, the first {args.check} steps")
        dparam = check_params({c.name: c.params() for c in cs}, f"M={m}, after {args.check} steps")
        log(f"M={m}: {len(cs)} contestants up and agreeing after {args.check} steps (largest relative loss "
            f"difference {worst:.1e}, largest parameter difference {dparam:.1e}) after {time.time() - t0:.0f} s")
        times = {c.name: [] for c in cs}
        bubbles = {c.name: [] for c in cs}
        extra = {c.name: [] for c in cs}
        for r in range(args.rounds):
            order = cs[r % len(cs):] + cs[:r % len(cs)]
            for c in order:
                recs = c.run(1 + args.steps)
                losses[c.name] += [x["loss"] for x in recs]
                ends = [x["end"] for x in recs]
                times[c.name] += [b - a for a, b in zip(ends, ends[1:])]
                bubbles[c.name] += [x["bubble"] for x in recs[1:] if x.get("bubble") is not None]
                keep = ("scheduler_wall_s", "work_span_s", "allreduce_s", "workers", "dispatched", "span", "busy")
                extra[c.name] += [dict({k: x[k] for k in keep if k in x}, previous_end=a["end"])
                                  for a, x in zip(recs, recs[1:])]
            log(f"M={m}: round {r + 1}/{args.rounds} done (load {load()})")
        worst = check_losses(losses, f"M={m}, all {len(losses[cs[0].name])} steps")
    finally:
        for c in cs:
            try:
                c.stop()
            except Exception as e:
                log(f"stopping {c.name}: {e}")
    plan = float(_plan_bubble(m))
    rows = []
    for c in cs:
        ts = sorted(times[c.name])
        q1, med, q3 = _quartiles(ts)
        row = {"contestant": c.name, "group": c.group, "peer": c.peer, "M": m, "B": m * peers_spec.MBS,
               "step_s": med, "q1_s": q1, "q3_s": q3, "iqr_s": q3 - q1, "samples_per_s": m * peers_spec.MBS / med,
               "timed_steps": len(ts), "bubble": statistics.median(bubbles[c.name]) if bubbles[c.name] else None,
               "bubble_plan": plan if c.pp == 2 else None, "times_s": times[c.name], "losses": losses[c.name]}
        if extra[c.name] and "workers" in extra[c.name][0]:
            row["relaytrain"] = _relay_breakdown(extra[c.name], med)
        elif extra[c.name] and "span" in extra[c.name][0]:  # the processes: compute per rank, and the rest
            ex = extra[c.name]
            span = statistics.median(e["span"] for e in ex)
            row["breakdown"] = {"span_s": span, "outside_span_s": med - span,
                                "busy_s": [statistics.median(e["busy"][r] for e in ex)
                                           for r in range(len(ex[0]["busy"]))]}
        rows.append(row)
    for row in rows:
        peers = [r for r in rows if r["peer"] and r["group"] == row["group"]]
        if peers and row["group"] != "base":
            best = min(peers, key=lambda r: r["step_s"])
            row["vs_best_peer"] = best["step_s"] / row["step_s"]
            row["best_peer"] = best["contestant"]
    log(f"M={m}: done in {time.time() - t0:.0f} s; largest relative loss difference {worst:.1e}")
    return {"M": m, "rows": rows, "max_rel_loss_diff": worst, "max_param_diff_after_check": dparam}


def _plan_bubble(m: int):
    from service import schedules

    return schedules.simulate(schedules.build("1f1b", 2, m)).bubble


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[1], q[2]


def _relay_breakdown(extra: list[dict], median_step: float) -> dict:
    """Where a relaytrain step's time goes, medians over the timed steps, along the path that
    sets the pace (the scheduler and the first stage of replica 0, which starts the pipeline):
    the scheduler's own work between two steps (``between_steps_s``), the actor call reaching
    the worker (``dispatch_s``), the deferred optimizer step (``optimizer_s``), building the
    microbatches (``batch_s``), the workers' span from the first compute to the last return
    (``worker_span_s``, the all-reduce included), and the results reaching the scheduler
    (``return_s``)."""
    med = lambda xs: statistics.median(list(xs))  # noqa: E731
    w0 = next(iter(extra[0]["workers"]))
    out = {"between_steps_s": med(e["dispatched"] - e["previous_end"] for e in extra)}
    if extra[0]["workers"][w0].get("called") is not None:  # (an older engine in an A/B run has no such marks)
        out.update(dispatch_s=med(e["workers"][w0]["called"] - e["dispatched"] for e in extra),
                   optimizer_s=med(e["workers"][w0]["settled"] - e["workers"][w0]["called"] for e in extra),
                   batch_s=med(e["workers"][w0]["start"] - e["workers"][w0]["settled"] for e in extra))
    out.update({
           "worker_span_s": med(e["work_span_s"] for e in extra),
           "return_s": med(e["dispatched"] + e["scheduler_wall_s"] - max(w["end"] for w in e["workers"].values())
                           for e in extra),
           "allreduce_s": med(e["allreduce_s"] for e in extra),
           "busy_s": {w: med(e["workers"][w]["busy"] for e in extra) for w in extra[0]["workers"]}})
    out["outside_workers_s"] = median_step - out["worker_span_s"]
    return out


# ---------------------------------------------------------------- output

def table(results: list[dict]) -> str:
    lines = ["| contestant | M | step time median (ms) | IQR (ms) | samples/s | vs best peer | measured bubble "
             "| plan bubble (p-1)/(M+p-1) |", "|---|---|---|---|---|---|---|---|"]
    for res in results:
        for r in res["rows"]:
            vs = f"{r['vs_best_peer']:.2f}" if "vs_best_peer" in r else ""
            bub = "" if r["bubble"] is None else f"{r['bubble']:.1%}"
            plan = "" if r["bubble_plan"] is None else f"{r['bubble_plan']:.1%}"
            lines.append(f"| {r['contestant']} | {r['M']} | {r['step_s'] * 1e3:.0f} | {r['iqr_s'] * 1e3:.0f} | "
                         f"{r['samples_per_s']:.0f} | {vs} | {bub} | {plan} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    """Step time against M (top) and speed relative to the best peer (bottom), per contestant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["contestant"] for r in results[0]["rows"]]
    ms = [res["M"] for res in results]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9), gridspec_kw={"height_ratios": [3, 2]})
    for col, (groups, title) in enumerate(((("base", "pipeline"), "pipeline parallel, p = 2"),
                                           (("base", "dp"), "data parallel, 2 workers"))):
        top, bottom = axes[0][col], axes[1][col]
        for k, name in enumerate(names):
            pts = [(res["M"], r) for res in results for r in res["rows"] if r["contestant"] == name]
            if not pts or pts[0][1]["group"] not in groups:
                continue
            xs = [m for m, _ in pts]
            style = dict(linestyle="--" if pts[0][1]["peer"] else ("-" if "relaytrain" in name else ":"),
                         marker="o", color=f"C{k}", label=name)
            top.errorbar(xs, [r["step_s"] * 1e3 for _, r in pts], capsize=3, **style,
                         yerr=[[(r["step_s"] - r["q1_s"]) * 1e3 for _, r in pts],
                               [(r["q3_s"] - r["step_s"]) * 1e3 for _, r in pts]])
            if "vs_best_peer" in pts[0][1]:
                bottom.plot(xs, [r["vs_best_peer"] for _, r in pts], **style)
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ms, [str(m) for m in ms])
            ax.grid(True, alpha=0.3)
        top.set_ylabel("step time (ms), median; bars: interquartile range")
        top.set_title(title)
        top.legend(fontsize=8)
        bottom.axhline(1.0, color="k", linewidth=0.8)
        bottom.set_xlabel("microbatches per step M (microbatch 64, global batch 64 M)")
        bottom.set_ylabel("speed vs the best peer (>1: faster)")
    fig.suptitle(f"{peers_spec.DESCRIPTION}\n2 cores, one thread per worker", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="M = 8 only, 4 rounds (under 5 minutes)")
    ap.add_argument("--ms", type=int, nargs="+", default=None, help="microbatch counts (default 4 8 16)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per M (default 6; --quick 4)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per contestant per round (default 5)")
    ap.add_argument("--check", type=int, default=3, help="steps whose losses are compared before timing")
    ap.add_argument("--which", nargs="+", default=["pipeline", "dp"], choices=["pipeline", "dp"])
    ap.add_argument("--only", nargs="+", help="only the contestants whose name holds one of these words "
                    "(and the single process); for development")
    ap.add_argument("--ab-engine", metavar="DIR", nargs="+", help="also run every relaytrain contestant on the engine "
                    "(actors/, service/) in DIR, e.g. `git archive HEAD~1 actors service | tar -x -C DIR`: "
                    "before/after figures of an engine change from one interleaved run (each contestant's "
                    "scheduler is checked to import from DIR)")
    ap.add_argument("--no-raytrain", action="store_true", help="leave Ray Train out (it needs the bench extra)")
    ap.add_argument("--out", default=None, help="path prefix of the results (.json/.txt/.png; default "
                    "bench/results/peers, with --quick bench/results/peers_quick)")
    args = ap.parse_args()
    args.out = os.path.abspath(args.out or RESULTS / ("peers_quick" if args.quick else "peers"))
    args.ab_engine = [os.path.abspath(d) for d in args.ab_engine or []]
    ms = args.ms or ([8] if args.quick else [4, 8, 16])
    args.rounds = args.rounds or (4 if args.quick else 6)
    import ray
    import torch

    from actors.scheduler import JobScheduler  # noqa: F401  (the engine imports before Ray starts)

    load_start = load()
    log(f"load average at start {load_start} (2 cores); M in {ms}, {args.rounds} rounds x {args.steps} timed steps")
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
        if "dp" in args.which and not args.no_raytrain and wanted:
            try:
                import ray.train  # noqa: F401
            except ImportError as e:
                raise SystemExit(f"peers: Ray Train cannot be imported ({e}): `make bench-peers` installs the "
                                 "`bench` extra (or pip install -c constraints.txt -e '.[bench]'); "
                                 "--no-raytrain leaves it out") from None
            raytrain = peers_raytrain.RayTrainDDP(2)
            raytrain.start()
        for m in ms:
            results.append(run_m(m, args, raytrain))
    finally:
        if raytrain is not None:
            raytrain.stop()
        ray.shutdown()
    load_end = load()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = table(results)
    header = (f"{peers_spec.DESCRIPTION}; {args.rounds} interleaved rounds x {args.steps} timed steps per contestant "
              f"and M; one thread per worker; 2 cores; load average {load_start} at start, {load_end} at end; "
              f"{time.strftime('%Y-%m-%d')}")
    print("\n" + header + "\n\n" + text)
    out.with_suffix(".txt").write_text(header + "\n\n" + text + "\n")
    out.with_suffix(".json").write_text(json.dumps({
        "time": time.time(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": time.time() - t_start,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "ray": ray.__version__},
        "load_average": {"start": load_start, "end": load_end},
        "config": {"model": peers_spec.DESCRIPTION, "ms": ms, "rounds": args.rounds,
                   "timed_steps_per_round": args.steps,
                   "check_steps": args.check, "rtol": RTOL, "atol": ATOL},
        "results": results}, indent=1))
    try:
        plot(results, out.with_suffix(".png"))
    except ImportError as e:
        log(f"no plot ({e}); `make bench-peers` installs matplotlib")
    log(f"wrote {out.with_suffix('.json')}, .txt and .png in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
