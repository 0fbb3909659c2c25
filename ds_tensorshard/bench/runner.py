"""``ds-tensorshard bench``: stock DeepSpeed stage 0 / ZeRO-1 / ZeRO-2, PyTorch DDP + ZeroRedundancyOptimizer,
PyTorch FSDP2 in its ZeRO-2 form and ds_tensorshard (torch and mpi backends), side by side on the same model,
data and ranks; or, with ``--configs two_...``, two models trained in the same processes (stock ZeRO-2 each;
ds_tensorshard with a plan per model, stepped in turn; ds_tensorshard with one joint plan and ``step_many``).

Each configuration runs as its own ``mpiexec -n RANKS`` job of :mod:`.worker` (a fresh set of
processes, so peak RSS is its own); this module launches them one after another (``--rounds K``: the whole list K
times over, alternating, each figure then the median of its rounds' medians), then writes
``results.json``, ``results.md`` (its command, table + ratio matrix) and ``results.png`` into ``--out``.
:mod:`.figure` merges several runs into one published figure.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ds_tensorshard.bench.configs import (
    CONFIGS,
    LAYOUT_CONFIGS,
    MASTER_CONFIGS,
    OFFLOAD_CONFIGS,
    ONE_MODEL_CONFIGS,
    PARAM_OFFLOAD_CONFIGS,
    RUN_ARGUMENTS,
    SHARDED,
    STAGE3_CONFIGS,
    TWO_MODEL_CONFIGS,
    add_run_arguments,
    second_model_shape,
)
from ds_tensorshard.commands.models import LORA_RANK

LABELS = {
    "stage0": "stock stage 0",
    "zero1": "stock ZeRO-1",
    "zero2": "stock ZeRO-2",
    "ddp_zero": "DDP + ZeroRedundancyOptimizer",
    "fsdp2": "PyTorch FSDP2 (ZeRO-2 form)",
    "fsdp2_reshard": "PyTorch FSDP2 (ZeRO-3 form, resharded after forward)",
    "zero3": "stock ZeRO-3",
    "ts3_torch": "ds_tensorshard stage 3 (torch)",
    "ts3_mpi": "ds_tensorshard stage 3 (mpi)",
    "zero3_offload_param": "stock ZeRO-3 + offload_param",
    "ts3_offload_param": "ds_tensorshard stage 3 + offload_param",
    "ts_torch": "ds_tensorshard (torch)",
    "ts_mpi": "ds_tensorshard (mpi)",
    "zero2_offload": "stock ZeRO-2 + offload",
    "ts_offload": "ds_tensorshard + offload (torch)",
    "ts_offload_mpi": "ds_tensorshard + offload (mpi)",
    "zero2_bf16_masters": "stock ZeRO-2, bf16 masters and states",
    "ts_bf16_masters": "ds_tensorshard, bf16 masters and states",
    "ts_torch_windows": "ds_tensorshard (torch), windows",
    "ts_torch_stripes": "ds_tensorshard (torch), stripes",
    "ts_mpi_windows": "ds_tensorshard (mpi), windows",
    "ts_mpi_stripes": "ds_tensorshard (mpi), stripes",
    "ts_torch_flat": "ds_tensorshard (torch), flat parameters",
    "ts_mpi_flat": "ds_tensorshard (mpi), flat parameters",
    "two_zero2": "2 models: stock ZeRO-2 each",
    "two_ts_separate": "2 models: ds_tensorshard, plan each, in turn",
    "two_ts_joint": "2 models: ds_tensorshard, joint plan, step_many",
}
PHASES = ("fwd_bwd_s", "reduce_s", "optimizer_s", "gather_s")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_config(config: str, args: argparse.Namespace, raw_dir: str, tree: str | None = None) -> list[dict]:
    """One configuration's ``mpiexec`` job (``tree``: its workers from that source tree, ``--baseline``); each
    rank's results."""
    mpiexec = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        raise SystemExit("ds-tensorshard bench launches its ranks with mpiexec: pip install 'ds_tensorshard[mpi]'")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(DS_ACCELERATOR=env.get("DS_ACCELERATOR", "cpu"), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    raw_dir = os.path.abspath(raw_dir)
    if tree is not None:  # its workers run in the tree: ``python -m`` looks in the working directory first
        env["PYTHONPATH"] = os.path.abspath(tree)
        raw_dir = os.path.join(raw_dir, "baseline")
        os.makedirs(raw_dir, exist_ok=True)
    cmd = [
        mpiexec,
        "-n",
        str(args.ranks),
        sys.executable,
        "-m",
        "ds_tensorshard.bench.worker",
        config,
        raw_dir,
        "--port",
        str(free_port()),
    ]
    for name in RUN_ARGUMENTS:
        if getattr(args, name) is not None:
            cmd += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=None if tree is None else os.path.abspath(tree),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )  # its ranks die with it: see kill_group
    try:
        out, err = proc.communicate(timeout=args.timeout)
    finally:
        kill_group(proc)
    if proc.returncode != 0:
        raise SystemExit(f"configuration {config} failed:\n{out[-3000:]}\n{err[-3000:]}")
    ranks = []
    for rank in range(args.ranks):
        with open(os.path.join(raw_dir, f"{config}.rank{rank}.json")) as f:
            ranks.append(json.load(f))
    return ranks


