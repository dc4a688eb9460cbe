"""A real S3-API server on the loopback for the object-store tests: moto's server mode
(``moto[server]``, requirements-dev.txt) in a child process, on a port the OS picks.

The child runs moto's ``ThreadedMotoServer`` on ``127.0.0.1:0``, prints the port it got and
serves until its standard input closes (so it also ends when the test process dies). The tests
reach it through s3fs and boto3 with the credentials and endpoint an s3fs user would set
(:meth:`S3Server.env`: ``AWS_*``), or through ``storage_options`` (:meth:`S3Server.options`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

_CHILD = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print("PORT", server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # until the parent closes it (or dies)
server.stop()
"""

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "tierckpt-test", "AWS_SECRET_ACCESS_KEY": "tierckpt-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}
"""Credentials moto accepts (it checks none unless IAM authentication is on)."""


class ServerUnavailable(RuntimeError):
    """moto's server could not be started (not installed, or it did not report a port)."""


class S3Server:
    """moto's S3-API server in a child process, for one test session.

    Args:
        start_timeout_s: seconds to wait for the child to report its port.
    Raises:
        ServerUnavailable: from :meth:`start`, with the reason.
    """

    def __init__(self, start_timeout_s: float = 60.0):
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None

    def start(self) -> "S3Server":
        """Start the child and wait for its port.

        Raises:
            ServerUnavailable: moto is missing, the child exited, or no port came in time.
        """
        try:
            import moto.server  # noqa: F401  # the reason for a skip, before a child is started
            import s3fs  # noqa: F401
        except ImportError as e:
            raise ServerUnavailable(f"moto[server] / s3fs not installed ({e}); `make venv` installs "
                                    "requirements-dev.txt") from None
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        line = _read_line(self.proc, self.start_timeout_s)
        if not line.startswith("PORT "):
            self.stop()
            raise ServerUnavailable(f"moto's server did not start (its first line: {line!r})")
        self.port = int(line.split()[1])
        return self

    def stop(self) -> None:
        """End the child (closing its standard input; killed after 10 s)."""
        if self.proc is None:
            return
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """What an s3fs user exports: credentials, region and ``AWS_ENDPOINT_URL`` (botocore
        reads it for every service)."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def options(self) -> dict:
        """The same as s3fs ``storage_options`` (``key``/``secret``/``endpoint_url``)."""
        return {"key": CREDENTIALS["AWS_ACCESS_KEY_ID"], "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                "endpoint_url": self.endpoint}

    def client(self):
        """A boto3 S3 client of this server."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
                            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])

    def new_bucket(self, prefix: str = "tck") -> str:
        """Create a bucket with a fresh name and return the name."""
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        self.client().create_bucket(Bucket=name)
        return name

    def deny(self, bucket: str, actions: list[str]) -> None:
        """Put a bucket policy denying ``actions`` (e.g. ``["s3:PutObject"]``) to everyone."""
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Deny", "Principal": "*", "Action": actions,
                                                          "Resource": f"arn:aws:s3:::{bucket}/*"}]}
        self.client().put_bucket_policy(Bucket=bucket, Policy=json.dumps(policy))

    def allow_all(self, bucket: str) -> None:
        """Remove the bucket's policy."""
        self.client().delete_bucket_policy(Bucket=bucket)

    def keys(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """{key: size in bytes} of every object under ``prefix``."""
        out, token = {}, None
        while True:
            kw = {"Bucket": bucket, "Prefix": prefix, **({"ContinuationToken": token} if token else {})}
            page = self.client().list_objects_v2(**kw)
            out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
            if not page.get("IsTruncated"):
                return out
            token = page["NextContinuationToken"]


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    import selectors

    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    ready = sel.select(timeout_s)
    sel.close()
    return proc.stdout.readline().strip() if ready else ""


def clear_fsspec_cache() -> None:
    """Forget s3fs's cached filesystem instances (they keep an event loop and a client per
    option set; a test that changes the environment's endpoint must not get an old one)."""
    try:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
    except ImportError:
        pass


__all__ = ["S3Server", "ServerUnavailable", "CREDENTIALS", "clear_fsspec_cache"]
