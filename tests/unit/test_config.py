"""Configuration: bad configs fail at deepspeed.initialize, naming the key, before the model is touched."""

import logging
import re

import deepspeed
import pytest
import torch
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import safe_get_full_grad

import ds_tensorshard
from ds_tensorshard.datapath.defaults import DEFAULT_BUCKET_NUMEL
from ds_tensorshard.errors import TensorShardConfigError, UnsupportedDeepSpeedVersion, UnsupportedTorchVersion
from ds_tensorshard.versions import check_deepspeed_version, check_torch_version, fp16_refusal

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
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}},
        "'zero_optimization.offload_param' (device 'nvme') is not supported at ZeRO stage 3",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}},
        "'zero_optimization.offload_optimizer' (device 'nvme') is not supported at ZeRO stage 3",
    ),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, "'zero_optimization.zero_hpz_partition_size'"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "'zero_optimization.zero_quantized_weights'"),
    (
        {"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}},
        "'zero_optimization.zero_quantized_gradients'",
    ),
    (
        {"zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": 100}},
        "'zero_optimization.stage3_module_granularity_threshold'",
    ),
    (
        {"zero_optimization": {"stage": 3}, "tensorshard": {"enabled": True, "bucket_layout": "flat"}},
        "'tensorshard.bucket_layout' 'flat' at ZeRO stage 3",
    ),
    ({"zero_optimization": {"stage": 3}, "gradient_predivide_factor": 2.0}, "'gradient_predivide_factor' != 1.0"),
    (
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}},
        "'zero_optimization.offload_optimizer' device 'nvme' is not supported with 'tensorshard.enabled': stock "
        "ZeRO-1/2 has no NVMe optimizer offload either",
    ),
    ({"zero_optimization": {"stage": 1, "offload_param": {"device": "nvme"}}}, "'zero_optimization.offload_param'"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "is a ZeRO stage 3 feature"),
    ({"zero_optimization": {"stage": 2, "cpu_offload_param": True}}, "'zero_optimization.cpu_offload_param'"),
    (
        {"zero_optimization": {"stage": 1, "allgather_bucket_size": 1001}},
        "allgather_bucket_size must be a multiple of nccl_start_alignment_factor, 2",
    ),
    (
        {
            "zero_optimization": {"stage": 2, "compute_grad_norm": False, "offload_optimizer": {"device": "cpu"}},
            "gradient_clipping": 0.0,
        },
        "'zero_optimization.compute_grad_norm' false is not supported with 'zero_optimization.offload_optimizer'",
    ),
    (
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "optimizer": {"type": "Lamb"}},
        "'optimizer.type' 'Lamb' is not supported with 'zero_optimization.offload_optimizer' device cpu: DeepSpeed "
        "has no CPU LAMB",
    ),
    ({"tensorshard": {"enabled": True, "bucket_size": 10}}, "unknown key 'tensorshard.bucket_size'"),
    ({"tensorshard": {"enabled": "yes"}}, "'tensorshard.enabled'"),
    ({"tensorshard": {"enabled": True, "comm_backend": "nccl"}}, "'tensorshard.comm_backend'"),
    ({"tensorshard": {"enabled": True, "comm_backend": "mpi", "bucket_numel": -1}}, "'tensorshard.bucket_numel'"),
    ({"tensorshard": {"enabled": True, "bucket_numel": 0}}, "'tensorshard.bucket_numel'"),
    ({"tensorshard": {"enabled": True, "bucket_numel": 1.5}}, "'tensorshard.bucket_numel'"),
    ({"tensorshard": [1]}, "'tensorshard' must be a JSON object"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}, "'optimizer.type' 'OneBitAdam' cannot be sharded"),
    ({"compile": {"deepcompile": True}}, "'compile.deepcompile' is not supported"),
    ({"checkpoint": {"use_node_local_storage": True}}, "'checkpoint.use_node_local_storage' is not supported"),
    ({"expert_parallel": {"enabled": True, "autoep_size": 1}}, "'expert_parallel.enabled' is not supported"),
]