def kill_group(proc: subprocess.Popen) -> None:
    """Kill the process group ``proc`` leads (a configuration's mpiexec and every rank it started, on a timeout,
    Ctrl-C or SIGTERM), if any of it is still alive, and reap ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_config's cleanup, unlike the default action


def summarize(config: str, ranks: list[dict], baseline: bool = False) -> dict[str, Any]:
    """Per step, the slowest rank counts; then medians over steps (``baseline``: run from ``--baseline``'s tree,
    whose workers may predate the operator counts)."""
    steps = list(zip(*(r["steps"] for r in ranks)))
    median = lambda key: statistics.median(max(rank_row[key] for rank_row in step) for step in steps)  # noqa: E731
    state = [r["optimizer_state_bytes"] for r in ranks]
    return {
        "config": config,
        "label": LABELS[config] + (" @ baseline" if baseline else ""),
        "world_size": ranks[0]["world_size"],
        "numel": ranks[0]["numel"],
        "step_s": median("step_s"),
        "cpu_s": median("cpu_s"),
        **{k: median(k) for k in PHASES},
        "sent_bytes_per_rank": median("sent_bytes"),
        "host_bytes_per_rank": median("host_bytes"),
        "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks],
        "optimizer_state_bytes_fullest": max(state),
        "optimizer_state_bytes_total": sum(state),
        "optimizer_state_fullest_over_ideal": max(state) * len(state) / sum(state),
        "aten_ops_per_step": max(r.get("aten_ops_per_step", 0) for r in ranks),
        "host_syncs_per_step": max(r.get("host_syncs_per_step", 0) for r in ranks),
        "aten_ops_per_step_by_rank": [r.get("aten_ops_per_step", 0) for r in ranks],
        **(
            {
                "newton_schulz_fullest_over_ideal": max(r["newton_schulz_work"] for r in ranks)
                * len(ranks)
                / ranks[0]["newton_schulz_total"]
            }
            if ranks[0].get("newton_schulz_total")
            else {}
        ),
        "losses": ranks[0]["steps"][-1]["losses"],
        "losses_by_step": ranks[0]["losses_by_step"],
    }


def of_rounds(rounds: list[dict]) -> dict[str, Any]:
    """One configuration's summaries over alternating rounds as one: the last round's, with each time (step, CPU,
    phases) the median of the rounds' and every round's step time beside it (``step_s_rounds``), each rank's peak
    RSS its highest."""
    times = ("step_s", "cpu_s", *PHASES)
    return {
        **rounds[-1],
        **{key: statistics.median(r[key] for r in rounds) for key in times},
        "step_s_rounds": [r["step_s"] for r in rounds],
        "peak_rss_bytes": [max(ranks) for ranks in zip(*(r["peak_rss_bytes"] for r in rounds))],
    }


def markdown(results: list[dict], args: argparse.Namespace) -> str:
    """``results.md``: what was run, the table of every configuration, the notes, and the step-time ratios."""
    rounds = getattr(args, "rounds", 1)  # runs from before --rounds
    lines = [
        f"Command: `{command_line(vars(args))}`",
        "",
        f"{_models_line(args)} {results[0]['numel'] / 1e6:.1f}M {'trainable ' if args.model == 'lora' else ''}"
        f"parameters; global batch {args.global_batch} x {args.seq} tokens; {args.ranks} ranks; {args.dtype}; "
        f"median of {args.steps} steps after {args.warmup} warm-up"
        f"{f', then of {rounds} alternating rounds' if rounds > 1 else ''}. "
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs.",
        "",
        "| configuration | step s | fwd+bwd | reduce | optimizer | gather | CPU s | peak RSS/rank MiB | "
        "opt. state fullest rank MiB | fullest / ideal | opt. state bytes/param | sent/rank/step MiB | ATen ops/step | "
        "host syncs/step |",
        "|---" * 14 + "|",
    ]
    for r in results:
        lines.append(
            f"| {r['label']} | {r['step_s']:.3f} | {r['fwd_bwd_s']:.3f} | {r['reduce_s']:.3f} | "
            f"{r['optimizer_s']:.3f} | {r['gather_s']:.3f} | {r['cpu_s']:.3f} | "
            f"{' / '.join(_mib(b) for b in r['peak_rss_bytes'])} | {_mib(r['optimizer_state_bytes_fullest'])} | "
            f"{r['optimizer_state_fullest_over_ideal']:.4f} | {r['optimizer_state_bytes_total'] / r['numel']:.2f} | "
            f"{_mib(r['sent_bytes_per_rank'])} | {r['aten_ops_per_step']:,} | {r['host_syncs_per_step']:,} |"
        )
    lines += _notes(results)
    if rounds > 1:
        lines += [
            "",
            "Step s of each round, in the order run: "
            + "; ".join(f"{r['label']} " + ", ".join(f"{s:.3f}" for s in r["step_s_rounds"]) for r in results),
        ]
    lines += [
        "",
        "Step-time ratio (row / column):",
        "",
        "| | " + " | ".join(r["label"] for r in results) + " |",
        "|---" * (len(results) + 1) + "|",
    ]
    for row in results:
        lines.append(
            f"| {row['label']} | " + " | ".join(f"{row['step_s'] / col['step_s']:.2f}" for col in results) + " |"
        )
    return "\n".join(lines) + "\n"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def _models_line(args: argparse.Namespace) -> str:
    """The start of ``results.md``: the model (or the two models) benchmarked."""
    if args.configs[0] in TWO_MODEL_CONFIGS:
        second = second_model_shape(args.width, args.layers)
        return (
            f"Two GPTs trained in the same processes, vocab {args.vocab}: {args.layers} layers x width "
            f"{args.width} and {second['layers']} layers x width {second['width']}, together"
        )
    if args.model == "lora":
        return (
            f"Model: LoRA-like, frozen base of {args.layers} linear layers of width {args.width}, vocab {args.vocab}, "
            f"{2 * args.layers:,} trainable rank-{LORA_RANK} adapter tensors, optimizer {args.optimizer};"
        )
    return f"Model: GPT, {args.layers} layers, width {args.width}, vocab {args.vocab}, optimizer {args.optimizer},"


def _notes(results: list[dict]) -> list[str]:
    """The lines under the table: what the operator counts are, host traffic, Newton-Schulz work, first losses."""
    lines = [
        "",
        "ATen ops/step, host syncs/step: the ATen operators one step() dispatches after backward and the host syncs "
        "among them (scalar reads, `aten._local_scalar_dense`, and device-to-host copies; on CPU ranks every tensor "
        "is on the host, so only the scalar reads), on one more, untimed step, the rank with the most.",
    ]
    if "step_s_by_round" in results[0]:
        lines += [
            "",
            "Step s of each round: "
            + "; ".join(f"{r['label']} {'/'.join(f'{s:.3f}' for s in r['step_s_by_round'])}" for r in results),
        ]
    if any(r["host_bytes_per_rank"] for r in results):
        lines += [
            "",
            "ZeRO-Offload, bytes between the accelerator and host memory per step, fullest rank (on CPU: what would "
            "cross): " + "; ".join(f"{r['label']} {_mib(r['host_bytes_per_rank'])} MiB" for r in results),
        ]
    if any("newton_schulz_fullest_over_ideal" in r for r in results):
        lines += [
            "",
            "Newton-Schulz work (m n min(m, n) per matrix orthogonalized) on the fullest rank over an even "
            "share: "
            + "; ".join(
                f"{r['label']} {r['newton_schulz_fullest_over_ideal']:.3f}"
                for r in results
                if "newton_schulz_fullest_over_ideal" in r
            ),
        ]
    return lines + [
        "",
        "Loss of the first model at the first steps, rank 0: "
        + "; ".join(f"{r['label']} " + ", ".join(f"{s[0]:.6f}" for s in r["losses_by_step"][:2]) for r in results),
    ]


def plot(results: list[dict], path: str) -> None:
    """``results.png``: the median time of each phase per configuration, and the fullest rank's peak RSS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    draw(results, left, right)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw(results: list[dict], left: Any, right: Any) -> None:
    """One run's plot on two matplotlib axes: phases stacked per configuration (left), peak RSS (right)."""
    breaks = {" (": "\n(", ": ": ":\n", ", ": ",\n", " + ZeroRedundancyOptimizer": "\n+ ZeroRedundancy-\nOptimizer"}
    labels = [functools.reduce(lambda text, pair: text.replace(*pair), breaks.items(), r["label"]) for r in results]
    bottom = [0.0] * len(results)
    for phase in PHASES:
        values = [r[phase] for r in results]
        left.bar(labels, values, bottom=bottom, label=phase[:-2].replace("_", "+"))
        bottom = [b + v for b, v in zip(bottom, values)]
    left.set_ylabel("median time per phase (s)")
    left.legend()
    left.tick_params(axis="x", labelsize=7)
    right.bar(labels, [max(r["peak_rss_bytes"]) / 2**30 for r in results], color="gray")
    right.set_ylabel("peak RSS, fullest rank (GiB)")
    right.tick_params(axis="x", labelsize=7)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS),
        choices=ONE_MODEL_CONFIGS + TWO_MODEL_CONFIGS,
        help=f"one-model configurations (default: all but ZeRO stage 3's {', '.join(STAGE3_CONFIGS)} and with "
        f"offload_param {', '.join(PARAM_OFFLOAD_CONFIGS)}, ZeRO-Offload's {', '.join(OFFLOAD_CONFIGS)}, the bf16 "
        f"masters' {', '.join(MASTER_CONFIGS)} and the explicit bucket layouts {', '.join(LAYOUT_CONFIGS)}) or "
        f"two-model ones ({', '.join(TWO_MODEL_CONFIGS)}), not both in one run",
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the configurations this many times over, alternating, and report the median of the rounds",
    )
    parser.add_argument(
        "--baseline",
        help="a source tree (another commit's worktree): each ds_tensorshard configuration runs from it too "
        "(PYTHONPATH=BASELINE), next to the same one from this tree in every round",
    )
    add_run_arguments(parser)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds allowed per configuration")
    parser.add_argument("--out", default="bench_results")


