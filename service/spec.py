"""The job spec: what a user posts or writes in a YAML/JSON file.

Every field has a description (it shows in the OpenAPI docs); cross-field checks
live in validators whose messages say what to change.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional, Union

import yaml
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

IMPORT_PATH_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")
OPTIMIZERS = ("sgd", "adam", "adamw")
LOSSES = ("cross_entropy", "mse")
# The elastic range's documented defaults (worker slots a job may shrink to and grow to); the
# Kubernetes worker groups in k8s/raycluster.yaml scale between the same bounds.
ELASTIC_MIN_WORKERS = 1
ELASTIC_MAX_WORKERS = 16
MODEL_KINDS = ("mlp", "cnn", "regression_mlp", "char_transformer", "gpt")
DATA_KINDS = ("digits", "digits_images", "regression", "chars", "tokens")


INT64_MAX = 2**63 - 1  # the job store keeps steps and seeds as 64-bit integers, as torch's seeds are


class _Strict(BaseModel):
    """Unknown fields are refused (a typo is not ignored); whole numbers and switches must be
    given as such (``steps: true`` or ``dp: "2"`` is refused, not read as 1 and 2); a number
    must be finite (NaN and infinities are refused)."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _check_numbers(value: Any, where: str = "") -> None:
    """Every number anywhere in a raw spec (builder args and runtime_env too) is finite and a
    whole number fits in 64 bits: the store, JSON and torch's seeds take nothing else."""
    if isinstance(value, bool):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise PydanticCustomError("spec_number", "{where}: {value} is not a finite number; give a finite one",
                                  {"where": where or "spec", "value": str(value)})
    if isinstance(value, int) and not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise PydanticCustomError("spec_number", "{where}: {value} is too large: whole numbers in a spec must lie "
                                  "within +-{limit} (64 bits)", {"where": where or "spec", "value": str(value),
                                                                 "limit": str(INT64_MAX)})
    if isinstance(value, dict):
        for k, v in value.items():
            _check_numbers(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_numbers(v, f"{where}[{i}]")


def _check_import_path(v: Optional[str]) -> Optional[str]:
    if v is not None and not IMPORT_PATH_RE.match(v):
        raise ValueError(f"{v!r} is not an import path: write it as 'package.module:function'")
    return v


class _Source(_Strict):
    """A builder import path or a built-in kind (exactly one), with its arguments."""

    _what: ClassVar[str]
    _kinds: ClassVar[tuple[str, ...]]

    builder: Optional[str] = None
    kind: Optional[str] = None
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the builder or built-in")

    _ok_path = field_validator("builder")(classmethod(lambda cls, v: _check_import_path(v)))

    @model_validator(mode="after")
    def _one_source(self):
        if (self.builder is None) == (self.kind is None):
            raise ValueError(f"give exactly one of {self._what}.builder ('module:function') or {self._what}.kind "
                             f"(one of {', '.join(self._kinds)})")
        return self


class ModelSpec(_Source):
    _what, _kinds = "model", MODEL_KINDS
    builder: Optional[str] = Field(
        None, description="'module:function' returning a torch.nn.Sequential or a layer list (zero-argument "
                          "callables, each building one layer); imported from the spec's folder")
    kind: Optional[Literal["mlp", "cnn", "regression_mlp", "char_transformer", "gpt"]] = Field(
        None, description="a built-in model instead of a builder ('gpt': a layer list; see the README)")


class DataSpec(_Source):
    _what, _kinds = "data", DATA_KINDS
    builder: Optional[str] = Field(
        None, description="'module:function' returning (X, Y) tensors or a map-style Dataset of (x, y)")
    kind: Optional[Literal["digits", "digits_images", "regression", "chars", "tokens"]] = Field(
        None, description="a built-in data set instead of a builder ('tokens': args path, seq_len, dtype)")


class LossSpec(_Strict):
    builder: str = Field(..., description="'module:function' returning loss(pred, target) -> mean over the microbatch")

    _ok_path = field_validator("builder")(classmethod(lambda cls, v: _check_import_path(v)))


class ScheduleSpec(_Strict):
    name: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="after the warm-up: 'constant' keeps lr, 'linear' and 'cosine' decay it to min_lr at "
                                "the last step")
    warmup_steps: StrictInt = Field(0, ge=0, description="steps over which the rate rises linearly to lr (lr x s / W)")
    min_lr: float = Field(0.0, ge=0, description="the rate at the last step for 'linear' and 'cosine'")


