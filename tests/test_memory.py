"""Peak memory of a job's processes, read from /proc while it runs (issue 15): each worker
builds and holds only its stage, the scheduler holds no layer at all.

The model is a GPT layer list of 89 M parameters (the whole model: 340 MiB of parameters,
1.33 GiB with gradients and two Adam slots) at pp = 4, so a worker's share (about a quarter)
and the whole model differ by hundreds of MiB, far above the noise of a few MiB.  The test
reads VmHWM (the kernel's peak RSS) of every worker and of the scheduler from
/proc/<pid>/status while the job runs, sampling every 50 ms; the processes are found by their
Ray actor names and tell their pid and cell themselves (bench/memory.py's ``Sampler``).

It fails on code that builds the whole model in each worker (a worker's peak before its first
action, what configure built, would be the whole model's parameters: three to four times its
stage's) or in the scheduler (its peak would grow by the model's parameters, and by their
gradients when it profiles them), and on a worker that keeps more than its share in training.
"""
from __future__ import annotations

import uuid

import numpy as np
import pytest

from bench import memory
from service.spec import parse_spec

MiB = 2**20
# an 8192 x 1280 token embedding (tied to the head: the first and the last stage hold a copy
# each) and 4 blocks of 19.7 M parameters: 89.2 M distinct parameters
MODEL = {"vocab_size": 8192, "seq_len": 16, "d_model": 1280, "n_heads": 10, "n_layers": 4}
TINY = {"vocab_size": 96, "seq_len": 16, "d_model": 32, "n_heads": 4, "n_layers": 2}
MBS, BATCH = 1, 4
# What configure may hold beyond the layers it builds: their module objects, the optimizer,
# the data reader (measured: the peak before the first action is the built bytes -1..+0 MiB).
CONFIGURE_SLACK = 32 * MiB
# What a running worker holds beyond the empty one (the base), 1.25 x its share and the
# transients below: its process group, transport buffers and torch's thread pools (tiny-model
# workers peak 8-12 MiB over the base), and glibc keeping freed gradient and activation blocks
# below its mmap threshold for reuse (50 MiB for one block's stage: its step replayed with the
# engine's StepRunner in one process, MALLOC_MMAP_THRESHOLD_ unset against set to 1 MiB); twice
# that, for the noise of a shared machine.
WORKER_SLACK = 128 * MiB
# The scheduler's peak over its base (the same actor class, having had a tiny model pre-flighted:
# its imports, and the trace's facts from the pre-flight task): its worker group, record and
# polls.  A quarter of one block's parameters (75 MiB); the scheduler imports no torch (about
# 250 MiB), so any tensor that passed through it would show.
SCHEDULER_SLACK = 20 * MiB


def spec_for(name: str, args: dict, tokens: str):
    return parse_spec({
        "name": name, "model": {"kind": "gpt", "args": args},
        "data": {"kind": "tokens", "args": {"path": tokens, "seq_len": args["seq_len"], "dtype": "uint16"}},
        "loss": "cross_entropy", "optimizer": {"name": "adamw", "lr": 1e-4},
        "training": {"global_batch_size": BATCH, "microbatch_size": MBS, "steps": 2, "seed": 0},
        "parallelism": {"dp": 1, "pp": 4, "schedule": "1f1b", "transport": "collective"},
    })


