"""Bad specs fail before any actor starts, with a message that says what to change."""
import copy
import re
import os

import pytest
import torch

from service.loading import load_job, preflight
from service.spec import SpecError, load_spec, parse_spec
from tests.conftest import FIXTURES

BASE = {
    "name": "t", "model": {"kind": "mlp", "args": {"in_features": 64, "hidden": 16, "layers": 2}},
    "data": {"kind": "digits"}, "optimizer": {"name": "adam", "lr": 0.01},
    "training": {"global_batch_size": 32, "microbatch_size": 8, "steps": 2},
}


def spec_with(_base=None, **changes):
    """``_base`` (BASE by default) with ``changes``: ``training__steps=3`` sets training.steps."""
    d = copy.deepcopy(BASE if _base is None else _base)
    for path, value in changes.items():
        node = d
        keys = path.split("__")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return d


def test_valid_spec_defaults():
    s = parse_spec(BASE)
    assert s.parallelism.dp == 1 and s.parallelism.schedule == "1f1b" and s.microbatches == 4


def test_niceness_is_resources_nice_from_0_to_19():
    assert parse_spec(BASE).resources.nice == 0
    assert parse_spec(spec_with(resources__nice=19)).resources.nice == 19
    with pytest.raises(SpecError, match="resources.nice: Input should be less than or equal to 19"):
        parse_spec(spec_with(resources__nice=20))
    with pytest.raises(SpecError, match="resources.nice: Input should be greater than or equal to 0"):
        parse_spec(spec_with(resources__nice=-5))
    with pytest.raises(SpecError, match=r"runtime_env.env_vars.RAY_worker_niceness: the job's processes take their "
                                        r"niceness from resources.nice \(0-19, default 0\); set that instead"):
        parse_spec(spec_with(runtime_env={"env_vars": {"RAY_worker_niceness": "10", "A": "1"}}))
    assert parse_spec(spec_with(runtime_env={"env_vars": {"A": "1"}})).runtime_env == {"env_vars": {"A": "1"}}


def test_batch_not_multiple_of_dp_times_microbatch():
    with pytest.raises(SpecError, match=r"global_batch_size \(32\) must be a multiple of parallelism.dp x "
                                        r"training.microbatch_size \(3 x 8 = 24\)"):
        parse_spec(spec_with(parallelism__dp=3))


def test_batch_not_multiple_of_microbatch():
    with pytest.raises(SpecError, match=r"training.global_batch_size \(30\) must be a multiple of "
                                        r"training.microbatch_size \(8\)"):
        parse_spec(spec_with(training__global_batch_size=30))


def test_unknown_optimizer():
    with pytest.raises(SpecError, match="optimizer.name: unknown optimizer 'lamb': use one of sgd, adam, adamw"):
        parse_spec(spec_with(optimizer__name="lamb"))


def test_bad_optimizer_argument():
    s = parse_spec(spec_with(optimizer={"name": "adam", "lr": 0.01, "momentum": 0.9}))
    with pytest.raises(SpecError, match="optimizer: adam rejects its arguments.*momentum"):
        preflight(s)


@pytest.mark.parametrize("name,args", [("sgd", {"lr": 0.5, "momentum": 0.9}), ("sgd", {"lr": 0.1}),
                                       ("adam", {"lr": 0.01}), ("adamw", {"lr": 0.01, "weight_decay": 0.1})])
def test_optimizers_are_built_fused_and_step_like_torchs_default(name, args):
    """SGD, Adam and AdamW on CPU tensors are built with ``fused=True`` (one pass per tensor),
    unless the spec chooses ``fused`` or ``foreach`` itself; 20 steps end within rounding of
    torch's default implementation, in float64."""
    from service.loading import build_optimizer

    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(64, 33, dtype=torch.float64)) for _ in range(3)]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = build_optimizer(parse_spec(spec_with(optimizer={"name": name, **args})), ours)
    assert opt.defaults["fused"] is True
    ref = type(opt)(plain, **args)
    assert not ref.defaults.get("fused")
    for _ in range(20):
        grads = [torch.randn_like(p) for p in ours]
        for a, b, g in zip(ours, plain, grads):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, plain):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    chosen = build_optimizer(parse_spec(spec_with(optimizer={"name": name, **args, "foreach": True})), ours)
    assert not chosen.defaults.get("fused") and chosen.defaults["foreach"] is True


