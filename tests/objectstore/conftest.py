"""An S3 endpoint for the object-store tests: moto's server on 127.0.0.1, one fresh bucket per test.

Skipped, with the reason, where boto3 or moto[server] is missing or the server cannot start.
"""

from __future__ import annotations

import itertools
import socket
import threading

import pytest

_buckets = itertools.count()


@pytest.fixture(scope="session")
def moto_endpoint():
    """The URL of a moto S3 server running in this process for the whole session."""
    pytest.importorskip("boto3", reason="the object-store tests need boto3 (pip install fastpersist[test])")
    server_module = pytest.importorskip(
        "moto.server", reason="the object-store tests need moto[server] (pip install fastpersist[test])"
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    try:
        server.start()
    except Exception as e:  # noqa: BLE001 - any failure to start means: skip, with the reason
        pytest.skip(f"moto's S3 server cannot start on 127.0.0.1:{port}: {e}")
    yield f"http://127.0.0.1:{port}"
    server.stop()


class Store:
    """The test's bucket, a boto3 client on it, and helpers to look at the store directly."""

    def __init__(self, endpoint: str, bucket: str):
        import boto3

        self.endpoint = endpoint
        self.bucket = bucket
        self.client = boto3.session.Session().client("s3")
        self.client.create_bucket(Bucket=bucket)

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def uploads_in_progress(self) -> list:
        return self.client.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])


@pytest.fixture
def s3(moto_endpoint, monkeypatch, tmp_path):
    """A fresh bucket on the moto server, with the standard AWS variables pointing at it (and nothing else)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    return Store(moto_endpoint, f"fastpersist-test-{next(_buckets)}")


class RecordingClient:
    """A real boto3 client whose calls are counted, and whose methods a test may make fail.

    ``fail[name] = (n, exception)`` raises ``exception`` at the n-th call
    (1-based) of ``name``; ``before[name]`` is called with the arguments
    before each call; ``after[name]`` maps ``(n, response)`` to what the
    n-th call returns. ``in_flight_peak`` is the most ``upload_part`` calls
    running at once.
    """

    def __init__(self, client):
        self._client = client
        self.meta = client.meta
        self.calls: dict[str, int] = {}
        self.fail: dict[str, tuple[int, BaseException]] = {}
        self.before: dict[str, object] = {}
        self.after: dict[str, object] = {}
        self.in_flight = 0
        self.in_flight_peak = 0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        method = getattr(self._client, name)
        if not callable(method):
            return method

        def call(**arguments):
            with self._lock:
                count = self.calls[name] = self.calls.get(name, 0) + 1
                if name == "upload_part":
                    self.in_flight += 1
                    self.in_flight_peak = max(self.in_flight_peak, self.in_flight)
            try:
                if name in self.before:
                    self.before[name](**arguments)
                failure = self.fail.get(name)
                if failure is not None and failure[0] == count:
                    raise failure[1]
                response = method(**arguments)
                return self.after[name](count, response) if name in self.after else response
            finally:
                if name == "upload_part":
                    with self._lock:
                        self.in_flight -= 1

        return call


@pytest.fixture
def recording_client(s3, monkeypatch):
    """Every client fastpersist makes in this test is a :class:`RecordingClient` over a real one; the
    fixture's value is a list of them, in order."""
    from fastpersist.io.targets.s3 import connection

    made = []
    real = connection.make_client

    def make(concurrency):
        client = RecordingClient(real(concurrency))
        made.append(client)
        return client

    monkeypatch.setattr(connection, "make_client", make)
    return made