def test_each_process_holds_only_its_share(ray_session, tmp_path, monkeypatch):
    from actors import runner
    from actors.runner import run_job

    # the scheduler traces the model as the control plane's jobs have it: in the first worker
    # (actors/layerfacts.py), whose peak before its first action must still be its own stage's,
    # not the trace's; `relaytrain run` would hand the scheduler its own trace instead
    start = runner.launch.start_scheduler
    monkeypatch.setattr(runner.launch, "start_scheduler", lambda *a, **k: start(*a, **{**k, "traced": None}))

    monkeypatch.setenv("RELAYTRAIN_MODEL_PT_MAX_MB", "0")  # the driver's one-file copy is not under test
    tokens = str(tmp_path / "tokens.bin")
    np.random.default_rng(0).integers(0, 96, size=1 << 14, dtype=np.uint16).tofile(tokens)
    bases = memory.measure_base(spec_for("memory-tiny", TINY, tokens))  # an empty worker, a pre-flighted scheduler
    base, sched_base = bases["base"], bases["scheduler"]

    name = f"memory-{uuid.uuid4().hex[:6]}"
    sampler = memory.Sampler(name, interval=0.05, pss_every=0)
    sampler.start()
    try:
        final = run_job(spec=spec_for(name, MODEL, tokens), out=str(tmp_path / "out"), progress=False, record=False)
    finally:
        sampler.stop()
    assert final["state"] == "SUCCEEDED"

    layers = memory.gpt_layers(MODEL)
    whole_params = 4 * memory.param_count(MODEL)       # float32 bytes of the distinct parameters
    whole_state = memory.state_bytes(whole_params)
    tie_bytes = 4 * MODEL["vocab_size"] * MODEL["d_model"]
    holders = {0, MODEL["n_layers"] + 2}                 # the embedding and the head hold the tie
    live = final["metrics"][-1]["peak_live"]
    first_action = {}
    for entry in final["timelines"]:
        for cell, acts in entry["workers"].items():
            first_action[cell] = min(first_action.get(cell, float("inf")), acts[0][1])
    workers = sampler.workers()
    assert sorted(tuple(w["cell"]) for w in workers) == [(0, s) for s in range(4)], sampler.actors
    report = []
    for w in workers:
        s = w["cell"][1]
        lo, hi = w["layers"] or memory.shape_bounds(final["events"])[s]
        held = set(range(lo, hi))
        params = sum(layers[i]["param_bytes"] for i in held)
        share = memory.state_bytes(params) + live[s] * memory.activation_bytes(MODEL, MBS, lo, hi)
        # transients sized by one tensor, not by the stage: autograd's fresh buffer for a
        # gradient it then adds into the held one (1x the largest parameter), and
        # actors/ties.py's received sum of the tied gradient (1x the tie); fused AdamW (the
        # default) allocates none (the single-tensor one allocated 2x the largest parameter)
        largest = max(layers[i]["largest"] for i in held)
        tied = tie_bytes if held & holders else 0
        transients = tied + largest
        # configure builds the stage's layers; the last stage also builds layer 0 for a moment,
        # to copy the tied weight's initial value (service/loading.py ModelRecipe.copy_tied_init)
        built = params + (layers[0]["param_bytes"] if tied and lo > 0 else 0)
        before = [hwm for t, _rss, hwm, _anon, _shm in sampler.series[w["pid"]] if t < first_action[f"w0.{s}"]]
        assert before, f"worker {s}: no memory sample before its first action"
        configured, peak = max(before) - base, w["peak"] - base
        report.append(f"w0.{s} layers {lo}-{hi - 1}: over the base {base / MiB:.0f} MiB, configure {configured / MiB:.0f} "
                      f"MiB (built {built / MiB:.0f}), peak {peak / MiB:.0f} MiB (share {share / MiB:.0f}, transients "
                      f"{transients / MiB:.0f}); the whole model: {whole_params / MiB:.0f} MiB of parameters, "
                      f"{whole_state / MiB:.0f} MiB of state")
        assert configured < 1.25 * built + CONFIGURE_SLACK, report[-1]
        assert configured < 0.6 * whole_params, report[-1]
        assert peak < 1.25 * share + transients + WORKER_SLACK, report[-1]
        assert peak < 0.6 * whole_state, report[-1]
    sched = sampler.scheduler()
    assert sched is not None, sampler.actors
    report.append(f"scheduler: peak {sched['peak'] / MiB:.0f} MiB, its base {sched_base / MiB:.0f} MiB; "
                  f"one block's parameters {layers[1]['param_bytes'] / MiB:.0f} MiB")
    print("\n".join(report))
    assert sched["peak"] < sched_base + SCHEDULER_SLACK, report[-1]
    # and they all ran at the node's normal priority (resources.nice 0), not Ray's nice 15
    assert {a["nice"] for a in sampler.actors.values()} == {0}, sampler.actors
    assert SCHEDULER_SLACK < layers[1]["param_bytes"] / 3


