"""The audit trail: one JSON line per OpenAI API request, and one per admin change (docs/admin.md),
written off the request path.

An `AuditRecord` is put on a bounded queue (`logging.handlers.QueueHandler`) and returns at
once; a `QueueListener` thread turns it into JSON, hashing the prompt and the completion
there (SHA-256; the texts themselves only with `debug_mode`), and a `RotatingFileHandler`
writes it. So the event loop never waits on the disk, and never hashes a 4 MiB prompt. When
the queue is full (the disk cannot keep up), records are dropped and counted (`dropped`, and
a warning at most every `DROP_WARNING_S`) rather than block a request. docs/audit.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import logging.handlers
import queue
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loadmaster.common.gateway_config import AuditSettings

__all__ = ["AdminRecord", "AuditLog", "AuditRecord", "format_admin_record", "format_record"]

log = logging.getLogger(__name__)

DROP_WARNING_S = 10.0


@dataclass(slots=True)
class AuditRecord:
    """One request, as it ended. `prompt` and `completion` are texts here; the writer hashes them."""

    time_unix_s: float
    request_id: str
    endpoint: str
    outcome: str  # `ok`, `content_filter`, `cancelled`, or the error code (`policy_refused`, …)
    status: int  # the HTTP status answered (200 for a stream that began, whatever happened later)
    latency_ms: float
    subject: str = ""
    auth: str = ""  # none | api_key | oidc
    client_id: str = ""
    model: str = ""
    priority: int | None = None
    stream: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""
    error: str = ""
    prompt: str | None = field(default=None, repr=False)
    completion: str | None = field(default=None, repr=False)


@dataclass(slots=True)
class AdminRecord:
    """One admin change (or refused attempt): who, what, and the values before and after.
    Key records carry only a prefix of their hash, never the key."""

    time_unix_s: float
    action: str  # `keys.add`, `keys.update`, `keys.revoke`, `guardrails.add`, `config.set` …
    target: str  # the key's name, the guardrail's id, the setting's path
    outcome: str  # `ok`, or the error code the caller got
    subject: str = ""
    auth: str = ""  # none | api_key | oidc | admin_token
    old: Any = None
    new: Any = None
    error: str = ""
    gateway_id: str = ""


def format_admin_record(record: AdminRecord) -> str:
    fields: dict[str, Any] = asdict(record)
    fields.pop("time_unix_s")
    line = {
        "time": datetime.fromtimestamp(record.time_unix_s, UTC).isoformat(timespec="milliseconds"),
        "kind": "admin",
        **fields,
    }
    return json.dumps(line, ensure_ascii=False, separators=(",", ":"), default=str)


def format_record(record: AuditRecord, *, debug_mode: bool) -> str:
    """The JSON line (called on the writer thread)."""
    fields: dict[str, Any] = asdict(record)
    prompt, completion = fields.pop("prompt"), fields.pop("completion")
    fields.pop("time_unix_s")
    line: dict[str, Any] = {
        "time": datetime.fromtimestamp(record.time_unix_s, UTC).isoformat(timespec="milliseconds"),
        **fields,
        "latency_ms": round(record.latency_ms, 3),
        "prompt_sha256": _sha256(prompt),
        "completion_sha256": _sha256(completion),
    }
    if debug_mode:
        line["prompt"], line["completion"] = prompt, completion
    return json.dumps(line, ensure_ascii=False, separators=(",", ":"))


def _sha256(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


class _RecordFormatter(logging.Formatter):
    def __init__(self, *, debug_mode: bool) -> None:
        super().__init__()
        self._debug_mode = debug_mode

    def format(self, record: logging.LogRecord) -> str:
        entry = record.msg
        if isinstance(entry, AdminRecord):
            return format_admin_record(entry)
        assert isinstance(entry, AuditRecord)
        return format_record(entry, debug_mode=self._debug_mode)


class _FolderMakingFileHandler(logging.handlers.RotatingFileHandler):
    """Opened at its first record when `delay`: the folder is made then."""

    def _open(self) -> Any:
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


class _NonBlockingQueueHandler(logging.handlers.QueueHandler):
    """Puts the record as it is (formatting waits for the writer thread); never blocks."""

    def __init__(self, records: queue.Queue[Any]) -> None:
        super().__init__(records)
        self.dropped = 0
        self._warned_at = 0.0

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            now = time.monotonic()
            if now - self._warned_at >= DROP_WARNING_S:
                self._warned_at = now
                log.warning("audit: the writer is behind; %d record(s) dropped so far", self.dropped)


class _Listener(logging.handlers.QueueListener):
    def __init__(self, records: queue.Queue[Any], *handlers: logging.Handler) -> None:
        super().__init__(records, *handlers)
        self._records = records

    def enqueue_sentinel(self) -> None:
        self._records.put(None)  # QueueListener's sentinel; on close, in a thread: waits for room


class AuditLog:
    """`write(record)` from the event loop; `start()` opens the file, `close()` drains and closes.

    With request auditing off (`enabled: false`) the log still takes admin changes
    (`write_admin`); its file is then opened only when the first one comes."""

    def __init__(self, settings: AuditSettings, *, path: Path) -> None:
        self._settings = settings
        self.path = path
        self._records: queue.Queue[Any] = queue.Queue(settings.queue_size)
        self._handler = _NonBlockingQueueHandler(self._records)
        self._listener: _Listener | None = None

    @property
    def dropped(self) -> int:
        return self._handler.dropped

    def start(self) -> None:
        """Blocking (it creates the folder and opens the file): call it in a thread."""
        writer = _FolderMakingFileHandler(
            self.path,
            maxBytes=self._settings.max_file_bytes,
            backupCount=self._settings.backup_count,
            encoding="utf-8",
            delay=not self._settings.enabled,
        )
        writer.setFormatter(_RecordFormatter(debug_mode=self._settings.debug_mode))
        self._listener = _Listener(self._records, writer)
        self._listener.start()
        log.info("audit log: %s", self.path)

    def write(self, record: AuditRecord | AdminRecord) -> None:
        self._handler.handle(logging.LogRecord("loadmaster.audit", logging.INFO, "", 0, record, None, None))

    def close(self) -> None:
        """Blocking: writes what is queued, then closes the file (call it in a thread)."""
        if self._listener is None:
            return
        self._listener.stop()
        for handler in self._listener.handlers:
            handler.close()
        self._listener = None
