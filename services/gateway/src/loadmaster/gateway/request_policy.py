"""The OpenAI front end's `RequestPolicy`: the client's profile and cooldown (profiles.py) and
guardrails around each completion request, and its audit record once it ends (however it
ends: answered, refused, failed or abandoned)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from loadmaster.common.clock import Clock, SystemClock
from loadmaster.common.errors import LoadmasterError
from loadmaster.gateway.audit import AuditLog, AuditRecord
from loadmaster.gateway.auth import Principal
from loadmaster.gateway.generation import (
    Finished,
    GenerationEvent,
    GenerationRequest,
    RequestError,
    RequestWatch,
    TextChunk,
)
from loadmaster.gateway.generations import DEFAULT_PRIORITY
from loadmaster.gateway.guardrails import CONTENT_FILTER, Guardrails, prompt_text
from loadmaster.gateway.profiles import ClientPolicy, apply_profile

__all__ = ["GatewayPolicy"]


class GatewayPolicy:
    def __init__(
        self,
        guardrails: Guardrails,
        audit: AuditLog | None,
        *,
        clock: Clock | None = None,
        clients: ClientPolicy | None = None,
    ) -> None:
        self.guardrails = guardrails
        self.audit = audit
        self.clock: Clock = clock or SystemClock()
        self.clients = clients

    def open(self, *, endpoint: str, request_id: str) -> RequestWatch:
        return _Watch(self, endpoint, request_id, self.clock.time(), self.clock.monotonic())


@dataclass(slots=True, eq=False)
class _Watch:
    policy: GatewayPolicy
    endpoint: str
    request_id: str
    started: float  # clock.time()
    started_monotonic: float
    principal: Principal | None = None
    generation: GenerationRequest | None = None
    client_id: str = ""
    parts: list[str] = field(default_factory=list)
    written: bool = False

    def authenticated(self, principal: Principal) -> None:
        self.principal = principal

    async def admit(self, generation: GenerationRequest, *, client_id: str) -> GenerationRequest:
        self.generation, self.client_id = generation, client_id
        assert self.principal is not None
        clients = self.policy.clients
        if clients is not None:
            principal = self.principal
            profile = clients.profile(
                client_id=client_id,
                api_key=principal.name if principal.method == "api_key" else "",
                tenant=principal.tenant,
            )
            clients.charge(client_id, profile)
            generation = self.generation = apply_profile(generation, profile)
        await self.policy.guardrails.admit(
            generation,
            request_id=self.request_id,
            principal=self.principal,
            client_id=client_id,
            endpoint=self.endpoint,
        )
        return generation

    def watch(self, events: AsyncIterator[GenerationEvent]) -> AsyncIterator[GenerationEvent]:
        if self.policy.guardrails.screens_completions:
            events = self.policy.guardrails.screen(events)
        return self._recorded(events) if self.policy.audit is not None else events

    async def _recorded(self, events: AsyncIterator[GenerationEvent]) -> AsyncIterator[GenerationEvent]:
        finished: Finished | None = None
        try:
            async for item in events:
                if isinstance(item, TextChunk):
                    self.parts.append(item.text)
                elif isinstance(item, Finished):
                    finished = item
                yield item
        except Exception as error:
            self.failed(error)
            raise
        finally:
            close = getattr(events, "aclose", None)
            if close is not None:
                await close()
            if finished is not None:
                outcome = "content_filter" if finished.finish_reason == CONTENT_FILTER else "ok"
                self._write(outcome, 200, finished=finished)
            else:
                self._write("cancelled", 499)  # closed before the end: the client went away

    def failed(self, error: BaseException) -> None:
        if isinstance(error, RequestError):
            self._write(error.code or "invalid_request", error.status, error=error.message)
        elif isinstance(error, LoadmasterError):
            self._write(error.edge_code or "internal", error.http_status, error=error.message)
        else:
            self._write("internal", 500, error=type(error).__name__)

    def _write(self, outcome: str, status: int, *, finished: Finished | None = None, error: str = "") -> None:
        audit = self.policy.audit
        if audit is None or self.written:
            return
        self.written = True
        generation, principal = self.generation, self.principal
        completion = "".join(self.parts) if generation is not None else None
        audit.write(
            AuditRecord(
                time_unix_s=self.started,
                request_id=self.request_id,
                endpoint=self.endpoint,
                outcome=outcome,
                status=status,
                latency_ms=(self.policy.clock.monotonic() - self.started_monotonic) * 1000,
                subject=principal.name if principal else "",
                auth=principal.method if principal else "",
                client_id=self.client_id,
                model=(
                    finished.model if finished and finished.model else generation.model if generation else ""
                ),
                priority=_priority(generation),
                stream=generation.stream if generation else False,
                prompt_tokens=finished.prompt_tokens if finished else 0,
                completion_tokens=finished.completion_tokens if finished else 0,
                finish_reason=finished.finish_reason if finished else "",
                error=error,
                prompt=prompt_text(generation) if generation is not None else None,
                completion=completion,
            )
        )


def _priority(generation: GenerationRequest | None) -> int | None:
    if generation is None:
        return None
    return DEFAULT_PRIORITY if generation.priority is None else generation.priority
