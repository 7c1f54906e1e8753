"""Prefix affinity: the key that sends generations sharing a prompt prefix to the same worker.

A worker's transformers engine reuses the KV pages of a prompt prefix it has computed before
(a shared system prompt, the earlier turns of a chat: docs/prefix-reuse.md), but only its own.
So the gateway hashes the first `PREFIX_CHARS` characters of each generation's prompt (for a
chat, its messages in order, role and content) into `RequestInfo.affinity_key`, and the
scheduler's placement sends requests with the same key to the worker the key ranks first
(rendezvous hashing, within the room and slack rules of scheduler/placement.py).

A prompt shorter than `PREFIX_CHARS` gets no key: it spans about one KV page (64-256 tokens)
or less, too little to be worth steering for. The hash includes the model id; it is computed on
the loop over at most `PREFIX_CHARS` characters.
"""

from __future__ import annotations

import hashlib

from loadmaster.gateway.generation import GenerationRequest

__all__ = ["PREFIX_CHARS", "prefix_affinity_key"]

PREFIX_CHARS = 256  # about one 64-token KV page of English text

_ROLE_END, _MESSAGE_END = "\x1f", "\x1e"  # separators no chat text uses


def prefix_affinity_key(request: GenerationRequest) -> str:
    """A short hex key of the prompt's first PREFIX_CHARS characters; "" for a shorter prompt."""
    if request.messages is not None:
        parts: list[str] = []
        size = 0
        for turn in request.messages:
            role = "system" if turn.role == "developer" else turn.role
            part = f"{role}{_ROLE_END}{turn.content}{_MESSAGE_END}"
            parts.append(part)
            size += len(part)
            if size >= PREFIX_CHARS:
                break
        text = "".join(parts)
    else:
        text = request.prompt or ""
    if len(text) < PREFIX_CHARS:
        return ""
    digest = hashlib.blake2b(f"{request.model}\x00{text[:PREFIX_CHARS]}".encode(), digest_size=8)
    return digest.hexdigest()
