"""verl's trainer over a Ray cluster of two nodes: two ``ray start`` nodes on this machine, one verl run joining them.

Each node is a separate ``ray start --block`` (its own raylet, object store, one fake GPU and a few CPU slots), so the
workers on either node get their environment from that node, not from verl's driver: the CPU platform selection
(``VERL_PLATFORM=cpu``) and the run's variables must travel in the Ray job's ``runtime_env``
(``verl_stable.toy.trainer_process.job_env``), otherwise verl picks NCCL there and fails. One verl ``main_ppo`` with
``trainer.nnodes=2 trainer.n_gpus_per_node=1`` (R3 through the compact transport, 2 steps, ~1-2 min on 2 idle cores)
is shared by the assertions: it must finish, replay exactly on both ranks, and have placed an actor rank and a rollout
replica on each node (Ray's state API, read while the cluster is still up; both nodes have the same IP here, so the
check compares node ids).

The cluster is this module's own: a private temp dir and free ports, torn down by signalling the processes it started
(never ``ray stop``, which would stop every Ray instance of the user on the machine).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

NODES = 2
CPUS_PER_NODE = 8  # TransferQueue starts more actors than the host has cores (the single-node runs ask for 16)
# a node start takes ~10 s on an idle host; on one loaded by other verl runs the head missed 120 s (session 16)
START_TIMEOUT_S = 300
# Ray gives a starting node's raylet a hard-coded 30 s to register with the GCS (ray/_private/node.py); on two cores
# with the suite's other worker in a 4-rank Megatron test the head missed it once (session 26): start that node again
RAY_NODE_TIMEOUT = "The current node timed out during startup"
START_ATTEMPTS = 3


def _free_ports(count: int) -> list[int]:
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def _ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


class TwoNodeCluster:
    """A head node and a worker node, each a ``ray start --block`` process group of this test's own."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        # Ray's unix sockets live below the temp dir: keep it short (a socket path holds at most 107 bytes)
        self.temp_dir = Path(tempfile.mkdtemp(prefix="vs2n-", dir="/tmp"))
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
        # the nodes must not inherit the CPU platform from here: the run has to bring it to them
        for name in list(self.env):
            if name.startswith("VERL_"):
                del self.env[name]
        self._pick_head_ports()

    def _pick_head_ports(self) -> None:
        gcs, client, dashboard = _free_ports(3)
        self.address = f"127.0.0.1:{gcs}"
        self.dashboard = f"http://127.0.0.1:{dashboard}"
        self.head_args = [
            "--head",
            f"--port={gcs}",
            f"--ray-client-server-port={client}",
            "--include-dashboard=true",  # Ray's state API (where each actor ran) is served by the dashboard
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
        ]

    def _start(self, name: str, role_args: list[str]) -> None:
        agent_listen, agent_grpc, runtime_env_agent, metrics, node_manager, object_manager = _free_ports(6)
        cmd = [
            _ray_cli(),
            "start",
            "--block",
            *role_args,
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={CPUS_PER_NODE}",
            "--num-gpus=1",  # a fake GPU: verl's resource pools place one actor rank per GPU
            f"--object-store-memory={512 << 20}",
            f"--temp-dir={self.temp_dir}",
            f"--dashboard-agent-listen-port={agent_listen}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--runtime-env-agent-port={runtime_env_agent}",
            f"--metrics-export-port={metrics}",
            f"--node-manager-port={node_manager}",
            f"--object-manager-port={object_manager}",
            "--min-worker-port=0",  # workers take ports the OS picks: the two nodes share the host's port range
            "--max-worker-port=0",
            "--disable-usage-stats",
        ]
        log_path = self.workdir / f"ray_start_{name}.log"
        with open(log_path, "w") as log:
            # a session (process group) of its own: teardown signals exactly these processes
            proc = subprocess.Popen(
                cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.workdir
            )
        self.procs.append(proc)
        deadline = time.monotonic() + START_TIMEOUT_S
        while "Ray runtime started" not in log_path.read_text(errors="ignore"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start ({name}) failed:\n{log_path.read_text(errors='ignore')[-4000:]}")
            time.sleep(0.5)

    def start(self) -> None:
        for name in ("head", "worker"):
            for attempt in range(1, START_ATTEMPTS + 1):
                try:
                    self._start(name, self.head_args if name == "head" else [f"--address={self.address}"])
                    break
                except RuntimeError as failed:
                    if RAY_NODE_TIMEOUT not in str(failed) or attempt == START_ATTEMPTS:
                        raise
                    self._kill_group(self.procs.pop())  # that node's group only: the head may be up
                    if name == "head":
                        self._pick_head_ports()

    @staticmethod
    def _kill_group(proc: subprocess.Popen) -> None:
        """SIGKILL to a node's process group, then reap its ``ray start``."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def node_ids(self) -> set[str]:
        from ray.util.state import list_nodes

        return {node.node_id for node in list_nodes(address=self.dashboard) if node.state == "ALIVE"}

    def actor_nodes(self, class_name: str) -> list[str]:
        """The node id of every actor of class ``class_name`` the cluster has run (alive or finished).

        Ray names a class by its qualified name: verl's ``WorkerDict`` is ``create_colocated_worker_cls.<locals>.
        WorkerDict``.
        """
        from ray.util.state import list_actors

        actors = list_actors(address=self.dashboard, detail=True, limit=10_000)
        return [actor.node_id for actor in actors if actor.class_name.rsplit(".", 1)[-1] == class_name]

    def stop(self) -> None:
        """SIGINT lets each ``ray start --block`` stop its node's processes; what is left of its group is killed."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs:
            self._kill_group(proc)
        self._kill_leftovers()
        subprocess.run(["rm", "-rf", str(self.temp_dir)], check=False)

    def _kill_leftovers(self) -> None:
        """Processes of this cluster that left the process groups (Ray workers): found by the private temp dir."""
        marker = str(self.temp_dir).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if entry.stat().st_uid != os.getuid() or marker not in (entry / "cmdline").read_bytes():
                    continue
                os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The one verl run over the two-node cluster: (metrics, log, node ids, actor rank nodes, rollout server nodes)."""
    from verl_stable.toy import launch
    from verl_stable.toy.assets import AssetSpec, ensure_assets
    from verl_stable.transport.options import MANAGER_FQN

    tmp = tmp_path_factory.mktemp("two_nodes")
    assets = ensure_assets(tmp / "assets", AssetSpec(task="copy"))
    cluster = TwoNodeCluster(tmp)
    try:
        cluster.start()
        overrides = launch.cpu_overrides(
            assets, steps=2, precision="bf16", routing_capture=True, metrics_logger=("file",)
        )
        overrides += [
            f"trainer.default_local_dir={tmp / 'ckpt'}",
            f"trainer.nnodes={NODES}",
            "trainer.n_gpus_per_node=1",
            f"+ray_kwargs.ray_init.address='{cluster.address}'",
            # the nodes bring their own CPUs and GPUs: Ray refuses these when joining a cluster
            "ray_kwargs.ray_init.num_cpus=null",
            "ray_kwargs.ray_init.num_gpus=null",
            "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",
            f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER_FQN}",
            "+verl_stable.routing.share_prompt_rows_min_bytes=0",  # share every group: the path under test
            "trainer.v1.trainer_mode=stable_sync",
            # each rank gets half the batch: micro-batches by token budget, as in the dp = 2 single-node test
            "trainer.balance_batch=True",
            "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256",
        ]
        proc = launch.run_main_ppo(overrides, tmp / "run", timeout_s=1200, ray_start_retries=0)
        log = (tmp / "run" / "main_ppo.log").read_text(errors="ignore")
        assert proc.returncode == 0, log[-4000:]
        yield (
            launch.read_metrics(tmp / "run" / "metrics.jsonl"),
            log,
            cluster.node_ids(),
            cluster.actor_nodes("WorkerDict"),
            cluster.actor_nodes("HFRolloutServer"),
        )
    finally:
        cluster.stop()


@pytest.mark.e2e
def test_run_over_two_nodes_trains_every_step(run):
    metrics, log, nodes, _, _ = run
    assert len(nodes) == NODES
    assert [row["step"] for row in metrics] == [1, 2]
    assert "'VERL_PLATFORM': 'cpu'" in log  # verl's ray.init got the platform choice in the job's runtime_env


@pytest.mark.e2e
def test_both_ranks_replay_the_rollout_routing_exactly(run):
    for row in run[0]:
        assert row["stable/routing/disagreement"] == 0.0, row["step"]
        assert row["stable/routing/coverage/response_replayed"] == 1.0, row["step"]


@pytest.mark.e2e
def test_an_actor_rank_and_a_rollout_replica_on_each_node(run):
    _, _, nodes, ranks, servers = run
    assert len(ranks) == NODES and set(ranks) == nodes  # one WorkerDict (actor rank) per node
    assert len(servers) == NODES and set(servers) == nodes  # each replica's hf server next to its rank
