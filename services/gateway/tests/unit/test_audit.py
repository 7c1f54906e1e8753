"""The audit log's writer: JSON lines, hashes unless debug_mode, rotation, never blocking."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

from loadmaster.common.gateway_config import AuditSettings
from loadmaster.gateway.audit import AdminRecord, AuditLog, AuditRecord


def record(request_id: str, *, prompt: str | None = "hello", completion: str | None = "world") -> AuditRecord:
    return AuditRecord(
        time_unix_s=1_700_000_000.25,
        request_id=request_id,
        endpoint="chat.completions",
        outcome="ok",
        status=200,
        latency_ms=12.3456,
        subject="alice",
        auth="oidc",
        client_id="arm-1",
        model="tiny-chat",
        priority=0,
        prompt_tokens=3,
        completion_tokens=2,
        finish_reason="stop",
        prompt=prompt,
        completion=completion,
    )


def lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_record_is_one_json_line_with_hashes_not_texts(tmp_path: Path) -> None:
    audit = AuditLog(AuditSettings(enabled=True), path=tmp_path / "a" / "audit.jsonl")
    audit.start()
    audit.write(record("r1"))
    audit.write(record("r2", prompt=None, completion=None))  # refused before it was read
    audit.close()
    first, second = lines(tmp_path / "a" / "audit.jsonl")
    assert first["time"] == "2023-11-14T22:13:20.250+00:00" and first["latency_ms"] == 12.346
    assert (first["subject"], first["client_id"], first["model"], first["priority"]) == (
        "alice",
        "arm-1",
        "tiny-chat",
        0,
    )
    assert (first["prompt_tokens"], first["completion_tokens"], first["outcome"]) == (3, 2, "ok")
    assert first["prompt_sha256"] == hashlib.sha256(b"hello").hexdigest()
    assert first["completion_sha256"] == hashlib.sha256(b"world").hexdigest()
    assert "prompt" not in first and "completion" not in first
    assert second["prompt_sha256"] is None


def test_debug_mode_writes_the_texts_too(tmp_path: Path) -> None:
    audit = AuditLog(AuditSettings(enabled=True, debug_mode=True), path=tmp_path / "audit.jsonl")
    audit.start()
    audit.write(record("r1"))
    audit.close()
    [line] = lines(tmp_path / "audit.jsonl")
    assert (line["prompt"], line["completion"]) == ("hello", "world")
    assert line["prompt_sha256"] == hashlib.sha256(b"hello").hexdigest()


def test_the_file_rotates_and_keeps_backup_count_files(tmp_path: Path) -> None:
    audit = AuditLog(
        AuditSettings(enabled=True, max_file_bytes=2048, backup_count=2), path=tmp_path / "audit.jsonl"
    )
    audit.start()
    for index in range(100):
        audit.write(record(f"r{index}"))
    audit.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]
    assert all(p.stat().st_size <= 2048 for p in tmp_path.iterdir())
    kept = [line["request_id"] for name in reversed(files) for line in lines(tmp_path / name)]
    assert kept == [f"r{i}" for i in range(100 - len(kept), 100)]  # the newest, in order


def test_a_writer_that_cannot_keep_up_drops_and_counts_instead_of_blocking(tmp_path: Path) -> None:
    audit = AuditLog(AuditSettings(enabled=True, queue_size=5), path=tmp_path / "audit.jsonl")
    audit.start()
    assert audit._listener is not None
    [handler] = audit._listener.handlers
    gate = threading.Event()
    original = handler.emit
    handler.emit = lambda r: (gate.wait(10), original(r))  # type: ignore[method-assign]  # a stuck disk
    for index in range(50):
        audit.write(record(f"r{index}"))  # returns at once every time
    assert 44 <= audit.dropped <= 45  # five wait in the queue (one more may be in the writer's hands)
    gate.set()
    audit.close()
    assert 5 <= len(lines(tmp_path / "audit.jsonl")) <= 6


def test_admin_changes_are_written_even_with_request_auditing_off(tmp_path: Path) -> None:
    path = tmp_path / "audit" / "gateway-audit.jsonl"
    audit = AuditLog(AuditSettings(enabled=False), path=path)
    audit.start()
    assert not path.parent.exists()  # nothing is made until an admin change comes
    audit.write(
        AdminRecord(
            time_unix_s=1_700_000_000.0,
            action="keys.revoke",
            target="svc",
            outcome="ok",
            subject="ops",
            auth="api_key",
            old={"state": "active"},
            new={"state": "revoked"},
        )
    )
    audit.close()
    (line,) = lines(path)
    assert line["kind"] == "admin" and line["action"] == "keys.revoke" and line["subject"] == "ops"
    assert (line["old"], line["new"]) == ({"state": "active"}, {"state": "revoked"})
