"""What bf16 and activation checkpointing cost and save: step time and peak memory per worker.

    .venv/bin/python bench/recipe.py [--quick] [--sizes d128 d256] [--pp 2 4] [--mbs 1 4] [--steps 3]
                                     [--no-one-process] [--from-json PATH]

Trains the built-in GPT (AdamW, random uint16 tokens, 1F1B, collective transport, dp = 1) with
the four training recipes

    precision fp32 | bf16   x   activation_checkpointing off | on

at pp = 2 and pp = 4, two model sizes (d_model 128 and 256, 4 blocks, vocab 8192, seq_len 128;
d512 and d1024 with ``--sizes``) and two microbatch sizes (1 and 4 samples: 128 and 512
tokens); a step is pp microbatches (global batch = pp x microbatch), so 1F1B's warm-up fills
exactly and stage 0 holds pp live microbatches, the most 1F1B ever holds.  Every job of a row group (size, pp, microbatch) uses the same partition: the
engine's balanced partition of the fp32 model (bench/memory.py's ``stage_bounds``), given
explicitly, so the four recipes put the same layers on each worker.

For each job it reports the median step time over the steps after the first (``step_time_s``
of the job's metrics rows; the first step is the warm-up) and each worker's peak resident memory
(VmHWM from /proc, sampled by bench/memory.py's ``Sampler``) over the base, the VmHWM of an
empty StageWorker actor (bench/memory.py's ``measure_base``, once per precision: a bf16 worker
also runs the engine's bf16 probe), both relative to fp32 without checkpointing of the same row
group.  Beside them, per row group: each worker's layers, train state (16 B a parameter), live
microbatches, fp32 activation bytes of one microbatch (bench/memory.py's ``activation_bytes``),
the bf16 copies of its Linear weights one microbatch keeps for its backward under autocast, and
the activation crossing each stage boundary per microbatch in fp32 and in bf16 (shape and dtype
from the engine's pre-flight trace, which runs the layers under bf16 autocast).

The same four recipes also run in one process at the first size (a plain loop: nn.Sequential,
AdamW, the microbatches of a pp = 2 step accumulated, one thread like a worker; autocast and
per-layer checkpointing as tests/reference.py), as a baseline.

Most of the bench's time is the bf16 jobs on a CPU without bf16 instructions (AVX2 only: bf16
matmuls run an order of magnitude slower than fp32 there) and the start of each job's actors;
the default grid is 32 jobs.  ``--sizes``, ``--pp``, ``--mbs``, ``--steps`` change the grid.
``--quick``: d_model 256, microbatch 2, pp 2 only.  Writes bench/results/recipe.json and
recipe.txt (recipe_quick.* with --quick).  The machine is shared: the load average at the start
and the end is in the header, and each job's in the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ["RELAYTRAIN_MODEL_PT_MAX_MB"] = "0"  # no one-file model.pt from the driver: not under test
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402
from bench.memory import (MIN_AVAILABLE, MiB, Sampler, activation_bytes, gpt_layers, gpt_spec,  # noqa: E402
                          measure_base, param_count, shape_bounds, stage_bounds,
                          state_bytes, write_tokens)

RESULTS = ROOT / "bench" / "results"

VOCAB, SEQ, BLOCKS = 8192, 128, 4
SIZES = {f"d{d}": {"vocab_size": VOCAB, "seq_len": SEQ, "d_model": d, "n_heads": h, "n_layers": BLOCKS}
         for d, h in ((128, 4), (256, 4), (512, 8), (1024, 16))}
RECIPES = [("fp32", False), ("fp32", True), ("bf16", False), ("bf16", True)]  # the first is the reference
# d128 and d256, not larger: a bf16 step costs ~14x an fp32 one here, and the 16 bf16 jobs are most of the
# bench's time (d256 + d512 at microbatch 1 and 4 would take ~25 min on 2 quiet cores)
FULL = {"sizes": ["d128", "d256"], "pps": [2, 4], "mbss": [1, 4], "steps": 3, "one_process_sizes": ["d128"]}
QUICK = {"sizes": ["d256"], "pps": [2], "mbss": [2], "steps": 3, "one_process_sizes": ["d256"]}
ONE_PROCESS_MICROBATCHES = 2  # the one-process loop's step: the batch of a pp = 2 step
ONE_PROCESS_THREADS = 1       # as one worker; two OpenMP threads on two shared cores stall each other
JOB_TIMEOUT = 900.0           # a bf16 step on a CPU without bf16 instructions is slow


# ---------------------------------------------------------------- specs and model facts

def recipe_spec(name: str, args: dict, pp: int, mbs: int, microbatches: int, steps: int, tokens: Path,
                precision: str, ckpt: bool, partition: list[int] | None):
    """bench/memory.py's GPT spec (AdamW, 1F1B, collective, dp 1) with the recipe and partition."""
    from service.spec import parse_spec

    d = gpt_spec(name, args, 1, pp, mbs, microbatches * mbs, steps, tokens).model_dump(mode="json")
    d["training"].update(precision=precision, activation_checkpointing=ckpt)
    if partition is not None:
        d["parallelism"]["partition"] = list(partition)
    return parse_spec(d)


