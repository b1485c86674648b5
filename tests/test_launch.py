"""The launchers: every accelerate config through accelerate's own loader, the multi-node scripts' `--dry-run`
commands for 2 nodes × 8 GPUs, CP groups inside a node, and a real 2-"node" run on localhost.

The localhost run starts `launch/multi_node.sh` twice (NODE_RANK 0 and 1, 2 processes each, loopback rendezvous): 4
gloo ranks in one CP group (parallel.cp=4) laid out as the scripts intend, ring 2 across the "nodes" and Ulysses 2
inside each (parallel.cp_ring=2). Its per-step loss and grad norm must equal, within 1e-5 relative, those of the
single-process run of the same recipe: tests/test_finetune.py's serial tiny-wan LoRA run, shared through `runs`
(identical overrides, one run per session).
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
from pathlib import Path

import pytest

from tests.harness import ENV, LAUNCH_TIMEOUT_S, QUIET, REPO, assert_same_steps

# The launch scripts' inputs come from the environment: none may leak in from the one running the tests.
SCRIPT_VARS = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "RECIPE", "SLURM_NNODES")
BASE_ENV = {k: v for k, v in os.environ.items() if k not in SCRIPT_VARS}
CONFIGS = sorted((REPO / "configs" / "accelerate").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_accelerate_config_loads_with_accelerates_loader(path: Path) -> None:
    """Each config file through `accelerate launch`'s own loader and argument defaults: the process counts, machine
    counts and precision the trainer relies on (the recipe owns mixed precision: check_inputs refuses any other)."""
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DistributedType

    config = load_config_from_file(str(path))
    assert isinstance(config, ClusterConfig)
    assert config.distributed_type == DistributedType.MULTI_GPU  # with Accelerator(cpu=True): N processes on CPU
    assert config.mixed_precision == "no" and config.rdzv_backend == "static"
    assert config.num_processes % config.num_machines == 0 and 0 <= config.machine_rank < config.num_machines
    args, *_ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
    assert (args.num_processes, args.num_machines) == (config.num_processes, config.num_machines)
    assert args.multi_gpu and args.mixed_precision == "no"


def _dry_run(script: str, env: dict[str, str], *args: str) -> list[str]:
    env = {**BASE_ENV, "RECIPE": "recipes/wan/14b_lora.yaml", "GPUS_PER_NODE": "8", **env}
    proc = subprocess.run(["bash", script, "--dry-run", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def _parse(line: str, node: int, label: str = ""):
    """A dry-run line `node R[ (host)]: <command>` → accelerate's parsed launch arguments."""
    from accelerate.commands.launch import launch_command_parser

    prefix = f"node {node}{label}: "
    assert line.startswith(prefix), line
    argv = shlex.split(line.removeprefix(prefix))
    assert argv[:3] == [".venv/bin/python", "-m", "train.launch"], argv
    return launch_command_parser().parse_args(argv[3:])


OVERRIDES = ("--set", "parallel.cp=8", "--set", "name=wan 14b run")


def _check(args, node: int, ip: str, port: int) -> None:
    assert args.config_file == "configs/accelerate/multi_node.yaml"
    assert (args.num_machines, args.num_processes, args.machine_rank) == (2, 16, node)
    assert (args.main_process_ip, args.main_process_port) == (ip, port)
    assert args.training_script == "train/finetune.py"
    assert args.training_script_args == ["--recipe", "recipes/wan/14b_lora.yaml", *OVERRIDES]


def test_multi_node_and_slurm_dry_run_two_nodes_of_eight() -> None:
    """`--dry-run` prints each node's exact command and exits 0: parsed back by accelerate's launch parser, the two
    commands differ only in machine_rank, and carry the rendezvous, 16 processes on 2 machines, the recipe and the
    overrides (including one with a space, quoted)."""
    env = {"NNODES": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29511"}
    lines = _dry_run("launch/multi_node.sh", env, *OVERRIDES)
    assert len(lines) == 2
    for node, line in enumerate(lines):
        _check(_parse(line, node), node, "10.0.0.1", 29511)
    assert _dry_run("launch/multi_node.sh", {**env, "NODE_RANK": "1"}, *OVERRIDES) == lines[1:]  # that node only

    slurm = _dry_run("launch/slurm.sbatch", {"SLURM_JOB_NODELIST": "gpu-a,gpu-b", "SLURM_NNODES": "2"}, *OVERRIDES)
    assert len(slurm) == 2
    for node, (line, host) in enumerate(zip(slurm, ["gpu-a", "gpu-b"])):
        _check(_parse(line, node, f" ({host})"), node, "gpu-a", 29500)  # the first node hosts the rendezvous

    # The degrees those commands give: cp 8 inside each node, dp_shard 2 across the nodes.
    from train.config import load_recipe

    assert load_recipe("recipes/wan/14b_lora.yaml", ["parallel.cp=8"]).parallel.resolve(16) == (1, 2, 8)


@pytest.mark.parametrize("nodes,per_node,cp", [(2, 8, 8), (2, 8, 4), (2, 2, 2)])
def test_cp_groups_stay_inside_a_node(nodes: int, per_node: int, cp: int) -> None:
    """torchrun numbers ranks node by node (node R holds R×per_node … R×per_node+per_node-1); the trainer's mesh
    (train/parallel.py, on a fake process group of the full world size) puts each rank's CP group inside its node."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from train.parallel import ParallelDims

    world = nodes * per_node
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = ParallelDims(1, world // cp, cp).build("cpu")
            group = mesh.world["ulysses"].mesh.tolist()
        finally:
            dist.destroy_process_group()
        assert rank in group and len(group) == cp
        assert {r // per_node for r in group} == {rank // per_node}, (rank, group)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# tests/test_finetune.py's serial tiny-wan LoRA run (4 steps, a checkpoint after each): identical overrides
SERIAL = ("parallel.cp=1", "checkpoint.every_n_steps=1", "checkpoint.keep_last=3")


def test_two_nodes_on_localhost_match_one_process(tmp_path: Path, runs) -> None:
    """Two "nodes" of 2 processes each (launch/multi_node.sh, loopback rendezvous) train one CP group of 4 laid out
    as the scripts intend: Ulysses inside a node (consecutive ranks), ring across the nodes (parallel.cp_ring=2).
    One CP group: the run must match the single-process run step by step."""
    out = tmp_path / "two_nodes"
    nodes = {"NNODES": "2", "GPUS_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
             "RECIPE": "recipes/tiny/wan.yaml"}  # fmt: skip
    sets = [*QUIET, f"output_dir={out}", "parallel.cp=4", "parallel.cp_ring=2"]
    args = ["bash", "launch/multi_node.sh", *[a for s in sets for a in ("--set", s)]]
    base = {**BASE_ENV, **ENV}
    procs = [subprocess.Popen(args, cwd=REPO, env={**base, **nodes, "NODE_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (1, 0)]  # fmt: skip
    try:
        logs = [p.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-4000:] for log in logs)
    layout = json.loads((out / "layout.json").read_text())
    assert layout["mesh"].startswith("mesh dp_replicate=1 × dp_shard=1 × cp=4 (ring 2 × ulysses 2) = 4 ranks")
    assert "SUM over cp=4" in layout["gradient_reduction"]
    two = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    one = runs("recipes/tiny/wan.yaml", *SERIAL).metrics
    assert [m["step"] for m in two] == [m["step"] for m in one] == [1, 2, 3, 4]
    assert_same_steps(two, one, "2 nodes × 2 processes (cp 4 = ring 2 × ulysses 2) vs 1 process")
    assert two[-1]["loss"] != two[0]["loss"]
