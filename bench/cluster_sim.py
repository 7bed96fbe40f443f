"""bench/cluster.py's trace, the discrete-event simulation of its policies, and the tables (no Ray).

    .venv/bin/python bench/cluster_sim.py [--sim-jobs 200] [--sim-slots 32 64] [--seed 0]
                                          [--sim-start-s 18] [--sim-reshape-s 6] [--nodes 6]

does what ``bench/cluster.py --simulate`` does: it runs service/fairshare.py's three policies
(fifo, fair, elastic: see bench/cluster.py) with nothing but ``fairshare.allocate``.  A job's
work is its steps x the step time on one worker; it runs at the speed of its workers (linear
speed-up); a start costs --sim-start-s and each reshape of an elastic job --sim-reshape-s, during
which it holds its slots and makes no progress.  Scenarios: the small trace on --nodes slots, two
variants of it (its job s01 rigid; s01 preemptible), and synthetic traces of the same shape
(--sim-jobs jobs, 3 tenants weighted 2:1:1, sizes 1/2/4/8 with probabilities .55/.2/.15/.1, half
elastic up to twice their size, log-normal lengths with a median of 2 min, Poisson arrivals at
1.3x the capacity) on each of --sim-slots; then 50 random small traces for the spread.  Writes
bench/results/cluster_sim.{json,txt} and cluster.png (per policy, the slots each tenant holds over
time, for the real run and the simulations found in bench/results).

The trace (TRACE; 12 jobs, 2 tenants weighted 2:1) has the shape that the published analyses of
production deep-learning clusters report: Microsoft's Philly (Jeon et al., "Analysis of
Large-Scale Multi-Tenant GPU Clusters for DNN Training Workloads", USENIX ATC 2019) and
SenseTime's Helios (Hu et al., "Characterization and Prediction of Deep Learning Workloads in
Large-Scale GPU Datacenters", SC 2021): most jobs ask for one device while a few large jobs take
most of the device-time; run times are heavy-tailed; jobs arrive in bursts, so a queue forms.  It
is a hand-made miniature of that shape (1-4 workers, 15 s to 4 min of one worker's time), not a
replay of either trace's rows.

Goals (the issue): no job fails for lack of room; elastic fair share's average job completion
time at least 30% below FIFO's on the same trace; every tenant within 10% of its weighted share
while it has work, judged against the weighted max-min share of the capacity given what its
active jobs can use under the policy (a tenant whose only job wants 1 worker is not owed 4; the
plain weighted share is in the table beside it); every job equal to its one-process loop (the
real run).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service import fairshare  # noqa: E402

RESULTS = ROOT / "bench" / "results"
POLICIES = ("fifo", "fair", "elastic")
WEIGHTS = {"vision": 2.0, "speech": 1.0}   # the small trace's tenants
SIM_WEIGHTS = {"a": 2.0, "b": 1.0, "c": 1.0}

# the paced model's blocks and global batch (bench/cluster.py's jobs): they set a step's time
BLOCKS, BATCH = 4, 48
ELASTIC_MAX = 4

# The small trace: (job, tenant, arrival s, preferred workers, kind, steps); kind "elastic"
# (1..4 workers), "rigid" (its dp, never touched) or "preemptible" (rigid, checkpointed, may be
# stopped and requeued by the fair policies; --simulate's variants).  At the default pace (1 ms a
# sample a block: 0.58 s a step on one worker) the work is 15 s to 4 min of one worker's time;
# most jobs are 1-worker and short, four long ones hold most of the work; half the jobs are
# elastic, the rigid ones at most their tenant's weighted share of 6 slots.
TRACE = [
    ("v01", "vision", 0, 2, "elastic", 140),
    ("s01", "speech", 2, 4, "elastic", 200),
    ("v02", "vision", 6, 1, "rigid", 40),
    ("v03", "vision", 10, 4, "elastic", 400),
    ("s02", "speech", 14, 1, "elastic", 50),
    ("v04", "vision", 20, 1, "rigid", 30),
    ("s03", "speech", 26, 2, "elastic", 60),
    ("v05", "vision", 32, 1, "elastic", 40),
    ("s04", "speech", 40, 1, "rigid", 25),
    ("v06", "vision", 48, 2, "rigid", 80),
    ("s05", "speech", 56, 1, "elastic", 300),
    ("v07", "vision", 66, 1, "rigid", 35),
]
SMOKE = [
    ("e1", "vision", 0, 2, "elastic", 30),
    ("r1", "speech", 4, 2, "rigid", 20),
]


def trace_jobs(rows) -> list[dict]:
    return [{"id": j, "tenant": t, "arrival": float(a), "size": n, "elastic": k == "elastic",
             "preemptible": k == "preemptible", "steps": s,
             "min": 1 if k == "elastic" else n, "max": ELASTIC_MAX if k == "elastic" else n}
            for j, t, a, n, k, s in rows]


def step_seconds(sleep_ms: float) -> float:
    """Seconds of sleep in one step on one worker: every sample sleeps in each block, forward
    once and backward twice."""
    return 3 * sleep_ms * BLOCKS * BATCH / 1e3


def synthetic_trace(n: int, slots: int, seed: int, load: float = 1.3) -> list[dict]:
    """``n`` jobs in the small trace's shape, for a cluster of ``slots``; lengths in seconds of
    their preferred size (``work`` in slot-seconds)."""
    rng = random.Random(seed)
    tenants = list(SIM_WEIGHTS)
    jobs = []
    for i in range(n):
        size = rng.choices([1, 2, 4, 8], [0.55, 0.2, 0.15, 0.1])[0]
        size = min(size, slots)
        elastic = rng.random() < 0.5
        preemptible = not elastic and size >= 4 and rng.random() < 0.5
        seconds = min(3 * 3600.0, max(20.0, rng.lognormvariate(math.log(120.0), 1.4)))
        jobs.append({"id": f"j{i:03d}", "tenant": rng.choice(tenants), "size": size, "elastic": elastic,
                     "preemptible": preemptible,
                     "min": 1 if elastic else size, "max": min(slots, max(ELASTIC_MAX, 2 * size)) if elastic else size,
                     "work": seconds * size})
    window = sum(j["work"] for j in jobs) / (load * slots)  # arrivals spread so that the offered load is `load`
    t = 0.0
    for j in jobs:
        t += rng.expovariate(n / window)
        j["arrival"] = round(t, 3)
    return jobs


# ---------------------------------------------------------------- shares and summaries

def waterfill(capacity: float, demand: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
    """Weighted max-min fair shares of ``capacity``, none above its demand."""
    out = {t: 0.0 for t in demand}
    active = {t for t, d in demand.items() if d > 0}
    left = float(capacity)
    while active and left > 1e-9:
        wsum = sum(weights.get(t, 1.0) for t in active)
        full = [t for t in active if demand[t] - out[t] <= left * weights.get(t, 1.0) / wsum + 1e-12]
        if not full:
            for t in active:
                out[t] += left * weights.get(t, 1.0) / wsum
            break
        for t in full:
            left -= demand[t] - out[t]
            out[t] = demand[t]
            active.discard(t)
    return out


def usable_max(job: dict, policy: str) -> int:
    """The most workers the policy lets a job hold."""
    return job["max"] if policy == "elastic" else job["size"]


def summarize(jobs: list[dict], segments: list[tuple], capacity: float, weights: dict[str, float],
              policy: str) -> dict:
    """``jobs``: dicts with id, tenant, arrival, end (None: did not end), failed; ``segments``:
    (t0, t1, {job: slots held}) covering the run.  Times in seconds from the first arrival."""
    ended = [j for j in jobs if j.get("end") is not None and not j.get("failed")]
    jct = sorted(j["end"] - j["arrival"] for j in ended)
    t0 = min(j["arrival"] for j in jobs)
    by_id = {j["id"]: j for j in jobs}
    tenants = sorted({j["tenant"] for j in jobs})
    acc = {t: {"time": 0.0, "used": 0.0, "owed": 0.0, "weighted": 0.0, "of_used": 0.0, "of_used_time": 0.0,
               "weight_frac": 0.0} for t in tenants}
    busy = total = 0.0
    for a, b, held in segments:
        dt = b - a
        if dt <= 0:
            continue
        mid = (a + b) / 2
        active = [j for j in jobs if j["arrival"] <= mid and (j.get("end") is None or mid < j["end"])]
        used = {t: 0.0 for t in tenants}
        for k, n in held.items():
            if k in by_id:
                used[by_id[k]["tenant"]] += n
        all_used = sum(used.values())
        busy += all_used * dt
        total += capacity * dt
        demand = {t: 0.0 for t in tenants}
        for j in active:
            demand[j["tenant"]] += usable_max(j, policy)
        demand = {t: min(d, capacity) for t, d in demand.items()}
        owed = waterfill(capacity, demand, weights)
        wsum = sum(weights.get(t, 1.0) for t in tenants if demand[t] > 0)
        for t in tenants:
            if demand[t] <= 0:
                continue
            s = acc[t]
            s["time"] += dt
            s["used"] += used[t] * dt
            s["owed"] += owed[t] * dt
            s["weighted"] += capacity * weights.get(t, 1.0) / wsum * dt
            s["weight_frac"] += weights.get(t, 1.0) / wsum * dt
            if all_used > 0:
                s["of_used"] += used[t] / all_used * dt
                s["of_used_time"] += dt
    shares = {}
    for t, s in acc.items():
        if s["time"] <= 0:
            continue
        used, owed = s["used"] / s["time"], s["owed"] / s["time"]
        shares[t] = {"weight": weights.get(t, 1.0), "with_work_s": round(s["time"], 1),
                     "slots": round(used, 3), "fair_slots": round(owed, 3),
                     "weighted_slots": round(s["weighted"] / s["time"], 3),
                     "of_used": round(s["of_used"] / s["of_used_time"], 4) if s["of_used_time"] else None,
                     "weight_share": round(s["weight_frac"] / s["time"], 4),
                     "off": round(used / owed - 1, 4) if owed else None}
    ends = [j["end"] for j in jobs if j.get("end") is not None]
    return {"jobs": len(jobs), "ended": len(ended), "failed": sum(1 for j in jobs if j.get("failed")),
            "unfinished": sum(1 for j in jobs if j.get("end") is None and not j.get("failed")),
            "avg_jct": statistics.fmean(jct) if jct else None,
            "p95_jct": percentile(jct, 95) if jct else None,
            "makespan": (max(ends) - t0) if ends else None,
            "utilisation": busy / total if total else None,
            "shares": shares,
            "share_ok": all(s["off"] is not None and abs(s["off"]) <= 0.10 for s in shares.values())}


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def util_series(segments: list[tuple], jobs: list[dict]) -> dict:
    """Per tenant, the slots held over time: {"t": [...], tenant: [...]} (step-wise, at each
    segment's start)."""
    by_id = {j["id"]: j["tenant"] for j in jobs}
    tenants = sorted(set(by_id.values()))
    out: dict = {"t": [], **{t: [] for t in tenants}}
    for a, _b, held in segments:
        out["t"].append(round(a, 3))
        for t in tenants:
            out[t].append(sum(n for k, n in held.items() if by_id.get(k) == t))
    if segments:
        out["t"].append(round(segments[-1][1], 3))
        for t in tenants:
            out[t].append(0)
    return out


# ---------------------------------------------------------------- the simulation

def demand_of(j: dict, running: int) -> fairshare.JobDemand:
    return fairshare.JobDemand(id=j["id"], tenant=j["tenant"], order=j["arrival"], min_workers=j["min"],
                               max_workers=j["max"], preferred=j["size"], running=running,
                               preemptible=j.get("preemptible", False))


def simulate(trace: list[dict], capacity: int, weights: dict[str, float], policy: str,
             start_s: float, reshape_s: float) -> dict:
    """A discrete-event run of ``trace`` (each job with ``work`` in slot-seconds) under
    ``policy``: the policy decides at every arrival, end and reshape's end, as the cluster
    scheduler would on its next tick.  A preempted job checkpoints where it is (no work lost),
    goes back to the queue and pays a start again when it is admitted."""
    jobs = {j["id"]: {**j, "done": 0.0, "n": 0, "busy_until": 0.0, "starting": False, "end": None,
                      "start": None, "reshapes": 0, "preempted": 0} for j in trace}
    arrivals = sorted(trace, key=lambda j: (j["arrival"], j["id"]))
    nxt, t = 0, arrivals[0]["arrival"]
    segments: list[tuple] = []
    decisions = 0
    while any(j["end"] is None for j in jobs.values()):
        while nxt < len(arrivals) and arrivals[nxt]["arrival"] <= t + 1e-9:
            nxt += 1
        active = [j for j in jobs.values() if j["arrival"] <= t + 1e-9 and j["end"] is None]
        if active:
            alloc = fairshare.allocate(capacity, [demand_of(j, j["n"]) for j in active], weights, policy)
            decisions += 1
            for j in active:
                a = alloc[j["id"]]
                if a.workers == j["n"]:
                    continue
                if a.workers == 0:
                    if not j.get("preemptible"):
                        raise AssertionError(f"{policy}: {j['id']} preempted ({a.reason}) but not preemptible")
                    j.update(n=0, starting=False, busy_until=t)
                    j["preempted"] += 1
                    continue
                if j["n"] == 0:
                    j.update(n=a.workers, busy_until=t + start_s, starting=True)
                    if j["start"] is None:
                        j["start"] = t
                else:
                    if not j["elastic"]:
                        raise AssertionError(f"{policy}: rigid job {j['id']} reshaped: {a.reason}")
                    if j["starting"] and t < j["busy_until"]:
                        j["n"] = a.workers   # not started yet: it starts on its new allotment
                    else:
                        j.update(n=a.workers, busy_until=max(t, j["busy_until"]) + reshape_s, starting=False)
                        j["reshapes"] += 1
        # the next event: an arrival, an end, or the end of a start or reshape
        cands = [arrivals[nxt]["arrival"]] if nxt < len(arrivals) else []
        for j in jobs.values():
            if j["n"]:
                begin = max(t, j["busy_until"])
                cands.append(begin + (j["work"] - j["done"]) / j["n"])
                if j["busy_until"] > t + 1e-9:
                    cands.append(j["busy_until"])
        t1 = min(cands)
        held = {j["id"]: j["n"] for j in jobs.values() if j["n"]}
        if t1 > t:
            segments.append((t, t1, held))
        for j in jobs.values():
            if j["n"]:
                j["done"] += j["n"] * max(0.0, t1 - max(t, j["busy_until"]))
                if j["done"] >= j["work"] - 1e-6:
                    j.update(end=t1, n=0)
        t = t1
    out = [{"id": j["id"], "tenant": j["tenant"], "arrival": j["arrival"], "end": j["end"], "failed": False,
            "size": j["size"], "elastic": j["elastic"], "min": j["min"], "max": j["max"],
            "reshapes": j["reshapes"], "preempted": j["preempted"], "wait": j["start"] - j["arrival"]}
           for j in jobs.values()]
    res = summarize(out, segments, capacity, weights, policy)
    res.update(policy=policy, slots=capacity, decisions=decisions, reshapes=sum(j["reshapes"] for j in out),
               preemptions=sum(j["preempted"] for j in out),
               avg_wait=statistics.fmean(j["wait"] for j in out), series=util_series(segments, out))
    return res


def variant(rows, job: str, kind: str) -> list:
    return [(j, t, a, n, kind if j == job else k, s) for j, t, a, n, k, s in rows]


def run_simulations(args) -> dict:
    t1 = step_seconds(args.sleep_ms) * (1 + args.sim_overhead)

    def small(rows):
        return [{**j, "work": j["steps"] * t1} for j in trace_jobs(rows)]

    scenarios = [{"name": f"small trace, {args.nodes} slots", "trace": "small", "slots": args.nodes,
                  "weights": WEIGHTS, "jobs": small(TRACE)},
                 {"name": f"small trace with s01 rigid, {args.nodes} slots", "trace": "small-s01-rigid",
                  "slots": args.nodes, "weights": WEIGHTS, "jobs": small(variant(TRACE, "s01", "rigid"))},
                 {"name": f"small trace with s01 preemptible, {args.nodes} slots", "trace": "small-s01-preemptible",
                  "slots": args.nodes, "weights": WEIGHTS, "jobs": small(variant(TRACE, "s01", "preemptible"))}]
    for slots in args.sim_slots:
        scenarios.append({"name": f"synthetic, {args.sim_jobs} jobs, {slots} slots", "trace": "synthetic",
                          "slots": slots, "weights": SIM_WEIGHTS,
                          "jobs": synthetic_trace(args.sim_jobs, slots, args.seed)})
    out = []
    for sc in scenarios:
        runs = {p: simulate(sc["jobs"], sc["slots"], sc["weights"], p, args.sim_start_s, args.sim_reshape_s)
                for p in POLICIES}
        work = sum(j["work"] for j in sc["jobs"])
        out.append({"name": sc["name"], "trace": sc["trace"], "slots": sc["slots"], "weights": sc["weights"],
                    "n_jobs": len(sc["jobs"]), "work_slot_s": work,
                    "sizes": _count(j["size"] for j in sc["jobs"]),
                    "elastic_jobs": sum(1 for j in sc["jobs"] if j["elastic"]),
                    "jobs": sc["jobs"] if sc["trace"] == "small" else None, "runs": runs})
    return {"kind": "simulate", "time": time.time(), "step_s_one_worker": t1, "start_s": args.sim_start_s,
            "reshape_s": args.sim_reshape_s, "seed": args.seed, "scenarios": out,
            "spread": spread(args, 12, args.nodes, 50)}


def spread(args, n: int, slots: int, seeds: int) -> dict:
    """How much the elastic policy's gain depends on the trace: ``seeds`` random traces of ``n``
    jobs from the synthetic generator (its two heaviest tenants' weights 2:1), lengths scaled to
    the small trace's (a median of 20 s on the preferred size), on ``slots``."""
    cuts, fifo_off, elastic_off, with_costs = [], [], [], []
    for seed in range(seeds):
        jobs = synthetic_trace(n, slots, 1000 + seed)
        for j in jobs:
            j["work"] *= 20.0 / 120.0
            j["arrival"] *= 20.0 / 120.0
            j["tenant"] = "vision" if j["tenant"] == "a" else "speech"
            j["max"] = min(j["max"], slots)
        for costs, out in (((0.0, 0.0), cuts), ((args.sim_start_s, args.sim_reshape_s), with_costs)):
            r = {p: simulate(jobs, slots, WEIGHTS, p, *costs) for p in ("fifo", "elastic")}
            out.append(1 - r["elastic"]["avg_jct"] / r["fifo"]["avg_jct"])
            if costs[0]:
                fifo_off.append(max(abs(s["off"]) for s in r["fifo"]["shares"].values()))
                elastic_off.append(max(abs(s["off"]) for s in r["elastic"]["shares"].values()))

    def q(xs):
        return {"p10": round(percentile(xs, 10), 3), "median": round(percentile(xs, 50), 3),
                "p90": round(percentile(xs, 90), 3), "at_least_30pct": round(sum(x >= 0.3 for x in xs) / len(xs), 3),
                "at_most_10pct": round(sum(x <= 0.10 for x in xs) / len(xs), 3)}

    return {"jobs": n, "slots": slots, "seeds": seeds, "cut_without_costs": q(cuts), "cut": q(with_costs),
            "fifo_worst_share_off": q(fifo_off), "elastic_worst_share_off": q(elastic_off)}


def _count(xs) -> dict:
    out: dict = {}
    for x in xs:
        out[str(x)] = out.get(str(x), 0) + 1
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


# ---------------------------------------------------------------- tables

def _f(x, fmt: str = ".1f") -> str:
    return "" if x is None else format(x, fmt)


def policy_table(runs: dict) -> str:
    lines = ["| policy | avg JCT (s) | p95 JCT (s) | makespan (s) | utilisation | failed | unfinished | reshapes "
             "| preemptions | avg JCT vs fifo | tenants: slots held / weighted max-min share (off) | tenants: share of used "
             "slots / weight share | shares within 10% |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = runs.get("fifo", {}).get("avg_jct")
    for p in POLICIES:
        r = runs.get(p)
        if r is None:
            continue
        sh = r["shares"]
        held = "; ".join(f"{t} (w {s['weight']:g}) {s['slots']:.2f} / {s['fair_slots']:.2f} "
                         f"({s['off'] * 100:+.0f}%)" if s["off"] is not None else f"{t} -" for t, s in sh.items())
        used = "; ".join(f"{t} {_f(s['of_used'] and s['of_used'] * 100, '.0f')}% / {s['weight_share'] * 100:.0f}%"
                         for t, s in sh.items())
        gain = f"{(r['avg_jct'] / base - 1) * 100:+.0f}%" if base and r["avg_jct"] else ""
        lines.append(f"| {p} | {_f(r['avg_jct'])} | {_f(r['p95_jct'])} | {_f(r['makespan'])} "
                     f"| {_f(r['utilisation'] and r['utilisation'] * 100, '.0f')}% | {r['failed']} "
                     f"| {r['unfinished']} | {r.get('reshapes', '')} | {r.get('preemptions', '')} | {gain} | {held} | {used} "
                     f"| {'yes' if r['share_ok'] else 'no'} |")
    return "\n".join(lines)


def goals(runs: dict) -> str:
    f, e = runs.get("fifo"), runs.get("elastic")
    parts = []
    failed = sum(r["failed"] + r["unfinished"] for r in runs.values())
    parts.append(f"no job failed or left unfinished: {'yes' if not failed else f'NO ({failed})'}")
    if f and e and f["avg_jct"] and e["avg_jct"]:
        cut = 1 - e["avg_jct"] / f["avg_jct"]
        parts.append(f"elastic fair share's average JCT {cut * 100:.0f}% below FIFO's "
                     f"({'meets' if cut >= 0.30 else 'MISSES'} the 30% goal)")
    if e:
        parts.append(f"elastic: every tenant within 10% of its weighted max-min share: "
                     f"{'yes' if e['share_ok'] else 'NO'}")
    return "; ".join(parts)


def render_sim(res: dict) -> str:
    text = [f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(res['time']))}; discrete-event simulation of "
            f"service/fairshare.py's policies (no Ray): linear speed-up, start {res['start_s']:g} s, reshape "
            f"{res['reshape_s']:g} s; small trace's step {res['step_s_one_worker']:.3f} s on one worker; synthetic "
            f"traces seed {res['seed']}. JCT: submission to end. Utilisation: slots held / slots, first "
            "arrival to last end. Shares: time-averages while the tenant has a job queued or running; 'off' "
            "is the slots held against the weighted max-min share of the capacity given what its active jobs "
            "can use under the policy (judged within 10%); 'share of used slots / weight share' is the plain "
            "weighted share, for reference.\n"]
    for sc in res["scenarios"]:
        text.append(f"### {sc['name']}: {sc['n_jobs']} jobs ({sc['elastic_jobs']} elastic), sizes "
                    f"{', '.join(f'{k}: {v}' for k, v in sc['sizes'].items())}, {sc['work_slot_s'] / 60:.0f} "
                    f"slot-minutes of work, weights {', '.join(f'{t} {w:g}' for t, w in sc['weights'].items())}\n")
        text.append(policy_table(sc["runs"]))
        text.append("\n" + goals(sc["runs"]) + "\n")
    sp = res.get("spread")
    if sp:
        c, c0, fo, eo = sp["cut"], sp["cut_without_costs"], sp["fifo_worst_share_off"], sp["elastic_worst_share_off"]
        text.append(f"### How much it depends on the trace: {sp['seeds']} random traces of {sp['jobs']} jobs on "
                    f"{sp['slots']} slots (the synthetic generator, 2 tenants 2:1, lengths scaled to a median of 20 s)\n")
        text.append(f"elastic's average JCT below FIFO's: median {c['median'] * 100:.0f}% (10th-90th percentile "
                    f"{c['p10'] * 100:.0f}%-{c['p90'] * 100:.0f}%), at least 30% on {c['at_least_30pct'] * 100:.0f}% of "
                    f"the traces; without start and reshape costs: median {c0['median'] * 100:.0f}% "
                    f"({c0['p10'] * 100:.0f}%-{c0['p90'] * 100:.0f}%), at least 30% on "
                    f"{c0['at_least_30pct'] * 100:.0f}%. The worst tenant's distance from its weighted max-min share: "
                    f"elastic median {eo['median'] * 100:.0f}% ({eo['p10'] * 100:.0f}%-{eo['p90'] * 100:.0f}%; within "
                    f"10% on {eo['at_most_10pct'] * 100:.0f}% of the traces), FIFO median {fo['median'] * 100:.0f}% "
                    f"(within 10% on {fo['at_most_10pct'] * 100:.0f}%).")
    return "\n".join(text)


