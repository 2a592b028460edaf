"""What each launcher a user starts a script with hands every worker on one node: its environment and
the arguments it adds. gaeq starts the ranks itself (forked from its fork server, without the
launcher's agent, which would import torch once more per cell) and gives each exactly this, so the
script cannot tell the difference (read from the launchers' sources: torch.distributed.run,
deepspeed.launcher.launch, accelerate.utils.launch.prepare_multi_gpu_env). The launchers' names are
the matrix's (gaeq.problem.script.Launcher)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from gaeq.problem.script import Launcher


def threads(launcher: Launcher, *, world_size: int, given: Mapping[str, str]) -> dict[str, str]:
    """OMP_NUM_THREADS as `launcher` hands it to its workers when started in the environment `given` —
    the thread count changes summation order, so a split's numbers are the launcher's only with its
    threads. Every launcher keeps a value it was given; unset, torchrun sets 1 for more than one worker
    on the node and nothing for one (torch then runs a thread per core), accelerate launch sets its
    ``--num_cpu_threads_per_process`` default, 1, and DeepSpeed's launcher sets nothing (without
    ``--bind_cores_to_rank``: every rank a thread per core)."""
    if "OMP_NUM_THREADS" in given or launcher is Launcher.DEEPSPEED:
        return {}
    if launcher is Launcher.TORCHRUN and world_size == 1:
        return {}
    return {"OMP_NUM_THREADS": "1"}


def worker_env(
    launcher: Launcher, *, rank: int, world_size: int, port: int, given: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The variables `launcher` sets for worker `rank` of `world_size` on one node, started in the
    environment `given` (gaeq's, by default); `init_process_group` meets at MASTER_ADDR:MASTER_PORT,
    where rank 0 serves the store."""
    common = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    } | threads(launcher, world_size=world_size, given=os.environ if given is None else given)
    torchrun = {
        "ROLE_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "ROLE_WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": "1",
        "GROUP_RANK": "0",
        "ROLE_NAME": "default",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "gaeq",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        # not TORCHELASTIC_USE_AGENT_STORE (no agent serves the store: rank 0 does) nor the agent's
        # TORCHELASTIC_ERROR_FILE
    }
    if launcher is Launcher.DEEPSPEED:
        return common | {
            "CROSS_RANK": "0",
            "CROSS_SIZE": "1",
            "LOCAL_SIZE": str(world_size),
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(world_size))),  # as it sets them on any machine
            "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
        }
    if launcher is Launcher.ACCELERATE:
        return (
            common
            | torchrun
            | {
                "ACCELERATE_MIXED_PRECISION": "no",
                "ACCELERATE_DYNAMO_BACKEND": "NO",
                "ACCELERATE_DYNAMO_MODE": "default",
                "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False",
                "ACCELERATE_DYNAMO_USE_DYNAMIC": "False",
                "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False",
            }
        )
    return common | torchrun


def worker_args(launcher: Launcher, *, rank: int) -> list[str]:
    """What `launcher` puts before the script's own arguments (its only rank-dependent argument)."""
    return [f"--local_rank={rank}"] if launcher is Launcher.DEEPSPEED else []


def command(launcher: Launcher, *, world_size: int, script: str, args: list[str]) -> str:
    """The command line the user would type to start this split with `launcher` (what gaeq validate
    prints and a cell's `ran` records)."""
    start = {
        Launcher.TORCHRUN: ["torchrun", "--standalone", "--nproc_per_node", str(world_size)],
        Launcher.DEEPSPEED: ["deepspeed", "--num_gpus", str(world_size)],
        Launcher.ACCELERATE: ["accelerate", "launch", "--multi_gpu", "--num_processes", str(world_size)],
    }[launcher]
    return " ".join([*start, script, *args])


STARTED_BY = {Launcher.TORCHRUN: "torchrun", Launcher.ACCELERATE: "torchrun", Launcher.DEEPSPEED: "deepspeed"}
"""The launcher `gaeq run --launcher` starts a script under, by the launcher the script names:
``accelerate launch --multi_gpu`` is torchrun's start with accelerate's defaults added (and on a
CPU-only machine starts one process whatever it is told)."""


def launch_mismatch(script_launcher: Launcher, launcher: str, *, lanes: int | None = None) -> str | None:
    """Why ``gaeq run``'s launch options cannot apply to a script matrix (None: they can): a launcher
    that cannot start the script as its user starts it, or lanes (a script's cells run one at a time,
    each cell its own ranks)."""
    if lanes is not None:
        return f"--lanes {lanes}: a script's cells run one at a time, each its own ranks (lanes are gaeq's own cells')"
    if launcher == "local" or STARTED_BY[script_launcher] == launcher:
        return None
    return (
        f"--launcher {launcher}: your script is started by {script_launcher.value} (script.launcher); gaeq starts it "
        f"under {STARTED_BY[script_launcher]} (--launcher {STARTED_BY[script_launcher]}) or forks its ranks as "
        f"{script_launcher.value} would (--launcher local)"
    )
