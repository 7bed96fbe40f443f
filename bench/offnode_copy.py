"""What the off-node copy of an elastic job's state costs a step (``elastic.snapshot_every_steps``).

    .venv/bin/python bench/offnode_copy.py [--hidden 128 512] [--shapes 1x3 2x2] [--steps 80]
                                           [--rounds 2] [--tag NAME]

On a ``ray.cluster_utils.Cluster`` of 1-CPU nodes (a head with no CPUs, as many nodes as the
shape has workers: each worker on a node of its own, so each stage's copy crosses nodes), an
elastic job (the elastic tests' MLP: 64 -> 7 blocks of width --hidden -> 10, float64, SGD with
momentum, global batch 64 in microbatches of 8, 1F1B, collective transport; a worker may
hold 3/4 of the model's state, so every shape has stages) trains --steps steps
with a copy after every step (``snapshot_every_steps: 1``, the default) and without one
(``0``), alternately, --rounds times.  The shape is fixed: ``min_workers`` and ``max_workers``
equal to dp x pp, and the planner's costs declared.  Per job, after the first 10 steps:

  * period: the median and the 90th percentile of the time between consecutive metrics rows
    (what training runs at), and the slowest;
  * copy: the median of the rows' ``snapshot_s`` (from a commit until every stage's copy of it
    has landed on its peer; the next step commits only after it);
  * stalls: the periods over 500 ms.

Each of the 2 cores runs a raylet per node beside the workers: the figures are this machine's,
for the relative cost of the copy, not a cluster's.  Writes bench/results/offnode_copy.json and
.txt (offnode_copy_<tag>.* with --tag).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def params(hidden: int) -> int:
    """The MLP's parameters: 64 -> hidden, 6 x hidden -> hidden, hidden -> 10, with biases."""
    return 64 * hidden + hidden + 6 * (hidden * hidden + hidden) + hidden * 10 + 10


def spec_for(hidden: int, dp: int, pp: int, steps: int, every: int):
    from service.spec import parse_spec

    return parse_spec({
        "name": f"copy{every}-h{hidden}-{dp}x{pp}-{time.time():.0f}",
        "model": {"kind": "mlp", "args": {"in_features": 64, "hidden": hidden, "layers": 7, "dtype": "float64"}},
        "data": {"kind": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "training": {"global_batch_size": 64, "microbatch_size": 8, "steps": steps, "seed": 3},
        "parallelism": {"dp": dp, "pp": pp, "transport": "collective", "schedule": "1f1b",
                        "layer_costs_ms": [0.1, 10, 10, 10, 10, 10, 10, 0.1]},
        # a worker holds at most 3/4 of the model's state (parameters, gradients, momentum): every shape has stages
        "resources": {"memory_per_worker_mb": 0.75 * 3 * 8 * params(hidden) / 2**20},
        "elastic": {"enabled": True, "min_workers": dp * pp, "max_workers": dp * pp, "snapshot_every_steps": every},
        "checkpoint": {"every_steps": 0},
    })


def measure(hidden: int, dp: int, pp: int, steps: int, every: int, out: str) -> dict:
    from actors.runner import run_job

    spec = spec_for(hidden, dp, pp, steps, every)
    r = run_job(spec=spec, out=out, progress=False, timeout=60, record=False)
    if r["state"] != "SUCCEEDED":
        raise SystemExit(f"the job {spec.name} ended {r['state']}: {r.get('error')}")
    rows = r["metrics"]
    shapes = {(m["dp"], m["pp"]) for m in rows}
    if shapes != {(dp, pp)}:
        raise SystemExit(f"the job {spec.name} ran at {sorted(shapes)}, not {dp}x{pp}")
    t = [m["time"] for m in rows[10:]]
    periods = sorted(b - a for a, b in zip(t, t[1:]))
    copies = [m.get("snapshot_s") or 0.0 for m in rows[10:]]
    return {"hidden": hidden, "shape": f"{dp}x{pp}", "every": every, "steps": len(rows),
            "period_ms": 1000 * statistics.median(periods), "p90_ms": 1000 * periods[int(0.9 * len(periods))],
            "max_ms": 1000 * periods[-1], "copy_ms": 1000 * statistics.median(copies),
            "stalls": sum(p > 0.5 for p in periods), "periods": len(periods)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--shapes", nargs="+", default=["1x3", "2x2"])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    results, lines = [], []
    out = tempfile.mkdtemp(prefix="relaytrain-offnode-")
    for shape in args.shapes:
        dp, pp = map(int, shape.split("x"))
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        for _ in range(dp * pp):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        try:
            for hidden in args.hidden:
                for _ in range(args.rounds):
                    for every in (1, 0):
                        row = measure(hidden, dp, pp, args.steps, every, out)
                        results.append(row)
                        line = (f"{row['shape']} hidden {hidden:4d} snapshot_every_steps {every}: period median "
                                f"{row['period_ms']:6.1f} ms, p90 {row['p90_ms']:6.1f}, max {row['max_ms']:7.1f}; copy "
                                f"{row['copy_ms']:5.1f} ms; periods over 500 ms {row['stalls']}/{row['periods']}")
                        print(line, flush=True)
                        lines.append(line)
        finally:
            ray.shutdown()
            cluster.shutdown()
    name = f"offnode_copy_{args.tag}" if args.tag else "offnode_copy"
    res = ROOT / "bench" / "results"
    res.mkdir(parents=True, exist_ok=True)
    (res / f"{name}.json").write_text(json.dumps({"argv": sys.argv[1:], "time": time.time(), "rows": results}, indent=1))
    (res / f"{name}.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
