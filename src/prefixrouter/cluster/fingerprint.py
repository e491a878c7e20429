"""Configuration fingerprints: what must be equal on every replica for block hashes to agree.

A peer's routing names block hashes; they mean the same prefix here only if
both replicas hash alike: the routing mode, chunk size or block size, the
tokenizer, the template version, and the namespace inputs (which model names
are adapters, which tenants keep their cache apart, their salts and the
secret the salts derive from). The gateway lists
those fields as name -> canonical text (``gateway/cluster_link.py``); here
each becomes a short SHA-256 digest, and the whole a 64-bit digest that every
message's envelope carries.

Secrets (salts, ``salt_secret``) are only ever digested: a field's
digest goes over the wire, never its value. Heartbeats carry the per-field
digests, so a replica that differs from a live peer can name the field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass


def _digest(text: str) -> str:
    return hashlib.sha256(b"prefixrouter-fingerprint\0" + text.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """Per-field digests and the digest of them all.

    Attributes:
        fields: Field name -> 16 hex digits of its canonical text's digest.
        value: The 64-bit digest of every field (what envelopes carry).
    """

    fields: Mapping[str, str]
    value: int

    @classmethod
    def of(cls, canonical: Mapping[str, str]) -> Fingerprint:
        """The fingerprint of ``canonical`` (field name -> canonical text of its value)."""
        fields = {name: _digest(text) for name, text in sorted(canonical.items())}
        return cls.from_fields(fields)

    @classmethod
    def from_fields(cls, fields: Mapping[str, str]) -> Fingerprint:
        """The fingerprint of per-field digests already made (as a heartbeat carries them)."""
        joined = "\n".join(f"{k}={v}" for k, v in sorted(fields.items()))
        value = int.from_bytes(hashlib.sha256(joined.encode("utf-8")).digest()[:8], "little")
        return cls(dict(sorted(fields.items())), value)

    def differing(self, other: Mapping[str, str]) -> list[str]:
        """Names of the fields whose digests differ from ``other``'s (or that one side lacks)."""
        names = set(self.fields) | set(other)
        return sorted(n for n in names if self.fields.get(n) != other.get(n))
