"""S3-compatible object store (AWS S3, SeaweedFS, MinIO, ...) over boto3.

Timeouts are short and botocore retries few, so an outage surfaces quickly as
``StoreError``; the retry policy lives above this layer (e.g. ``CheckpointStore``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import boto3
from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from gpu_runtime.store.object_store import ObjectStore, StoreError, _check_key

log = logging.getLogger(__name__)

MB = 1024 * 1024
_NOT_FOUND = {"404", "NoSuchKey", "NotFound", "NoSuchBucket"}
_AUTH = {"403", "AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId", "Forbidden"}
_CONFLICT = {"412", "PreconditionFailed", "409", "ConditionalRequestConflict"}
_MD5_ETAG = re.compile(r"^[0-9a-f]{32}(-[0-9]+)?$")


def _code(err: ClientError) -> str:
    return str(err.response.get("Error", {}).get("Code", ""))


class S3Store(ObjectStore):
    """Keys live under ``s3://bucket/prefix/<key>``."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        region: str = "us-east-1",
        connect_timeout: float = 2.0,
        read_timeout: float = 20.0,
        max_attempts: int = 2,
        multipart_threshold: int = 16 * MB,
        multipart_chunksize: int = 16 * MB,
        max_concurrency: int = 4,
        create_bucket: bool = True,
    ) -> None:
        if not bucket:
            raise ValueError("S3Store: bucket name is empty")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.root_uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.multipart_chunksize = multipart_chunksize
        self.multipart_threshold = multipart_threshold
        cfg = Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"max_attempts": max_attempts, "mode": "standard"},
            s3={"addressing_style": "path"} if endpoint_url else None,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            max_pool_connections=max(10, max_concurrency * 2),
        )
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            region_name=region,
            config=cfg,
        )
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
            use_threads=max_concurrency > 1,
        )
        if create_bucket:
            self.ensure_bucket()

    @classmethod
    def from_uri(cls, uri: str, **kwargs: Any) -> S3Store:
        """``s3://bucket/prefix``; endpoint and credentials come from the environment:
        ``MILESTONE_S3_ENDPOINT`` (or ``AWS_ENDPOINT_URL``), ``AWS_ACCESS_KEY_ID``,
        ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` (default us-east-1).
        Keyword arguments override the constructor defaults."""
        parsed = urlparse(uri)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"not an s3 URI (want s3://bucket/prefix): {uri!r}")
        env = os.environ
        access = env.get("AWS_ACCESS_KEY_ID")
        secret = env.get("AWS_SECRET_ACCESS_KEY")
        endpoint = env.get("MILESTONE_S3_ENDPOINT") or env.get("AWS_ENDPOINT_URL")
        if endpoint and not (access and secret):
            raise StoreError(
                f"{uri}: endpoint {endpoint} is set but AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY are not"
            )
        kwargs.setdefault("endpoint_url", endpoint or None)
        kwargs.setdefault("access_key", access)
        kwargs.setdefault("secret_key", secret)
        kwargs.setdefault("region", env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1")
        return cls(parsed.netloc, parsed.path, **kwargs)

    # -- helpers -----------------------------------------------------------------

    def _key(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    @contextmanager
    def _errors(self, op: str, key: str = "", *, missing_is_keyerror: bool = False) -> Iterator[None]:
        where = f"s3://{self.bucket}/{self._key(key) if key else self.prefix}"
        try:
            yield
        except ClientError as e:
            code = _code(e)
            if missing_is_keyerror and code in _NOT_FOUND and code != "NoSuchBucket":
                raise KeyError(key) from None
            msg = e.response.get("Error", {}).get("Message", "")
            if code in _AUTH:
                msg += " (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and bucket permissions)"
            raise StoreError(f"S3 {op} {where} failed: {code} {msg}".rstrip()) from e
        except (BotoCoreError, Boto3Error) as e:
            raise StoreError(f"S3 {op} {where} failed: {type(e).__name__}: {e}") from e

    def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist (idempotent)."""
        with self._errors("head_bucket"):
            try:
                self._client.head_bucket(Bucket=self.bucket)
                return
            except ClientError as e:
                if _code(e) not in _NOT_FOUND:
                    raise
        with self._errors("create_bucket"):
            try:
                self._client.create_bucket(Bucket=self.bucket)
                log.info("created bucket %s at %s", self.bucket, self.endpoint_url or "AWS")
            except ClientError as e:
                if _code(e) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    # -- ObjectStore ---------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._errors("put", key):
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def get_bytes(self, key: str) -> bytes:
        with self._errors("get", key, missing_is_keyerror=True):
            resp = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            return bytes(resp["Body"].read())

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def update(self, key: str, fn: Callable[[bytes | None], bytes | None], attempts: int = 20) -> None:
        """Compare-and-swap with S3 conditional writes: ``If-Match`` the ETag that was
        read (``If-None-Match: *`` when absent); a lost race reads again and retries."""
        for _ in range(attempts):
            old: bytes | None = None
            etag: str | None = None
            with self._errors("get", key):
                try:
                    resp = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
                    old, etag = bytes(resp["Body"].read()), str(resp["ETag"])
                except ClientError as e:
                    if _code(e) not in _NOT_FOUND or _code(e) == "NoSuchBucket":
                        raise
            new = fn(old)
            if new is None:
                return
            cond = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}
            with self._errors("conditional put", key):
                try:
                    self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=new, **cond)
                    return
                except ClientError as e:
                    if _code(e) not in _CONFLICT:
                        raise
        raise StoreError(f"S3 update s3://{self.bucket}/{self._key(key)}: still contended after {attempts} attempts")

    def head(self, key: str) -> tuple[int, str] | None:
        """``(size, etag without quotes)`` or ``None`` when the key does not exist."""
        with self._errors("head", key):
            try:
                resp = self._client.head_object(Bucket=self.bucket, Key=self._key(key))
            except ClientError as e:
                if _code(e) in _NOT_FOUND and _code(e) != "NoSuchBucket":
                    return None
                raise
        return int(resp["ContentLength"]), str(resp.get("ETag", "")).strip('"')

    def list(self, prefix: str) -> list[str]:
        """Keys equal to ``prefix`` or under the folder ``prefix/`` (like ``LocalStore``)."""
        folder = prefix.rstrip("/")
        full = self._key(folder) if folder else self.prefix
        out: list[str] = []
        with self._errors("list", folder):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    rel = self._rel(obj["Key"])
                    if not folder or rel == folder or rel.startswith(folder + "/"):
                        out.append(rel)
        return sorted(out)

    def delete(self, key: str) -> None:
        with self._errors("delete", key):
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def delete_prefix(self, prefix: str) -> None:
        keys = self.list(prefix)
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[i : i + 1000]]
            with self._errors("delete_objects", prefix):
                resp = self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )
            if resp.get("Errors"):
                first = resp["Errors"][0]
                raise StoreError(
                    f"S3 delete_objects under {prefix!r}: {len(resp['Errors'])} failed, "
                    f"first {first.get('Key')}: {first.get('Code')} {first.get('Message')}"
                )

    def put_file(self, key: str, path: str | Path) -> None:
        """Multipart (parallel parts) above ``multipart_threshold``."""
        with self._errors("upload", key):
            self._client.upload_file(str(path), self.bucket, self._key(key), Config=self._transfer)

    def get_file(self, key: str, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".part")
        try:
            with self._errors("download", key, missing_is_keyerror=True):
                self._client.download_file(self.bucket, self._key(key), str(tmp), Config=self._transfer)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def verify_file(self, key: str, path: str | Path, sha256: str, size: int) -> bool:
        """Cheap check first: size + ETag (plain or multipart md5) computed from the local
        file with the part size this store uploads with; otherwise re-read and hash."""
        stat = self.head(key)
        if stat is None or stat[0] != size:
            return False
        etag = stat[1]
        if _MD5_ETAG.match(etag) and etag == self._expected_etag(Path(path), size):
            return True
        log.debug("ETag of %s not comparable (%s); re-reading to verify", key, etag)
        return super().verify_file(key, path, sha256, size)

    def _expected_etag(self, path: Path, size: int) -> str:
        if size < self.multipart_threshold:
            h = hashlib.md5()
            with path.open("rb") as f:
                while chunk := f.read(4 * MB):
                    h.update(chunk)
            return h.hexdigest()
        digests = []
        with path.open("rb") as f:
            while chunk := f.read(self.multipart_chunksize):
                digests.append(hashlib.md5(chunk).digest())
        return f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"