STAGE3_BAD = [(over, message) for over, message in BAD if over.get("zero_optimization", {}).get("stage") == 3]


@pytest.mark.parametrize("overrides,message", STAGE3_BAD, ids=[m for _, m in STAGE3_BAD])
def test_stage3_config_refused_at_initialize_is_refused_at_zero_init(overrides, message):
    """``deepspeed.zero.Init`` with the tensorshard block refuses what ``deepspeed.initialize`` refuses at stage 3,
    with the same message, before the model under it is built."""
    built = []
    with pytest.raises(TensorShardConfigError) as err:
        with deepspeed.zero.Init(config_dict_or_path=base_config(**overrides)):
            built.append(torch.nn.Linear(4, 2))
    assert message in str(err.value)
    assert built == []


@pytest.mark.parametrize("overrides,message", BAD, ids=[m for _, m in BAD])
def test_bad_config_fails_at_initialize_naming_the_key(overrides, message):
    config = base_config(**overrides)
    model = torch.nn.Linear(4, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config["bf16"] = {"enabled": True}  # an engine that got past validation would cast the model to bf16
    with pytest.raises(TensorShardConfigError) as err:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert message in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())


def test_node_local_storage_inside_zero_optimization_is_refused_naming_the_key():
    """DeepSpeed reads the key only from the ``checkpoint`` block; its ZeRO model refuses it, as for stock."""
    with pytest.raises(ValueError, match=r"use_node_local_storage\n  Extra inputs are not permitted"):
        initialize(base_config(zero_optimization={"stage": 2, "use_node_local_storage": True}))


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


def test_start_up_line_says_which_buckets_were_chosen_and_why(ds_log):
    _, _, opt = initialize(base_config())  # a CPU rank, gloo, no bucket key: the layout measured faster there
    assert (opt.layout.layout, opt.bucket_numel) == ("windows", DEFAULT_BUCKET_NUMEL)
    last_start_up_line = lambda: [line for line in ds_log if line.startswith("ds_tensorshard: stage 2")][-1]  # noqa: E731
    assert f"{opt.layout.layout} of at most 4,000,000 elements ({opt.layout.why})" in last_start_up_line()
    assert "windows: measured faster than stripes on CPU ranks (torch (gloo) at 1 rank)" in last_start_up_line()
    _, _, opt = initialize(base_config(tensorshard={"enabled": True, "bucket_layout": "stripes", "bucket_numel": 8}))
    assert opt.stripes and opt.bucket_numel == 8
    assert "stripes of at most 8 elements (bucket_layout and tensorshard.bucket_numel set" in last_start_up_line()
    _, _, opt = initialize(base_config(zero_optimization={"stage": 2, "reduce_bucket_size": 9}))
    assert opt.bucket_numel == 9 and "zero_optimization.reduce_bucket_size 9 set in the config" in opt.layout.why


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
            ds_tensorshard.config.engine_checks.validate_engine_config(config)
        assert ("(or stage 1)" in str(err.value)) == (stage == 2 and fp16_refusal(1, version) is None)
    else:
        assert ds_tensorshard.config.engine_checks.validate_engine_config(config).enabled


@pytest.mark.parametrize("version", ["2.4.1", "2.12.1+cu126", "2.16.0", "2.16.0.dev20261201"])
def test_unsupported_torch_versions_are_named(version, monkeypatch):
    monkeypatch.delenv("DS_TENSORSHARD_UNTESTED_TORCH", raising=False)
    with pytest.raises(
        UnsupportedTorchVersion, match=rf"supports torch >=2\.13\.0,<2\.16 but torch {re.escape(version)} is"
    ):
        check_torch_version(version)
    monkeypatch.setenv("DS_TENSORSHARD_UNTESTED_TORCH", "1")
    with pytest.warns(UserWarning, match=rf"torch {re.escape(version)} is installed.*DS_TENSORSHARD_UNTESTED_TORCH=1"):
        check_torch_version(version)