@pytest.mark.parametrize("changes, message", [
    ({"optimizer__lr": float("nan")}, "invalid job spec: optimizer.lr: nan is not a finite number; give a finite one"),
    ({"optimizer__lr": float("inf")}, "invalid job spec: optimizer.lr: inf is not a finite number; give a finite one"),
    ({"optimizer__momentum": float("-inf")}, "optimizer.momentum: -inf is not a finite number"),
    ({"model__args__scale": [1.0, float("nan")]}, "model.args.scale[1]: nan is not a finite number"),
    ({"training__steps": 10**30}, "invalid job spec: training.steps: 1000000000000000000000000000000 is too large: "
                                  "whole numbers in a spec must lie within +-9223372036854775807 (64 bits)"),
    ({"training__seed": 2**64}, "training.seed: 18446744073709551616 is too large"),
    ({"training__steps": True}, "invalid job spec: training.steps: Input should be a valid integer, not true"),
    ({"parallelism__dp": "2"}, 'invalid job spec: parallelism.dp: Input should be a valid integer, not "2"'),
    ({"training__shuffle": "yes"}, 'invalid job spec: training.shuffle: Input should be a valid boolean, not "yes"'),
    ({"runtime_env__env_vars": {"OMP_NUM_THREADS": 4}},
     'invalid job spec: runtime_env: env_vars.OMP_NUM_THREADS is 4: Ray takes environment values as strings only; '
     'quote it ("4")'),
    ({"runtime_env__env_vars": ["A=1"]}, "runtime_env: env_vars must map names to values, not a list"),
])
def test_numbers_and_types_a_spec_cannot_mean(changes, message):
    """A NaN or an infinity, a number past 64 bits, ``true`` or ``"2"`` for a whole number: refused
    before anything starts, naming the field (the store, JSON and torch's seeds take none of them)."""
    with pytest.raises(SpecError) as e:
        parse_spec(spec_with(**changes))
    assert message in str(e.value)


def test_numbers_as_yaml_writes_them_still_load(tmp_path):
    """PyYAML reads ``1e-3`` as text: a float field still takes it; whole numbers and switches
    come as YAML's own."""
    p = tmp_path / "s.yaml"
    p.write_text("name: t\nmodel: {kind: mlp, args: {in_features: 64, hidden: 16, layers: 2}}\ndata: {kind: digits}\n"
                 "optimizer: {name: adam, lr: 1e-3}\ntraining: {global_batch_size: 32, microbatch_size: 8, steps: 2, "
                 "shuffle: no}\n")
    s = load_spec(p)
    assert s.optimizer.lr == 0.001 and s.training.steps == 2 and s.training.shuffle is False


def test_misspelled_field():
    with pytest.raises(SpecError, match="parallelism.stages: unknown field"):
        parse_spec(spec_with(parallelism__stages=2))


def test_more_stages_than_layers():
    s = parse_spec(spec_with(parallelism__pp=4))  # mlp with 2 hidden layers has 3 entries
    with pytest.raises(SpecError, match="parallelism.pp is 4 but the model has only 3 layers"):
        preflight(s)


def test_import_path_that_does_not_import():
    s = parse_spec(spec_with(model={"builder": "nosuchpkg.models:build"}))
    with pytest.raises(SpecError, match="model.builder: cannot import module 'nosuchpkg.models'") as e:
        preflight(s, [FIXTURES])
    # the spec's folder is searched (shipped with the job): the path is wrong, not how code travels
    assert str(e.value).endswith(f"(looked in {FIXTURES} and the installed packages); check the import path: it is "
                                 "a module in the spec's folder (shipped with the job) or an installed package, "
                                 "written 'package.module:name'"), str(e.value)
    with pytest.raises(SpecError) as e:
        preflight(s, [])
    assert str(e.value).endswith("; check the import path, or ship the code with runtime_env.working_dir")


def test_a_module_that_imports_a_missing_package_names_the_package():
    """The module was found: the path is right, a dependency is missing (it said to check the path)."""
    s = parse_spec(spec_with(model={"builder": "userpkg.needs_missing:build"}))
    with pytest.raises(SpecError) as e:
        preflight(s, [FIXTURES])
    assert str(e.value) == ("model.builder: importing 'userpkg.needs_missing' failed: No module named "
                            "'relaytrain_no_such_dependency'; the package 'relaytrain_no_such_dependency' it needs is "
                            "not installed where the job runs (add it to the image, or runtime_env.pip)")


