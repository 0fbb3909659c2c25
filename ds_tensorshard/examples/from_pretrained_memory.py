"""Peak RSS per rank of Hugging Face ``from_pretrained`` under ``deepspeed.zero.Init``: stock ZeRO-3 against
ds_tensorshard's stage 3, side by side, each rank a fresh process::

    python -m ds_tensorshard.examples.from_pretrained_memory --dir /tmp/fpm               # GPT-2, 124M parameters
    python -m ds_tensorshard.examples.from_pretrained_memory --dir /tmp/fpm_s --width 64 --layers 2 --vocab 512

First (``--dir`` empty) it builds a GPT-2 from a local ``GPT2Config`` (randomly initialized, seeded) and
``save_pretrained``s it (safetensors). Then, for each of stock ZeRO-3 (the config without the tensorshard block)
and ds_tensorshard (with it), it starts ``--ranks`` processes on gloo; each holds a
``transformers.integrations.HfDeepSpeedConfig`` of a stage-3 config, so that ``from_pretrained`` builds the model
inside ``deepspeed.zero.Init`` and loads the weights through ``GatheredParameters(modifier_rank=0)`` (rank 0 reads
the file), and reports: its RSS before the load, its peak RSS (``ru_maxrss``: the load's peak, imports included),
and the bytes of parameters it holds right after (``p.data`` and ``p.ds_tensor``, each byte once). Printed: a JSON
line per rank, a table, and ours over stock's per rank (peak and peak above the RSS before the load).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time

MODES = ("stock", "ds_tensorshard")


def ds_config(mode: str, dtype: str) -> dict:
    """The stage-3 config ``from_pretrained`` sees; ds_tensorshard's adds the block."""
    config: dict = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": dtype == "bf16"},
    }
    if mode == "ds_tensorshard":
        config["tensorshard"] = {"enabled": True}
    return config


def make(model_dir: str, args: argparse.Namespace) -> int:
    """Save a randomly initialized GPT-2 of the given shape to ``model_dir``; returns its parameters."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width, n_layer=args.layers, n_head=args.heads
    )
    model = GPT2LMHeadModel(config)
    model.save_pretrained(model_dir)
    return sum(p.numel() for p in model.parameters())


def rss_mib() -> float:
    """This process's resident set now (MiB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def held_bytes(module) -> int:
    """Bytes of parameters this rank holds: ``p.data`` and ``p.ds_tensor`` (a view of another, or of one flat
    buffer, counted once)."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for p in module.parameters()
        for t in (p.data, getattr(p, "ds_tensor", None))
        if t is not None and t.numel()
    )
    held, end = 0, 0
    for start, stop in spans:
        held += max(0, stop - max(start, end))
        end = max(end, stop)
    return held


def rank_main(mode: str, model_dir: str, dtype: str) -> None:
    """One rank: ``from_pretrained`` under the stage-3 config; prints its figures as one JSON line."""
    import deepspeed
    from transformers import GPT2LMHeadModel
    from transformers.integrations import HfDeepSpeedConfig

    import ds_tensorshard  # noqa: F401  (registers the plugin)

    deepspeed.init_distributed(dist_backend="gloo")
    hf_config = HfDeepSpeedConfig(ds_config(mode, dtype))  # noqa: F841  (kept alive: from_pretrained reads it)
    before = rss_mib()
    started = time.perf_counter()
    model = GPT2LMHeadModel.from_pretrained(model_dir)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    result = {
        "mode": mode,
        "rank": deepspeed.comm.get_rank(),
        "parameters": numel,
        "rss_before_mib": round(before, 1),
        "peak_rss_mib": round(peak, 1),
        "held_mib": round(held_bytes(model) / 2**20, 1),
        "load_s": round(seconds, 1),
    }
    print("RESULT " + json.dumps(result), flush=True)
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(mode: str, root: str, ranks: int, dtype: str) -> list[dict]:
    """Start the ranks of one mode, each a fresh process, on the model saved under ``root``; their results."""
    port = str(free_port())
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        command = [sys.executable, "-m", __spec__.name, "--dir", root, "--rank-of", mode, "--dtype", dtype]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate()
        lines = [line[len("RESULT ") :] for line in out.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{mode}: a rank failed (exit {proc.returncode}):\n{err[-3000:]}")
        results.append(json.loads(lines[-1]))
    return sorted(results, key=lambda r: r["rank"])


def table(results: dict[str, list[dict]]) -> None:
    """The side-by-side table and ours over stock's, per rank."""
    print(f"{'mode':16} {'rank':>4} {'RSS before':>11} {'peak RSS':>9} {'peak-before':>11} {'params held':>11}")
    for mode, rows in results.items():
        for r in rows:
            rise = r["peak_rss_mib"] - r["rss_before_mib"]
            print(
                f"{mode:16} {r['rank']:>4} {r['rss_before_mib']:>9.1f}Mi {r['peak_rss_mib']:>7.1f}Mi "
                f"{rise:>9.1f}Mi {r['held_mib']:>9.1f}Mi"
            )
    for stock, ours in zip(results["stock"], results["ds_tensorshard"]):
        rise_stock = stock["peak_rss_mib"] - stock["rss_before_mib"]
        rise_ours = ours["peak_rss_mib"] - ours["rss_before_mib"]
        ratios = {
            "rank": ours["rank"],
            "peak_ratio": round(ours["peak_rss_mib"] / stock["peak_rss_mib"], 3),
            "rise_ratio": round(rise_ours / rise_stock, 3),
            "held_ratio": round(ours["held_mib"] / stock["held_mib"], 3),
        }
        print(json.dumps(ratios), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="where the model is saved (made if absent)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="zero.Init builds in it")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rank-of", choices=MODES, help=argparse.SUPPRESS)  # one rank's run (internal)
    args = parser.parse_args()
    model_dir = os.path.join(args.dir, "model")
    if args.rank_of:
        rank_main(args.rank_of, model_dir, args.dtype)
        return
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        print(json.dumps({"made": model_dir, "parameters": make(model_dir, args)}), flush=True)
    results = {}
    for mode in MODES:
        results[mode] = launch(mode, args.dir, args.ranks, args.dtype)
        for row in results[mode]:
            print(json.dumps(row), flush=True)
    table(results)


if __name__ == "__main__":
    main()