def test_supported_torch_versions_pass():
    for version in ("2.13.0+cpu", "2.14.1", "2.15.0+cu128"):
        check_torch_version(version)
    check_torch_version(torch.__version__)


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
    said = "'zero_optimization.stage' 0: no ZeRO-1/2 optimizer to replace, this engine runs as stock"
    assert said in "\n".join(ds_log)
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


def test_odd_allgather_bucket_size_is_refused_as_stock_refuses_it():
    """Stock's ZeRO-1/2 constructor asserts it (DeepSpeed's test_zero.py expects that AssertionError); ds_tensorshard,
    which does not use the key, refuses it at initialize with stock's message and exception type."""
    with pytest.raises(AssertionError, match="allgather_bucket_size must be a multiple of nccl_start_alignment"):
        initialize(base_config(zero_optimization={"stage": 2, "allgather_bucket_size": 1001}))
    _, _, opt = initialize(base_config(zero_optimization={"stage": 2, "allgather_bucket_size": 1000}))
    assert isinstance(opt, ds_tensorshard.TensorShardOptimizer)


@pytest.mark.parametrize(
    "zero",
    [
        {"stage": 2, "offload_optimizer": {"device": OffloadDeviceEnum.cpu}},  # as DeepSpeed's own tests write it
        {"stage": 1, "offload_optimizer": {"device": OffloadDeviceEnum.cpu, "pin_memory": False}},
        {"stage": 2, "cpu_offload": True},  # deprecated; stock reads it as offload_optimizer device cpu
    ],
)
def test_offload_spelled_as_deepspeed_allows_is_followed(zero):
    """DeepSpeed's OffloadDeviceEnum (a str enum: str() of it is 'OffloadDeviceEnum.cpu' on Python 3.11) and the
    deprecated ``cpu_offload: true`` both mean ZeRO-Offload, as for stock: the owners' masters are host copies."""
    _, engine, opt = initialize(base_config(zero_optimization=zero))
    assert isinstance(opt, ds_tensorshard.TensorShardOptimizer) and engine.zero_cpu_offload()
    assert opt.host is not None and type(opt.optimizer).__name__ == "DeepSpeedCPUAdam"


@pytest.mark.parametrize(
    "zero", [{"stage": 2, "cpu_offload": False}, {"stage": 2, "offload_optimizer": {"device": OffloadDeviceEnum.none}}]
)
def test_offload_turned_off_as_deepspeed_allows_keeps_masters_on_the_device(zero):
    _, engine, opt = initialize(base_config(zero_optimization=zero))
    assert not engine.zero_cpu_offload() and opt.host is None


OFFLOADED = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}


