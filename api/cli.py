"""The ``relaytrain`` command."""
from __future__ import annotations

import argparse
import os
import sys
from fractions import Fraction


def _schedule(args) -> int:
    from service import schedules

    def cost(text: str, flag: str) -> Fraction:
        try:
            value = Fraction(text)
        except (ValueError, ZeroDivisionError, OverflowError):
            raise ValueError(f"{flag} must be a number like 2, 1.5 or 3/2; got {text!r}") from None
        if value <= 0:
            raise ValueError(f"{flag} must be more than 0 (a time, in units of the forward's); got {text!r}")
        return value

    chunks = args.stages_per_worker
    if chunks is None:  # the schedule's default, as parallelism.stages_per_worker's
        chunks = 2 if args.schedule in schedules.CHUNKED else 1
    if args.replicas:
        return _replicated_schedule(args)
    try:
        if args.stage_costs:  # (it was ignored without a word: a user trial)
            raise ValueError("--stage-costs orders the plan of replicated stages: give --replicas too (e.g. "
                             "--replicas 1,2,1 --stage-costs 1,2,1); a plain pipeline's plan takes --backward-cost "
                             "and --weight-cost")
        if args.weight_group < 1:
            raise ValueError(f"--weight-group must be at least 1; got {args.weight_group}")
        plan = schedules.build(args.schedule, args.stages, args.microbatches, chunks, args.weight_group)
        weight = None if args.weight_cost is None else cost(args.weight_cost, "--weight-cost")
        for flag, on in (("--sends-early", args.sends_early), ("--last-sent-early", args.last_sent_early)):
            if on and plan.split:
                raise ValueError(f"{args.schedule} splits its backward into B and W already; {flag} "
                                 "is for gpipe, 1f1b and interleaved_1f1b")
        if args.sends_early and args.last_sent_early:
            raise ValueError("--sends-early sends every input gradient early, --last-sent-early only each worker's "
                             "last one of the step: give one of them")
        if args.sends_early:
            plan = schedules.sends_early(plan)
        title = (f"{plan.name} (input gradients sent early)" if args.sends_early else
                 f"{plan.name} (each worker's last input gradient sent early)" if args.last_sent_early else
                 f"{plan.name} (W's in groups of {plan.weight_group})" if plan.weight_group > 1
                 else None)
        print(schedules.render_grid(plan, cost(args.backward_cost, "--backward-cost"), weight, title,
                                    args.last_sent_early))
    except ValueError as e:
        print(f"relaytrain schedule: {e}", file=sys.stderr)
        return 2
    return 0


def _numbers(text: str, flag: str, kind=int) -> list:
    try:
        return [kind(x) for x in text.split(",")]
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{flag} takes numbers separated by commas, like 1,2,1; got {text!r}") from None


def _replicated_schedule(args) -> int:
    """``relaytrain schedule --replicas 1,2,1``: the per-worker orders of a pipeline with replicated stages."""
    from service import replicas

    try:
        reps = _numbers(args.replicas, "--replicas")
        if len(reps) != args.stages:
            raise ValueError(f"--replicas gives {len(reps)} counts for --stages {args.stages}: give one per stage")
        costs = _numbers(args.stage_costs, "--stage-costs", Fraction) if args.stage_costs else None
        print(replicas.render_grid(replicas.plan(args.schedule, reps, args.microbatches, costs)))
    except ValueError as e:
        print(f"relaytrain schedule: {e}", file=sys.stderr)
        return 2
    return 0


