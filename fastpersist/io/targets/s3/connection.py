"""S3 URLs, clients and errors: ``s3://bucket/key`` parsed, a boto3 client made, a store's refusal translated.

Every request of the S3 target goes through these (the design:
:mod:`fastpersist.io.targets.s3`). Endpoint, region and credentials come from
boto3's standard chain (the ``AWS_*`` environment variables,
``~/.aws/config`` and ``~/.aws/credentials``, instance roles), so MinIO and
Ceph work with ``AWS_ENDPOINT_URL``. boto3 is imported on first use only
(``pip install fastpersist[s3]``). A client is made per save or load (boto3
clients are thread-safe, sessions are not), so changes to the environment
apply to the next call.

Callers elsewhere call :func:`make_client` through this module
(``connection.make_client(...)``), so that a test replacing it here replaces
it for every request.
"""

from __future__ import annotations

import dataclasses
import errno
import math

from fastpersist.errors import (
    BucketNotFoundError,
    ObjectNotFoundError,
    ObjectStoreCredentialsError,
    ObjectStoreError,
    ObjectStoreUnavailableError,
)

__all__ = [
    "SCHEME",
    "MAX_PARTS",
    "ObjectURL",
    "target",
    "make_client",
    "part_size_for",
    "translate",
    "error_fields",
    "with_translation",
]

SCHEME = "s3://"
MAX_PARTS = 10_000
"""S3's limit on the parts of one multipart upload."""
_MiB = 1 << 20

_CREDENTIAL_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidToken",
        "SignatureDoesNotMatch",
        "TokenRefreshRequired",
        "403",
    }
)


@dataclasses.dataclass(frozen=True)
class ObjectURL:
    """A parsed ``s3://bucket/key``: what :func:`commit_plan` and :func:`download` take.

    ``path`` is the URL (errors and futures name it), ``given`` the key (its stem
    names the archive's top folder, as a local file's name does).
    """

    bucket: str
    key: str

    @property
    def path(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"

    @property
    def given(self) -> str:
        return self.key

    def __str__(self) -> str:
        return self.path


def target(url: str) -> ObjectURL:
    """Parses ``s3://bucket/key``.

    Raises:
        ValueError: no bucket or no key, or a key ending in ``/`` (a "folder").
    """
    bucket, _, key = url[len(SCHEME) :].partition("/")
    if not bucket or not key or key.endswith("/"):
        raise ValueError(f"expected an object URL like 's3://bucket/path/to/ckpt.pt', got {url!r}")
    return ObjectURL(bucket, key)


def make_client(concurrency: int):
    """A boto3 S3 client configured from the standard AWS chain, with a connection per concurrent request.

    Raises:
        ObjectStoreUnavailableError: (an ``ImportError``) boto3 is not installed.
    """
    try:
        import boto3
        from botocore.config import Config
    except ImportError as e:
        raise ObjectStoreUnavailableError(
            f"s3:// paths need boto3, which is not installed ({e}); install it with: pip install fastpersist[s3]"
        ) from e
    config = Config(
        max_pool_connections=max(10, concurrency + 2),
        retries={"mode": "standard"},
        user_agent_extra="fastpersist",
    )
    return boto3.session.Session().client("s3", config=config)


def part_size_for(total: int, configured: int) -> int:
    """The part size for an object of ``total`` bytes: ``configured``, or more where that would need too many parts.

    Raised sizes are whole MiB, so the ring's buffers stay page multiples.
    """
    if math.ceil(total / configured) <= MAX_PARTS:
        return configured
    return math.ceil(total / MAX_PARTS / _MiB) * _MiB


def _describe_store(client) -> str:
    endpoint = getattr(client.meta, "endpoint_url", None)
    region = getattr(client.meta, "region_name", None)
    return f"endpoint {endpoint}, region {region}"


def translate(
    error: BaseException, url: ObjectURL, client, action: str, *, code: str | None = None
) -> ObjectStoreError:
    """``error`` (from botocore, or anything a request raised) as the fastpersist error that says what to do.

    ``code`` replaces the error's own code (a HEAD's bare ``404`` known to mean ``NoSuchBucket``).
    """
    if isinstance(error, ObjectStoreError):
        return error
    own_code, status, message = error_fields(error)
    code = code or own_code
    store = _describe_store(client)
    if type(error).__name__ in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        code = type(error).__name__
    if code in _CREDENTIAL_CODES or code in (
        "NoCredentialsError",
        "PartialCredentialsError",
        "CredentialRetrievalError",
    ):
        return ObjectStoreCredentialsError(
            errno.EACCES,
            f"{action} was refused: the credentials were not accepted ({code}: {message}) by the store "
            f"({store}). Check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or AWS_PROFILE, "
            f"and that they may read and write s3://{url.bucket}",
            url.path,
            code=code,
        )
    if code == "NoSuchBucket":
        return BucketNotFoundError(
            errno.ENOENT,
            f"{action} failed: bucket {url.bucket!r} does not exist ({store}). Create it, or check the URL, "
            "AWS_ENDPOINT_URL and AWS_DEFAULT_REGION",
            url.path,
            code=code,
        )
    if code in ("NoSuchKey", "404"):
        return ObjectNotFoundError(
            errno.ENOENT,
            f"{action} failed: there is no object at this key in bucket {url.bucket!r} ({store}). Check the key "
            f"(aws s3 ls s3://{url.bucket}/{url.key.rpartition('/')[0]})",
            url.path,
            code=code,
        )
    if code in ("PreconditionFailed", "412"):
        return ObjectStoreError(
            errno.EIO,
            f"{action} failed: the object was replaced while it was being read; load it again",
            url.path,
            code=code,
        )
    if code is None and status is None:  # no answer from the store: the network, the endpoint, a timeout
        code = type(error).__name__
        return ObjectStoreError(
            errno.EIO,
            f"{action} failed: {code}: {error} ({store}). Check AWS_ENDPOINT_URL and the network, then retry",
            url.path,
            code=code,
        )
    return ObjectStoreError(
        errno.EIO, f"{action} failed: the store answered {code} ({message}) ({store})", url.path, code=code
    )


def error_fields(error: BaseException) -> tuple[str | None, int | None, str]:
    """(code, HTTP status, message) of a botocore ``ClientError``; (None, None, str) for anything else."""
    response = getattr(error, "response", None)
    if not isinstance(response, dict) or "Error" not in response:
        return None, None, str(error)
    details = response.get("Error", {})
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return details.get("Code") or (str(status) if status else None), status, details.get("Message", "")


def with_translation(url: ObjectURL, client, action: str, call, **arguments):
    """``call(**arguments)`` (one request of ``client``), its failure raised as :func:`translate` makes it."""
    try:
        return call(**arguments)
    except Exception as error:
        raise translate(error, url, client, action) from error
