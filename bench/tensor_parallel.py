"""Tensor parallelism inside a stage (``parallelism.tp``): step time, each rank's peak memory
and the bytes TP's collectives move, for the built-in GPT (float32, AdamW, random tokens).

Shapes (dp, pp, tp): (1,1,1) on one thread and on two (the fair one-node baseline: TP's two
workers use both cores), (1,1,2), (1,2,1) and (1,2,2), each a real relaytrain job (collective
transport, 1F1B) at each --d-model.  For each: the median step time after 2 warm-up steps,
every worker's VmHWM read from /proc while the job runs (bench/memory.py's Sampler; glibc's
mmap threshold fixed at 1 MiB in the workers, as bench/memory.py's tuned runs, so that freed
activations do not grow the heap step after step), and above its first sampled RSS (the
worker with Ray and torch imported, before its layers), the bytes
of parameters that worker holds (its layers' parameters, the split ones divided by tp) and its
train state (16 B a parameter: fp32 parameter, gradient, 2 AdamW slots), and the payload bytes
of the layers' collectives a step on TP rank 0 of each stage (the metrics row's tp_bytes)
against Megatron-LM's count: 2 all-reduces forward and 2 backward per block and microbatch,
each of microbatch x seq_len x d_model elements.

    .venv/bin/python bench/tensor_parallel.py [--d-model 512 1024 2048] [--layers 4] [--steps 4]
        [--default-malloc --out tensor_parallel_speed]

Writes bench/results/OUT.{json,txt} (tensor_parallel: fixed mmap threshold, for memory;
tensor_parallel_speed: glibc's default, for speed).
"""
from __future__ import annotations

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

MiB = 2**20
VOCAB, SEQ, HEADS, MBS, M = 512, 128, 8, 4, 4
SHAPES = [((1, 1, 1), 1), ((1, 1, 1), 2), ((1, 1, 2), 1), ((1, 2, 1), 1), ((1, 2, 2), 1)]  # (shape, cpus per worker)


def spec_of(name: str, tokens: str, d: int, layers: int, shape: tuple, cpus: int, steps: int, tuned: bool = True):
    from service.spec import parse_spec

    dp, pp, tp = shape
    return parse_spec({
        "name": name,
        "model": {"kind": "gpt", "args": {"vocab_size": VOCAB, "seq_len": SEQ, "d_model": d, "n_heads": HEADS,
                                          "n_layers": layers}},
        "data": {"kind": "tokens", "args": {"path": tokens, "seq_len": SEQ}}, "loss": "cross_entropy",
        "optimizer": {"name": "adamw", "lr": 3e-4},
        "training": {"global_batch_size": MBS * M * dp, "microbatch_size": MBS, "steps": steps, "seed": 0},
        "parallelism": {"dp": dp, "pp": pp, "tp": tp, "schedule": "1f1b", "transport": "collective"},
        "resources": {"cpus_per_worker": cpus},
        # glibc's mmap threshold fixed (as bench/memory.py's tuned runs): freed activations go back to the
        # system instead of growing the heap step after step, so VmHWM shows what the worker holds
        "runtime_env": {"env_vars": {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}} if tuned else {}})


def held_params(d: int, layers: int, lo: int, hi: int, tp: int) -> tuple[int, int]:
    """(parameters a TP rank of a stage holding layers [lo, hi) keeps, of which split)."""
    block_split = 3 * d * d + 3 * d + d * d + 4 * d * d + 4 * d + 4 * d * d  # qkv w+b, proj w, fc w+b, proj w
    block_whole = d + d + 4 * d  # proj b, mlp proj b, 2 LayerNorms
    n = split = 0
    for i in range(lo, hi):
        if i == 0:
            n += VOCAB * d + SEQ * d
        elif i <= layers:
            n += block_split // tp + block_whole
            split += block_split // tp
        elif i == layers + 1:
            n += 2 * d
        else:
            n += VOCAB * d  # the head, tied to the embedding: each holder keeps its own copy
    return n, split


