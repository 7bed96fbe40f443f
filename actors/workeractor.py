"""The worker actor's class as a job's scheduler names it, without importing torch.

``ray.remote`` needs the class in the process that creates the actors, and importing
actors/worker.py there would import torch: about 2.4 s of CPU and 300 MB in every job's
scheduler, before its first worker could be asked for.  ``StageWorker`` here is that actor's
class for Ray (its name in the dashboard and in tracebacks, ``ray::StageWorker.run_step()``):
its ``__init__``, in the worker's own process, builds the real worker (actors/worker.py) and
each remote method calls the real one.  ``METHODS`` lists them; tests/test_step_queue.py checks
that it names every public method of the real class."""
from __future__ import annotations

from typing import Optional

from actors import codepkg

METHODS = ("commit", "export", "snapshot", "keep_copy", "export_copy", "drop_copies", "save_part", "part_written",
           "write_final", "node_id", "ping", "take_output", "configure", "rendezvous_address", "connect",
           "deliver", "abort", "run_step", "run_eval", "shutdown", "trace")


class StageWorker:
    """One (dp_rank, pp_rank) cell of a job (actors/worker.py ``StageWorker``)."""

    def __init__(self, job_id: str, spec: dict, search: list[str], timeout: float = 300.0,
                 code: Optional[tuple] = None):
        from actors.worker import StageWorker as Worker

        codepkg.worker_enter(code)  # the job's code package, when relaytrain ships it (actors/codepkg.py)
        self._worker = Worker(job_id, spec, search, timeout)

    def __getattr__(self, name: str):
        """The real worker's attributes (what ``__ray_call__`` functions read, as benches do)."""
        worker = self.__dict__.get("_worker")
        if worker is None:
            raise AttributeError(name)
        return getattr(worker, name)


def _calls(name: str):
    def method(self, *args, **kwargs):
        return getattr(self._worker, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"actors/worker.py: ``StageWorker.{name}``"
    return method


for _name in METHODS:
    setattr(StageWorker, _name, _calls(_name))
