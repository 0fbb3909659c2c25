"""The DeepSpeed-suite runner's bookkeeping (tests/helpers/deepspeed_suite): which files it selects, how a tree of
another release is refused, how records are read, and how each test that passes stock is classified."""

from __future__ import annotations

import json

import pytest

from tests.helpers.deepspeed_suite.events import read_from
from tests.helpers.deepspeed_suite.run import check_tree, selection
from tests.helpers.deepspeed_suite.table import file_row, verdict


def result(outcome: str, *kinds: str, message: str = "") -> dict:
    return {"outcome": outcome, "message": message, "events": [[kind, ""] for kind in kinds]}


def test_each_stock_zero12_test_is_classified_by_its_plugin_run():
    stock = {
        "a": result("passed", "zero12"),
        "b": result("passed", "zero12"),
        "c": result("passed", "zero12"),
        "d": result("passed", "zero12"),
        "e": result("passed"),  # stage 0 or 3: not a ZeRO-1/2 test
        "f": result("failed", "zero12"),  # fails stock: not counted
        "g": result("skipped"),
    }
    plugin = {
        "a": result("passed", "zero12", "engaged"),
        "b": result("failed", "refused", message="TensorShardConfigError: 'x' is not supported"),
        "c": result("failed", "zero12", "engaged", message="AttributeError: y"),
        "d": result("passed", "zero12"),  # passed, but stock's optimizer: the forcing did not reach it
    }
    row, problems = file_row(stock, plugin)
    assert row == {
        "selected": 7,
        "stock pass": 5,
        "stock ZeRO-1/2": 4,
        "engaged": 3,
        "pass": 1,
        "refused": 1,
        "fail": 1,
        "not engaged": 1,
    }
    assert problems == [
        ("refused", "b", "TensorShardConfigError: 'x' is not supported"),
        ("fail", "c", "AttributeError: y"),
        ("not engaged", "d", ""),
    ]
    assert verdict(None) == "not engaged"


def test_records_are_read_whole_lines_only(tmp_path):
    path = tmp_path / "events"
    path.write_text(json.dumps({"pid": 1, "kind": "zero12", "detail": "X"}) + "\n" + '{"pid": 2, "ki')
    records, offset = read_from(str(path), 0)
    assert [r["kind"] for r in records] == ["zero12"]
    with open(path, "a") as f:
        f.write('nd": "engaged", "detail": "2"}\n')
    records, offset = read_from(str(path), offset)
    assert [r["kind"] for r in records] == ["engaged"] and offset == path.stat().st_size
    assert read_from(str(tmp_path / "none"), 0) == ([], 0)


def test_the_selection_is_every_unit_test_file_that_configures_zero_but_inference(tmp_path):
    unit = tmp_path / "tests" / "unit"
    for name, text in {
        "v1/zero/test_a.py": '{"zero_optimization": {"stage": 2}}',
        "runtime/test_b.py": "zero_stage = 1",
        "runtime/test_c.py": "no ZeRO here",
        "inference/test_d.py": '{"zero_optimization": {}}',
        "v1/zero/helper.py": '{"zero_optimization": {}}',
    }.items():
        (unit / name).parent.mkdir(parents=True, exist_ok=True)
        (unit / name).write_text(text)
    assert selection(tmp_path / "tests") == ["unit/runtime/test_b.py", "unit/v1/zero/test_a.py"]


def test_a_tree_of_another_release_is_refused_unless_asked_for(tmp_path, capsys):
    from importlib.metadata import version

    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "common.py").write_text("")
    (tmp_path / "version.txt").write_text("0.0.1\n")
    with pytest.raises(SystemExit, match=f"DeepSpeed 0.0.1, the installed DeepSpeed is {version('deepspeed')}: check"):
        check_tree(tmp_path, any_version=False)
    assert check_tree(tmp_path, any_version=True) == tmp_path / "tests"
    assert "warning:" in capsys.readouterr().out
    (tmp_path / "version.txt").write_text(version("deepspeed"))
    assert check_tree(tmp_path, any_version=False) == tmp_path / "tests"
    with pytest.raises(SystemExit, match="not a DeepSpeed source tree"):
        check_tree(tmp_path / "tests", any_version=False)


def test_the_plugin_run_gives_every_stage_3_config_the_block_and_leaves_the_rest(tmp_path, monkeypatch):
    from ds_tensorshard.config.schema import BLOCK, ENV_CONFIG
    from tests.helpers.deepspeed_suite import forcing

    assert (forcing.BLOCK, forcing.ENV_CONFIG) == (BLOCK, ENV_CONFIG)
    monkeypatch.delenv(ENV_CONFIG, raising=False)
    stage3 = {"train_batch_size": 2, "zero_optimization": {"stage": 3}}
    assert forcing.with_block(stage3) == {**stage3, BLOCK: {"enabled": True}}
    assert BLOCK not in stage3  # the caller's dict is not changed
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(stage3))
    assert forcing.with_block(str(path)) == {**stage3, BLOCK: {"enabled": True}}  # a file's path, as DeepSpeed reads
    monkeypatch.setenv(ENV_CONFIG, '{"comm_backend": "mpi"}')
    assert forcing.with_block(stage3)[BLOCK] == {"enabled": True, "comm_backend": "mpi"}
    own = {**stage3, BLOCK: {"enabled": False}}
    for unchanged in ({"zero_optimization": {"stage": 2}}, {"zero_optimization": {"stage": 0}}, {}, own, None):
        assert forcing.with_block(unchanged) is unchanged
    assert forcing.with_block(str(tmp_path / "absent.json")) == str(tmp_path / "absent.json")


def test_stage_3_tests_are_counted_by_their_engines_and_inits():
    stock = {
        "engine": result("passed", "zero3"),
        "init": result("passed", "init3"),
        "refused": result("passed", "zero3"),
        "fails": result("passed", "init3", "zero3"),
        "no optimizer": result("passed", "zero3"),
        "zero2": result("passed", "zero12"),
    }
    plugin = {
        "engine": result("passed", "zero3", "engaged3"),
        "init": result("passed", "init3", "owned3"),
        "refused": result("failed", "refused", message="TensorShardConfigError: 'k'"),
        "fails": result("failed", "init3", "owned3", message="AssertionError"),
        "no optimizer": result("passed", "zero3"),  # DeepSpeedZeRoOffload: stock's, by design
        "zero2": result("passed", "zero12", "engaged"),
    }
    row, problems = file_row(stock, plugin, "3")
    assert row == {
        "selected": 6,
        "stock pass": 6,
        "stock ZeRO-3": 5,
        "engaged": 4,
        "pass": 2,
        "refused": 1,
        "fail": 1,
        "not engaged": 1,
    }
    assert [(outcome, nodeid) for outcome, nodeid, _ in problems] == [
        ("refused", "refused"),
        ("fail", "fails"),
        ("not engaged", "no optimizer"),
    ]
    assert file_row(stock, plugin)[0]["stock ZeRO-1/2"] == 1  # the stage-1/2 table is unchanged