def test_import_path_without_function():
    s = parse_spec(spec_with(model={"builder": "userpkg.models:nope"}))
    with pytest.raises(SpecError, match="module 'userpkg.models' has no attribute 'nope'"):
        preflight(s, [FIXTURES])


def test_malformed_import_path():
    with pytest.raises(SpecError, match="'userpkg.models' is not an import path: write it as 'package.module:function'"):
        parse_spec(spec_with(model={"builder": "userpkg.models"}))


def test_builder_not_sequential():
    s = parse_spec(spec_with(model={"builder": "userpkg.models:not_sequential"},
                             data={"builder": "userpkg.data:build"}))
    with pytest.raises(SpecError, match="must return torch.nn.Sequential or a layer list .*, got Linear"):
        preflight(s, [FIXTURES])


def test_a_layer_that_writes_into_its_input_is_told_how_to_write_it():
    """torch's inplace=True modules get a copy of a stage's input; a user layer's own x += 1
    cannot be seen before it runs, so the pre-flight check says what to write instead."""
    s = parse_spec(spec_with(model={"builder": "userpkg.models:adds_in_place"}, data={"builder": "userpkg.data:build"},
                             loss="cross_entropy"))
    with pytest.raises(SpecError) as e:
        preflight(s, [FIXTURES])
    assert ("layer 1 (AddsInPlace), given an input of shape (8, 8) torch.float32, raised RuntimeError: a leaf "
            "Variable that requires grad") in str(e.value)
    assert "compute it out of place (x = x + y, not x += y" in str(e.value)
    s = parse_spec(spec_with(model={"builder": "userpkg.models:torchvision_style"}, data={"kind": "digits_images"}))
    preflight(s, [FIXTURES])  # ReLU(inplace=True) entries pass


@pytest.mark.parametrize("data, message", [
    ("dicts", "data.builder: the Dataset's item 0 is a dict with keys ['input_ids', 'labels'], not an (x, y) pair: "
              "return (x, y) from __getitem__"),
    ("nested_inputs", "data.builder: the Dataset's x is a tuple, not one tensor (or array, or number): a pipeline "
                      "passes one tensor from layer to layer"),
])
def test_dataset_items_that_are_not_x_y_tensors_say_what_to_return(data, message):
    s = parse_spec(spec_with(model={"builder": "userpkg.models:build"}, data={"builder": f"userpkg.data:{data}"},
                             training={"global_batch_size": 32, "microbatch_size": 8, "steps": 2, "shuffle": False}))
    with pytest.raises(SpecError) as e:
        preflight(s, [FIXTURES])
    assert message in str(e.value)


def test_a_layer_that_takes_several_tensors_is_told_to_be_wrapped():
    s = parse_spec(spec_with(model={"builder": "userpkg.models:attention_as_an_entry"},
                             data={"builder": "userpkg.data:build"}))
    with pytest.raises(SpecError) as e:
        preflight(s, [FIXTURES])
    assert "layer 1 (MultiheadAttention), given an input of shape (8, 8) torch.float32, raised TypeError" in str(e.value)
    assert "wrap a layer that takes more (nn.MultiheadAttention takes query, key and value)" in str(e.value)


def test_a_block_that_needs_its_optional_arguments_is_told_to_be_wrapped():
    """A transformers decoder layer straight in the Sequential: it takes the hidden states and,
    optionally, position embeddings and a mask, and fails without them (found by a user trial
    with LlamaDecoderLayer: "cannot unpack non-iterable NoneType object", nothing more)."""
    s = parse_spec(spec_with(model={"builder": "userpkg.models:decoder_layer_as_an_entry"},
                             data={"builder": "userpkg.data:build"}))
    with pytest.raises(SpecError) as e:
        preflight(s, [FIXTURES])
    assert "layer 1 (DecoderLayerLike), given an input of shape (8, 8) torch.float32, raised TypeError" in str(e.value)
    assert ("nothing for its other arguments (attention_mask, position_ids, position_embeddings): if it needs them "
            "(a transformers block needs position_embeddings or an attention mask), wrap it") in str(e.value)


