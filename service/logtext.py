"""Text of a job's log and of errors: a job's events (failures with their tracebacks) and what its actors
printed, merged by time.  Used by ``GET /v1/jobs/{id}/logs`` and ``relaytrain logs --follow``."""
from __future__ import annotations

import datetime


def stamp(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def merged(events: list[dict], output: list[dict]) -> list[str]:
    """Events ({id, time, type, message, detail?}) and output lines ({id, time, source, stream,
    line}) in time order (an event first at equal times), as text lines."""
    entries = []  # (time, 0 for an event | 1 for output, id, its lines)
    for e in events:
        lines = [f"{stamp(e['time'])} {e['type']:<10} {e['message']}"]
        lines += ["    " + ln for ln in str(e.get("detail") or "").splitlines()]
        entries.append((e["time"], 0, e["id"], lines))
    for o in output:
        entries.append((o["time"], 1, o["id"], [f"{stamp(o['time'])} [{o['source']} {o['stream']}] {o['line']}"]))
    return [ln for *_, group in sorted(entries, key=lambda e: e[:3]) for ln in group]


def first_line(e: BaseException, default: str = "") -> str:
    """The first line of an error's text that says something (Ray's and psycopg's run on for
    lines: a sentence for the user takes the first)."""
    return next((ln.strip() for ln in str(e).splitlines() if ln.strip()), default)
