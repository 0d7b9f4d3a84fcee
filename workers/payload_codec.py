"""Optional end-to-end encryption of Temporal payloads (AES-256-GCM).

With ``MILESTONE_PAYLOAD_KEY`` (or ``MILESTONE_PAYLOAD_KEY_FILE``) set, every client
and worker that connects through ``workers.common.connect`` encrypts each payload
before it leaves the process and decrypts it on the way in, so the Temporal server,
its database and anyone reading history see ciphertext only. The key lives in the
environment or a file, never in the run config (which is itself a payload).

Wire format of an encrypted payload: metadata ``encoding: binary/encrypted`` and
``encryption-key-id: <fingerprint>``; data ``nonce (12 bytes) || AES-GCM(serialized
inner Payload)``. The fingerprint names the key without revealing it, so a process
holding another key fails with a message saying which key is needed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Mapping, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec

KEY_ENV = "MILESTONE_PAYLOAD_KEY"
KEY_FILE_ENV = "MILESTONE_PAYLOAD_KEY_FILE"
ENCODING = b"binary/encrypted"
KEY_ID = "encryption-key-id"
NONCE_BYTES = 12


class PayloadKeyError(ValueError):
    """The payload key setting is unusable (the message names the variable, never the key)."""


def parse_key(text: str, where: str) -> bytes:
    """A 32-byte key written as base64 (standard or URL-safe) or 64 hex digits."""
    text = text.strip()
    key: bytes | None = None
    if len(text) == 64:
        try:
            key = bytes.fromhex(text)
        except ValueError:
            key = None
    if key is None:
        try:
            key = base64.b64decode(text.replace("-", "+").replace("_", "/"), validate=True)
        except (binascii.Error, ValueError):
            key = None
    if key is None or len(key) != 32:
        raise PayloadKeyError(
            f"{where}: not a 32-byte key in base64 or hex (make one with: "
            "python -c \"import os, base64; print(base64.b64encode(os.urandom(32)).decode())\")"
        )
    return key


def key_from_env(env: Mapping[str, str] | None = None) -> bytes | None:
    """The payload key from ``MILESTONE_PAYLOAD_KEY`` or the file ``MILESTONE_PAYLOAD_KEY_FILE`` names."""
    env = os.environ if env is None else env
    inline, path = env.get(KEY_ENV), env.get(KEY_FILE_ENV)
    if inline and path:
        raise PayloadKeyError(f"set one of {KEY_ENV} and {KEY_FILE_ENV}, not both")
    if inline:
        return parse_key(inline, KEY_ENV)
    if path:
        try:
            text = open(path, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as err:
            reason = err.strerror if isinstance(err, OSError) else "not a text file"
            raise PayloadKeyError(f"{KEY_FILE_ENV}={path}: cannot read the key file: {reason}") from None
        return parse_key(text, f"{KEY_FILE_ENV}={path}")
    return None


def key_id(key: bytes) -> str:
    """A fingerprint that names a key without revealing it."""
    return hashlib.sha256(b"milestone-payload-key:" + key).hexdigest()[:16]


class EncryptionCodec(PayloadCodec):
    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self.key_id = key_id(key)

    def encrypt(self, payload: Payload) -> Payload:
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, payload.SerializeToString(), None)
        return Payload(metadata={"encoding": ENCODING, KEY_ID: self.key_id.encode()}, data=nonce + sealed)

    def decrypt(self, payload: Payload) -> Payload:
        """The inner payload; payloads that are not encrypted pass through unchanged."""
        if payload.metadata.get("encoding") != ENCODING:
            return payload
        their = payload.metadata.get(KEY_ID, b"").decode()
        if their != self.key_id:
            raise ValueError(
                f"payload encrypted with key {their or '(unnamed)'}, this process holds key {self.key_id}: "
                f"set {KEY_ENV} to the key the run was started with"
            )
        try:
            plain = self._aead.decrypt(payload.data[:NONCE_BYTES], payload.data[NONCE_BYTES:], None)
        except InvalidTag:
            raise ValueError(f"payload under key {self.key_id} fails authentication: it was altered") from None
        inner = Payload()
        inner.ParseFromString(plain)
        return inner

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.encrypt(p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.decrypt(p) for p in payloads]


def codec_from_env(env: Mapping[str, str] | None = None) -> EncryptionCodec | None:
    key = key_from_env(env)
    return EncryptionCodec(key) if key is not None else None