def test_model_and_data_do_not_fit():
    s = parse_spec(spec_with(data={"builder": "userpkg.data:build"}))  # 8 features into a 64-input MLP
    with pytest.raises(SpecError, match=r"the model fails on a microbatch of the data \(x of shape \(8, 8\)"):
        preflight(s, [FIXTURES])


def test_float64_numpy_rows_into_a_float32_model_are_refused_before_start():
    """numpy's float64 into an nn.Linear of float32: the meta device's products run any dtypes,
    so the trace passed and every worker failed at step 1 with torch's "mat1 and mat2 must have
    the same dtype" (a user trial).  Refused now, naming the layer and the cast."""
    s = parse_spec(spec_with(data={"builder": "userpkg.data:numpy_rows"}, model={"builder": "userpkg.models:build"}))
    with pytest.raises(SpecError) as e:
        preflight(s, [FIXTURES])
    assert str(e.value) == (
        "the model fails on a microbatch of the data (x of shape (8, 8), dtype torch.float64): layer 0 (Linear) "
        "raised RuntimeError: addmm of tensors of different dtypes (float32, float64): PyTorch's kernels need them "
        "to be the same; the layer's parameters are float32 and its input float64: have the data builder return "
        "float32 inputs (X.float(), or torch.as_tensor(a, dtype=torch.float32) of a numpy array, float64 by "
        "default), or build the model in the data's dtype")
    # the same refusal for a model too large to run once for real (the meta trace's is certain)
    from service import tracing
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tracing, "REAL_RUN_MAX_BYTES", 0)
        with pytest.raises(SpecError, match=r"^the model fails on a microbatch .* addmm of tensors of different "
                                            r"dtypes \(float32, float64\).*build the model in the data's dtype$"):
            preflight(s, [FIXTURES])


def test_under_bf16_autocast_only_float64_beside_other_dtypes_is_refused():
    """Under precision bf16 the workers run their layers under autocast, which casts float32,
    bfloat16 and float16 operands of a product to one dtype: bf16 data into a float32 Linear
    trains, and only float64 beside them is refused (a review of the dtype check)."""
    import copy

    from torch import nn

    from service import tracing

    def trace(layer, x, bf16):
        return tracing.trace(lambda device: {0: copy.deepcopy(layer).to(device)}, 1, x, torch.zeros(4, 3),
                             lambda a, b: ((a.float() - b) ** 2).mean(), bf16=bf16)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(tracing, "REAL_RUN_MAX_BYTES", 0)  # the meta trace's verdict alone
        trace(nn.Linear(8, 3), torch.zeros(4, 8, dtype=torch.bfloat16), bf16=True)
        trace(nn.Linear(8, 3).bfloat16(), torch.zeros(4, 8), bf16=True)
        for bf16, x in ((True, torch.zeros(4, 8, dtype=torch.float64)), (False, torch.zeros(4, 8, dtype=torch.bfloat16))):
            with pytest.raises(SpecError, match="addmm of tensors of different dtypes"):
                trace(nn.Linear(8, 3), x, bf16)


@pytest.mark.parametrize("builder, message", [
    ("three_tensors", "data.builder returned a tuple of 3 tensors, not (X, Y): return the inputs the first layer "
                      "takes and the loss's targets, two tensors of the same length"),
    ("as_dict", "data.builder returned a dict (keys ['x', 'y']), not (X, Y): return two tensors of the same length, "
                "such as (d['x'], d['y']), or a map-style Dataset of (x, y) pairs"),
    ("numbers", "data.builder: the Dataset's item 0 is an int, not an (x, y) pair: return (x, y) from __getitem__"),
    ("broken", "data: reading a microbatch failed with KeyError: 'item {i} missing: 100% broken {} ("),
    ("ragged", "data.builder: the samples of one microbatch have different shapes (stack expects each tensor to be "
               "equal size"),
    ("stream", "data.builder returned an IterableDataset (Stream); relaytrain reads samples by index"),
])
def test_data_that_is_not_x_and_y_says_so_before_anything_else(builder, message):
    """What a builder returns when it is not (X, Y) or a Dataset of (x, y) pairs: each said as such.
    A 3-tuple, a dict and a list of numbers were read as a Dataset of 3, 2 and 3 samples, and
    refused as "fewer than training.global_batch_size" (a user trial); an error in __getitem__
    named no line of the user's code; unpadded sequences gave torch's stack error alone."""
    s = parse_spec(spec_with(data={"builder": f"userpkg.data:{builder}"}, model={"builder": "userpkg.models:build"}))
    with pytest.raises(SpecError) as e:
        preflight(s, [FIXTURES])
    assert str(e.value).startswith(message), str(e.value)
    if builder == "broken":  # the user's line, not torch's or the standard library's
        assert re.search(r"\)' \(raised at \S+/fixtures/userpkg/data\.py, line \d+, in __getitem__\)$", str(e.value))
    if builder == "ragged":
        assert "pad sequences to one length in __getitem__" in str(e.value)