def _plan(args) -> int:
    """``relaytrain plan SPEC``: the modelled step of each way to use the spec's workers per
    pipeline (stages, replicated stages), the planner's choice beside pp only and dp only."""
    from pathlib import Path

    from actors import layerfacts
    from service import planner
    from service.loading import search_dirs
    from service.spec import SpecError, load_spec

    try:
        spec = load_spec(args.spec)
        p = spec.parallelism
        workers = args.workers if args.workers is not None else p.dp * p.pipeline_workers
        if workers < 1:
            raise SpecError(f"--workers must be at least 1, got {workers}")
        if workers % p.dp:
            raise SpecError(f"--workers {workers} is not a multiple of parallelism.dp {p.dp}")
        if p.schedule not in ("gpipe", "1f1b"):
            raise SpecError(f"it compares ways to replicate stages, which run gpipe or 1f1b, not {p.schedule}; "
                            f"`relaytrain schedule --schedule {p.schedule} --stages {p.pp} --microbatches "
                            f"{spec.training.global_batch_size // (p.dp * spec.training.microbatch_size)}` shows "
                            f"{p.schedule}'s plan and bubble")
        spec = spec.model_copy(update={"parallelism": p.model_copy(update={"replicas": "auto"})})
        layers = layerfacts.learn(spec, search_dirs(str(Path(args.spec).resolve().parent)))
    except (SpecError, ValueError) as e:
        print(f"relaytrain plan: {e}", file=sys.stderr)
        return 2
    f, w = layers.facts, workers // p.dp
    model = dict(schedule=p.schedule, transport=p.transport, optimizer=spec.optimizer.name)
    mem = spec.resources.memory_per_worker_mb
    shapes = planner.replica_shapes(f, p.dp, w, spec.microbatches, **model)
    try:
        best, why = planner.choose_replicas(f, p.dp, w, spec.microbatches, memory_bytes=mem * 2**20 if mem else None,
                                            **model)
    except ValueError as e:
        print(f"relaytrain plan: {e}", file=sys.stderr)
        return 2
    print(f"{workers} workers ({w} per pipeline, dp {p.dp}), {p.schedule}, {spec.microbatches} microbatches; layer "
          f"costs (ms, {'declared' if p.layer_costs_ms else 'estimated'}): "
          f"[{', '.join(f'{s * 1e3:.3g}' for s in f.seconds)}]")
    if any(s.pp > 1 and not s.replicas and f.early(s.bounds, p.dp) for s in shapes):
        print("plain pipelines timed with each input gradient sent before the weight gradients (every stage's "
              "weights sit in plain Linear layers; `relaytrain schedule --sends-early` draws the plan)")
    print(f"{'shape':<26}{'layers per stage':<20}{'modelled step':>15}{'peak memory':>14}")
    asked = p.replicas  # the spec's own shape among them (none with another --workers)

    def the_specs(s) -> bool:
        if args.workers is not None and args.workers != p.dp * p.pipeline_workers:
            return False
        if asked == "auto":
            return s.key == best.key
        if asked and any(r > 1 for r in asked):
            return tuple(s.replicas) == tuple(asked)
        return s.pp == p.pp and not s.replicas

    for s in sorted(shapes, key=lambda s: s.step_s):
        tags = [t for t, ok in (("the spec's", the_specs(s)), ("replicas: auto runs this", s.key == best.key),
                                ("pp only", s.pp == w and not s.replicas),
                                ("dp only", s.pp == 1),
                                ("does not fit memory_per_worker_mb", bool(mem) and s.memory_bytes > mem * 2**20)) if ok]
        print(f"{s.label():<26}{str(list(s.sizes)):<20}{s.step_s * 1e3:>12.1f} ms{s.memory_bytes / 2**20:>11.2f} MB"
              + (f"  ({', '.join(tags)})" if tags else ""))
    print(why)
    return 0


