"""Run ``lightning-hybrid`` on several local processes from a Jupyter notebook and read back its metrics.

The notebooks' entry point; the launcher itself lives in :mod:`lightning_hybrid.launch.torchrun`, shared
with the tests. Nothing here imports ``torch.distributed``: the notebook's kernel stays one plain process.

    from lightning_hybrid.notebook import launch_cli
    run = launch_cli(["fit", "--config", "recipes/tiny-cpu.yaml", "--trainer.max_steps", "20"], nproc=4,
                     log_dir="runs/quickstart")
    steps, losses = zip(*run["scalars"]["train_loss"])
"""

from lightning_hybrid.launch.torchrun import (
                                              LocalJob,
                                              free_port,
                                              latest_version_dir,
                                              launch_cli,
                                              read_scalars,
                                              torchrun_command,
                                              worker_pids,
)

__all__ = ["launch_cli", "read_scalars", "latest_version_dir", "free_port", "torchrun_command", "worker_pids",
           "LocalJob"]