class OptimizerSpec(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    name: str = Field(..., description="sgd, adam or adamw; other fields are torch.optim arguments (lr, momentum, ...)")
    lr: float = Field(0.001, gt=0, description="learning rate (the peak, with a schedule)")
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec, description="the learning rate per step")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v.lower() not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {v!r}: use one of {', '.join(OPTIMIZERS)}")
        return v.lower()

    def kwargs(self) -> dict[str, Any]:
        extra = dict(self.model_extra or {})
        return {"lr": self.lr, **extra}


class TrainingSpec(_Strict):
    global_batch_size: StrictInt = Field(..., ge=1, description="samples per optimizer step (B); never changed by a reshape")
    microbatch_size: StrictInt = Field(..., ge=1, description="samples per microbatch; B must be a multiple of dp x this")
    steps: StrictInt = Field(..., ge=1, description="optimizer steps to train")
    seed: StrictInt = Field(0, ge=0, description="seeds the initial parameters and the sample order")
    shuffle: StrictBool = Field(True, description="a new permutation of the data each epoch")
    grad_clip_norm: Optional[float] = Field(
        None, gt=0, description="scale the gradients so that their total L2 norm over the whole model (every stage "
                                "and replica; a tied parameter counted once) is at most this")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="'bf16': forward and backward under bf16 autocast; weights, gradients, their sum and the "
                            "optimizer state stay fp32")
    activation_checkpointing: StrictBool = Field(
        False, description="recompute each layer's forward in its backward instead of keeping its inner activations")
    skip_nonfinite: StrictBool = Field(
        False, description="skip (on every worker) a step whose gradient norm is inf or NaN, and go on; without it "
                           "such a step fails the job")
    batch_norm: Literal["microbatch", "deferred", "global"] = Field(
        "deferred", description="BatchNorm layers normalise each microbatch with its own statistics; their running "
                                "statistics move once per step with the whole global batch's ('deferred'), or once "
                                "per microbatch in the step's global microbatch order ('microbatch'); 'global': "
                                "every sample is normalised with the whole global batch's statistics, forward and "
                                "backward, as one process on the whole batch (needs schedule gpipe, its default "
                                "then: a stage holding a BatchNorm waits for all its microbatches there); the "
                                "buffers are identical on every replica in every mode")

    @model_validator(mode="after")
    def _divides(self):
        if self.global_batch_size % self.microbatch_size:
            raise ValueError(
                f"training.global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"training.microbatch_size ({self.microbatch_size})")
        return self


class ParallelismSpec(_Strict):
    dp: StrictInt = Field(1, ge=1, description="data-parallel replicas")
    pp: StrictInt = Field(1, ge=1, description="pipeline stages")
    schedule: Literal["1f1b", "gpipe", "interleaved_1f1b", "zb_h1", "zbv"] = Field(
        "1f1b", description="micro-batch schedule: 1f1b, gpipe, interleaved_1f1b (several model chunks per worker), "
                            "zb_h1 (zero bubble: each backward split into input and weight gradients, the weight "
                            "gradients fill the bubble) or zbv (zero bubble on 2 chunks per worker in a V)")
    stages_per_worker: Optional[StrictInt] = Field(
        None, ge=1, description="model chunks (virtual stages) on each worker: interleaved_1f1b and zbv place several "
                                "(default 2; zbv needs exactly 2), the other schedules one")
    weight_group: StrictInt = Field(
        1, ge=1, description="zb_h1 and zbv: the weight gradients (W) of this many microbatches computed together, "
                             "one matrix product per Linear layer over all their rows: fewer, larger products that "
                             "read and write each gradient once per group, faster where memory bandwidth is the "
                             "limit; the plan then runs each group's W's where its last one stood (a larger plan "
                             "bubble) and holds the group's Linear inputs and output gradients until then; more "
                             "than a step's microbatches: all of them")
    transport: Literal["object_store", "collective"] = Field(
        "collective", description="how activations move between stages: 'collective' (send/recv over gloo, NCCL on "
                                  "GPUs; the faster; every microbatch's activation must keep the shape of the first) "
                                  "or 'object_store' (Ray actor calls; no process group, any activation shape)")
    partition: Union[Literal["balanced", "uniform"], list[StrictInt]] = Field(
        "balanced", description="'balanced' by measured layer cost, 'uniform' layer counts, or explicit layer counts")
    layer_costs_ms: Optional[list[float]] = Field(
        None, description="forward+backward milliseconds of one microbatch per layer on a worker; given, they replace "
                          "the scheduler's profile (which runs on its CPU) for partitions and the elastic planner")
    replicas: Union[Literal["auto"], list[StrictInt], None] = Field(
        None, description="workers per pipeline stage (replicated stages, PipeDream's 1F1B-RR): [r_0, ..., r_{pp-1}], "
                          "microbatch k of a stage with r workers runs on its replica k mod r, and the replicas' "
                          "gradients are summed as data parallelism's; 'auto': the planner uses each pipeline's pp "
                          "workers as it models fastest (fewer stages, some replicated) from measured layer costs")
    tp: StrictInt = Field(
        1, ge=1, description="tensor parallelism inside each stage: its layers split over tp workers on one node "
                             "(each layer's tp_plan: 'colwise' / 'rowwise' / 'packed_colwise' Linear submodules; "
                             "layers without a plan are replicated); a job has dp x pp x tp workers")

    @property
    def replica_counts(self) -> tuple[int, ...]:
        """Workers per stage of a given ``replicas`` list (empty: one each, or 'auto')."""
        return tuple(self.replicas) if isinstance(self.replicas, list) and any(r > 1 for r in self.replicas) else ()

    @property
    def pipeline_workers(self) -> int:
        """Workers of one pipeline: sum(replicas), or pp x tp."""
        return sum(self.replica_counts) or self.pp * self.tp

    @property
    def chunks(self) -> int:
        """Model chunks per worker (``stages_per_worker``, or the schedule's default)."""
        if self.stages_per_worker is not None:
            return self.stages_per_worker
        return 2 if self.schedule in ("interleaved_1f1b", "zbv") else 1

    @property
    def virtual_stages(self) -> int:
        return self.pp * self.chunks

    @model_validator(mode="after")
    def _partition(self):
        v = self.stages_per_worker
        if v is not None and v > 1 and self.schedule not in ("interleaved_1f1b", "zbv"):
            raise ValueError(f"parallelism.stages_per_worker {v} needs a schedule that places several model chunks on "
                             f"each worker: interleaved_1f1b or zbv, not {self.schedule}; or set stages_per_worker 1")
        if self.weight_group > 1 and self.schedule not in ("zb_h1", "zbv"):
            raise ValueError(f"parallelism.weight_group {self.weight_group} groups the W actions (weight gradients) of "
                             f"a split schedule, but {self.schedule} has none (its backward computes the weight "
                             f"gradients itself): set schedule zb_h1 or zbv, or weight_group 1")
        if self.schedule == "zbv" and self.chunks != 2:
            raise ValueError(f"parallelism.schedule zbv places exactly 2 model chunks on each worker (a V), but "
                             f"stages_per_worker is {v}: set it to 2 or leave it out")
        if isinstance(self.partition, list):
            n = self.virtual_stages
            if len(self.partition) != n:
                per = "stage" if self.chunks == 1 else f"model chunk (pp x stages_per_worker = {n})"
                raise ValueError(f"parallelism.partition lists {len(self.partition)} stage sizes but there are {n}: "
                                 f"give one layer count per {per}")
            if any(n < 1 for n in self.partition):
                raise ValueError("parallelism.partition: every stage needs at least 1 layer")
        if isinstance(self.replicas, list):
            if len(self.replicas) != self.pp:
                raise ValueError(f"parallelism.replicas lists {len(self.replicas)} replica counts but pp is {self.pp}: "
                                 f"give one count per stage, e.g. {[1] * self.pp} (1 = not replicated)")
            if any(r < 1 for r in self.replicas):
                i = next(i for i, r in enumerate(self.replicas) if r < 1)
                raise ValueError(f"parallelism.replicas[{i}] is {self.replicas[i]}: every stage needs at least 1 worker "
                                 "(1 = not replicated)")
        if self.replicas is not None and self.schedule not in ("gpipe", "1f1b") and (
                self.replicas == "auto" or any(r > 1 for r in self.replicas)):
            raise ValueError(f"parallelism.replicas runs with schedule 1f1b or gpipe (each replica takes every r-th "
                             f"microbatch through one model chunk), not {self.schedule}: set parallelism.schedule "
                             "to 1f1b or gpipe, or leave replicas out")
        if self.tp > 1:
            if self.replicas is not None and (self.replicas == "auto" or any(r > 1 for r in self.replicas)):
                raise ValueError(f"parallelism.tp {self.tp} and parallelism.replicas cannot be combined in one job yet "
                                 "(a replicated stage's workers split its microbatches, a TP group's split its "
                                 "layers): use one of them")
            if self.schedule not in ("gpipe", "1f1b", "interleaved_1f1b"):
                raise ValueError(f"parallelism.tp {self.tp} runs with schedule 1f1b, gpipe or interleaved_1f1b, not "
                                 f"{self.schedule} (the split backward of the zero-bubble schedules is not built for "
                                 "tensor-parallel layers yet): set parallelism.schedule to one of those")
        if self.layer_costs_ms is not None and (not self.layer_costs_ms or min(self.layer_costs_ms) < 0):
            raise ValueError("parallelism.layer_costs_ms: give one non-negative cost per layer")
        return self


class ResourcesSpec(_Strict):
    cpus_per_worker: float = Field(1, gt=0, description="CPU slots per worker actor")
    gpus_per_worker: Optional[float] = Field(
        None, ge=0, description="GPUs per worker; unset = 1 when the cluster has a GPU per worker, else 0")
    memory_per_worker_mb: Optional[float] = Field(
        None, gt=0, description="memory a worker may use for its stage (parameters, gradients, optimizer state and "
                                "activations in flight); the elastic planner only picks shapes that fit")
    nice: StrictInt = Field(
        0, ge=0, le=19, description="the Unix niceness of the job's scheduler and workers: 0 runs them at the node's "
                                    "normal priority (Ray's default for its workers, 15, lets any other process on "
                                    "the node take their CPU); raise it to let other work on the node go first")


class ElasticSpec(_Strict):
    enabled: StrictBool = Field(False, description="keep training while nodes join, leave or drain, reshaping dp x pp")
    min_workers: StrictInt = Field(ELASTIC_MIN_WORKERS, ge=1, description="fewest workers the job trains on; below it the job waits")
    max_workers: StrictInt = Field(ELASTIC_MAX_WORKERS, ge=1, description="most workers the job grows to when nodes join")
    wait_timeout_s: float = Field(300.0, gt=0, description="how long a job below min_workers waits for slots, then fails")
    snapshot_every_steps: StrictInt = Field(
        1, ge=0, description="copy the committed state of every stage to the scheduler's node every N steps, so losing "
                             "every replica of a stage loses no step (0 = rely on checkpoints)")
    min_gain: float = Field(0.10, ge=0, description="a voluntary reshape (scale-up) needs this modelled speed-up")
    grow_payback_s: float = Field(5.0, ge=0, description="a scale-up must also save this many modelled seconds over "
                                                         "the steps left (its reshape pauses every worker)")

    @model_validator(mode="after")
    def _range(self):
        if self.min_workers > self.max_workers:
            raise ValueError(f"elastic.min_workers ({self.min_workers}) is above elastic.max_workers "
                             f"({self.max_workers})")
        return self


class CheckpointSpec(_Strict):
    every_steps: StrictInt = Field(0, ge=0, description="write a checkpoint every N committed steps and after the last "
                                                  "(0 = no checkpoints)")
    path: str = Field("./checkpoints", min_length=1,
                      description="where checkpoints go: a local folder, file:///abs/path or s3://bucket/prefix "
                                  "(a submitted job writes under <path>/<tenant>/<job id>; with a relative local "
                                  "path, under the server's data folder, <home>/checkpoints/<tenant>/<job id>, "
                                  "whatever the relative path says; `relaytrain run` takes a relative path from its "
                                  "working directory); credentials and the endpoint come from the environment "
                                  "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL)")
    keep: StrictInt = Field(3, ge=1, description="how many recent checkpoints to keep (older ones are deleted, on the "
                                           "storage too)")
    max_failures: StrictInt = Field(3, ge=1, description="fail the job when this many checkpoints in a row could not be "
                                                   "written (each failure is a checkpoint_failed event) and they "
                                                   "have been failing for fail_after_s")
    fail_after_s: float = Field(300.0, ge=0, allow_inf_nan=False,
                                description="how long checkpoints must have been failing, from the first failure in a "
                                            "row, before max_failures fails the job: a storage outage of a minute "
                                            "does not end a job that writes a checkpoint every few seconds (0: "
                                            "max_failures alone)")
    slow_after_s: float = Field(120.0, gt=0, allow_inf_nan=False,
                                description="a checkpoint still being written after this long says so (a "
                                            "checkpoint_slow event, once): storage that hangs rather than refuses")

    @field_validator("path")
    @classmethod
    def _file_urls_are_absolute(cls, v: str) -> str:
        # file://ckpt would be a folder relative to whichever process writes (the server's,
        # a scheduler's working directory), not the one the user meant: say which form to use
        if v.lower().startswith("file://") and not v[len("file://"):].startswith("/"):
            rest = v[len("file://"):]
            raise ValueError(f"{v!r}: a file:// URL takes an absolute path (file:///abs/path, three slashes); "
                             f"for a folder relative to the working directory write {rest!r} without file://")
        return v


class RestartSpec(_Strict):
    max: StrictInt = Field(0, ge=0, description="how many times the job is restarted from its newest complete checkpoint "
                                          "when its scheduler is lost (0 = never)")


class SchedulingSpec(_Strict):
    priority: StrictInt = Field(0, ge=-1000, le=1000, description="orders this tenant's own queued jobs: higher first "
                                                          "(between tenants, the weighted fair share decides)")
    preemptible: StrictBool = Field(False, description="the cluster scheduler may stop this job at a step boundary, after "
                                                 "a checkpoint, to give its slots to a job the fair share says "
                                                 "should run; it is queued again and resumes from that checkpoint. "
                                                 "Needs checkpoint.every_steps")


class EvalSpec(_Strict):
    every_steps: StrictInt = Field(..., ge=1, description="evaluate after every N committed steps (and after the last)")
    data: DataSpec = Field(..., description="the evaluation data, given like the job's data")
    batches: StrictInt = Field(1, ge=1, description="batches of training.global_batch_size samples: the first "
                                              "batches x B samples of the eval data, in order")


class JobSpec(_Strict):
    name: str = Field(..., min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                      description="job name: letters, digits, '-', '_', '.'")
    model: ModelSpec
    data: DataSpec
    loss: Union[Literal["cross_entropy", "mse"], LossSpec] = Field("cross_entropy", description="loss function")
    optimizer: OptimizerSpec = Field(default_factory=lambda: OptimizerSpec(name="adam"))
    training: TrainingSpec
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    restarts: RestartSpec = Field(default_factory=RestartSpec)
    elastic: ElasticSpec = Field(default_factory=ElasticSpec)
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    eval: Optional[EvalSpec] = Field(None, description="a validation loss every N steps, with the committed parameters")
    runtime_env: dict[str, Any] = Field(default_factory=dict, description="passed to Ray: working_dir, py_modules, pip, env_vars")

    @model_validator(mode="before")
    @classmethod
    def _finite_numbers(cls, data: Any) -> Any:
        _check_numbers(data)
        return data

    @field_validator("runtime_env")
    @classmethod
    def _env_vars_are_strings(cls, env: dict[str, Any]) -> dict[str, Any]:
        env_vars = env.get("env_vars")
        if env_vars is None:
            return env
        if not isinstance(env_vars, dict):
            raise ValueError(f"env_vars must map names to values, not a {type(env_vars).__name__}")
        bad = [k for k, v in env_vars.items() if not isinstance(v, str)]
        if bad:
            raise ValueError(f"env_vars.{bad[0]} is {env_vars[bad[0]]!r}: Ray takes environment values "
                             f"as strings only; quote it (\"{env_vars[bad[0]]}\")")
        return env

    @model_validator(mode="after")
    def _shape_fits_batch(self):
        t, p = self.training, self.parallelism
        if t.global_batch_size % (p.dp * t.microbatch_size):
            raise ValueError(
                f"training.global_batch_size ({t.global_batch_size}) must be a multiple of "
                f"parallelism.dp x training.microbatch_size ({p.dp} x {t.microbatch_size} = "
                f"{p.dp * t.microbatch_size}): change the batch size, the microbatch size or dp")
        if t.batch_norm == "global":
            if "schedule" not in p.model_fields_set:
                p.schedule = "gpipe"
            elif p.schedule != "gpipe":
                raise ValueError(
                    f"training.batch_norm: global normalises every sample with the whole batch's statistics, so a "
                    f"stage holding a BatchNorm must see all its microbatches there before any goes on, which "
                    f"parallelism.schedule {p.schedule} does not allow: set schedule: gpipe (or leave it out), or "
                    f"use batch_norm: deferred")
        w = self.optimizer.schedule.warmup_steps
        if w > t.steps:
            raise ValueError(f"optimizer.schedule.warmup_steps ({w}) is above training.steps ({t.steps}): the rate "
                             "would never reach lr; use fewer warm-up steps")
        if self.scheduling.preemptible and not self.checkpoint.every_steps:
            raise ValueError("scheduling.preemptible needs checkpoints: a preempted job resumes from its newest "
                             "checkpoint, so set checkpoint.every_steps (and checkpoint.path), or drop preemptible")
        if self.restarts.max and not self.checkpoint.every_steps:
            raise ValueError(f"restarts.max ({self.restarts.max}) restarts a job from its newest checkpoint, and this "
                             "one writes none: set checkpoint.every_steps (and checkpoint.path), or restarts.max: 0")
        env_vars = self.runtime_env.get("env_vars")
        if isinstance(env_vars, dict) and "RAY_worker_niceness" in env_vars:
            raise ValueError("runtime_env.env_vars.RAY_worker_niceness: the job's processes take their niceness from "
                             "resources.nice (0-19, default 0); set that instead")
        e = self.elastic
        if e.enabled and not e.min_workers <= p.dp * p.pipeline_workers <= e.max_workers:
            raise ValueError(
                f"the preferred shape parallelism.dp x parallelism.pp ({p.dp} x {p.pipeline_workers} = "
                f"{p.dp * p.pipeline_workers} workers) must lie within elastic.min_workers..max_workers "
                f"({e.min_workers}..{e.max_workers})")
        if p.tp > 1 and t.batch_norm == "global":
            raise ValueError("training.batch_norm: global is not built for tensor-parallel stages (parallelism.tp "
                             f"{p.tp}): use batch_norm: deferred")
        reps = p.replica_counts
        if reps and self.microbatches // p.dp < max(reps):
            raise ValueError(
                f"parallelism.replicas {list(reps)} gives a stage {max(reps)} workers but each pipeline has only "
                f"{self.microbatches // p.dp} microbatches a step (global_batch_size / microbatch_size / dp): a replica "
                "would have nothing to do; use fewer replicas or more microbatches")
        if p.replicas is not None and t.batch_norm == "global":
            raise ValueError("training.batch_norm: global waits for every microbatch at each BatchNorm, which a "
                             "replicated stage splits between its workers: use batch_norm: deferred, or leave "
                             "parallelism.replicas out")
        return self

    @property
    def microbatches(self) -> int:
        return self.training.global_batch_size // self.training.microbatch_size

    @property
    def uses_imports(self) -> bool:
        return bool(self.model.builder or self.data.builder or isinstance(self.loss, LossSpec))


class SpecError(ValueError):
    """A spec that cannot work; the message says what to change."""


def error_message(e: dict) -> str:
    """One of pydantic's errors in words a person acts on (the CLI's sentence and the REST 422)."""
    if e.get("type") == "extra_forbidden":
        return "unknown field (check its spelling)"
    if e.get("type") == "missing":
        return "required field is missing"
    if e.get("type") == "model_type":  # "Input should be a valid dictionary or instance of ScheduleSpec"
        got = e.get("input")
        shown = json.dumps(got, default=str) if got is None or isinstance(got, (str, int, float, bool, list)) \
            else type(got).__name__
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        hint = f": write {{name: {got}}}" if tuple(e.get("loc") or ())[-1:] == ("schedule",) and isinstance(got, str) \
            else ""
        return f"must be a mapping of its fields (field: value), not {shown}{hint}"
    return str(e.get("msg", "")).removeprefix("Value error, ")


def format_validation_error(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "spec"
        msg = error_message(e)
        if e["type"] in ("int_type", "bool_type", "float_type", "string_type") and isinstance(
                e.get("input"), (str, int, float, bool)):
            msg += f", not {json.dumps(e['input'])}"
        if e["type"] == "spec_number" or not e["loc"]:  # the message names the field itself (a check of the whole spec)
            parts.append(msg)
            continue
        parts.append(f"{loc}: {msg}")
    return "invalid job spec: " + "; ".join(parts)


def parse_spec(data: Any) -> JobSpec:
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(format_validation_error(e)) from None


# A job spec holds tens of values, a few hundred with a long layer list; YAML's anchors and
# aliases can make a few hundred bytes stand for billions ("billion laughs"), which anything that
# walks the data (JSON, validation) would then expand.
SPEC_MAX_VALUES = 100_000
SPEC_MAX_DEPTH = 64


class _SpecLoader(yaml.SafeLoader):
    """YAML's safe loader without its dates: ``name: 2024-01-01`` is the string a spec means;
    a key written twice in one mapping is an error (YAML's loader kept the last without a word:
    a spec with ``name:`` twice ran under the second; a user trial). Keys a merge (``<<: *base``)
    brings in may be overridden, as YAML means."""

    def flatten_mapping(self, node):
        # the check sees a mapping's own keys, before a merge brings others into its node (PyYAML
        # flattens a merge source's node in place, so a nested anchor is seen merged when built)
        checked = self.__dict__.setdefault("_checked", set())
        if id(node) not in checked:
            checked.add(id(node))
            self._no_key_twice(node)
        super().flatten_mapping(node)

    def _no_key_twice(self, node):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: SafeLoader says so itself
                    continue
                if first is not key_node:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping", node.start_mark, f"found the key {key!r} twice (first {first.start_mark.line + 1}:"
                        f"{first.start_mark.column + 1}); write each field once", key_node.start_mark)


_SpecLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def read_yaml(text: str) -> Any:
    """A YAML spec's data, refused (``ValueError``, saying why) when it nests deeper than
    ``SPEC_MAX_DEPTH`` or stands for more than ``SPEC_MAX_VALUES`` values once its aliases are
    expanded.  Raises ``yaml.YAMLError`` for text that is not YAML."""
    depth = deepest = 0
    opening = text.count("[") + text.count("{")
    for ch in text if opening > SPEC_MAX_DEPTH else "":  # flow brackets first: PyYAML takes seconds over thousands
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    if deepest > SPEC_MAX_DEPTH:
        raise ValueError(f"it nests deeper than {SPEC_MAX_DEPTH} levels; a job spec needs a few")
    try:
        data = yaml.load(text, Loader=_SpecLoader)
    except RecursionError:
        raise ValueError(f"it nests deeper than {SPEC_MAX_DEPTH} levels; a job spec needs a few") from None
    seen, todo = 0, [(data, 1)]
    while todo:
        value, depth = todo.pop()
        seen += 1
        if seen > SPEC_MAX_VALUES:
            raise ValueError(f"it stands for more than {SPEC_MAX_VALUES:,} values once its aliases (*name) are "
                             "expanded; a job spec holds a few hundred: write the values out, or use fewer aliases")
        if depth > SPEC_MAX_DEPTH:
            raise ValueError(f"it nests deeper than {SPEC_MAX_DEPTH} levels; a job spec needs a few")
        if isinstance(value, dict):
            todo.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            todo.extend((v, depth + 1) for v in value)
        elif not isinstance(value, (str, int, float, bool, type(None))):  # !!binary, !!set, an explicit !!timestamp
            raise ValueError(f"it holds a {type(value).__name__} ({str(value)[:60]!r}), which a job spec has no use "
                             "for: write strings, numbers, true/false, lists and mappings")
    return data


def load_spec(path: str | Path) -> JobSpec:
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"spec file {str(p)!r} does not exist")
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix == ".json" else read_yaml(text)
    except (yaml.YAMLError, json.JSONDecodeError, ValueError, RecursionError) as e:
        raise SpecError(f"{p} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {e}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{p} must hold a mapping of spec fields (name, model, data, ...), not {type(data).__name__}")
    return parse_spec(data)
