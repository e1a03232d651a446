#!/usr/bin/env bash
# Entry point of the cifar image.
#
#   worker [ARGS...]   create what the worker needs on the server when missing: the work pool, the
#                      `training` concurrency limit; make or update the automations (flow runs whose
#                      heartbeats stopped marked CRASHED; notifications); register every deployment
#                      unless the server has them from this very code (flows/worker_setup.py); then
#                      `prefect worker start --pool $CIFAR_WORK_POOL --with-healthcheck [--limit
#                      $CIFAR_WORKER_LIMIT] ARGS...`
#   anything else      run as given: `python flows/pipeline.py ...`, `prefect ...`, `mlflow ...`, `bash`
#
# Needs PREFECT_API_URL and PREFECT_API_AUTH_STRING (and MLFLOW_TRACKING_URI, MLFLOW_TRACKING_USERNAME and
# MLFLOW_TRACKING_PASSWORD for a tracking server); docker/compose.yaml sets them all.
set -euo pipefail

# CIFAR_CA_FILE: a CA certificate to trust besides the system's, e.g. the stack's local CA for a worker that
# reaches the servers through the front door (docker/worker-remote.yaml). Python's ssl and httpx (Prefect)
# read SSL_CERT_FILE, requests (MLflow) REQUESTS_CA_BUNDLE: both get the system bundle plus this one
# (docker/worker-remote.yaml names the same file for the commands run with `exec`).
if [[ -n ${CIFAR_CA_FILE:-} ]]; then
    bundle=$HOME/ca-bundle.crt
    cat /etc/ssl/certs/ca-certificates.crt "$CIFAR_CA_FILE" > "$bundle"
    export SSL_CERT_FILE=$bundle REQUESTS_CA_BUNDLE=$bundle
fi

pool=${CIFAR_WORK_POOL:-cifar-process}

if [[ ${1:-worker} != worker ]]; then
    exec "$@"
fi
shift || true

# The pool and the `training` limit when missing (at most one training at a time, tasks/training.py tags its
# task `training`; raise it with `prefect concurrency-limit create training N` once workers run on separate
# devices); the automations; and the deployments, deployed again only when this image's code differs from the
# code they were deployed from (flows/worker_setup.py), all in one process.
# A flow run whose process dies with its container (killed, evicted, out of memory, the machine lost) reports
# nothing more: without a rule it would stay RUNNING forever. Every flow run sends a heartbeat event every
# PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds (30 in docker/compose.yaml); the automation "cifar: crash flow
# runs whose heartbeats stopped" marks a run with no heartbeat and no final state for
# CIFAR_CRASHED_AFTER_SECONDS (90) CRASHED, and a new run of it resumes from its last checkpoint. With it,
# the notifications (CIFAR_NOTIFY_WEBHOOK_URL or _FILE): flows/automations.py makes or updates both, so a
# new image brings its rules to a server made by an older one.
crashed_after=${CIFAR_CRASHED_AFTER_SECONDS:-90}
python flows/worker_setup.py --pool "$pool" --crashed-after "$crashed_after"
# prefect.yaml's pull step starts each flow run in "{{ $PWD }}" as the worker sees it: this directory
# (the image's WORKDIR, /app), so the flows' `./workdir` is the `workdir` volume.
export PWD

# `docker stop`, `podman stop`, `compose down` and a Kubernetes eviction send SIGTERM here (through the
# image's init). Prefect's worker answers it by stopping itself; the flow runs it started, each in a session
# of its own, would then die with the container, mid-step, without a checkpoint. So the worker runs as a
# child of this shell, and a SIGTERM goes first to every flow run's process: a training saves its state
# after the next step (TensorFlow's preemption handler) and its run ends Failed, to be resumed by running it
# again; a run outside training ends Crashed. Once they have ended (their states reported by the worker),
# the worker stops. The container needs the time: stop_grace_period in docker/compose.yaml.
children_of() {  # The processes whose parent is $1 (no procps in the image).
    local status key value
    for status in /proc/[0-9]*/status; do
        {  # A process may end between the listing and the read: no message for it.
            while read -r key value; do
                if [[ $key == PPid: ]]; then
                    [[ $value == "$1" ]] && basename "$(dirname "$status")"
                    break
                fi
            done < "$status"
        } 2>/dev/null
    done
}
alive() {  # Whether process $1 still runs (a zombie has ended: its parent has not read its status yet).
    local key value
    {
        while read -r key value; do
            [[ $key == State: ]] && { [[ $value != Z* ]]; return; }
        done < "/proc/$1/status"
    } 2>/dev/null
    return 1
}
stopping=
trap 'stopping=1' TERM INT
# The worker in a process group of its own: the image's init may signal this shell's whole group, and the
# worker must not begin its own shutdown while its flow runs are still saving.
set -m
# CIFAR_WORKER_LIMIT=N: at most N flow runs at once in this worker (1 when each worker owns one device).
# Empty (the default): no limit, so a single worker can run a search and its trials side by side.
prefect worker start --pool "$pool" --with-healthcheck ${CIFAR_WORKER_LIMIT:+--limit "$CIFAR_WORKER_LIMIT"} "$@" &
worker=$!
status=0
waited=
while [[ -z $stopping ]] && alive "$worker"; do
    waited=1
    wait "$worker" && status=0 || status=$?  # Returns early (above 128) when a signal arrives.
done
if [[ -z $waited && -z $stopping ]]; then  # It ended before the first look (bash keeps its status): that status.
    wait "$worker" && status=0 || status=$?
fi
if [[ -n $stopping ]] && alive "$worker"; then
    runs=$(children_of "$worker")  # The flow runs' processes.
    if [[ -n $runs ]]; then
        echo "entrypoint: SIGTERM: stopping the flow runs' processes ($(echo $runs)) before the worker" >&2
        kill -TERM $runs 2>/dev/null || true
        for run in $runs; do
            while alive "$run"; do sleep 1; done
        done
        sleep 5  # The worker reports how they ended.
    fi
    kill -TERM "$worker" 2>/dev/null || true
    wait "$worker" && status=0 || status=$?
fi
exit "$status"
