"""The base of every settings section (`loadmaster.common.config`): unknown keys are errors."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Section", "ServiceEndpoint"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServiceEndpoint(Section):
    """Where a gRPC service is reached (`address`) and what it binds (`listen`, default: address).

    On SIGTERM the service turns NOT_SERVING at once, refuses new work and gives what is in
    flight up to `shutdown_grace_s` to finish before it closes its links (30 s, Kubernetes'
    default termination grace period)."""

    address: str
    listen: str | None = None
    shutdown_grace_s: float = Field(default=30.0, ge=0)

    @property
    def listen_address(self) -> str:
        return self.listen or self.address
