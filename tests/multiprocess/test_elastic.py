"""Elastic training across the multihost tier's two hosts (``-m multihost``, made by launch/multihost.sh):
``torchrun --nnodes=1:2 --nproc-per-node=2 --rdzv-backend=c10d`` with one agent per host, training
tests/workers/elastic_worker.py (a checkpoint after every step, the latest loaded on start, the global batch
kept). The second host's agent and workers are killed (by their ids, over ssh) mid-training or in the middle of
a save; the first host's agent restarts its workers at world size 2; then the second host's agent starts again
and the group restarts at 4. Every resumed stretch must equal a resume by hand from the same checkpoint at the
same world size, and stay within ``ACROSS_WORLDS`` of the uninterrupted 4-rank run. Stock ZeRO-2 under the same
driver fails to resume at 2. The agents run with torchrun's defaults (its shared store: the plugin gives each
round a store of its own, ds_tensorshard/transports/elastic_store.py);
:func:`test_shared_store_restart_reads_stale_gloo_addresses` shows what that store keeps across rounds without the
plugin. ``ELASTIC_OUT=FILE`` appends one JSON line of figures per test.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import WORKERS
from tests.helpers.compare import ACROSS_WORLDS
from tests.helpers.ranks import free_port, launcher_env, run_in_group, run_ranks

pytestmark = pytest.mark.multihost
WORKER = os.path.join(WORKERS, "elastic_worker.py")
PROBE = os.path.join(WORKERS, "rendezvous_probe.py")
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # torchrun's own new TCPStore for every round (the probe)
FORWARD = ("DS_ACCELERATOR", "OMP_NUM_THREADS", "PYTHONPATH", "TORCH_EXTENSIONS_DIR", "PATH", *FRESH_STORE)
DEADLINE_S = 900  # one test, the slowest part on 2 shared cores being the ranks' start (imports, FusedAdam load)


@pytest.fixture(scope="module")
def hosts() -> list[str]:
    names = os.environ.get("MULTIHOST_HOSTS", "").split()
    if len(names) < 2:
        pytest.skip(os.environ.get("MULTIHOST_SKIP", "no hosts: run bash launch/multihost.sh"))
    return names


def torchrun(endpoint: str, max_restarts: int, args: list[str]) -> list[str]:
    """The driver's command, the same on both hosts; the rendezvous store is served by the first host's agent."""
    return [
        os.path.join(os.path.dirname(sys.executable), "torchrun"),
        "--nnodes=1:2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        "--rdzv-id=elastic",
        "--rdzv-conf=last_call_timeout=10",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=1",
        WORKER,
        *args,
    ]


class Agent:
    """One host's torchrun agent: started here (the first host) or over ssh, its output in a file; its workers
    write their pids under ``pids/<host>`` (elastic_worker ``--pids``), so that a host's processes can be
    killed by their ids."""

    def __init__(self, host: str, local: bool, cmd: list[str], env: dict, folder: Path, name: str) -> None:
        self.host, self.local, self.folder, self.killed = host, local, folder, False
        self.pids = folder / f"pids-{name}"
        self.agent_pid_file = folder / f"agent-{name}.pid"
        self.log = folder / f"agent-{name}.log"
        cmd = [*cmd, "--pids", str(self.pids)]
        if not local:
            exports = " ".join(f"{k}={shlex.quote(env[k])}" for k in FORWARD if k in env)
            remote = f"cd {shlex.quote(str(folder))} && echo $$ > {self.agent_pid_file} && exec env {exports} "
            cmd = ["ssh", host, remote + shlex.join(cmd)]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, env=env, cwd=folder, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        if local:
            self.agent_pid_file.write_text(str(self.proc.pid))

    def worker_pids(self) -> list[int]:
        folder = self.pids / self.host
        return [int(p.name) for p in folder.iterdir()] if folder.is_dir() else []

    def kill_host(self) -> None:
        """SIGKILL this agent and every worker of it still running, at once (a lost host), by their ids (each
        checked to be torchrun's or elastic_worker's first: a pid of an ended one may have been reused)."""
        pids = [int(self.agent_pid_file.read_text()), *self.worker_pids()]
        kill = (
            f"for p in {' '.join(map(str, pids))}; do grep -qs -e torchrun -e elastic_worker /proc/$p/cmdline && "
            "echo $p; done | xargs -r kill -KILL 2>/dev/null; true"
        )
        cmd = ["sh", "-c", kill] if self.local else ["ssh", self.host, kill]
        subprocess.run(cmd, timeout=60, check=True)
        self.killed = True

    def wait(self, deadline: float) -> int | None:
        try:
            return self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """Whatever is left of this agent and its workers (after a failure or a timeout)."""
        if self.proc.poll() is None and not self.killed:  # an agent that ended took its workers with it
            try:
                self.kill_host()
            except (OSError, ValueError, subprocess.SubprocessError):
                pass
        try:
            os.killpg(self.proc.pid, 9)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=60)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def wait_for(what: str, condition: Callable[[], bool], deadline: float, agents: list[Agent]) -> float:
    """Poll until ``condition()``; the time it held. Fails, with the agents' output, at the deadline or when an
    agent that must stay up has exited."""
    while not condition():
        ended = [a for a in agents if a.proc.poll() is not None]
        if time.monotonic() > deadline or ended:
            tails = "\n".join(f"--- {a.log.name} (rc {a.proc.poll()}):\n{a.text()[-5000:]}" for a in agents)
            raise AssertionError(f"waiting for {what}: {'deadline passed' if not ended else 'an agent ended'}\n{tails}")
        time.sleep(0.5)
    return time.monotonic()


def latest_step(save: Path) -> int:
    tag = (save / "latest").read_text() if (save / "latest").exists() else "step0"
    return int(tag.removeprefix("step"))


def lose_host_after_step_3(a: Agent, b: Agent, save: Path, deadline: float) -> float:
    """Wait for the save after step 3, then lose host B (its agent and workers killed); when it was lost."""
    wait_for("the save after step 3", lambda: latest_step(save) >= 3, deadline, [a, b])
    b.kill_host()
    return time.monotonic()


def starts(log: Path) -> list[dict]:
    return [r for r in records(log) if r["event"] == "start"]


def losses(log: Path, after_start: int = 0, before_start: int | None = None) -> dict[int, float]:
    """Step -> loss of the steps run between the ``after_start``-th and ``before_start``-th starts in ``log``."""
    out, seen = {}, -1
    for r in records(log):
        seen += r["event"] == "start"
        if r["event"] == "step" and seen >= after_start and (before_start is None or seen < before_start):
            out[r["step"]] = r["loss"]
    return out


def last_losses(log: Path) -> dict[int, float]:
    """Step -> the loss of the last run of that step (a step run again after a restart replaces the first)."""
    return {r["step"]: r["loss"] for r in records(log) if r["event"] == "step"}


def hand_run(folder: Path, name: str, world: int, steps: int, *options: str) -> dict[int, float]:
    """elastic_worker on this host at ``world`` ranks without torchrun (a resume by hand, or the uninterrupted
    run); its step -> loss."""
    log = folder / f"{name}.jsonl"
    save = folder / "ckpt" if "--load-tag" in options else folder / f"{name}-ckpt"
    run_ranks([WORKER, str(save), str(log), "ts", str(steps), "--no-save", *options], world, timeout=DEADLINE_S)
    return last_losses(log)


def largest_difference(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() <= b.keys(), (sorted(a), sorted(b))
    return max(abs(a[s] - b[s]) for s in a)


def record(test: str, **figures: object) -> None:
    if os.environ.get("ELASTIC_OUT"):
        with open(os.environ["ELASTIC_OUT"], "a") as f:
            f.write(json.dumps({"test": test, **figures}) + "\n")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    """The 4-rank run without any kill (one host, no torchrun: the arithmetic is the world size's)."""
    return hand_run(tmp_path_factory.mktemp("uninterrupted"), "uninterrupted", 4, 14)


def start_group(
    hosts: list[str], folder: Path, mode: str, steps: int, max_restarts: int, *options: str, fresh: bool = False
):
    """The second host's agent, then the first's (which serves the rendezvous): both join the first round, with
    torchrun's defaults (no ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``), or with it set (``fresh``)."""
    env = {k: v for k, v in launcher_env().items() if k not in FRESH_STORE}
    env.update(FRESH_STORE if fresh else {})
    cmd = torchrun(
        f"{hosts[0]}:{free_port()}",
        max_restarts,
        [str(folder / "ckpt"), str(folder / "log.jsonl"), mode, str(steps), *options],
    )
    b = Agent(hosts[1], False, cmd, env, folder, "b")
    a = Agent(hosts[0], True, cmd, env, folder, "a")
    return a, b, cmd, env


def test_lost_host_resumes_at_2_with_torchruns_defaults(hosts, tmp_path, uninterrupted):
    """The issue's case with torchrun's defaults: the second host lost after a save, the survivors' workers are
    restarted at world size 2, resume from the save and train to the end, as a run at 2 ranks by hand from it."""
    steps, log, save = 8, tmp_path / "log.jsonl", tmp_path / "ckpt"
    deadline = time.monotonic() + DEADLINE_S
    a, b, _, _ = start_group(hosts, tmp_path, "ts", steps, 3, "--step-sleep", "1")
    try:
        killed = lose_host_after_step_3(a, b, save, deadline)
        b.wait(deadline)
        assert a.wait(deadline) == 0, a.text()[-5000:]
    finally:
        for agent in (a, b):
            agent.stop()
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" not in a.text()  # the plugin's warning: not with round stores
    first, down = starts(log)[:2] if len(starts(log)) == 2 else pytest.fail(f"starts: {starts(log)}")
    assert [(s["world"], s["gas"]) for s in (first, down)] == [(4, 2), (2, 4)], starts(log)
    at_2 = losses(log, 1)
    assert down["loaded"] == f"step{down['step']}" and sorted(at_2) == list(range(down["step"], steps)), starts(log)
    by_hand = hand_run(tmp_path, "hand2", 2, steps, "--load-tag", down["loaded"])
    assert at_2 == {s: by_hand[s] for s in at_2}, (at_2, by_hand)  # the same arithmetic: bit for bit
    assert losses(log, 0, 1) == {s: uninterrupted[s] for s in losses(log, 0, 1)}
    record("down_defaults", resumed_from=down["loaded"], kill_to_end_s=round(time.monotonic() - killed, 1))


def test_lost_host_resumes_at_2_then_at_4_when_it_returns(hosts, tmp_path, uninterrupted):
    """Down and back up. With torchrun's defaults the return fails in torch's own agents (torch 2.13.0
    ``DynamicRendezvousHandler.next_rendezvous``: the rank-0 agent, which kept its store info from the first
    round, does not publish the new round's ``MASTER_ADDR``, and the returning agent waits for it until
    ``DistStoreError: wait timeout after 60000ms``, before any worker starts); so this test sets
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (docs/cluster.md)."""
    steps, log, save = 14, tmp_path / "log.jsonl", tmp_path / "ckpt"
    t0 = time.monotonic()
    deadline = t0 + DEADLINE_S
    a, b, cmd, env = start_group(hosts, tmp_path, "ts", steps, 3, "--step-sleep", "1", fresh=True)
    agents = [a, b]
    try:
        killed = lose_host_after_step_3(a, b, save, deadline)
        b.wait(deadline)
        agents = [a]
        resumed = wait_for(
            "a step at world size 2",
            lambda: any(r["world"] == 2 for r in records(log) if r["event"] == "step"),
            deadline,
            [a],
        )
        b2 = Agent(hosts[1], False, cmd, env, tmp_path, "b2")
        agents = [a, b2]
        rejoined = time.monotonic()
        up = wait_for("a step at world size 4 after the return", lambda: bool(losses(log, 2)), deadline, [a, b2])
        codes = [a.wait(deadline), b2.wait(deadline)]
        assert codes == [0, 0], f"{codes}\n{a.text()[-5000:]}\n{b2.text()[-5000:]}"
    finally:
        for agent in (a, b, *agents):
            agent.stop()
    first, down, back = starts(log)[:3] if len(starts(log)) == 3 else pytest.fail(f"starts: {starts(log)}")
    # DeepSpeed derived GAS from train_batch_size 8 and micro batch 1 at each world size: the global batch kept
    assert [(s["world"], s["gas"]) for s in (first, down, back)] == [(4, 2), (2, 4), (4, 2)], starts(log)
    assert first["loaded"] is None and down["loaded"] and back["loaded"], starts(log)
    t_down, t_back = down["step"], back["step"]
    assert down["loaded"] == f"step{t_down}" and t_down >= 3 and t_back > t_down, starts(log)
    at_2, at_4 = losses(log, 1, 2), losses(log, 2)  # at 2 up to the step the return interrupted (logged, unsaved)
    assert at_2 and sorted(at_4) == list(range(t_back, steps)), (at_2, at_4)
    by_hand_2 = hand_run(tmp_path, "hand2", 2, max(at_2) + 1, "--load-tag", down["loaded"])
    by_hand_4 = hand_run(tmp_path, "hand4", 4, steps, "--load-tag", back["loaded"])
    assert at_2 == {s: by_hand_2[s] for s in at_2}, (at_2, by_hand_2)  # the same arithmetic: bit for bit
    assert at_4 == {s: by_hand_4[s] for s in at_4}, (at_4, by_hand_4)
    before = losses(log, 0, 1)
    assert before == {s: uninterrupted[s] for s in before}, (before, uninterrupted)  # 4 ranks both
    final = last_losses(log)
    assert sorted(final) == list(range(steps))
    worst = largest_difference(final, uninterrupted)
    assert worst <= ACROSS_WORLDS["fp32"]["loss"], (final, uninterrupted)
    record(
        "down_and_up",
        resumed_at_2_from=down["loaded"],
        resumed_at_4_from=back["loaded"],
        vs_hand_2=largest_difference(at_2, by_hand_2),
        vs_hand_4=largest_difference(at_4, by_hand_4),
        vs_uninterrupted_at_2=largest_difference(at_2, uninterrupted),
        vs_uninterrupted=worst,
        kill_to_first_step_at_2_s=round(resumed - killed, 1),
        return_to_first_step_at_4_s=round(up - rejoined, 1),
        total_s=round(time.monotonic() - t0, 1),
    )


def test_host_lost_mid_save_fails_the_save_and_resumes_from_the_previous(hosts, tmp_path, uninterrupted):
    """The second host's ranks hold inside the save after step 3 (half a file written) and are killed there:
    the survivors' save fails, naming the lost host, 'latest' stays at step2, and the restart resumes from it."""
    steps, log, save = 6, tmp_path / "log.jsonl", tmp_path / "ckpt"
    deadline = time.monotonic() + DEADLINE_S
    a, b, _, _ = start_group(hosts, tmp_path, "ts", steps, 3, "--hold-save-at", "3", "--hold-host", hosts[1])
    try:
        wait_for(
            "the second host's ranks holding mid-save", lambda: len(list(save.glob("HOLDING-*"))) == 2, deadline, [a, b]
        )
        assert (save / "latest").read_text() == "step2" and list(save.glob(".step3.saving-*")), os.listdir(save)
        b.kill_host()
        killed = time.monotonic()
        code = a.wait(deadline)
        assert code == 0, a.text()[-6000:]
    finally:
        a.stop()
        b.stop()
    out = a.text()
    address = socket.gethostbyname(hosts[1])  # what the transport's error names
    failed = [line for line in out.splitlines() if "SAVE FAILED saving checkpoint" in line]
    assert len(failed) == 2 and all(f"{save}/step3 failed: a rank was lost" in line for line in failed), out[-6000:]
    assert all(address in line for line in failed), failed
    down = starts(log)[1]
    assert (down["world"], down["gas"], down["loaded"]) == (2, 4, "step2"), starts(log)
    resumed = losses(log, 1)
    assert sorted(resumed) == list(range(2, steps))
    worst = largest_difference(resumed, uninterrupted)
    assert worst <= ACROSS_WORLDS["fp32"]["loss"], (resumed, uninterrupted)
    record(
        "mid_save",
        error=failed[0][:600],
        loaded=down["loaded"],
        vs_uninterrupted=worst,
        kill_to_end_s=round(time.monotonic() - killed, 1),
    )


def test_stock_zero2_under_the_same_driver(hosts, tmp_path):
    """Stock ZeRO-2: the survivors restart at 2 and cannot load the 4-rank checkpoint; every restart fails the
    same way until torchrun gives up."""
    steps, save = 8, tmp_path / "ckpt"
    deadline = time.monotonic() + DEADLINE_S
    a, b, _, _ = start_group(hosts, tmp_path, "stock", steps, 2, "--step-sleep", "1")
    try:
        killed = lose_host_after_step_3(a, b, save, deadline)
        code = a.wait(deadline)
    finally:
        a.stop()
        b.stop()
    out = a.text()
    refusals = out.count("The checkpoint being loaded used a DP world size of 4 but the current world size is 2")
    assert code != 0 and refusals >= 2, out[-6000:]
    record("stock", torchrun_rc=code, refusals=refusals, kill_to_exit_s=round(time.monotonic() - killed, 1))


@pytest.mark.parametrize("fresh_store", [False, True], ids=["shared_store", "fresh_store"])
def test_shared_store_restart_reads_stale_gloo_addresses(hosts, tmp_path, fresh_store):
    """The cause of the first restart's ``Gloo connectFullMesh failed ... Connection refused``: by default the
    rank-0 agent's c10d rendezvous keeps one TCPStore server for its workers across restarts, and the restarted
    workers' process group writes the same keys as their predecessors', so a rank that reads its peer's key
    before the peer has replaced it gets the dead rank's gloo address. The probe (one host, torchrun, round 0
    exits 1) shows round 1 in round 0's store; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives every round a new
    one."""
    env = {**launcher_env(), **(FRESH_STORE if fresh_store else {})}
    cmd = torchrun(f"{hosts[0]}:{free_port()}", 1, [])
    cmd[cmd.index(WORKER)] = PROBE
    cmd[1] = "--nnodes=1"
    proc = run_in_group(cmd, timeout=300, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    masters = [re.search(rf"PROBE restart={r} rank=0 master=(\S+)", out) for r in (0, 1)]
    stale = re.search(r"PROBE restart=1 rank=1 stale_keys=(True|False)", out)
    assert proc.returncode == 0 and all(masters) and stale, out[-5000:]
    same_store = masters[0].group(1) == masters[1].group(1)  # type: ignore[union-attr]
    assert (same_store, stale.group(1)) == ((False, "False") if fresh_store else (True, "True")), out[-5000:]
    record("probe", fresh_store=fresh_store, same_store=same_store, stale_keys=stale.group(1))