def test_numpy_arrays_as_x_and_y_are_taken_as_tensors():
    from service.loading import Samples

    import numpy as np
    got = Samples((np.ones((4, 2), dtype=np.float32), np.arange(4)))
    x, y = got.batch(torch.tensor([1, 3]))
    assert x.dtype == torch.float32 and y.tolist() == [1, 3]


def test_too_little_data():
    s = parse_spec(spec_with(data={"builder": "userpkg.data:build", "args": {"n": 10}},
                             model={"builder": "userpkg.models:build"}))
    with pytest.raises(SpecError, match="gave 10 samples, fewer than training.global_batch_size"):
        preflight(s, [FIXTURES])


def test_explicit_partition_must_cover_model():
    s = parse_spec(spec_with(parallelism={"pp": 2, "partition": [1, 1]}))
    with pytest.raises(SpecError, match=r"partition \[1, 1\] covers 2 layers but the model has 3"):
        preflight(s)


def test_spec_file_errors(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(SpecError, match="is not valid YAML"):
        load_spec(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(SpecError, match="must hold a mapping"):
        load_spec(bad)


def test_user_spec_file_loads_and_preflights():
    path = os.path.join(FIXTURES, "user_job.yaml")
    s = load_spec(path)
    t = preflight(s, [FIXTURES])  # traced on the meta device: no parameter memory
    assert len(t.metas) == 5 and t.on_meta and t.metas[-1] == ((8, 3), torch.float32)


@pytest.mark.parametrize("model, data, loss", [
    ({"kind": "mlp"}, {"kind": "digits"}, "cross_entropy"),
    ({"kind": "cnn"}, {"kind": "digits_images"}, "cross_entropy"),
    ({"kind": "regression_mlp"}, {"kind": "regression"}, "mse"),
    ({"kind": "char_transformer"}, {"kind": "chars"}, "cross_entropy"),
    ({"kind": "gpt"}, {"kind": "chars"}, "cross_entropy"),
])
def test_builtins_fit_together(model, data, loss):
    t = preflight(parse_spec(spec_with(model=model, data=data, loss=loss, parallelism__pp=2)))
    assert len(t.metas) >= 2 and t.on_meta


def test_loss_builder_from_user_code():
    s = parse_spec(spec_with(model={"builder": "userpkg.models:build"}, data={"builder": "userpkg.data:build"},
                             loss={"builder": "userpkg.models:smooth_l1"}))
    preflight(s, [FIXTURES])
    job = load_job(s, [FIXTURES])
    out = job.model(job.samples.x[:4])
    assert job.loss(out, job.samples.y[:4]).dim() == 0


def test_loss_that_is_not_a_scalar():
    s = parse_spec(spec_with(model={"builder": "userpkg.models:build"}, data={"builder": "userpkg.data:build"},
                             loss={"builder": "userpkg.models:build"}))  # returns a model, not a loss
    with pytest.raises(SpecError, match="the loss fails on the model's output|must return a scalar"):
        preflight(s, [FIXTURES])


def test_elastic_range_and_preferred_shape():
    s = parse_spec(spec_with(elastic={"enabled": True, "min_workers": 1, "max_workers": 4}))
    assert s.elastic.enabled and s.elastic.snapshot_every_steps == 1
    with pytest.raises(SpecError, match=r"elastic.min_workers \(5\) is above elastic.max_workers \(4\)"):
        parse_spec(spec_with(elastic={"enabled": True, "min_workers": 5, "max_workers": 4}))
    with pytest.raises(SpecError, match=r"preferred shape parallelism.dp x parallelism.pp \(2 x 2 = 4 workers\) "
                                        r"must lie within elastic.min_workers..max_workers \(1..2\)"):
        parse_spec(spec_with(parallelism__dp=2, parallelism__pp=2, elastic={"enabled": True, "max_workers": 2}))
    with pytest.raises(SpecError, match="resources.memory_per_worker_mb: Input should be greater than 0"):
        parse_spec(spec_with(resources__memory_per_worker_mb=0))


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(os.path.dirname(__file__), "..", "examples"))))
def test_examples_are_valid_specs(name):
    if name.endswith((".yaml", ".yml", ".json")):
        spec = load_spec(os.path.join(os.path.dirname(__file__), "..", "examples", name))
        assert spec.name


