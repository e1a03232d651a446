#!/usr/bin/env bash
# Entry point of the cifar image.
#
#   worker [ARGS...]   create the work pool and the `training` concurrency limit if missing, register
#                      every deployment in prefect.yaml, then
#                      `prefect worker start --pool $CIFAR_WORK_POOL --with-healthcheck ARGS...`
#   anything else      run as given: `python flows/pipeline.py ...`, `prefect ...`, `bash`
#
# Needs PREFECT_API_URL (and MLFLOW_TRACKING_URI for a tracking server); docker/compose.yaml sets both.
set -euo pipefail

pool=${CIFAR_WORK_POOL:-cifar-process}

if [[ ${1:-worker} != worker ]]; then
    exec "$@"
fi
shift || true

if ! prefect work-pool inspect "$pool" >/dev/null 2>&1; then
    # Another worker may create it at the same moment; only a pool that still is missing is an error.
    prefect work-pool create "$pool" --type process || prefect work-pool inspect "$pool" >/dev/null
fi
# At most one training at a time (tasks/training.py tags its task `training`); raise the limit
# (`prefect concurrency-limit create training N`) once workers run on separate devices.
if ! prefect concurrency-limit inspect training >/dev/null 2>&1; then
    prefect concurrency-limit create training 1 >/dev/null || prefect concurrency-limit inspect training >/dev/null
fi
prefect --no-prompt deploy --all
# prefect.yaml's pull step starts each flow run in "{{ $PWD }}" as the worker sees it: this directory
# (the image's WORKDIR, /app), so the flows' `./workdir` is the `workdir` volume.
export PWD
exec prefect worker start --pool "$pool" --with-healthcheck "$@"