def command_line(arguments: Mapping[str, Any], out: str | None = None) -> str:
    """The ``ds-tensorshard bench`` command of a run's arguments (``results.json``'s), its options at their
    defaults left out; ``out`` in place of its ``--out`` where given."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    words = ["ds-tensorshard", "bench"]
    for key, default in vars(parser.parse_args([])).items():
        value = out if key == "out" and out is not None else arguments.get(key, default)
        if value != default:
            words += ["--" + key.replace("_", "-"), *map(str, value if isinstance(value, list) else [value])]
    return shlex.join(words)


def run(args: argparse.Namespace) -> list[dict]:
    if args.optimizer != "adamw" and ({"ddp_zero"} | set(TWO_MODEL_CONFIGS)) & set(args.configs):
        if args.configs == list(CONFIGS):  # the default set: DDP + ZeroRedundancyOptimizer runs AdamW only
            args.configs = [c for c in CONFIGS if c != "ddp_zero"]
        else:
            raise SystemExit(
                f"--optimizer {args.optimizer} runs the one-model DeepSpeed configurations only "
                "(not ddp_zero or the two-model ones)"
            )
    if set(MASTER_CONFIGS) & set(args.configs) and args.dtype != "bf16":
        raise SystemExit(f"--configs {' '.join(MASTER_CONFIGS)}: bf16 master weights need --dtype bf16")
    if len({c in TWO_MODEL_CONFIGS for c in args.configs}) > 1:
        raise SystemExit(
            "--configs: one-model and two-model configurations are compared in separate runs "
            f"(two-model: {', '.join(TWO_MODEL_CONFIGS)})"
        )
    raw_dir = os.path.join(args.out, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    from ds_tensorshard.commands.progress import bar as progress_bar

    trees = (None,) if args.baseline is None else (None, args.baseline)
    runs = [(c, tree) for c in args.configs for tree in trees if tree is None or c in SHARDED]
    rounds: dict[tuple[str, str | None], list[dict]] = {run: [] for run in runs}
    with progress_bar(len(runs) * args.rounds, "bench", "config") as bar:  # silent unless on a terminal
        for _ in range(args.rounds):
            for config, tree in runs:
                bar.set_postfix_str(LABELS[config])
                ranks = run_config(config, args, raw_dir, tree)
                rounds[config, tree].append(summarize(config, ranks, tree is not None))
                bar.update(1)
    results = [of_rounds(rounds[run]) for run in runs]
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"arguments": {k: v for k, v in vars(args).items() if k != "func"}, "results": results}, f, indent=2)
    table = markdown(results, args)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    plot(results, os.path.join(args.out, "results.png"))
    print(table)
    print(f"wrote {args.out}/results.json, results.md, results.png")
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ds-tensorshard bench", description=__doc__)
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
