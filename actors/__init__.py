"""Ray actors: the per-job JobScheduler and the StageWorker (plain classes; ray.remote is
applied where they are spawned)."""