@pytest.mark.parametrize("case", sorted(memory.REUSE_CASES))
def test_a_step_reuses_the_memory_the_step_before_freed(ray_session, tmp_path, case):
    """Each step frees its weight gradients (set to None, as a hand-written loop does) and its
    activations, and the next asks for the same sizes: a worker that gets them back from the
    kernel pays a zero-filled page fault for every 4 KiB page, every step (actors/heap.py).
    Read from /proc/<pid>/stat while the job runs: after four steps, each worker's steps take
    fewer page faults than 1 MiB has pages, but for at most one of the ten (the engine before
    actors/heap.py: about 2,000 every step for the 4 MiB case).  Before the weight gradients
    were written into the step before's memory and the threads' small-block caches were turned
    off, the heap fragmented and grew into fresh memory: the first stage faulted a 1-4 MiB
    block in up to 4 of the ten steps (the 25 MiB case: a 10 MiB block, 2,560 faults); in 14 runs
    after, no step of either case took more than 194 (README: "What reusing a step's memory
    changed")."""
    from actors.runner import run_job

    name = f"faults-{uuid.uuid4().hex[:6]}"
    steps, settle = 14, 4
    spec = memory.reuse_spec(case, name, steps)
    sampler = memory.Sampler(name, interval=0.02, pss_every=0)
    sampler.start()
    try:
        final = run_job(spec=spec, out=str(tmp_path / "out"), progress=False, record=False)
    finally:
        sampler.stop()
    assert final["state"] == "SUCCEEDED"
    ends = [row["time"] for row in final["metrics"]]
    lo, hi = ends[settle - 1], ends[-1]  # steps settle+1 .. steps
    workers = sampler.workers()
    assert len(workers) == 2, sampler.actors
    report, faulting = [], []
    for w in workers:
        series = sampler.faults[w["pid"]]
        inside = [(t, n) for t, n in series if lo <= t <= hi]
        assert len(inside) >= steps - settle, f"too few samples of {w['name']} between steps {settle} and {steps}"

        def faults_by(t):  # the count at the last sample at or before t
            return max((n for ts, n in series if ts <= t), default=series[0][1])

        per_step = [faults_by(b) - faults_by(a) for a, b in zip(ends[settle - 1:], ends[settle:])]
        faulting.append(sum(1 for f in per_step if f >= 256))
        report.append(f"{w['name']}: page faults in steps {settle + 1}-{steps}: {per_step}")
    print("\n".join(report))
    assert max(faulting) <= 1, report  # (tests/test_priority.py reads the workers' malloc settings)