def assert_stocks_cpu_optimizer_steps_on_host_masters(optimizer: dict, inner: str) -> None:
    """As stock's engine chooses (_configure_basic_optimizer): DeepSpeed's CPU optimizer ``inner`` for the config's
    ``optimizer``, over owned fp32 masters that are host copies (never the model's own storage), with its state
    made on the host at the first step."""
    model, engine, opt = initialize(base_config(optimizer=optimizer, zero_optimization=dict(OFFLOADED)))
    assert type(opt.optimizer).__name__ == inner and opt.host is not None
    assert all(m.device.type == "cpu" for m in opt.shard.masters.values()) and not opt.shard.views
    loss = engine(torch.randn(2, 4)).square().sum()
    engine.backward(loss)
    before = opt.host.traffic.to_device
    engine.step()
    owned = sum(m.numel() for m in opt.shard.masters.values())
    assert opt.host.traffic.to_device - before == 4 * owned  # each updated fp32 tensor crossed back once
    assert all(t.device.type == "cpu" for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    if inner == "DeepSpeedCPUAdam":
        assert opt.optimizer.adam_w_mode  # AdamW: stock's adamw_mode


def test_offload_runs_stocks_cpu_optimizer_on_host_masters():
    """AdamW: DeepSpeedCPUAdam, whose op the install builds (launch/setup_env.sh). DeepSpeed's CPU Adagrad and
    Lion, each a JIT build of its own that nothing else needs: tests/multiprocess/test_host_optimizers.py."""
    assert_stocks_cpu_optimizer_steps_on_host_masters({"type": "AdamW", "params": {"lr": 1e-3}}, "DeepSpeedCPUAdam")


def test_offloaded_muon_orthogonalizes_on_the_device_and_steps_on_the_host():
    """DeepSpeed's Muon with offload: its auxiliary Adam is DeepSpeedCPUAdam (stock's choice for offload); each
    Muon matrix's gradient stays on the device (safe_get_full_grad reads it there), and only its momentum (lent
    and stored back) and update cross; the other tensors' gradients cross to the host once, and every updated
    tensor crosses back once."""
    muon = {"type": "Muon", "params": {"lr": 1e-2, "momentum": 0.95, "weight_decay": 0.1}}
    model, engine, opt = initialize(base_config(optimizer=muon, zero_optimization=dict(OFFLOADED)))
    assert type(opt.optimizer.aux_optimizer).__name__ == "DeepSpeedCPUAdam"
    assert opt.shard.on_device == {model[0].weight, model[1].weight}
    matrices = sum(p.numel() for p in opt.shard.on_device)
    owned = sum(m.numel() for m in opt.shard.masters.values())
    for _ in range(2):
        before = dict(vars(opt.host.traffic))
        engine.backward(engine(torch.randn(2, 4)).square().sum())
        reduced = safe_get_full_grad(model[0].weight)
        opt.prepare_step()  # from here the step's gradient is the one kept on the device
        assert torch.equal(safe_get_full_grad(model[0].weight), reduced)
        sections = opt.shard.grads.section_of
        muon_sections = {id(sections[p]) for p in opt.shard.on_device}  # the matrices' gradient buffers
        assert all(sections[p].step.device == engine.device for p in opt.shard.on_device)
        assert muon_sections.isdisjoint(id(sections[p]) for p in opt.shard.masters if p not in opt.shard.on_device)
        engine.step()
        crossed = {k: v - before[k] for k, v in vars(opt.host.traffic).items()}
        lent = 4 * matrices if engine.global_steps > 1 else 0  # the first step's momentum starts as zeros there
        # to the host: the vectors' gradients, the sum of squares of each matrix buffer for the norm (fp64),
        # the matrices' momentum and their update
        to_host = 4 * (owned - matrices) + 8 * len(muon_sections) + 8 * matrices
        assert crossed == {"to_host": to_host, "to_device": lent + 4 * owned}, crossed
    state = opt.optimizer.state
    keys = {k for m in opt.shard.masters.values() for k in state[m]}
    assert keys == {"momentum_buffer", "exp_avg", "exp_avg_sq", "step"}
    assert all(t.device.type == "cpu" for s in state.values() for t in s.values() if torch.is_tensor(t))


def test_offloaded_muon_with_an_accelerator_adam_is_refused():
    from deepspeed.ops.adam import FusedAdam
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    def muon(params):
        weights, vectors = [], []
        for p in params:
            (weights if p.dim() >= 2 else vectors).append(p)
        groups = [
            dict(params=weights, use_muon=True, lr=1e-2, momentum=0.95, weight_decay=0.0),
            dict(params=vectors, use_muon=False, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
        ]
        return MuonWithAuxAdam(groups, adam_optimizer=FusedAdam)

    config = {k: v for k, v in base_config(zero_optimization=dict(OFFLOADED)).items() if k != "optimizer"}
    with pytest.raises(TensorShardConfigError, match="with FusedAdam as its auxiliary Adam: its kernel runs"):
        initialize(config, optimizer=muon)


def test_cpu_optimizer_without_offload_is_refused():
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    config = {k: v for k, v in base_config().items() if k != "optimizer"}
    with pytest.raises(TensorShardConfigError, match="DeepSpeedCPUAdam updates tensors in host memory only"):
        initialize(config, optimizer=lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3))


def test_elastic_store_warning_only_where_torchrun_restarts_with_the_shared_store():
    from ds_tensorshard.config.elastic import elastic_store_warning

    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in elastic_store_warning(shared)
    assert elastic_store_warning({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None  # a new store a round
    assert elastic_store_warning({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None  # never restarted
    assert elastic_store_warning({}) is None  # not under torchrun
