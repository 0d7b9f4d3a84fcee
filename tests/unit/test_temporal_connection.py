"""Connection settings from the environment and the payload encryption codec (no server)."""

from __future__ import annotations

import asyncio
import base64
import os
from pathlib import Path

import pytest
from temporalio.api.common.v1 import Payload
from temporalio.converter import DefaultFailureConverterWithEncodedAttributes
from temporalio.service import TLSConfig

from tests.tls_certs import make_pki
from workers.payload_codec import ENCODING, EncryptionCodec, PayloadKeyError, key_from_env, parse_key
from workers.temporal_connection import TemporalSettingsError, data_converter, settings_from_env

KEY = os.urandom(32)
KEY_B64 = base64.b64encode(KEY).decode()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_defaults_are_plaintext_localhost() -> None:
    s = settings_from_env(env={})
    assert (s.address, s.namespace, s.api_key, s.tls) == ("localhost:7233", "default", None, False)


def test_arguments_win_over_the_environment() -> None:
    env = {"MILESTONE_TEMPORAL_ADDRESS": "env:1", "MILESTONE_TEMPORAL_NAMESPACE": "envns"}
    assert settings_from_env(env=env).address == "env:1"
    s = settings_from_env("arg:2", "argns", env=env)
    assert (s.address, s.namespace) == ("arg:2", "argns")


def test_api_key_turns_tls_on_and_stays_out_of_repr() -> None:
    s = settings_from_env(env={"MILESTONE_TEMPORAL_API_KEY": "sekrit-api-key"})
    assert s.api_key == "sekrit-api-key" and s.tls is True and s.uses_tls
    assert "sekrit" not in repr(s)
    off = settings_from_env(env={"MILESTONE_TEMPORAL_API_KEY": "k", "MILESTONE_TEMPORAL_TLS": "0"})
    assert off.tls is False
    assert settings_from_env(env={"MILESTONE_TEMPORAL_TLS": "1"}).tls is True


def test_mtls_files_become_a_tls_config(pki) -> None:
    s = settings_from_env(env={
        "MILESTONE_TEMPORAL_TLS_CA": str(pki.ca), "MILESTONE_TEMPORAL_TLS_CERT": str(pki.client_cert),
        "MILESTONE_TEMPORAL_TLS_KEY": str(pki.client_key), "MILESTONE_TEMPORAL_TLS_SERVER_NAME": "t.example",
    })
    assert isinstance(s.tls, TLSConfig)
    assert s.tls.server_root_ca_cert == pki.ca.read_bytes()
    assert s.tls.client_cert == pki.client_cert.read_bytes()
    assert s.tls.client_private_key == pki.client_key.read_bytes()
    assert s.tls.domain == "t.example"
    ca_only = settings_from_env(env={"MILESTONE_TEMPORAL_TLS_CA": str(pki.ca)})
    assert isinstance(ca_only.tls, TLSConfig) and ca_only.tls.client_cert is None