@pytest.mark.parametrize("builder, message", [
    ("not_callable", "model.builder: entry 1 of the layer list is a module instance, not a zero-argument callable "
                     "that builds the layer: write functools.partial(Block, ...) or lambda: Block(...)"),
    ("returns_no_module", "model.builder: layer 1 (returns_no_module.<locals>.<lambda>) returned str, not a "
                          "torch.nn.Module; each entry of the layer list must build one layer"),
    ("ties_a_missing_parameter", "model.builder: the tie ['0.weight', '1.wieght'] names '1.wieght', but layer 1 "
                                 "has no parameter 'wieght'; its parameters are ['weight', 'bias']"),
    # each name beside its own shape (the shapes were listed sorted, not in the tie's order: a user trial)
    ("ties_parameters_of_other_shapes", "model.builder: the tie ['0.weight', '1.weight'] joins parameters of "
                                        "different shapes: 0.weight [96, 32], 1.weight [32, 96]"),
    ("raises_in_a_layer", "model.builder: layer 1 (raises_in_a_layer.<locals>.broken) raised RuntimeError: "
                          "peer review failed"),
])
def test_bad_layer_lists_say_what_to_change(builder, message):
    s = parse_spec(spec_with(model={"builder": f"userpkg.layerlist:{builder}"}, data={"builder": "userpkg.data:build"}))
    with pytest.raises(SpecError) as e:
        preflight(s, [FIXTURES])
    assert str(e.value).startswith(message), str(e.value)


def test_a_layer_list_is_traced_without_memory():
    """The pre-flight check builds a layer list on the meta device: no parameter storage, whatever its size."""
    s = parse_spec(spec_with(model={"kind": "gpt", "args": {"vocab_size": 50304, "seq_len": 64, "d_model": 2048,
                                                            "n_heads": 16, "n_layers": 18}},
                             data={"kind": "chars", "args": {"context": 64}}, loss="cross_entropy"))
    t = preflight(s)  # ~1.0e9 parameters: 4 GiB were it built for real
    assert t.on_meta and sum(t.param_bytes) > 4e9 and t.metas[-1] == ((8, 64, 50304), torch.float32)


def test_preemptible_without_checkpoints_says_to_set_them():
    with pytest.raises(SpecError, match=r"scheduling.preemptible needs checkpoints: a preempted job resumes from its "
                                        r"newest checkpoint, so set checkpoint.every_steps"):
        parse_spec(spec_with(scheduling__preemptible=True))
    ok = parse_spec(spec_with(scheduling__preemptible=True, checkpoint__every_steps=5, scheduling__priority=3))
    assert ok.scheduling.preemptible and ok.scheduling.priority == 3


def test_a_relative_file_url_for_checkpoints_says_which_form_to_use():
    """file://ckpt would land relative to whichever process writes, not where the user ran from."""
    with pytest.raises(SpecError, match=r"checkpoint.path.*'file://ckpt': a file:// URL takes an absolute path "
                                        r"\(file:///abs/path, three slashes\); for a folder relative to the working "
                                        r"directory write 'ckpt' without file://"):
        parse_spec(spec_with(checkpoint__every_steps=5, checkpoint__path="file://ckpt"))
    for ok in ("file:///data/ckpt", "ckpt", "./ckpt", "/abs/ckpt", "s3://bucket/ckpt"):
        assert parse_spec(spec_with(checkpoint__every_steps=5, checkpoint__path=ok)).checkpoint.path == ok


