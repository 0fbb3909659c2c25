"""A benchmark run's command, as ``results.md`` records it, and several runs merged into one published figure
(``python -m ds_tensorshard.bench.figure``); in process, no run started."""

from __future__ import annotations

import argparse
import json
import shlex

from ds_tensorshard.bench import figure
from ds_tensorshard.bench.runner import PHASES, add_arguments, command_line, markdown, of_rounds


def bench_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def fake_results(label: str, step_s: float) -> dict:
    """One configuration's summary with the keys results.md and the plot read (the values made up)."""
    return {
        "config": "ts_torch",
        "label": label,
        "world_size": 2,
        "numel": 1000,
        "step_s": step_s,
        "cpu_s": step_s,
        **{phase: step_s / len(PHASES) for phase in PHASES},
        "sent_bytes_per_rank": 2**20,
        "host_bytes_per_rank": 0,
        "peak_rss_bytes": [2**30, 2**30],
        "optimizer_state_bytes_fullest": 2**20,
        "optimizer_state_bytes_total": 2**21,
        "optimizer_state_fullest_over_ideal": 1.0,
        "aten_ops_per_step": 10,
        "host_syncs_per_step": 0,
        "losses_by_step": [[7.0], [6.5]],
    }


def test_the_command_in_results_md_gives_back_the_run_arguments():
    argv = ["--configs", "zero2", "ts_mpi", "--ranks", "4", "--global-batch", "4", "--steps", "3", "--out", "a b"]
    args = bench_arguments(argv)
    command = command_line(vars(args))
    assert command == "ds-tensorshard bench --configs zero2 ts_mpi --ranks 4 --global-batch 4 --steps 3 --out 'a b'"
    assert vars(bench_arguments(shlex.split(command)[2:])) == vars(args)
    table = markdown([fake_results("ds_tensorshard (mpi)", 1.0)], args)
    assert table.splitlines()[0] == f"Command: `{command}`"


def test_alternating_rounds_report_the_median_of_each_configurations_rounds():
    args = bench_arguments(["--configs", "ts_torch", "ddp_zero", "--rounds", "3"])
    assert args.rounds == 3 and "--rounds 3" in command_line(vars(args))
    rounds = [fake_results("ds_tensorshard (torch)", s) for s in (0.9, 0.5, 0.6)]
    merged = of_rounds(rounds)
    assert (merged["step_s"], merged["cpu_s"], merged["step_s_rounds"]) == (0.6, 0.6, [0.9, 0.5, 0.6])
    assert merged["reduce_s"] == 0.6 / len(PHASES)
    table = markdown([merged], args)
    assert "then of 3 alternating rounds" in table and "ds_tensorshard (torch) 0.900, 0.500, 0.600" in table


def test_runs_merge_into_one_figure_with_the_commands_that_make_it(tmp_path):
    folder = tmp_path / "results_pair"
    for name, ranks, step_s in (("2ranks", "2", 1.5), ("4ranks", "4", 2.5)):
        args = bench_arguments(["--configs", "zero2", "--ranks", ranks, "--global-batch", ranks, "--out", "/elsewhere"])
        run = folder / "runs" / name
        run.mkdir(parents=True)
        results = [fake_results(f"run at {ranks} ranks", step_s)]
        (run / "results.json").write_text(json.dumps({"arguments": vars(args), "results": results}))
        (run / "results.md").write_text(markdown(results, args))
    figure.main([str(folder), "--also", "echo extra > comm.jsonl"])
    merged = json.loads((folder / "results.json").read_text())
    assert list(merged["runs"]) == ["2ranks", "4ranks"]
    assert merged["runs"]["4ranks"]["results"][0]["step_s"] == 2.5
    assert merged["commands"] == [
        f"ds-tensorshard bench --configs zero2 --out {folder}/runs/2ranks",
        f"ds-tensorshard bench --configs zero2 --ranks 4 --global-batch 4 --out {folder}/runs/4ranks",
        "echo extra > comm.jsonl",
        f"python -m ds_tensorshard.bench.figure {folder} --also 'echo extra > comm.jsonl'",
    ]
    text = (folder / "results.md").read_text()
    assert all(command in text for command in merged["commands"])
    assert "## 2ranks" in text and "| run at 4 ranks | 2.500 |" in text
    assert (folder / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
