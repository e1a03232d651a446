"""A multi-worker training's rendezvous over the Prefect API (`cifar.cluster.Rendezvous`).

The chief (the pipeline's training task) places workers 1..N-1 as flow runs of `train.worker_deployment`;
each process reports its address as the Prefect variable `cifar-job-<job>-worker-<index>`; the chief, once
all have joined, writes the cluster to `cifar-job-<job>-cluster` (or why the job cannot start, and cancels
the flow runs that never joined). Every process waits at most `train.gang_timeout_seconds`.
"""

from __future__ import annotations

import socket
import uuid
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.runtime import flow_run
from prefect.settings import get_current_settings
from prefect.states import Cancelled, Cancelling
from prefect.variables import Variable
from pydantic import BaseModel, ConfigDict

from cifar.cluster import (
    ClusterSpec,
    GangStartError,
    ResumePoint,
    WorkerAddress,
    mismatched_data,
    reachable_host,
    reserve_port,
    wait_for,
)
from cifar.config import ConfigOverrides, PipelineConfig

CHIEF_GRACE_SECONDS = 30.0  # A worker waits this much longer than the chief for the cluster.


class JobTicket(BaseModel):
    """A worker flow run's place in its job: the `job` parameter of `cifar-train-worker`."""

    model_config = ConfigDict(extra="forbid")
    job: str  # Names the job's Prefect variables.
    index: int  # 1..workers-1 (0 is the chief).
    workers: int
    chief: str  # The chief's flow run, for messages.


def variable_name(job: str, member: str) -> str:
    return f"cifar-job-{job}-{member}"


class PrefectRendezvous:
    """One process's side of a job's rendezvous (index 0: the chief, which also places the others)."""

    def __init__(self, config: PipelineConfig, workdir: str, ticket: JobTicket) -> None:
        self.api_url = get_current_settings().api.url
        if not self.api_url:
            raise ValueError(
                f"train.workers={config.train.workers} needs a Prefect server for the workers to meet: set "
                "PREFECT_API_URL, or run `python flows/pipeline.py`, which starts a local one"
            )
        self.config, self.workdir, self.ticket = config, workdir, ticket
        self.index, self.workers = ticket.index, ticket.workers
        self.timeout = config.train.gang_timeout_seconds
        self.placed: dict[int, UUID] = {}  # The chief's: worker index -> its flow run.

    @classmethod
    def chief(cls, config: PipelineConfig, workdir: str) -> PrefectRendezvous:
        name = flow_run.get_name() or "cifar-training"  # The pipeline run's name; this outside a flow run.
        ticket = JobTicket(job=uuid.uuid4().hex[:16], index=0, workers=config.train.workers, chief=name)
        return cls(config, workdir, ticket)

    def join(self, data_digest: str, resume: ResumePoint | None) -> ClusterSpec:
        """Reports this process; the chief places the others, waits for them and hands out the cluster."""
        port = reserve_port()
        me = WorkerAddress(
            index=self.index,
            address=f"{reachable_host(self.api_url)}:{port}",
            hostname=socket.gethostname(),
            flow_run=flow_run.get_name() or f"worker {self.index}",
            data_digest=data_digest,
        )
        self._write(f"worker-{self.index}", me.model_dump(mode="json"))
        if self.index == 0:
            return self._lead(me, resume or ResumePoint())
        # Longer than the chief, whose deadline (counted from before this worker existed) ends first: its reason
        # (who is missing) reaches every worker that joined.
        chief = f"the chief ({self.ticket.chief}) handed out no cluster"
        found = wait_for(lambda: self._read("cluster"), self.timeout + CHIEF_GRACE_SECONDS, lambda: chief)
        spec = ClusterSpec.model_validate(found)
        if spec.failure:
            raise GangStartError(spec.failure)
        return spec

    def close(self) -> None:
        """The chief's: deletes the job's variables (once training has started, nobody reads them again)."""
        for member in ["cluster", *(f"worker-{index}" for index in range(self.workers))]:
            Variable.unset(variable_name(self.ticket.job, member))

    def _lead(self, me: WorkerAddress, resume: ResumePoint) -> ClusterSpec:
        self._place_workers()
        try:
            joined = wait_for(self._all_joined, self.timeout, self._missing)
            failure = mismatched_data(me.data_digest, joined[1:])
            if failure:
                raise GangStartError(f"training job {self.ticket.job}: {failure}")
        except GangStartError as error:
            self._cancel_unjoined(str(error))
            self._write("cluster", ClusterSpec(job=self.ticket.job, failure=str(error)).model_dump(mode="json"))
            raise
        spec = ClusterSpec(job=self.ticket.job, workers=[address.address for address in joined], resume=resume)
        self._write("cluster", spec.model_dump(mode="json"))
        print(f"Training job {self.ticket.job}: {self.workers} workers joined: {', '.join(spec.workers)}")
        return spec

    def _place_workers(self) -> None:
        parameters = {"config": ConfigOverrides.of(self.config).model_dump(mode="json"), "workdir": self.workdir}
        for index in range(1, self.workers):
            ticket = self.ticket.model_copy(update={"index": index})
            run = run_deployment(
                self.config.train.worker_deployment,
                parameters={**parameters, "job": ticket.model_dump()},
                timeout=0,
                flow_run_name=f"{self.ticket.chief}-worker-{index}",
                tags=["cifar-training-job"],
            )
            self.placed[index] = run.id

    def _all_joined(self) -> list[WorkerAddress] | None:
        found = [self._read(f"worker-{index}") for index in range(self.workers)]
        if any(value is None for value in found):
            return None
        return [WorkerAddress.model_validate(value) for value in found]

    def _missing(self) -> str:
        """Who has not joined, and what their flow runs are doing (never picked up, still preparing data, ended)."""
        missing = [index for index in range(1, self.workers) if self._read(f"worker-{index}") is None]
        with get_client(sync_client=True) as client:
            runs = {index: client.read_flow_run(self.placed[index]) for index in missing}
        described = ", ".join(
            f"worker {index} (flow run {run.name}: {run.state.name if run.state else 'no state'})"
            for index, run in runs.items()
        )
        return f"training job {self.ticket.job}: {len(missing)} of {self.workers - 1} workers did not join: {described}"

    def _cancel_unjoined(self, reason: str) -> None:
        """Ends the placed flow runs that never joined: none stays scheduled or running for a job that will not
        start. Those that joined read the failure and end with it themselves."""
        with get_client(sync_client=True) as client:
            for index, flow_run_id in self.placed.items():
                if self._read(f"worker-{index}") is not None:
                    continue
                state = client.read_flow_run(flow_run_id).state
                if state is None or state.is_final():
                    continue
                ending = Cancelling(message=reason) if state.is_running() else Cancelled(message=reason)
                client.set_flow_run_state(flow_run_id, ending, force=True)

    def _write(self, member: str, value: dict) -> None:
        Variable.set(variable_name(self.ticket.job, member), value, overwrite=True)

    def _read(self, member: str) -> dict | None:
        return Variable.get(variable_name(self.ticket.job, member))