def _run(args) -> int:
    from actors.runner import JobFailed, run_job
    from service.rayconnect import RayConnectError
    from service.spec import SpecError

    try:
        final = run_job(args.spec, args.out, ray_address=args.ray_address, resume=args.resume,
                        progress=not args.no_progress, timeout=args.timeout, local_cpus=args.local_cpus)
    except SpecError as e:
        print(f"relaytrain: {e}", file=sys.stderr)
        return 2
    except RayConnectError as e:  # no Ray to run on: one sentence, nothing in --out touched
        print(f"relaytrain: {e}", file=sys.stderr)
        return 1
    except JobFailed as e:
        print(f"relaytrain: job failed: {e} (details in {args.out}/events.jsonl)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("relaytrain: interrupted; the job was stopped", file=sys.stderr)
        return 130
    last = final["metrics"][-1] if final.get("metrics") else None
    early = final.get("steps") and final["step"] < final["steps"]  # told to finish (a first Ctrl-C, or the server)
    print(f"relaytrain: {final['state']}: {final['step']} steps" + (f" of {final['steps']}, finished early" if early else "")
          + (f", last loss {last['loss']:.6g}" if last else "") + f"; model in {final.get('model', args.out)}")
    return 0


DEFAULT_SERVER = "http://127.0.0.1:8000"


def _serve(args) -> int:
    from pydantic import ValidationError

    from service.auth import TokenError, is_loopback, load_tokens, load_weights
    from service.settings import Settings

    over = {k: v for k, v in {"host": args.host, "port": args.port, "ray_address": args.ray_address,
                              "db": args.db, "local_cpus": args.local_cpus}.items() if v is not None}
    try:
        settings = Settings(**over)
    except ValidationError as e:  # one line per setting, named as it is set
        for err in e.errors():
            name = "_".join(str(x) for x in err["loc"])
            where = f"--{name.replace('_', '-')}" if name in over else f"RELAYTRAIN_{name.upper()}"
            print(f"relaytrain serve: {where}={err.get('input')!s}: {err['msg']}", file=sys.stderr)
        return 2
    try:
        tokens = load_tokens(settings.api_tokens, settings.tokens_file)
        load_weights(settings.api_tokens, settings.tokens_file, settings.tenant_weights, settings.weights_file)
    except TokenError as e:
        print(f"relaytrain serve: {e}", file=sys.stderr)
        return 2
    if not tokens and not is_loopback(settings.host):
        print(f"relaytrain serve: refusing to listen on {settings.host} without API tokens; set "
              "RELAYTRAIN_API_TOKENS='tenant:token,...' (or RELAYTRAIN_TOKENS_FILE), or bind to 127.0.0.1",
              file=sys.stderr)
        return 2
    if settings.ray_address and settings.ray_address.startswith("ray://"):
        from service.rayconnect import RayConnectError, check_client

        try:
            check_client(settings.ray_address)  # a refusal as one line, before the server starts
        except RayConnectError as e:
            print(f"relaytrain serve: {e}", file=sys.stderr)
            return 2
    elif settings.ray_address and settings.ray_address not in ("auto", "local"):
        # a named GCS address: connected now, a failure as one line (in the app's start, a traceback)
        from service import rayconnect
        from service.names import NAMESPACE

        try:
            rayconnect.init(settings.ray_address, namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False)
        except rayconnect.RayConnectError as e:
            print(f"relaytrain serve: {e}", file=sys.stderr)
            return 2
        import signal

        # ray.init set its SIGTERM handler (sys.exit(15)); uvicorn calls the handler it found once it
        # has shut down gracefully: the default's, as when Ray is connected in the app's start
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    import uvicorn

    from api.app import create_app

    try:
        app = create_app(settings)
    except Exception as e:  # the store cannot be opened or migrated: say so, no traceback
        from sqlalchemy.engine import make_url

        where = make_url(settings.db_url).render_as_string(hide_password=True)  # never print a password
        print(f"relaytrain serve: cannot open the job store at {where}: {e}", file=sys.stderr)
        return 2
    if tokens:  # jobs of tenants that have no token now (tokens turned on, a tenant removed) go on unseen
        hidden = {t: n for t, n in app.state.manager.store.active_by_tenant().items() if t not in set(tokens.values())}
        if hidden:
            print(f"relaytrain serve: warning: {sum(hidden.values())} active jobs belong to tenants with no token now "
                  f"({', '.join(f'{t}: {n}' for t, n in sorted(hidden.items()))}); they keep training and holding "
                  "their slots, but no one can see or cancel them through the API: give those tenants a token "
                  "(RELAYTRAIN_TOKENS_FILE)" + (", or run without tokens on loopback to reach tenant local's"
                                                if "local" in hidden else ""), file=sys.stderr)
    else:  # without tokens every caller is tenant local: other tenants' jobs are out of reach
        hidden = {t: n for t, n in app.state.manager.store.active_by_tenant().items() if t != "local"}
        if hidden:
            print(f"relaytrain serve: warning: {sum(hidden.values())} active jobs belong to tenants other than local "
                  f"({', '.join(f'{t}: {n}' for t, n in sorted(hidden.items()))}), which this server without tokens "
                  "cannot reach (every caller is tenant local): they keep training and holding their slots; serve "
                  "with their tokens to see or cancel them", file=sys.stderr)
    shown = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    print(f"relaytrain serve: the web page is at http://{shown}:{settings.port}/ (the API's OpenAPI page at /docs)",
          file=sys.stderr)
    import signal

    # SIGHUP ended the server without a word (a user trial): it asks for the tokens file and the
    # tenants' weights again
    signal.signal(signal.SIGHUP, lambda *_: (app.state.auth.reread(), app.state.weights.reread()))
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info")
    return 0


def _client(args):
    from service.client import Client

    return Client(args.server)


def _print_job(job: dict) -> None:
    shape = job.get("shape") or {}
    loss = f"{job['loss']:.6g}" if job.get("loss") is not None else "-"
    most = (job.get("spec") or {}).get("restarts", {}).get("max", 0)
    ckpt = job.get("checkpoint")
    queue = job.get("queue")
    allotted = job.get("allotted_workers")
    elastic = ((job.get("spec") or {}).get("elastic") or {}).get("enabled")
    queued = ""
    if job["state"] == "QUEUED":  # its place (1st, 2nd, ..., 11th, ..., 21st) and what it waits for
        n = queue["position"] if queue else 0
        nth = f"{n}{'th' if 11 <= n % 100 <= 13 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"
        queued = (f"\n  queued: {nth}, {queue['reason']}" if queue
                  else "\n  queued: waiting for the cluster scheduler to look at it")
    from service.replicas import shape_label_of

    placed = f"shape {shape_label_of(shape)}"
    if job["state"] == "QUEUED":  # holds no workers (a preempted job's row keeps what it ran as)
        ran = shape.get("ran_as")
        placed = f"no workers (ran as {shape_label_of(ran)} until preempted)" if ran else "no workers"
    print(f"{job['id']}  {job['state']:<10} step {job['step']}/{job['steps']}  loss {loss}  " + placed
          + (f"  allotted {allotted} worker{'' if allotted == 1 else 's'}" if allotted is not None and elastic else "")
          + (f"  restarts {job.get('restarts', 0)}/{most}" if most or job.get("restarts") else "")
          + queued
          + (f"\n  {job['waiting']}" if job.get("waiting") else "")
          + (f"\n  checkpoint: step {ckpt['step']} at {ckpt['path']}" if ckpt else "")
          + (f"\n  error: {job['error']}" if job.get("error") else ""))


def _submit(args) -> int:
    import json
    from pathlib import Path

    from service.client import ApiError, format_detail
    from service.packages import too_large_message, zip_folder
    from service.spec import SpecError, load_spec

    try:
        spec = load_spec(args.spec)
    except SpecError as e:
        print(f"relaytrain: {e}", file=sys.stderr)
        return 2
    client = _client(args)
    body = spec.model_dump(mode="json")
    try:
        if spec.uses_imports and "working_dir" not in spec.runtime_env:
            folder = Path(args.spec).resolve().parent
            data = zip_folder(folder)
            try:
                pkg = client.upload_package(data)
            except ApiError as e:
                if e.status != 413:
                    raise
                raise ApiError(413, too_large_message(data, folder, format_detail(e.detail))) from None
            body["runtime_env"] = {**body["runtime_env"], "working_dir": pkg["uri"]}
        job = client.submit(body, resume_from=args.resume_from)
        if not args.json:
            print(f"submitted {job['id']}", file=sys.stderr)
        if args.wait:
            job = _follow_remote(client, job, quiet=args.json)
    except ApiError as e:
        print(f"relaytrain: {e}", file=sys.stderr)
        return 1 if e.status == 0 else 2 if e.status in (400, 401, 404, 413, 422) else 1
    except KeyboardInterrupt:
        print("relaytrain: stopped following; the job goes on (relaytrain cancel JOB stops it)", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(job))
    elif not args.wait:
        _print_job(job)
    if args.wait and job["state"] != "SUCCEEDED":
        if not args.json:
            print(f"relaytrain: job {job['id']} ended {job['state']}: {job.get('error') or ''}".rstrip(": "),
                  file=sys.stderr)
        return 1
    return 0


def _follow_remote(client, job: dict, quiet: bool) -> dict:
    if quiet:
        return client.wait(job["id"])
    from tqdm import tqdm

    bar = tqdm(total=job["steps"], desc=job["id"], unit="step", file=sys.stderr, dynamic_ncols=True)

    def update(j):
        bar.update(j["step"] - bar.n)
        if j["state"] == "QUEUED" and j.get("queue"):  # what it waits for, not a bar stuck at 0%
            bar.set_postfix_str(f"QUEUED #{j['queue'].get('position')}: {j['queue'].get('reason')}")
        elif j.get("waiting"):  # admitted, short of worker slots
            bar.set_postfix_str(f"{j['state']}: {j['waiting']}")
        elif j.get("loss") is not None:
            bar.set_postfix(loss=f"{j['loss']:.4f}", samples_s=f"{j.get('samples_per_s') or 0:.0f}", state=j["state"])

    try:
        final = client.wait(job["id"], update)
    finally:
        bar.close()
    _print_job(final)
    return final


def _remote(fn):
    def run(args) -> int:
        from service.client import ApiError

        try:
            return fn(_client(args), args) or 0
        except ApiError as e:
            print(f"relaytrain: {e}", file=sys.stderr)
            return 1
    return run


def _bounded_int(low: int, high, name: str):
    """An argparse type: a whole number in [low, high] (argparse's one-line error otherwise)."""
    import argparse

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes a whole number, got {text!r}") from None
        if v < low or (high is not None and v > high):
            raise argparse.ArgumentTypeError(f"{name} must be {low}-{high}, got {v}" if high is not None else
                                             f"{name} must be {low} or more, got {v}")
        return v

    return parse


@_remote
def _list(client, args):
    page = client.jobs([x.upper() for x in args.state] if args.state else None, args.limit, args.offset)  # running is RUNNING
    for job in page["items"]:
        _print_job(job)
    queued = sum(job["state"] == "QUEUED" for job in page["items"])
    shown = f"{args.offset + 1}-{args.offset + len(page['items'])}" if args.offset and page["items"] else \
        str(len(page["items"]))
    more = args.offset + len(page["items"]) < page["total"]
    print(f"{shown} of {page['total']} jobs" + (f", {queued} of them queued (relaytrain cluster shows "
          "the queue)" if queued else "") + (f"; the next: --offset {args.offset + len(page['items'])}" if more and
                                             page["items"] else ""), file=sys.stderr)


@_remote
def _status(client, args):
    import json

    job = client.job(args.job)
    print(json.dumps(job, indent=1)) if args.json else _print_job(job)


@_remote
def _cluster(client, args):
    import json

    c = client.cluster()
    if args.json:
        print(json.dumps(c))
        return
    queue = c.get("queue") or []
    print(f"policy {c['policy']}, capacity {c['capacity']:g} CPU slots, {len(queue) or 'no'} job"
          f"{'' if len(queue) == 1 else 's'} queued")
    tenants = c.get("tenants") or []
    if tenants:
        rows = [("TENANT", "WEIGHT", "SHARE", "USING", "STARTING", "RUNNING", "QUEUED")] + [
            (t["tenant"], f"{t['weight']:g}", f"{t['share']:.3g}", f"{t['using']:g}", f"{t.get('starting', 0):g}",
             str(t["running"]), str(t["queued"])) for t in tenants]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            print("  ".join(r[0].ljust(widths[0]) if i == 0 else v.rjust(widths[i]) for i, v in enumerate(r)).rstrip())
    else:
        print("no active jobs")
    if queue:
        print("queue:")
        for q in queue:
            job = q.get("job") or "(another tenant's job)"
            print(f"  {q['position']:>3}. {q['tenant']}  {job}: {q['reason']}")


@_remote
def _events(client, args):
    from service.logtext import stamp

    for e in client.events(args.job):  # dated as `logs` dates them (UTC)
        print(f"{stamp(e['time'])} {e['type']:<10} {e['message']}")


@_remote
def _logs(client, args):
    if not args.follow:
        sys.stdout.write(client.logs(args.job, args.source, args.tail))
        return
    import time

    from service.logtext import merged
    from service.states import JobState

    ev_after = out_after = 0
    tail = args.tail  # the first round only, as `tail -f -n N`
    while True:
        # read before the lines: none is missed; a server restarting meanwhile is waited for
        ended = JobState(client.patiently(client.job, args.job)["state"]).is_terminal
        lines = []
        while True:  # everything new, a page at a time
            events = client.patiently(client.events, args.job, ev_after) if args.source in ("all", "events") else []
            output = client.patiently(client.output, args.job, out_after) if args.source in ("all", "output") else []
            if not events and not output:
                break
            ev_after = events[-1]["id"] if events else ev_after
            out_after = output[-1]["id"] if output else out_after
            lines += merged(events, output)
        for line in lines[-tail:] if tail else lines:
            print(line, flush=True)
        tail = None
        if ended:
            return
        time.sleep(1.0)


@_remote
def _timeline(client, args):
    import json

    from service import timeline

    v = client.timeline(args.job, args.step)
    if args.json:
        print(json.dumps(v))
    elif args.out:
        try:
            with open(args.out, "w") as f:
                f.write(timeline.render_svg(v))
        except OSError as e:
            print(f"relaytrain: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
            return 1
        print(f"wrote {args.out}: step {v['step']} of {args.job}, {len(v['lanes'])} lanes, measured utilization "
              f"{v['utilization']:.1%} (plan {v['utilization_plan']:.1%})" if v["utilization"] is not None
              and v["utilization_plan"] is not None else f"wrote {args.out}: step {v['step']} of {args.job}",
              file=sys.stderr)
    else:
        print(timeline.summary(v))


@_remote
def _cancel(client, args):
    _print_job(client.cancel(args.job))


@_remote
def _delete(client, args):
    done = client.delete(args.job, args.checkpoints)
    print(f"deleted {done['id']}" + (f"; its checkpoints: {done['checkpoints']}" if done.get("checkpoints") else ""))


@_remote
def _finish(client, args):
    _print_job(client.finish(args.job))


@_remote
def _download(client, args):
    """The job's final model into --out: its safetensors shards, then its index (last, so a folder
    with the index is whole); or, with --single, one model.pt."""
    from pathlib import Path

    from service.shards import INDEX

    out = Path(args.out)
    try:
        if args.single:
            out.mkdir(parents=True, exist_ok=True)
            size = client.download_model(args.job, out / "model.pt")
            print(f"model.pt: {size} bytes", file=sys.stderr)
            print(out / "model.pt")
            return 0
        listing = client.model_files(args.job)  # the job is done and its model there: only then a folder
        files = listing["files"]
        out.mkdir(parents=True, exist_ok=True)
        for i, f in enumerate(files, 1):
            name = f["name"]
            if Path(name).name != name or name.startswith("."):
                print(f"relaytrain: the server names a model file {name!r}, not a plain file name; not writing it",
                      file=sys.stderr)
                return 1
            size = client.download_model_file(args.job, name, out / name)
            if size != f["bytes"]:
                print(f"relaytrain: {name} came as {size} bytes, the server listed {f['bytes']}; download again",
                      file=sys.stderr)
                (out / name).unlink(missing_ok=True)
                return 1
            print(f"[{i}/{len(files)}] {name}: {size} bytes", file=sys.stderr)
        client.download_model_file(args.job, INDEX, out / INDEX)
        total = listing.get("metadata", {}).get("total_size")
        print(f"[index] {INDEX}" + (f": {len(files)} shards, {total} bytes of tensors" if total is not None else ""),
              file=sys.stderr)
    except OSError as e:
        print(f"relaytrain: cannot write into {out}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(out)


def _positive(kind):
    """An argparse type: a number of ``kind`` above 0 (a bad one: argparse's one-line error, exit 2)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be more than 0 (and finite), got {text}")
        return value
    return parse


def _local_commands(sub) -> None:
    """The commands that need no server: run, schedule, serve."""
    run = sub.add_parser("run", help="train one job in the foreground")
    run.add_argument("spec", help="job spec file (YAML or JSON)")
    run.add_argument("--out", required=True, help="folder for model/ (shards), model.pt, metrics.jsonl, events.jsonl")
    run.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: start a local one)")
    run.add_argument("--resume", nargs="?", const="", default=None, metavar="CKPT",
                     help="resume from a checkpoint folder, or the newest under the spec's checkpoint.path")
    run.add_argument("--timeout", type=_positive(float), default=300.0,
                     help="seconds a step may take before the job fails")
    run.add_argument("--local-cpus", type=_positive(int), default=None,
                     help="worker slots of the local Ray (default: the machine's cores; may be more)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(fn=_run)

    from service.schedules import SCHEDULES

    sch = sub.add_parser("schedule", help="print a pipeline schedule as a stage x time grid")
    sch.add_argument("--stages", type=int, required=True, help="pipeline workers (p)")
    sch.add_argument("--microbatches", type=int, required=True)
    sch.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    sch.add_argument("--stages-per-worker", type=int, default=None, metavar="V",
                     help="model chunks per worker: 1 for gpipe, 1f1b, zb_h1; any for interleaved_1f1b "
                          "(default 2); 2 for zbv (the default)")
    sch.add_argument("--backward-cost", default="2",
                     help="backward time in units of forward time (default 2); without --weight-cost the "
                          "whole backward (zb_h1, zbv: B and W half each), with it the input gradient B")
    sch.add_argument("--weight-cost", default=None,
                     help="weight-gradient time W in units of forward time (default: half of --backward-cost "
                          "for zb_h1 and zbv); 1f1b, gpipe, interleaved_1f1b run B + W as one backward")
    sch.add_argument("--weight-group", type=int, default=1, metavar="K",
                     help="zb_h1, zbv: the W's of K microbatches together, where the group's last W stood "
                          "(parallelism.weight_group; default 1)")
    sch.add_argument("--sends-early", action="store_true",
                     help="gpipe, 1f1b, interleaved_1f1b as the workers run them when the layers are plain "
                          "Linears: each B sends the input gradient, then its W computes the weight gradients")
    sch.add_argument("--last-sent-early", action="store_true",
                     help="gpipe, 1f1b, interleaved_1f1b as the workers run them when a chunk's weights are not in "
                          "plain Linears (layers that call F.linear, convolutions): only each worker's last "
                          "backward of the step sends its input gradient before its weight gradients")
    sch.add_argument("--replicas", default=None, metavar="R0,R1,...",
                     help="workers per stage (replicated stages, gpipe or 1f1b): one row per worker")
    sch.add_argument("--stage-costs", default=None, metavar="C0,C1,...",
                     help="with --replicas: each stage's forward time per microbatch (default 1 each; B = 2F)")
    sch.set_defaults(fn=_schedule)

    pl = sub.add_parser("plan", help="model the ways to use a spec's workers: stages, replicated stages, dp")
    pl.add_argument("spec", help="the job spec file (its parallelism.dp, pp or replicas give the workers)")
    pl.add_argument("--workers", type=int, default=None, help="workers in all (default: the spec's)")
    pl.set_defaults(fn=_plan)

    srv = sub.add_parser("serve", help="run the REST API server (control plane)")
    srv.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=None, help="port (default 8000)")
    srv.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: start a local one)")
    srv.add_argument("--db", default=None, help="job store URL (default: SQLite under the user's data folder)")
    srv.add_argument("--local-cpus", type=_positive(int), default=None, help="CPU slots of the local Ray (default: all cores)")
    srv.set_defaults(fn=_serve)


def _remote_commands(sub) -> None:
    """The commands that talk to a server (RELAYTRAIN_SERVER)."""
    def remote(name, fn, help_, job=True):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--server", default=os.environ.get("RELAYTRAIN_SERVER", DEFAULT_SERVER),
                       help="API server URL (env RELAYTRAIN_SERVER; token from RELAYTRAIN_TOKEN)")
        if job:
            p.add_argument("job", help="job id")
        p.set_defaults(fn=fn)
        return p

    sb = remote("submit", _submit, "submit a job spec to the server (uploads the spec's folder)", job=False)
    sb.add_argument("spec")
    sb.add_argument("--wait", action="store_true", help="follow the job until it ends; exit 0 only on SUCCEEDED")
    sb.add_argument("--resume-from", default=None, metavar="JOB",
                    help="start from the newest checkpoint of JOB, an ended job of yours (in this spec's shape)")
    sb.add_argument("--json", action="store_true", help="print the final job as one JSON line, last")
    ls = remote("list", _list, "list your jobs, newest first", job=False)
    ls.add_argument("--state", action="append", help="only jobs in this state (repeatable)")
    ls.add_argument("--limit", type=_bounded_int(1, 500, "--limit"), default=50, help="at most this many (1-500)")
    ls.add_argument("--offset", type=_bounded_int(0, None, "--offset"), default=0,
                    help="skip this many of the newest (the next page: --offset of the last + --limit)")
    st = remote("status", _status, "show one job")
    st.add_argument("--json", action="store_true")
    cl = remote("cluster", _cluster, "show the cluster scheduler's policy, capacity, tenants' shares and the queue",
                job=False)
    cl.add_argument("--json", action="store_true", help="print GET /v1/cluster's JSON")
    remote("events", _events, "show a job's events")
    lg = remote("logs", _logs, "show a job's log: its events and what its workers printed, by time")
    lg.add_argument("--source", choices=["all", "events", "output"], default="all",
                    help="events only, the actors' output only, or both (default)")
    lg.add_argument("--tail", type=int, default=None, metavar="N", help="only the last N lines")
    lg.add_argument("-f", "--follow", action="store_true", help="print new lines as they come until the job ends")
    remote("cancel", _cancel, "cancel a job")
    remote("finish", _finish, "end a training job after the step under way, keeping its model (it SUCCEEDS)")
    rm = remote("delete", _delete, "delete an ended job: its record, events, metrics, logs and model in the server")
    rm.add_argument("--checkpoints", action="store_true", help="its checkpoint folder too")
    dl = remote("download", _download, "download a SUCCEEDED job's model: its safetensors shards and index")
    dl.add_argument("--out", required=True, metavar="DIR", help="folder to write the files into (created)")
    dl.add_argument("--single", action="store_true",
                    help="write one DIR/model.pt (torch.load it) instead; for models up to the server's "
                         "RELAYTRAIN_MODEL_PT_MAX_MB")
    tl = remote("timeline", _timeline, "a recent step as measured on the workers: text, --json, or an SVG swimlane")
    tl.add_argument("--step", type=int, default=None, help="a step the server keeps (default: the newest kept)")
    tl.add_argument("--out", default=None, metavar="FILE.svg", help="write the swimlane picture as SVG")
    tl.add_argument("--json", action="store_true", help="print the timeline JSON")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="relaytrain", description="Elastic data x pipeline parallel training on Ray.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _local_commands(sub)
    _remote_commands(sub)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except BrokenPipeError:  # `relaytrain status JOB | head -1`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 1


if __name__ == "__main__":
    sys.exit(main())