def test_yaml_dates_stay_strings_and_other_non_json_values_are_named():
    """`name: 2024-01-01` is the string a user means (it was a date, and a 400 "Object of type date
    is not JSON serializable"); YAML's other types a spec has no use for are named."""
    from service.spec import read_yaml

    assert read_yaml("name: 2024-01-01\nseed: 7\n") == {"name": "2024-01-01", "seed": 7}
    assert parse_spec(spec_with(name=read_yaml("name: 2024-01-01")["name"])).name == "2024-01-01"
    for text, kind in [("a: !!binary aGVsbG8=", "bytes"), ("a: !!set {x}", "set"), ("a: !!timestamp 2001-12-14", "date")]:
        with pytest.raises(ValueError, match=rf"it holds a {kind} \(.*\), which a job spec has no use for: write "
                                             "strings, numbers, true/false, lists and mappings"):
            read_yaml(text)


def test_bf16_preflight_of_a_builder_that_converts_its_layers_with_to():
    """The bf16 pre-flight ran the layers in torch's FakeTensorMode, where `.to(dtype)` fails
    ("_apply(): Couldn't swap Embedding.weight"): every builder written `make().to(dt)` was refused
    under bf16, blaming the builder. A tied head stays tied."""
    s = parse_spec(spec_with(model={"builder": "userpkg.layerlist:attention_stack",
                                    "args": {"dtype": "float32", "layers": 1}},
                             data={"kind": "chars", "args": {"context": 16}}, loss="cross_entropy",
                             training__precision="bf16"))
    t = preflight(s, [FIXTURES])
    assert t.on_meta and t.metas[-1] == ((8, 16, 96), torch.bfloat16)  # the head's matmul under autocast


def test_class_labels_beyond_the_models_outputs_and_mse_targets_of_another_shape_are_refused():
    """Found by a user trial: a model of 5 outputs for the digits' labels 0-9 passed the check and
    failed at its first step with torch's "Target 7 is out of bounds"; mse reshaped targets of
    another shape (one of another size was torch's "shape '[8, 5]' is invalid for input of size
    80", and one of the same size was silently reshaped)."""
    s = parse_spec(spec_with(model={"kind": "mlp", "args": {"out_features": 5}}, data={"kind": "digits"}))
    with pytest.raises(SpecError, match=re.escape(
            "loss cross_entropy: the targets of data.kind=digits hold class labels from 0 to 9, but the model's "
            "output has 5 classes (its last dimension, of shape [8, 5] for a microbatch), so labels must be in "
            "[0, 5): make the model's last layer output 10 classes or more")):
        preflight(s)
    s = parse_spec(spec_with(model={"kind": "regression_mlp", "args": {"out_features": 5}},
                             data={"kind": "regression", "args": {"out_features": 10}}, loss="mse"))
    with pytest.raises(SpecError, match=re.escape(
            "the loss fails on the model's output (shape (8, 5)) and the targets (shape (8, 10)): ValueError: mse "
            "compares the model's output with targets of its shape, and the output has shape [8, 5] and the targets "
            "[8, 10] (only dimensions of size 1 may differ): make the model's output and the targets the same shape")):
        preflight(s)
    # one output per target, (N,) or (N, 1), passes
    preflight(parse_spec(spec_with(model={"kind": "regression_mlp"}, data={"kind": "regression"}, loss="mse")))


def test_a_check_of_the_whole_spec_and_a_field_that_is_not_a_mapping_read_plainly():
    """A user trial: "spec: optimizer.schedule.warmup_steps ..." said "spec" twice, and
    ``schedule: cosine`` was "Input should be a valid dictionary or instance of ScheduleSpec"."""
    with pytest.raises(SpecError) as e:
        parse_spec(spec_with(optimizer__schedule__warmup_steps=10, training__steps=3))
    assert str(e.value) == ("invalid job spec: optimizer.schedule.warmup_steps (10) is above training.steps (3): the "
                            "rate would never reach lr; use fewer warm-up steps")
    with pytest.raises(SpecError) as e:
        parse_spec(spec_with(optimizer__schedule="cosine"))
    assert str(e.value) == ("invalid job spec: optimizer.schedule: must be a mapping of its fields (field: value), "
                            'not "cosine": write {name: cosine}')
    with pytest.raises(SpecError) as e:
        parse_spec(spec_with(training=5))
    assert str(e.value) == "invalid job spec: training: must be a mapping of its fields (field: value), not 5"


