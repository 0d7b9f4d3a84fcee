"""How every process reaches Temporal: address, namespace, TLS / mTLS, API key, payload codec.

One place reads the environment, so the workers, the ``milestone`` CLI and the dev
stack connect the same way (command-line flags, where a program has them, win):

| variable | meaning |
|---|---|
| ``MILESTONE_TEMPORAL_ADDRESS`` | frontend ``host:port`` (default ``localhost:7233``) |
| ``MILESTONE_TEMPORAL_NAMESPACE`` | namespace (default ``default``) |
| ``MILESTONE_TEMPORAL_API_KEY`` | API key (Temporal Cloud); turns TLS on |
| ``MILESTONE_TEMPORAL_TLS_CA`` | PEM file: CA that signed the server certificate; turns TLS on |
| ``MILESTONE_TEMPORAL_TLS_CERT`` / ``_TLS_KEY`` | PEM files: client certificate and key (mTLS); turn TLS on |
| ``MILESTONE_TEMPORAL_TLS_SERVER_NAME`` | name to expect on the server certificate (and SNI) |
| ``MILESTONE_TEMPORAL_TLS`` | ``1`` / ``0``: force TLS on (system roots) or off |
| ``MILESTONE_PAYLOAD_KEY`` / ``_KEY_FILE`` | payload encryption key (see ``workers.payload_codec``) |

Secrets stay out of ``repr`` and error messages; a bad file is reported with the
variable and the path.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter, DefaultFailureConverterWithEncodedAttributes
from temporalio.service import TLSConfig

from workers.payload_codec import codec_from_env

DEFAULT_ADDRESS = "localhost:7233"
DEFAULT_NAMESPACE = "default"
PREFIX = "MILESTONE_TEMPORAL_"


class TemporalSettingsError(ValueError):
    """A connection setting is unusable; the message names the variable (and file)."""


@dataclass(frozen=True)
class TemporalSettings:
    address: str
    namespace: str
    api_key: str | None = dataclasses.field(default=None, repr=False)
    tls: TLSConfig | bool = False

    @property
    def uses_tls(self) -> bool:
        return self.tls is not False


def _read_pem(env: Mapping[str, str], name: str, marker: str) -> bytes | None:
    var = PREFIX + name
    path = env.get(var)
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise TemporalSettingsError(f"{var}={path}: cannot read the file: {err.strerror}") from None
    if b"-----BEGIN " not in data or marker.encode() not in data:
        raise TemporalSettingsError(f"{var}={path}: not a PEM file with a {marker.strip('-')} block")
    return data


def _flag(env: Mapping[str, str], name: str) -> bool | None:
    value = env.get(PREFIX + name, "").strip().lower()
    if not value:
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise TemporalSettingsError(f"{PREFIX}{name}={value!r}: use 1 or 0")


def settings_from_env(
    address: str | None = None, namespace: str | None = None, env: Mapping[str, str] | None = None
) -> TemporalSettings:
    """The connection settings: arguments first, then the environment, then defaults."""
    env = os.environ if env is None else env
    ca = _read_pem(env, "TLS_CA", "CERTIFICATE-----")
    cert = _read_pem(env, "TLS_CERT", "CERTIFICATE-----")
    key = _read_pem(env, "TLS_KEY", "PRIVATE KEY-----")
    if (cert is None) != (key is None):
        given, missing = ("TLS_CERT", "TLS_KEY") if cert is not None else ("TLS_KEY", "TLS_CERT")
        raise TemporalSettingsError(f"{PREFIX}{given} is set but {PREFIX}{missing} is not: mTLS needs both")
    server_name = env.get(PREFIX + "TLS_SERVER_NAME") or None
    api_key = env.get(PREFIX + "API_KEY") or None
    forced = _flag(env, "TLS")
    tls: TLSConfig | bool = False
    if ca or cert or server_name:
        tls = TLSConfig(server_root_ca_cert=ca, client_cert=cert, client_private_key=key, domain=server_name)
    elif api_key or forced:
        tls = True  # the system's root certificates
    if forced is False:
        if ca or cert or server_name:
            raise TemporalSettingsError(f"{PREFIX}TLS=0 contradicts the TLS files / server name that are set")
        tls = False
    return TemporalSettings(
        address=address or env.get(PREFIX + "ADDRESS") or DEFAULT_ADDRESS,
        namespace=namespace or env.get(PREFIX + "NAMESPACE") or DEFAULT_NAMESPACE,
        api_key=api_key,
        tls=tls,
    )


def data_converter(env: Mapping[str, str] | None = None) -> DataConverter:
    """The pydantic converter; with a payload key, also the encryption codec, and failure
    messages and stack traces moved into (encrypted) payloads."""
    codec = codec_from_env(env)
    if codec is None:
        return pydantic_data_converter
    return dataclasses.replace(
        pydantic_data_converter, payload_codec=codec,
        failure_converter_class=DefaultFailureConverterWithEncodedAttributes,
    )


async def connect_with(settings: TemporalSettings, converter: DataConverter | None = None) -> Client:
    return await Client.connect(
        settings.address,
        namespace=settings.namespace,
        data_converter=converter or data_converter(),
        api_key=settings.api_key,
        tls=settings.tls,
    )
