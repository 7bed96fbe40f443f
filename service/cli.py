"""The ``relaytrain`` command."""
from __future__ import annotations

import argparse
import sys
from fractions import Fraction


def _schedule(args) -> int:
    from service import schedules

    try:
        plan = schedules.build(args.schedule, args.stages, args.microbatches)
        print(schedules.render_grid(plan, Fraction(args.backward_cost)))
    except ValueError as e:
        print(f"relaytrain schedule: {e}", file=sys.stderr)
        return 2
    return 0


def _run(args) -> int:
    from service.runner import JobFailed, run_job
    from service.spec import SpecError

    try:
        final = run_job(args.spec, args.out, ray_address=args.ray_address, resume=args.resume,
                        progress=not args.no_progress, timeout=args.timeout)
    except SpecError as e:
        print(f"relaytrain: {e}", file=sys.stderr)
        return 2
    except JobFailed as e:
        print(f"relaytrain: job failed: {e} (details in {args.out}/events.jsonl)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("relaytrain: interrupted; the job was stopped", file=sys.stderr)
        return 130
    last = final["metrics"][-1] if final.get("metrics") else None
    print(f"relaytrain: {final['state']}: {final['step']} steps" + (f", last loss {last['loss']:.6g}" if last else "")
          + f"; model in {args.out}/model.pt")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="relaytrain", description="Elastic data x pipeline parallel training on Ray.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="train one job in the foreground")
    run.add_argument("spec", help="job spec file (YAML or JSON)")
    run.add_argument("--out", required=True, help="folder for model.pt, metrics.jsonl, events.jsonl")
    run.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: start a local one)")
    run.add_argument("--resume", nargs="?", const="", default=None, metavar="CKPT",
                     help="resume from a checkpoint folder, or the newest under the spec's checkpoint.path")
    run.add_argument("--timeout", type=float, default=300.0, help="seconds a step may take before the job fails")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(fn=_run)

    sch = sub.add_parser("schedule", help="print a pipeline schedule as a stage x time grid")
    sch.add_argument("--stages", type=int, required=True)
    sch.add_argument("--microbatches", type=int, required=True)
    sch.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    sch.add_argument("--backward-cost", default="2", help="backward time in units of forward time (default 2)")
    sch.set_defaults(fn=_schedule)

    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