def run(shape, cpus, d, layers, steps, tokens, tuned=True) -> dict:
    from actors.runner import run_job
    from memory import Sampler, reset_hwm

    dp, pp, tp = shape
    name = f"tp-{dp}x{pp}x{tp}-c{cpus}-d{d}-{uuid.uuid4().hex[:6]}"
    spec = spec_of(name, tokens, d, layers, shape, cpus, steps, tuned)
    reset_hwm(os.getpid())
    sampler = Sampler(name, interval=0.1, pss_every=0)
    sampler.start()
    try:
        with tempfile.TemporaryDirectory() as out:
            final = run_job(spec=spec, out=out, progress=False, record=False)
    finally:
        sampler.stop()
    rows = final["metrics"]
    step = statistics.median(r["step_time_s"] for r in rows[2:])
    shape_ev = next(e for e in final["events"] if e["type"] == "shape")
    bounds, lo = [], 0
    for n in shape_ev["partition"]:
        bounds.append((lo, lo + n))
        lo += n
    workers = []
    for w in sampler.workers():
        m = re.search(r":w(\d+)\.(\d+)(-\d+)?$", w["name"])
        slot = int(m.group(2))
        stage, rank = divmod(slot, tp)
        n, split = held_params(d, layers, *bounds[stage], tp)
        first = sampler.series.get(w["pid"]) or [(0, 0)]
        workers.append({"worker": f"w{m.group(1)}.{slot}", "stage": stage, "tp_rank": rank, "params": n,
                        "split_params": split, "state_mib": 16 * n / MiB, "vmhwm_mib": w["peak"] / MiB,
                        "first_rss_mib": first[0][1] / MiB})
    workers.sort(key=lambda w: (w["worker"].split(".")[0], int(w["worker"].split(".")[1])))
    blocks = [sum(1 for i in range(lo, hi) if 1 <= i <= layers) for lo, hi in bounds]
    megatron = [b * M * 4 * MBS * SEQ * d * 4 for b in blocks]
    return {"shape": list(shape), "cpus_per_worker": cpus, "d_model": d, "layers": layers, "step_s": step,
            "steps": [r["step_time_s"] for r in rows], "loss": rows[-1]["loss"], "workers": workers,
            "tp_bytes": rows[-1].get("tp_bytes"), "tp_collectives": rows[-1].get("tp_collectives"),
            "megatron_bytes": megatron if tp > 1 else None}


def measure(a) -> list:
    import numpy as np
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING", namespace="relaytrain")
    tokens = Path(tempfile.mkdtemp()) / "tokens.bin"
    np.random.default_rng(0).integers(0, VOCAB, 200_000).astype(np.uint16).tofile(tokens)
    results = []
    for d in a.d_model:
        for shape, cpus in SHAPES:
            r = run(shape, cpus, d, a.layers, a.steps, str(tokens), tuned=not a.default_malloc)
            results.append(r)
            print(f"d={d} {shape} cpus={cpus}: {r['step_s'] * 1e3:.0f} ms/step, peaks "
                  f"{[round(w['vmhwm_mib']) for w in r['workers']]} MiB, tp_bytes {r['tp_bytes']}", flush=True)
    ray.shutdown()
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default="tensor_parallel")
    ap.add_argument("--from-json", help="print the table of an earlier run's JSON (no run)")
    ap.add_argument("--default-malloc", action="store_true",
                    help="leave glibc's mmap threshold dynamic (the speed a user sees; VmHWM then also counts the "
                         "heap's growth)")
    a = ap.parse_args()

    if a.from_json:  # the table again from a run's figures
        results = json.loads(Path(a.from_json).read_text())
        for r in results:
            r["workers"].sort(key=lambda w: (w["worker"].split(".")[0], int(w["worker"].split(".")[1])))
        a.d_model = sorted({r["d_model"] for r in results})
        a.layers = results[0]["layers"]
        a.steps = len(results[0]["steps"])
    else:
        results = measure(a)
    lines = [f"GPT float32, vocab {VOCAB}, seq_len {SEQ}, {HEADS} heads, {a.layers} blocks, microbatches of {MBS}, "
             f"M = {M}, 1F1B, collective; median of {a.steps - 2} steps after 2 warm-up; 2-core machine; "
             f"{'glibc default malloc' if a.default_malloc else 'MALLOC_MMAP_THRESHOLD_=1 MiB in the workers'}", "",
             "| d_model | (dp,pp,tp) | threads/worker | step ms | vs (1,1,1) 2 threads | worker: params held (split) | "
             "train state MiB | VmHWM MiB | VmHWM - first RSS MiB | TP bytes/step (stage) | Megatron count |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in a.d_model:
        base = next(r["step_s"] for r in results if r["d_model"] == d and r["shape"] == [1, 1, 1]
                    and r["cpus_per_worker"] == 2)
        for r in (r for r in results if r["d_model"] == d):
            for k, w in enumerate(r["workers"]):
                head = (f"| {d} | {tuple(r['shape'])} | {r['cpus_per_worker']} | {r['step_s'] * 1e3:.0f} | "
                        f"{base / r['step_s']:.2f}x" if k == 0 else "| | | | |")
                tb = (f"{r['tp_bytes'][w['stage']] / MiB:.1f} MiB" if r["tp_bytes"] and w["tp_rank"] == 0 else "")
                mb = (f"{r['megatron_bytes'][w['stage']] / MiB:.1f} MiB" if r["megatron_bytes"] and w["tp_rank"] == 0
                      else "")
                lines.append(f"{head} | {w['worker']}: {w['params'] / 1e6:.2f} M ({w['split_params'] / 1e6:.2f} M) | "
                             f"{w['state_mib']:.0f} | {w['vmhwm_mib']:.0f} | {w['vmhwm_mib'] - w['first_rss_mib']:.0f} | "
                             f"{tb} | {mb} |")
    text = "\n".join(lines)
    print(text)
    (BENCH / "results" / f"{a.out}.json").write_text(json.dumps(results, indent=1))
    (BENCH / "results" / f"{a.out}.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