def test_bad_files_name_the_variable_and_the_file(pki, tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(TemporalSettingsError, match=f"MILESTONE_TEMPORAL_TLS_CA={missing}: cannot read the file: No such file"):
        settings_from_env(env={"MILESTONE_TEMPORAL_TLS_CA": str(missing)})
    with pytest.raises(TemporalSettingsError, match=f"MILESTONE_TEMPORAL_TLS_KEY={pki.client_cert}: not a PEM file with a PRIVATE KEY"):
        settings_from_env(env={"MILESTONE_TEMPORAL_TLS_CERT": str(pki.client_cert),
                               "MILESTONE_TEMPORAL_TLS_KEY": str(pki.client_cert)})
    with pytest.raises(TemporalSettingsError, match="TLS_CERT is set but MILESTONE_TEMPORAL_TLS_KEY is not"):
        settings_from_env(env={"MILESTONE_TEMPORAL_TLS_CERT": str(pki.client_cert)})
    with pytest.raises(TemporalSettingsError, match="MILESTONE_TEMPORAL_TLS=0 contradicts"):
        settings_from_env(env={"MILESTONE_TEMPORAL_TLS_CA": str(pki.ca), "MILESTONE_TEMPORAL_TLS": "0"})
    with pytest.raises(TemporalSettingsError, match="MILESTONE_TEMPORAL_TLS='maybe'"):
        settings_from_env(env={"MILESTONE_TEMPORAL_TLS": "maybe"})


def test_payload_key_forms_and_errors(tmp_path: Path) -> None:
    assert parse_key(KEY_B64, "x") == KEY
    assert parse_key(KEY.hex(), "x") == KEY
    assert parse_key(base64.urlsafe_b64encode(KEY).decode() + "\n", "x") == KEY
    f = tmp_path / "payload.key"
    f.write_text(KEY_B64 + "\n")
    assert key_from_env({"MILESTONE_PAYLOAD_KEY_FILE": str(f)}) == KEY
    assert key_from_env({}) is None
    with pytest.raises(PayloadKeyError, match="MILESTONE_PAYLOAD_KEY: not a 32-byte key") as err:
        key_from_env({"MILESTONE_PAYLOAD_KEY": base64.b64encode(b"short").decode()})
    assert "c2hvcnQ" not in str(err.value)  # the value itself is never echoed
    with pytest.raises(PayloadKeyError, match=f"MILESTONE_PAYLOAD_KEY_FILE={tmp_path / 'gone'}: cannot read the key file"):
        key_from_env({"MILESTONE_PAYLOAD_KEY_FILE": str(tmp_path / "gone")})
    with pytest.raises(PayloadKeyError, match="not both"):
        key_from_env({"MILESTONE_PAYLOAD_KEY": KEY_B64, "MILESTONE_PAYLOAD_KEY_FILE": str(f)})


def test_codec_encrypts_round_trips_and_names_the_key() -> None:
    codec = EncryptionCodec(KEY)
    plain = Payload(metadata={"encoding": b"json/plain"}, data=b'{"store": "s3://bucket-xyz/exp"}')
    (sealed,) = asyncio.run(codec.encode([plain]))
    assert sealed.metadata["encoding"] == ENCODING and b"bucket-xyz" not in sealed.SerializeToString()
    assert asyncio.run(codec.decode([sealed])) == [plain]
    assert asyncio.run(codec.encode([plain]))[0].data != sealed.data  # a fresh nonce each time
    assert asyncio.run(codec.decode([plain])) == [plain]  # unencrypted payloads pass through
    other = EncryptionCodec(os.urandom(32))
    with pytest.raises(ValueError, match=f"encrypted with key {codec.key_id}, this process holds key {other.key_id}"):
        other.decrypt(sealed)
    tampered = Payload(metadata=sealed.metadata, data=sealed.data[:-1] + bytes([sealed.data[-1] ^ 1]))
    with pytest.raises(ValueError, match="fails authentication"):
        codec.decrypt(tampered)


def test_data_converter_has_the_codec_only_with_a_key() -> None:
    assert data_converter({}).payload_codec is None
    conv = data_converter({"MILESTONE_PAYLOAD_KEY": KEY_B64})
    assert isinstance(conv.payload_codec, EncryptionCodec)
    assert conv.failure_converter_class is DefaultFailureConverterWithEncodedAttributes


def test_credentials_in_the_store_uri_are_refused_without_echoing_them() -> None:
    from pydantic import ValidationError

    from spec.run import RunConfig
    from spec.strict import format_validation_error

    with pytest.raises(ValidationError) as err:
        RunConfig.model_validate({"store": "s3://AKIAEXAMPLE:s3cr3tv4lue@bucket/exp"})
    text = format_validation_error(err.value)
    assert text.startswith("store: an s3:// store URI holds no credentials") and "s3cr3tv4lue" not in text
    assert RunConfig.model_validate({"store": "s3://bucket/exp@v2"}).store == "s3://bucket/exp@v2"  # '@' in a prefix is fine


def test_cli_and_workers_stop_on_a_bad_file_with_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    from milestone_cli.main import amain
    from workers.common import settings_problem

    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("hello")
    monkeypatch.setenv("MILESTONE_TEMPORAL_TLS_CA", str(not_pem))
    assert asyncio.run(amain(["status", "some-run"])) == 2
    err = capsys.readouterr().err
    assert err == f"error: MILESTONE_TEMPORAL_TLS_CA={not_pem}: not a PEM file with a CERTIFICATE block\n"
    assert settings_problem() == f"MILESTONE_TEMPORAL_TLS_CA={not_pem}: not a PEM file with a CERTIFICATE block"
    monkeypatch.delenv("MILESTONE_TEMPORAL_TLS_CA")
    monkeypatch.setenv("MILESTONE_PAYLOAD_KEY", "too-short")
    assert settings_problem().startswith("MILESTONE_PAYLOAD_KEY: not a 32-byte key")
