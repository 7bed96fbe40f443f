"""Install relaytrain and an extra into a venv (what `make` runs before `example` and `test`).

Run with the venv's own python: ``.venv/bin/python scripts/install_venv.py test``.

It installs with uv where uv can be had (pip installs it into the venv first): the same
packages as pip at the same versions, compiled to bytecode as pip does, in 32-70 s against pip's
62-92 s on this machine (2026-11-29, cold caches; the CI's clean clone pays this every run).
uv reads no pip configuration, so the places pip is told to look (find-links, extra indexes,
a site constraint file: on this machine the CPU build of torch lies in /opt/wheels) are read
from ``pip config list`` and passed on.  If uv cannot be installed or fails, pip does the
install as before.  Standard library only.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONSTRAINTS = os.path.join(HERE, "constraints.txt")
# pip's option -> uv's, for the settings that say where packages come from
PLACES = {"find-links": "--find-links", "extra-index-url": "--extra-index-url",
          "index-url": "--index-url", "constraint": "--constraint"}


def pip_places() -> list[str]:
    """uv options for where pip is configured to look, from `pip config list` (files and PIP_* env)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    seen: dict[str, list[str]] = {}
    for line in out.stdout.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in PLACES and value:
            for v in shlex.split(value.strip().strip("'\"")):
                if v not in seen.setdefault(name, []):
                    seen[name].append(v)
    args: list[str] = []
    for name, values in seen.items():
        if name == "index-url":  # one only: the last read wins in pip (the environment over the files)
            values = values[-1:]
        for v in values:
            args += [PLACES[name], v]
    return args


def with_uv(target: str) -> bool:
    if subprocess.run([sys.executable, "-m", "pip", "install", "-q", "uv"]).returncode != 0:
        return False
    uv = os.path.join(os.path.dirname(sys.executable), "uv")
    env = {**os.environ, "UV_LINK_MODE": "copy"}  # the cache and the venv may be on other file systems
    cmd = [uv, "pip", "install", "--python", sys.executable, "-q", "-c", CONSTRAINTS, *pip_places(),
           # as pip does: where PYTHONDONTWRITEBYTECODE is set (this machine), a venv without them
           # has every process of a job compile torch's modules again (seconds of CPU each)
           "--compile-bytecode",
           "--index-strategy", "unsafe-best-match",  # like pip: the best match over every index
           "-e", target]
    return subprocess.run(cmd, env=env, cwd=HERE).returncode == 0


def with_pip(target: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-c", CONSTRAINTS, "-e", target],
                   check=True, cwd=HERE)


def main() -> None:
    extra = sys.argv[1] if len(sys.argv) > 1 else "test"
    target = f".[{extra}]"
    if os.environ.get("RELAYTRAIN_INSTALL_WITH") != "pip":
        if with_uv(target):
            return
        print(f"install_venv: uv could not install {target}; installing with pip", file=sys.stderr)
    with_pip(target)


if __name__ == "__main__":
    main()