def linear_weight_bytes(args: dict) -> list[int]:
    """Per layer: fp32 bytes of the weights autocast casts to bf16 (nn.Linear weights and the
    head's), whose bf16 copies (half these bytes) a microbatch keeps for its backward."""
    import torch
    from torch import nn

    from service.builtins.gpt import Head, gpt

    out = []
    with torch.device("meta"):
        for make in gpt(**args)["layers"]:
            layer = make()
            out.append(sum(m.weight.numel() * 4 for m in layer.modules() if isinstance(m, (nn.Linear, Head))))
    return out


def boundary_meta(args: dict, mbs: int, tokens: Path, precision: str) -> list:
    """(shape, dtype name, bytes) of each layer's output for one microbatch, from the engine's
    pre-flight trace (under bf16 autocast for bf16)."""
    from service.loading import preflight

    spec = recipe_spec("recipe-trace", args, 1, mbs, 1, 1, tokens, precision, False, None)
    out = []
    for shape, dtype in preflight(spec).metas:
        n = 1
        for s in shape:
            n *= s
        out.append((list(shape), str(dtype).replace("torch.", ""), n * dtype.itemsize))
    return out


def group_facts(size: str, pp: int, mbs: int, tokens: Path, partition: list[int]) -> dict:
    args = SIZES[size]
    bounds, lo = [], 0
    for k in partition:
        bounds.append((lo, lo + k))
        lo += k
    layers = gpt_layers(args)
    lin = linear_weight_bytes(args)
    kinds = {"Embedding": "emb", "Block": "block", "LayerNorm": "ln", "Head": "head"}
    workers = []
    for s, (lo, hi) in enumerate(bounds):
        names = [kinds.get(x["kind"], x["kind"]) for x in layers[lo:hi]]
        workers.append({"layers": [lo, hi - 1], "kinds": _runs(names),
                        "state": state_bytes(sum(x["param_bytes"] for x in layers[lo:hi])),
                        "live": pp - s,  # 1F1B's warm-up, pp microbatches a step
                        "act_fp32": activation_bytes(args, mbs, lo, hi),
                        "bf16_weight_copies": sum(lin[lo:hi]) // 2})
    cross = {}
    for precision in ("fp32", "bf16"):
        metas = boundary_meta(args, mbs, tokens, precision)
        cross[precision] = [metas[hi - 1] for _, hi in bounds[:-1]]
    return {"size": size, "args": args, "params": param_count(args), "pp": pp, "mbs": mbs, "partition": partition,
            "workers": workers, "boundary": cross}


def _runs(names: list[str]) -> str:
    out: list[list] = []
    for n in names:
        if out and out[-1][0] == n:
            out[-1][1] += 1
        else:
            out.append([n, 1])
    return " + ".join(f"{k} blocks" if n == "block" and k > 1 else n for n, k in out)


# ---------------------------------------------------------------- one job

def median_after_first(times: list[float]) -> float | None:
    return statistics.median(times[1:]) if len(times) > 1 else (times[0] if times else None)


def run_recipe(size: str, pp: int, mbs: int, precision: str, ckpt: bool, steps: int, tokens: Path,
               partition: list[int], base: int) -> dict:
    """Train one job and sample its workers' memory."""
    from actors.runner import JobFailed, run_job

    name = f"recipe-{size}-pp{pp}-mb{mbs}-{precision}-{'ck' if ckpt else 'nock'}-{uuid.uuid4().hex[:6]}"
    spec = recipe_spec(name, SIZES[size], pp, mbs, pp, steps, tokens, precision, ckpt, partition)
    sampler = Sampler(name, interval=0.1, pss_every=0, min_available=MIN_AVAILABLE)
    load0, t0 = os.getloadavg()[0], time.time()
    sampler.start()
    error = None
    try:
        with tempfile.TemporaryDirectory(prefix="relaytrain-recipe-") as out:
            final = run_job(spec=spec, out=out, progress=False, record=False, timeout=JOB_TIMEOUT)
    except JobFailed as e:
        final, error = e.result or {"metrics": [], "events": []}, str(e)
    finally:
        sampler.stop()
    if sampler.guard_fired:
        error = f"stopped by the memory guard: {sampler.guard_fired}"
    metrics = final.get("metrics", [])
    times = [m["step_time_s"] for m in metrics]
    workers = [{"cell": w["cell"], "pid": w["pid"], "layers": w["layers"], "peak": w["peak"],
                "over_base": w["peak"] - base} for w in sampler.workers()]
    bounds = shape_bounds(final.get("events", []))
    return {"size": size, "pp": pp, "mbs": mbs, "precision": precision, "ckpt": ckpt, "steps": steps,
            "step_times": times, "step_median": median_after_first(times), "workers": workers, "base": base,
            "partition_run": [hi - lo for lo, hi in bounds], "peak_live": metrics[-1]["peak_live"] if metrics else None,
            "losses": [m["loss"] for m in metrics], "wall_s": time.time() - t0, "load": [load0, os.getloadavg()[0]],
            "error": error}


# ---------------------------------------------------------------- the one-process loop

_LOOP = r'''
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from torch.utils.checkpoint import checkpoint
from service.loading import build_data, build_loss, build_model, build_optimizer
from service.recipe import check_precision
from service.sampling import step_indices
from service.spec import parse_spec
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
spec = parse_spec(json.loads(sys.argv[2]))
torch.set_num_threads(int(sys.argv[3]))
t = spec.training
bf16, ckpt = t.precision == "bf16", t.activation_checkpointing
stand_in = torch.nn.Linear(8, 8)
o = build_optimizer(spec, stand_in.parameters())
stand_in(torch.randn(2, 8)).sum().backward(); o.step()
check_precision(spec, gpus=False)       # a worker's bf16 probe (nothing for fp32)
base = hwm()
model = build_model(spec)               # the whole model: nn.Sequential, the tie one parameter
opt = build_optimizer(spec, model.parameters())
samples, loss_fn = build_data(spec), build_loss(spec)
def forward(x):                         # as tests/reference.py: each entry recomputed in backward
    if not ckpt:
        return model(x)
    for layer in model:
        x = checkpoint(layer, x, use_reentrant=False)
    return x
times, losses = [], []
for g in range(t.steps):
    t0 = time.perf_counter()
    idx = step_indices(g, len(samples), t.global_batch_size, t.seed, t.shuffle)
    x, y = samples.batch(idx)
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for xm, ym in zip(x.split(t.microbatch_size), y.split(t.microbatch_size)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(forward(xm), ym) * (len(xm) / len(x))
        loss.backward()
        total += loss.item()
    opt.step()
    times.append(time.perf_counter() - t0)
    losses.append(total)
print(json.dumps({"base": base, "peak": hwm(), "step_times": times, "losses": losses}))
'''


def run_one_process(size: str, mbs: int, precision: str, ckpt: bool, steps: int, tokens: Path) -> dict:
    spec = recipe_spec(f"one-{size}", SIZES[size], 1, mbs, ONE_PROCESS_MICROBATCHES, steps, tokens, precision, ckpt,
                       None)
    load0, t0 = os.getloadavg()[0], time.time()
    proc = subprocess.run([sys.executable, "-c", _LOOP, str(ROOT), json.dumps(spec.model_dump(mode="json")),
                           str(ONE_PROCESS_THREADS)], capture_output=True, text=True, timeout=JOB_TIMEOUT * 2)
    row = {"size": size, "pp": 1, "mbs": mbs, "precision": precision, "ckpt": ckpt, "steps": steps,
           "wall_s": time.time() - t0, "load": [load0, os.getloadavg()[0]], "error": None}
    if proc.returncode != 0:
        return {**row, "error": proc.stderr[-1500:], "step_times": [], "step_median": None, "workers": []}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**row, "step_times": res["step_times"], "step_median": median_after_first(res["step_times"]),
            "losses": res["losses"], "base": res["base"],
            "workers": [{"cell": [0, 0], "peak": res["peak"], "over_base": res["peak"] - res["base"]}]}


# ---------------------------------------------------------------- the bench

def measure(grid: dict, tokens: Path, one_process: bool) -> dict:
    import ray

    ray.init(address="local", num_cpus=16, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    t_start = time.time()
    try:
        tiny = {"vocab_size": 96, "seq_len": 32, "d_model": 64, "n_heads": 4, "n_layers": 6}
        bases = {}
        for precision in ("fp32", "bf16"):
            spec = recipe_spec("recipe-base", tiny, 4, 1, 4, 2, tokens, precision, False, None)
            bases[precision] = measure_base(spec)
            print(f"empty worker ({precision}): {bases[precision]['base'] / MiB:.0f} MiB", flush=True)
        groups, rows, ones = [], [], []
        plan = [(s, pp, m) for s in grid["sizes"] for pp in grid["pps"] for m in grid["mbss"]]
        n_jobs = len(plan) * len(RECIPES)
        for size, pp, mbs in plan:
            # the engine's balanced partition of the fp32 model, fixed for the four recipes
            partition = [hi - lo for lo, hi in stage_bounds(
                recipe_spec("recipe-part", SIZES[size], pp, mbs, pp, 1, tokens, "fp32", False, None))]
            groups.append(group_facts(size, pp, mbs, tokens, partition))
            for precision, ckpt in RECIPES:
                r = run_recipe(size, pp, mbs, precision, ckpt, grid["steps"], tokens, partition,
                               bases[precision]["base"])
                rows.append(r)
                print(f"[{len(rows)}/{n_jobs} {(time.time() - t_start) / 60:.1f} min] {size} pp {pp} mb {mbs} "
                      f"{precision} ckpt {'on' if ckpt else 'off'}: {r['wall_s']:.0f} s, steps "
                      f"{[round(t, 2) for t in r['step_times']]} s, over base "
                      f"{[round(w['over_base'] / MiB) for w in r['workers']]} MiB, load {r['load'][1]:.1f}"
                      f"{', ' + r['error'][:300] if r['error'] else ''}", flush=True)
        if one_process:
            for size in grid["one_process_sizes"]:
                for mbs in grid["mbss"]:
                    for precision, ckpt in RECIPES:
                        r = run_one_process(size, mbs, precision, ckpt, grid["steps"], tokens)
                        ones.append(r)
                        print(f"one process {size} mb {mbs} {precision} ckpt {'on' if ckpt else 'off'}: "
                              f"{r['wall_s']:.0f} s, steps {[round(t, 2) for t in r['step_times']]} s, over base "
                              f"{[round(w['over_base'] / MiB) for w in r['workers']]} MiB"
                              f"{', ' + r['error'][-300:] if r['error'] else ''}", flush=True)
    finally:
        ray.shutdown()
    return {"bases": bases, "groups": groups, "rows": rows, "one_process": ones}


# ---------------------------------------------------------------- tables

def _key(r: dict) -> tuple:
    return r["size"], r["pp"], r["mbs"]


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row with time and per-worker memory relative to fp32 without checkpointing of its group."""
    ref = {_key(r): r for r in rows if r["precision"] == "fp32" and not r["ckpt"] and not r["error"]}
    out = []
    for r in rows:
        b = ref.get(_key(r))
        tr = (r["step_median"] / b["step_median"]) if b and r["step_median"] and b["step_median"] else None
        mr = None
        if b and not r["error"] and len(b["workers"]) == len(r["workers"]):
            mr = [w["over_base"] / v["over_base"] if v["over_base"] > 0 else None
                  for w, v in zip(r["workers"], b["workers"])]
        out.append({**r, "time_ratio": tr, "mem_ratio": mr})
    return out


def _f(x, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def table_main(rows: list[dict]) -> str:
    lines = ["| size | pp | microbatch | precision | checkpointing | step time median (s) | time vs fp32 "
             "| peak over base per worker (MiB) | memory vs fp32 per worker | fullest worker vs fp32 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    ref = {_key(r): r for r in rows if r["precision"] == "fp32" and not r["ckpt"] and not r["error"]}
    for r in with_ratios(rows):
        pp = "1 (one process)" if r["pp"] == 1 else str(r["pp"])
        peaks = " / ".join(f"{w['over_base'] / MiB:.0f}" for w in r["workers"])
        ratios = " / ".join(_f(x, ".2f") for x in r["mem_ratio"]) if r["mem_ratio"] else ""
        b = ref.get(_key(r))
        full = (max(w["over_base"] for w in r["workers"]) / max(w["over_base"] for w in b["workers"])
                if b and r["workers"] and not r["error"] else None)
        err = f" (failed: {r['error'][:80]})" if r["error"] else ""
        lines.append(f"| {r['size']} | {pp} | {r['mbs']} | {r['precision']} | {'on' if r['ckpt'] else 'off'} "
                     f"| {_f(r['step_median'], '.2f')}{err} | **{_f(r['time_ratio'], '.2f')}** | {peaks} | {ratios} "
                     f"| **{_f(full, '.2f')}** |")
    return "\n".join(lines)


def _each(ws: list[dict], key: str, fmt: str, unit: float = 1) -> str:
    return " / ".join(format(w[key] / unit if unit != 1 else w[key], fmt) for w in ws)


def table_groups(groups: list[dict]) -> str:
    lines = ["| size | params (M) | pp | microbatch | layers per worker | train state per worker (MiB) "
             "| live microbatches | fp32 activations of one microbatch (MiB) "
             "| bf16 weight copies one microbatch keeps (MiB) | stage boundary per microbatch, fp32 / bf16 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for g in groups:
        ws = g["workers"]
        cross = []
        for (shape, d32, b32), (_, d16, b16) in zip(g["boundary"]["fp32"], g["boundary"]["bf16"]):
            cross.append(f"{tuple(shape)}: {d32} {b32 / 1024:.0f} KiB / {d16} {b16 / 1024:.0f} KiB")
        lines.append(
            f"| {g['size']} | {g['params'] / 1e6:.1f} | {g['pp']} | {g['mbs']} "
            f"| {_each(ws, 'kinds', '')} | {_each(ws, 'state', '.0f', MiB)} | {_each(ws, 'live', '')} "
            f"| {_each(ws, 'act_fp32', '.1f', MiB)} | {_each(ws, 'bf16_weight_copies', '.1f', MiB)} "
            f"| {'; '.join(sorted(set(cross)))} |")
    return "\n".join(lines)


def render(res: dict) -> str:
    m, g = res["machine"], res["grid"]
    head = (f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(res['time']))}; {m['cpu']}, {m['cores']} cores "
            f"(torch CPU capability {m['capability']}), {m['mem_total_gib']} GiB; torch {m['torch']}, Ray {m['ray']}; "
            f"load average {res['load_start']:.1f} at the start, {res['load_end']:.1f} at the end "
            f"({m['cores']} cores, shared); bench time {res['wall_s'] / 60:.1f} min "
            f"({'--quick' if res['quick'] else 'full'})")
    sizes = "; ".join(f"{s} = d_model {SIZES[s]['d_model']}, {SIZES[s]['n_heads']} heads, {SIZES[s]['n_layers']} "
                      f"blocks, vocab {SIZES[s]['vocab_size']}, seq_len {SIZES[s]['seq_len']}" for s in g["sizes"])
    b32, b16 = res["bases"]["fp32"]["base"], res["bases"]["bf16"]["base"]
    text = [head, "",
            f"Built-in GPT ({sizes}; head tied to the embedding), AdamW, dp 1, 1F1B, collective transport, "
            f"{g['steps']} steps; a step is pp microbatches (global batch = pp x microbatch); one worker thread each "
            f"(pp workers share the {m['cores']} cores). Step time: median of the steps after the first. Peak: VmHWM "
            f"of each worker (stage 0 first) over the base, the VmHWM of an empty worker ({b32 / MiB:.0f} MiB fp32, "
            f"{b16 / MiB:.0f} MiB bf16). Ratios: against fp32 without checkpointing of the same size, pp and "
            f"microbatch. One process: a plain loop over the whole model, {g.get('one_process_threads', 2)} "
            f"thread(s), "
            f"{ONE_PROCESS_MICROBATCHES} microbatches a step (the batch of pp = 2), peak over its own base.\n",
            table_main(res["rows"] + res["one_process"]), "",
            "Per row group (workers stage 0 first; the partition is the engine's balanced one for fp32, fixed for "
            "the four recipes; activations per bench/memory.py's formula; weight copies: the bf16 casts of the "
            "Linear and head weights autocast makes in each microbatch's forward and autograd keeps until its "
            "backward, without checkpointing):\n",
            table_groups(res["groups"])]
    return "\n".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="d_model 256, microbatch 2, pp 2 only")
    ap.add_argument("--steps", type=int, help="steps per job (default 3: two timed after the warm-up)")
    ap.add_argument("--sizes", nargs="+", choices=sorted(SIZES), help="model sizes (default: d128 d256)")
    ap.add_argument("--pp", nargs="+", type=int, help="pipeline depths (default: 2 4)")
    ap.add_argument("--mbs", nargs="+", type=int, help="microbatch sizes (default: 1 4)")
    ap.add_argument("--no-one-process", action="store_true", help="skip the one-process baseline")
    ap.add_argument("--from-json", metavar="PATH", help="print the tables of a saved result again, run nothing")
    args = ap.parse_args()
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        out = render(res)
        print(out)
        Path(args.from_json).with_suffix(".txt").write_text(out + "\n")
        return
    grid = dict(QUICK if args.quick else FULL)
    for key, value in (("steps", args.steps), ("sizes", args.sizes), ("pps", args.pp), ("mbss", args.mbs)):
        if value:
            grid[key] = value
    grid["one_process_sizes"] = [s for s in grid["one_process_sizes"] if s in grid["sizes"]] or grid["sizes"][:1]
    RESULTS.mkdir(parents=True, exist_ok=True)
    t_start, load_start = time.time(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="relaytrain-recipe-") as work:
        tokens = Path(work) / "tokens.bin"
        write_tokens(tokens, VOCAB, 1 << 18)
        res = measure(grid, tokens, not args.no_one_process)
    grid["one_process_threads"] = ONE_PROCESS_THREADS
    res.update(time=t_start, quick=args.quick, grid=grid, machine=machine(), wall_s=time.time() - t_start,
               load_start=load_start, load_end=os.getloadavg()[0])
    out = render(res)
    print()
    print(out)
    name = "recipe_quick" if args.quick else "recipe"
    (RESULTS / f"{name}.txt").write_text(out + "\n")
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
