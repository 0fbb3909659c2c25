"""Configuration: bad configs fail at deepspeed.initialize, naming the key, before the model is touched."""

import logging

import deepspeed
import pytest
import torch
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

import ds_tensorshard
from ds_tensorshard.errors import TensorShardConfigError, TensorShardUsageError, UnsupportedDeepSpeedVersion
from ds_tensorshard.optimizer import direct_backward_refusal
from ds_tensorshard.versions import check_deepspeed_version, fp16_refusal
from tests.helpers.one_rank import make_engine

pytestmark = pytest.mark.usefixtures("single_rank_world")


@pytest.fixture
def ds_log() -> list[str]:
    """What DeepSpeed's logger (which ds_tensorshard logs through) says during the test."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    level = deepspeed.utils.logger.level
    deepspeed.utils.logger.setLevel(logging.INFO)
    deepspeed.utils.logger.addHandler(handler)
    yield lines
    deepspeed.utils.logger.removeHandler(handler)
    deepspeed.utils.logger.setLevel(level)


def base_config(**overrides):
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "tensorshard": {"enabled": True},
    }
    config.update(overrides)
    return config


def initialize(config, optimizer=None):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    if optimizer is not None:
        optimizer = optimizer(model.parameters())
    engine, opt, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, optimizer=optimizer
    )
    return model, engine, opt


BAD = [
    ({"zero_optimization": {"stage": 3}}, "'zero_optimization.stage'"),
    (
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        "'zero_optimization.offload_optimizer'",
    ),
    ({"zero_optimization": {"stage": 1, "offload_param": {"device": "nvme"}}}, "'zero_optimization.offload_param'"),
    ({"tensorshard": {"enabled": True, "bucket_size": 10}}, "unknown key 'tensorshard.bucket_size'"),
    ({"tensorshard": {"enabled": "yes"}}, "'tensorshard.enabled'"),
    ({"tensorshard": {"enabled": True, "comm_backend": "nccl"}}, "'tensorshard.comm_backend'"),
    ({"tensorshard": {"enabled": True, "comm_backend": "mpi", "bucket_numel": -1}}, "'tensorshard.bucket_numel'"),
    ({"tensorshard": {"enabled": True, "bucket_numel": 0}}, "'tensorshard.bucket_numel'"),
    ({"tensorshard": {"enabled": True, "bucket_numel": 1.5}}, "'tensorshard.bucket_numel'"),
    ({"tensorshard": [1]}, "'tensorshard' must be a JSON object"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}, "'optimizer.type' 'OneBitAdam' cannot be sharded"),
    # keys of DeepSpeed 0.16-0.19 whose effect on gradients or optimizer state ds_tensorshard does not follow
    ({"fp16": {"fp16_master_weights_and_grads": True}}, "'fp16.fp16_master_weights_and_grads' is not supported"),
    ({"bf16": {"bf16_master_weights_and_grads": True}}, "'bf16.bf16_master_weights_and_grads' is not supported"),
    (
        {"bf16": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
        "'bf16.bf16_master_weights_and_grads' is not supported",
    ),
    ({"zero_optimization": {"stage": 2, "zenflow": {}}}, "'zero_optimization.zenflow' is not supported"),
    ({"compile": {"deepcompile": True}}, "'compile.deepcompile' is not supported"),
    ({"checkpoint": {"use_node_local_storage": True}}, "'checkpoint.use_node_local_storage' is not supported"),
    ({"expert_parallel": {"enabled": True}}, "'expert_parallel.enabled' is not supported"),
    ({"torch_autocast": {"enabled": True, "dtype": "fp16"}}, "'torch_autocast.dtype' 'fp16' is not supported"),
    ({"torch_autocast": {"enabled": True}}, "'torch_autocast.enabled' without 'torch_autocast.dtype'"),
    (
        {"zero_optimization": {"stage": 1, "compute_grad_norm": False}, "data_types": {"grad_accum_dtype": "fp32"}},
        "'zero_optimization.compute_grad_norm' false is not supported with ZeRO stage 1, bf16",
    ),
    (
        {"zero_optimization": {"stage": 2, "compute_grad_norm": False}, "gradient_clipping": 1.0},
        "'zero_optimization.compute_grad_norm' false needs 'gradient_clipping' 0",
    ),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[m for _, m in BAD])
def test_bad_config_fails_at_initialize_naming_the_key(overrides, message):
    config = base_config(**overrides)
    model = torch.nn.Linear(4, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config["bf16"] = {**config.get("bf16", {}), "enabled": True}  # past validation the model would become bf16
    with pytest.raises(TensorShardConfigError) as err:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert message in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())


def test_unshardable_client_optimizer_is_refused_by_class_name():
    class MuAdam(torch.optim.Adam):  # named like mup's, which reads per-parameter infshape metadata
        pass

    with pytest.raises(TensorShardConfigError, match="optimizer MuAdam cannot be sharded.*infshape"):
        initialize(base_config(), optimizer=lambda ps: MuAdam(ps, lr=0.1))


def test_client_sgd_is_sharded():
    config = {k: v for k, v in base_config().items() if k != "optimizer"}
    _, _, opt = initialize(config, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    assert isinstance(opt.optimizer, torch.optim.SGD)


def test_client_torch_adamw_is_sharded():
    config = {k: v for k, v in base_config().items() if k != "optimizer"}
    _, _, opt = initialize(config, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    assert isinstance(opt, ds_tensorshard.TensorShardOptimizer)
    assert isinstance(opt.optimizer, torch.optim.AdamW)


def test_disabled_block_runs_stock_deepspeed():
    _, _, opt = initialize(base_config(tensorshard={"enabled": False}))
    assert type(opt) is DeepSpeedZeroOptimizer
    _, _, opt = initialize({k: v for k, v in base_config().items() if k != "tensorshard"})
    assert type(opt) is DeepSpeedZeroOptimizer


def test_bf16_stage1_with_fp32_accumulation_stays_on_tensorshard():
    # stock DeepSpeed routes this combination to BF16_Optimizer instead of ZeRO
    config = base_config(
        zero_optimization={"stage": 1}, bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}
    )
    _, _, opt = initialize(config)
    assert isinstance(opt, ds_tensorshard.TensorShardOptimizer)


def test_single_rank_owns_everything_and_inspects_plan():
    model, engine, opt = initialize(base_config())
    assert opt.plan.numel_per_rank == (sum(p.numel() for p in model.parameters()),)
    assert all(opt.plan.owner(p) == 0 for p in model.parameters())
    assert opt.param_groups is engine.basic_optimizer.param_groups


def test_install_is_idempotent():
    before = deepspeed.runtime.engine.DeepSpeedEngine._configure_zero_optimizer
    ds_tensorshard.install()
    ds_tensorshard.install()
    assert deepspeed.runtime.engine.DeepSpeedEngine._configure_zero_optimizer is before
    assert ds_tensorshard.installed()


@pytest.mark.parametrize("version", ["0.14.5", "0.15.4", "0.20.0", "1.0.0"])
def test_unsupported_deepspeed_versions_are_named(version, monkeypatch):
    monkeypatch.delenv("DS_TENSORSHARD_UNTESTED_DEEPSPEED", raising=False)
    with pytest.raises(
        UnsupportedDeepSpeedVersion, match=rf"supports deepspeed >=0\.16\.0,<0\.20 but deepspeed {version} is installed"
    ):
        check_deepspeed_version(version)
    monkeypatch.setenv("DS_TENSORSHARD_UNTESTED_DEEPSPEED", "1")  # try an untested release anyway: a warning
    with pytest.warns(UserWarning, match=rf"deepspeed {version} is installed.*DS_TENSORSHARD_UNTESTED_DEEPSPEED=1"):
        check_deepspeed_version(version)


@pytest.mark.parametrize(
    "version, stage, refused",
    [
        ((0, 17, 5), 2, False),
        ((0, 17, 6), 1, True),  # stock fp16 ZeRO-1 stops there
        ((0, 17, 6), 2, True),
        ((0, 18, 0), 1, False),
        ((0, 18, 2), 2, True),  # deepspeed#7718 in stock ZeRO-2
        ((0, 18, 3), 2, False),
        ((0, 19, 8), 2, False),
    ],
)
def test_fp16_is_refused_where_stock_gives_nothing_to_match(version, stage, refused, monkeypatch):
    assert (fp16_refusal(stage, version) is not None) == refused
    monkeypatch.setattr("ds_tensorshard.versions.installed_release", lambda: version)
    config = base_config(fp16={"enabled": True}, zero_optimization={"stage": stage})
    if refused:
        release = ".".join(map(str, version))
        with pytest.raises(
            TensorShardConfigError, match=rf"'fp16.enabled' with ZeRO stage {stage} .* {release}: "
        ) as err:
            ds_tensorshard.config.validate_engine_config(config)
        assert ("(or stage 1)" in str(err.value)) == (stage == 2 and fp16_refusal(1, version) is None)
    else:
        assert ds_tensorshard.config.validate_engine_config(config).enabled


def test_supported_version_passes():
    for version in ("0.16.0", "0.17.6", "0.18.9", "0.19.8"):
        check_deepspeed_version(version)
    check_deepspeed_version(deepspeed.__version__)


@pytest.mark.parametrize("zero", [{"stage": 0}, None], ids=["stage 0", "no zero block"])
@pytest.mark.parametrize("optimizer", [{"type": "AdamW", "params": {"lr": 1e-3}}, None], ids=["optimizer", "none"])
def test_an_engine_with_no_zero_optimizer_to_replace_runs_as_stock(zero, optimizer, ds_log):
    # a frozen reference model (TRL sets stage 0 on a copy of the training config) or an inference engine
    config = {k: v for k, v in base_config(zero_optimization=zero, optimizer=optimizer).items() if v is not None}
    _, engine, opt = initialize(config)
    stock_config = {k: v for k, v in config.items() if k != "tensorshard"}
    _, _, stock = initialize(stock_config)
    assert type(opt) is type(stock) and not isinstance(opt, ds_tensorshard.TensorShardOptimizer)
    assert "'zero_optimization.stage' 0: no ZeRO-1/2 optimizer to replace, this engine runs as stock" in "\n".join(
        ds_log
    )
    assert engine(torch.ones(1, 4)).shape == (1, 2)


@pytest.mark.parametrize("stage", [1, 2])
def test_stage_1_or_2_without_an_optimizer_gets_stocks_error(stage):
    config = {k: v for k, v in base_config(zero_optimization={"stage": stage}).items() if k != "optimizer"}
    with pytest.raises(AssertionError, match=f"zero stage {stage} requires an optimizer"):
        initialize(config)


def test_environment_switch_turns_the_plugin_on_for_a_config_without_a_block(monkeypatch):
    config = {k: v for k, v in base_config(zero_optimization={"stage": 1}).items() if k != "tensorshard"}
    monkeypatch.setenv("DS_TENSORSHARD", "1")
    monkeypatch.setenv("DS_TENSORSHARD_CONFIG", '{"split_tensors": "never", "bucket_numel": 7}')
    _, engine, opt = initialize(config)
    assert isinstance(opt, ds_tensorshard.TensorShardOptimizer) and not opt.partition_gradients
    assert engine._tensorshard_config.split_tensors == "never" and opt.bucket_numel == 7
    monkeypatch.delenv("DS_TENSORSHARD_CONFIG")
    _, _, opt = initialize(base_config(tensorshard={"enabled": False}))  # a block of its own wins
    assert type(opt) is DeepSpeedZeroOptimizer


@pytest.mark.parametrize(
    "switch, keys, message",
    [
        ("yes", None, "environment variable DS_TENSORSHARD='yes': use 1 (on) or 0 (off)"),
        ("1", "{split", "environment variable DS_TENSORSHARD_CONFIG is not valid JSON"),
        ("1", "[1]", "'DS_TENSORSHARD_CONFIG' must be a JSON object"),
        ("1", '{"comm_backend": "nccl"}', "invalid value for 'DS_TENSORSHARD_CONFIG.comm_backend'"),
        ("1", '{"bucket_size": 1}', "unknown key 'DS_TENSORSHARD_CONFIG.bucket_size'"),
    ],
)
def test_bad_environment_switch_is_refused_naming_the_variable(switch, keys, message, monkeypatch):
    monkeypatch.setenv("DS_TENSORSHARD", switch)
    if keys is not None:
        monkeypatch.setenv("DS_TENSORSHARD_CONFIG", keys)
    config = {k: v for k, v in base_config().items() if k != "tensorshard"}
    with pytest.raises(TensorShardConfigError) as err:
        initialize(config)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "overrides, older, added",
    [
        ({"bf16": {"bf16_master_weights_and_grads": True}}, (0, 18, 2), (0, 18, 3)),
        ({"zero_optimization": {"stage": 2, "zenflow": {}}}, (0, 17, 4), (0, 17, 5)),
        ({"compile": {"deepcompile": True}}, (0, 16, 5), (0, 16, 6)),
        ({"expert_parallel": {"enabled": True}}, (0, 19, 1), (0, 19, 2)),
        ({"torch_autocast": {"enabled": True, "dtype": "fp16"}}, (0, 17, 1), (0, 17, 2)),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else None,
)
def test_a_new_key_is_refused_only_where_deepspeed_reads_it(overrides, older, added, monkeypatch):
    # a release that does not know the key ignores it, as ds_tensorshard then does
    config = base_config(**overrides)
    monkeypatch.setattr("ds_tensorshard.versions.installed_release", lambda: older)
    assert ds_tensorshard.config.validate_engine_config(config).enabled
    monkeypatch.setattr("ds_tensorshard.versions.installed_release", lambda: added)
    with pytest.raises(TensorShardConfigError, match=f"'{next(iter(overrides))}.* is (not supported|refused)"):
        ds_tensorshard.config.validate_engine_config(config)


def test_bf16_autocast_is_followed_from_the_release_whose_stock_zero_uses_no_grad_scaler(monkeypatch):
    config = base_config(torch_autocast={"enabled": True, "dtype": "bfloat16"}, zero_optimization={"stage": 1})
    monkeypatch.setattr("ds_tensorshard.versions.installed_release", lambda: (0, 17, 5))
    with pytest.raises(TensorShardConfigError, match=r"'torch_autocast.enabled' is refused .* 0\.17\.5: .*GradScaler"):
        ds_tensorshard.config.validate_engine_config(config)
    monkeypatch.setattr("ds_tensorshard.versions.installed_release", lambda: (0, 17, 6))
    assert ds_tensorshard.config.validate_engine_config(config).enabled


def test_summed_gradients_lift_the_stage2_predivide_refusal_as_stock_does(monkeypatch):
    # stock ZeRO-2 skips its predivide/prescale asserts under gradient_allreduce_op "sum" (it ignores both)
    config = base_config(gradient_allreduce_op="sum", gradient_predivide_factor=2.0, prescale_gradients=True)
    assert ds_tensorshard.config.validate_engine_config(config).enabled
    monkeypatch.setattr("ds_tensorshard.versions.installed_release", lambda: (0, 19, 5))  # before the key
    with pytest.raises(TensorShardConfigError, match="'gradient_predivide_factor' != 1.0 is not supported"):
        ds_tensorshard.config.validate_engine_config(config)


def test_coalesce_grad_reduction_is_refused_naming_the_alternatives(engine):
    with pytest.raises(TensorShardUsageError, match=r"coalesce_grad_reduction\(\) is not supported.*managed_grad"):
        engine().coalesce_grad_reduction()
    _, stock, _ = initialize({k: v for k, v in base_config().items() if k != "tensorshard"})
    with stock.coalesce_grad_reduction():  # a stock engine keeps the stock method
        pass


@pytest.mark.parametrize("release", [(0, 17, 0), (0, 18, 4)], ids=["no flag: engine.backward runs ours", "flag"])
def test_a_direct_backward_is_refused_at_its_first_gradient_where_it_cannot_follow_stock(release, monkeypatch):
    monkeypatch.setattr("ds_tensorshard.optimizer.installed_release", lambda: release)
    engine = make_engine()
    optimizer = engine.optimizer
    if release < (0, 18, 3):  # that engine has no _running_engine_backward: it calls optimizer.backward(loss)
        optimizer._engine_backward_running = lambda: None
    tokens = torch.randint(0, 64, (2, 16))
    with pytest.raises(
        TensorShardUsageError, match=rf"loss.backward\(\) was called directly.*{'.'.join(map(str, release))}"
    ):
        engine(tokens).backward()
    assert optimizer.reducer.started == 0  # refused before any bucket was reduced
    engine.zero_grad()
    if release < (0, 18, 3):
        optimizer.backward(engine(tokens) / 2)  # what engine.backward(loss) does there
    else:
        engine.backward(engine(tokens))
    engine.step()


def test_direct_backward_refusal_by_release():
    assert direct_backward_refusal((0, 19, 8)) is None and direct_backward_refusal((0, 18, 5)) is None
    assert "gradient hooks" in direct_backward_refusal((0, 18, 4))
    assert "0.18.3 added it" in direct_backward_refusal((0, 18, 2))