# ---------------------------------------------------------------- the plot (both halves' results)

def plot(path: Path) -> None:
    """Per policy (rows), the slots each tenant holds over time (stacked) for each scenario
    (columns): the real run, then the simulations, whichever are in bench/results."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = []
    real = RESULTS / "cluster.json"
    if real.exists():
        r = json.loads(real.read_text())
        cols.append((f"real: {r['nodes']} one-CPU nodes", r["nodes"], r["runs"]))
    sim = RESULTS / "cluster_sim.json"
    if sim.exists():
        s = json.loads(sim.read_text())
        for sc in s["scenarios"]:
            if sc["trace"] not in ("small", "synthetic"):
                continue  # the small trace's variants: in the tables only
            cols.append((f"simulated: {sc['name']}", sc["slots"], sc["runs"]))
    if not cols:
        return
    fig, axes = plt.subplots(len(POLICIES), len(cols), figsize=(5.2 * len(cols), 8.5), squeeze=False)
    colours = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
    for c, (title, slots, runs) in enumerate(cols):
        for r, p in enumerate(POLICIES):
            ax = axes[r][c]
            run = runs.get(p)
            if not run or not run.get("series"):
                ax.set_axis_off()
                continue
            s = run["series"]
            t = s["t"]
            scale, unit = (60.0, "min") if (t and t[-1] > 1200) else (1.0, "s")
            xs = [x / scale for x in t]
            tenants = [k for k in s if k not in ("t", "cpu")]
            ax.stackplot(xs, *[s[k] for k in tenants], step="post", labels=tenants,
                         colors=colours[:len(tenants)], alpha=0.85)
            if "cpu" in s:
                ax.step(xs, s["cpu"], where="post", color="k", lw=0.8, ls=":", label="Ray CPUs in use")
            ax.axhline(slots, color="k", lw=0.8)
            ax.set_ylim(0, slots * 1.08)
            ax.set_xlim(left=0)
            util = run.get("utilisation")
            ax.set_title(f"{p}: avg JCT {_f(run.get('avg_jct'), '.0f')} s, util {_f(util and util * 100, '.0f')}%",
                         fontsize=9)
            if r == 0:
                ax.annotate(title, (0.5, 1.18), xycoords="axes fraction", ha="center", fontsize=10,
                            fontweight="bold")
            if r == len(POLICIES) - 1:
                ax.set_xlabel(f"time ({unit})")
            if c == 0:
                ax.set_ylabel("slots held")
            if r == 0 and c == 0 or (r == 0 and tenants != list(cols[0][2].get(p, {}).get("series", {}))):
                ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main

def add_sim_args(ap: argparse.ArgumentParser) -> None:
    """The simulation's options, and the small trace's cluster and pace (bench/cluster.py's too)."""
    ap.add_argument("--nodes", type=int, default=6, help="one-CPU worker nodes (slots) of the small trace's cluster")
    ap.add_argument("--sleep-ms", type=float, default=1.0, help="ms a Sleep layer sleeps per sample (forward; x2 backward)")
    ap.add_argument("--sim-jobs", type=int, default=200)
    ap.add_argument("--sim-slots", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--sim-start-s", type=float, default=18.0,
                    help="simulated start of a job: admission to its first step (s; the real run's median: 18 s "
                         "with six jobs starting at once on 2 cores, 9-12 s alone)")
    ap.add_argument("--sim-reshape-s", type=float, default=6.0,
                    help="simulated reshape of an elastic job (s; the real run's median: 5.7 s)")
    ap.add_argument("--sim-overhead", type=float, default=0.1,
                    help="simulated per-step overhead, a fraction of the small trace's paced step")
    ap.add_argument("--seed", type=int, default=0)


def write_simulations(args) -> None:
    """Run the simulations, print their tables and write bench/results/cluster_sim.* and the plot."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    res = run_simulations(args)
    out = render_sim(res)
    print(out)
    (RESULTS / "cluster_sim.txt").write_text(out + "\n")
    (RESULTS / "cluster_sim.json").write_text(json.dumps(res, indent=1))
    plot(RESULTS / "cluster.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sim_args(ap)
    write_simulations(ap.parse_args())


if __name__ == "__main__":
    main()