def test_the_step_thread_runs_every_call_on_one_thread_and_raises_what_it_raised():
    """Calls from any of Ray's threads run on the one step thread, in order; a step's own
    exception reaches the caller as it was raised (type, text, traceback)."""
    import threading

    from actors.heap import StepThread

    steps = StepThread(1)
    seen = []
    callers = [threading.Thread(target=lambda: seen.append(steps.run(threading.get_ident))) for _ in range(6)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert len(seen) == 6 and len(set(seen)) == 1 and seen[0] not in {t.ident for t in callers}

    def fails(x):
        raise ValueError(f"layer 3 got {x}")
    with pytest.raises(ValueError, match="layer 3 got 7") as e:
        steps.run(fails, 7)
    assert any(f.name == "fails" for f in e.traceback)
    assert steps.run(sum, [1, 2]) == 3  # and it goes on


def test_workers_get_one_malloc_arena_and_no_thread_caches_unless_the_job_sets_its_own(monkeypatch):
    from actors import heap, nodeenv
    from actors.nodeenv import NO_TCACHE

    def runtime_env(job_env, nice=0):  # under a scheduler whose runtime_env gave the niceness and the re-check
        return heap.runtime_env(job_env, nice, {"env_vars": {"RAY_worker_niceness": str(nice),
                                                             "RAY_get_check_signal_interval_milliseconds": "100"}})

    monkeypatch.setattr(nodeenv, "given_by_nodes", lambda job_env, nice=0: False)  # a cluster relaytrain did not start
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("RELAYTRAIN_KEEP_FREED", raising=False)
    ours = {"MALLOC_ARENA_MAX": "1", "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}
    assert NO_TCACHE == ours["GLIBC_TUNABLES"]
    assert runtime_env({}) == {"runtime_env": {"env_vars": ours}}
    assert runtime_env({"env_vars": {"A": "1"}}) == {"runtime_env": {"env_vars": ours}}
    assert runtime_env({"env_vars": {"MALLOC_ARENA_MAX": "4"}}) == {"runtime_env": {"env_vars": {"GLIBC_TUNABLES": NO_TCACHE}}}
    assert runtime_env({"env_vars": {"GLIBC_TUNABLES": "glibc.malloc.mxfast=0"}}) == \
        {"runtime_env": {"env_vars": {"MALLOC_ARENA_MAX": "1"}}}
    assert runtime_env({"env_vars": {"MALLOC_ARENA_MAX": "4", "GLIBC_TUNABLES": ""}}) == {}
    assert runtime_env({"env_vars": {"RELAYTRAIN_KEEP_FREED": "0"}}) == {"runtime_env": {"env_vars": {"MALLOC_ARENA_MAX": "1"}}}
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mxfast=0")  # what the job's processes inherit is kept
    assert runtime_env({})["runtime_env"]["env_vars"]["GLIBC_TUNABLES"] == f"glibc.malloc.mxfast=0:{NO_TCACHE}"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=3")
    assert runtime_env({})["runtime_env"]["env_vars"]["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=3"
    monkeypatch.delenv("GLIBC_TUNABLES")
    # a scheduler that started with no runtime_env (every node gave the settings then) and now
    # starts a worker where a node without them has joined: the worker gets them all itself
    assert heap.runtime_env({}, 0, {}) == {"runtime_env": {"env_vars": {
        "RAY_worker_niceness": "0", "RAY_get_check_signal_interval_milliseconds": "100", **ours}}}
    # where every node gives them, a job with no runtime_env of its own and niceness 0 passes none
    monkeypatch.setattr(nodeenv, "given_by_nodes", lambda job_env, nice=0: not job_env and not nice)
    assert heap.runtime_env({}, 0, {}) == {}
    assert heap.runtime_env({"env_vars": {"A": "1"}}, 0, {})["runtime_env"]["env_vars"]["MALLOC_ARENA_MAX"] == "1"


def test_a_job_starts_its_processes_without_a_runtime_env_only_where_every_node_gives_the_settings(monkeypatch):
    from actors import launch, nodeenv

    mark = {nodeenv.LABEL: nodeenv.VERSION}
    assert nodeenv.labelled([{"Alive": True, "Labels": mark}, {"Alive": False, "Labels": {}}])  # a dead node does not count
    assert not nodeenv.labelled([{"Alive": True, "Labels": mark}, {"Alive": True, "Labels": {}}])
    assert not nodeenv.labelled([{"Alive": True, "Labels": {nodeenv.LABEL: "0"}}])  # another version's settings
    assert not nodeenv.labelled([])
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setenv("RELAYTRAIN_KEEP_FREED", "0")
    # the one arena stays where RELAYTRAIN_KEEP_FREED=0 leaves glibc's thresholds and caches, as in a runtime_env
    assert nodeenv.settings(5) == {"RAY_worker_niceness": "5", "RAY_get_check_signal_interval_milliseconds": "100",
                                   "MALLOC_ARENA_MAX": "1"}
    monkeypatch.setattr(nodeenv, "given_by_nodes", lambda job_env, nice=0: not job_env and not nice)
    assert launch.job_process_env({}, 0) is None
    assert launch.job_process_env({}, 4) == {"env_vars": {"RAY_get_check_signal_interval_milliseconds": "100",
                                                          "RAY_worker_niceness": "4"}}
    assert launch.job_process_env({"env_vars": {"RAY_get_check_signal_interval_milliseconds": "50"}}, 0)["env_vars"] == \
        {"RAY_get_check_signal_interval_milliseconds": "50", "RAY_worker_niceness": "0"}


def test_a_process_off_the_jobs_niceness_says_so_in_the_jobs_log():
    from actors import nodeenv

    assert nodeenv.priority_note(0, now=0) == "" and nodeenv.priority_note(6, now=6) == ""
    note = nodeenv.priority_note(0, now=15)
    assert "runs at niceness 15, not the job's resources.nice 0" in note
    assert "relaytrain/process-env=1" in note and "actors/nodeenv.py" in note