def test_a_layer_with_extra_state_traces_and_its_checkpoint_is_checked_by_its_tensors(tmp_path):
    """``get_extra_state`` may return any object: the trace and a checkpoint's manifest record
    shapes of tensors only (a review: both assumed every state_dict value was a tensor)."""
    from pathlib import Path

    from service import checkpoint

    (tmp_path / "extra.py").write_text(
        "import torch.nn as nn\n"
        "class Scaled(nn.Linear):\n"
        "    def get_extra_state(self):\n"
        "        return {'scale': 1.0}\n"
        "    def set_extra_state(self, state):\n"
        "        self.scale = state['scale']\n"
        "def build():\n"
        "    return [lambda: Scaled(64, 32), nn.ReLU, lambda: nn.Linear(32, 10)]\n")
    s = parse_spec(spec_with(model={"builder": "extra:build"}, data={"kind": "digits"}))
    t = preflight(s, [str(tmp_path)])
    assert t.model_state == {"0.weight": (32, 64), "0.bias": (32,), "0._extra_state": None, "2.weight": (10, 32),
                             "2.bias": (10,)}
    root = Path(tmp_path / "ckpt")
    root.mkdir()
    folder = root / ".tmp-1"
    folder.mkdir()
    import torch

    part = checkpoint.write_part(folder, 0, 1, {"0.weight": torch.zeros(32, 64), "0.bias": torch.zeros(32),
                                                "0._extra_state": {"scale": 1.0}, "2.weight": torch.zeros(10, 32),
                                                "2.bias": torch.zeros(10)}, {"state": {}})
    assert part["shapes"] == {"0.weight": [32, 64], "0.bias": [32], "2.weight": [10, 32], "2.bias": [10]}
    done = checkpoint.finish(root, folder, 1, [part], {"job_id": "a-1"})
    checkpoint.check_fits(done, t.model_state)  # fits
    wider = {**t.model_state, "2.weight": (12, 32)}
    with pytest.raises(ValueError, match=r"2.weight is \[10, 32\] in the checkpoint and \[12, 32\] in the model"):
        checkpoint.check_fits(done, wider)
    checkpoint.check_fits(done, wider, own_job="a-1")  # the job's own checkpoint: not checked


def test_a_key_written_twice_in_a_yaml_spec_is_an_error_and_a_merge_may_override(tmp_path):
    """A user trial: a spec with ``name:`` twice was accepted, the second winning."""
    p = tmp_path / "twice.yaml"
    p.write_text("name: first\nmodel: {kind: mlp}\ndata: {kind: digits}\nname: second\n")
    with pytest.raises(SpecError, match=r"(?s)is not valid YAML: .*found the key 'name' twice \(first 1:1\); write each "
                                        r"field once\n  in \"<unicode string>\", line 4, column 1"):
        load_spec(p)
    from service.spec import read_yaml

    assert read_yaml("base: &b {lr: 0.1, name: sgd}\nopt:\n  <<: *b\n  lr: 0.2\n")["opt"] == {"lr": 0.2, "name": "sgd"}
    # a merge source that merges itself, anchored inside another mapping (PyYAML flattens it in place)
    nested = read_yaml("root: &root {lr: 1, x: 2}\na: {b: &base {<<: *root, lr: 3}}\nc: {<<: *base}\n")
    assert nested["a"]["b"] == nested["c"] == {"lr": 3, "x": 2}


def test_eval_labels_the_model_cannot_hold_are_refused_too(tmp_path):
    (tmp_path / "evdata.py").write_text(
        "import torch\n"
        "def build():\n"
        "    return torch.randn(64, 64), torch.arange(64) % 12  # labels 0-11 for a model of 10 classes\n")
    s = parse_spec(spec_with(model={"kind": "mlp"}, data={"kind": "digits"},
                             eval={"every_steps": 2, "data": {"builder": "evdata:build"}, "batches": 1},
                             training__global_batch_size=32))
    with pytest.raises(SpecError, match=re.escape(
            "loss cross_entropy: the targets of eval.data.builder hold class labels from 0 to 11, but the model's "
            "output has 10 classes")):
        preflight(s, [str(tmp_path)])
