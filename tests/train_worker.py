"""A training process for the subprocess tests (multi-device, multi-worker, kill-and-resume).

    python tests/train_worker.py DATA_DIR WORKDIR CONFIG_JSON [--logical-cpus N] [--epoch-sleep SECONDS]

Runs `cifar.train.train` with `make_config("default", CONFIG_JSON)` and prints one line
`RESULT {json}` with the TrainResult plus what the process saw (replicas, per-replica batch).
`--logical-cpus N` splits the CPU into N logical devices first, which must happen before
TensorFlow initializes: hence a fresh process. `--epoch-sleep` pauses after every epoch so a test
can kill the process at a known point.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data_dir")
    parser.add_argument("workdir")
    parser.add_argument("config_json")
    parser.add_argument("--logical-cpus", type=int, default=0)
    parser.add_argument("--epoch-sleep", type=float, default=0.0)
    arguments = parser.parse_args()

    import tensorflow as tf

    if arguments.logical_cpus:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(arguments.logical_cpus)]
        )

    from cifar import distribute
    from cifar.config import make_config
    from cifar.input_pipeline import make_train_dataset
    from cifar.train import train

    config = make_config("default", json.loads(arguments.config_json))

    def after_epoch(progress: dict) -> None:
        print("EPOCH", json.dumps(progress), flush=True)
        time.sleep(arguments.epoch_sleep)

    result = train(config, arguments.data_dir, arguments.workdir, epoch_callback=after_epoch)

    # What one step's global batch looks like on each replica under this process's strategy.
    plan = distribute.plan_devices(config.train)
    strategy = tf.distribute.get_strategy() if plan.cluster else distribute.create_strategy(plan)
    dataset = make_train_dataset(
        arguments.data_dir,
        splits=["train"],
        batch_size=config.train.batch_size,
        image_size=32,
        seed=0,
        deterministic=True,
    )
    replica_batches = []
    if plan.cluster is None:
        images, _ = next(iter(strategy.experimental_distribute_dataset(dataset)))
        replica_batches = [int(tensor.shape[0]) for tensor in strategy.experimental_local_results(images)]
    # The optimizer's step counter in the last checkpoint: how many steps really ran.
    import keras

    from cifar.checkpoints import load_index

    latest = load_index(result.checkpoint_dir).latest
    optimizer_steps = None
    if plan.is_chief and latest is not None:
        saved = keras.models.load_model(Path(result.checkpoint_dir) / latest.model_path)
        optimizer_steps = int(saved.optimizer.iterations.numpy())
    report = {
        **result.model_dump(),
        "optimizer_steps": optimizer_steps,
        "num_replicas": plan.num_replicas,
        "replica_batches": replica_batches,
        "is_chief": plan.is_chief,
    }
    print("RESULT", json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
