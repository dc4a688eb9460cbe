"""A real S3-API server on the loopback for the object-store tests: moto's server mode
(``moto[server]``, requirements-dev.txt) in a child process, on a port the OS picks.

The child (this file run as a script) serves moto's WSGI application on ``127.0.0.1:0`` with
werkzeug, as moto's ``ThreadedMotoServer`` does, prints the port it got and serves until its
standard input closes (so it also ends when the test process dies). The tests reach it through
s3fs and boto3 with the credentials and endpoint an s3fs user would set (:meth:`S3Server.env`:
``AWS_*``), or through ``storage_options`` (:meth:`S3Server.options`).

moto has no disk to fill and does not apply bucket policies to ``HeadBucket``, so two things
are added, each a behaviour of real servers:

- in front of moto, :class:`Meter` (WSGI middleware) counts each bucket's requests and the
  bytes of their bodies (:meth:`S3Server.stats`: what a ledger append really sends), and
  enforces a byte budget on a bucket's object writes (:meth:`S3Server.budget`): a ``PUT`` of an
  object that does not fit is answered as MinIO answers a full drive (HTTP 507,
  ``XMinioStorageFull``), the object store's ENOSPC;
- ``S3Server(auth=True)`` starts moto with its IAM authentication on after the first request
  (``INITIAL_NO_AUTH_ACTION_COUNT=1``: the request that creates the bucket), so every later
  request with keys moto does not know, ``HeadBucket`` included, is refused with 403 as AWS
  refuses wrong or expired credentials.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import urllib.request
import uuid

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "tierckpt-test", "AWS_SECRET_ACCESS_KEY": "tierckpt-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}
"""Credentials moto accepts (it checks none unless IAM authentication is on)."""


class ServerUnavailable(RuntimeError):
    """moto's server could not be started (not installed, or it did not report a port)."""


class S3Server:
    """moto's S3-API server in a child process, for one test session.

    Args:
        start_timeout_s: seconds to wait for the child to report its port.
        auth: moto's IAM authentication on after the first request (module docstring): only
            the bucket :meth:`new_bucket` creates first is reachable, and only with no keys that
            moto knows, i.e. every later request is refused.
    Raises:
        ServerUnavailable: from :meth:`start`, with the reason.
    """

    def __init__(self, start_timeout_s: float = 60.0, auth: bool = False):
        self.start_timeout_s = start_timeout_s
        self.auth = auth
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self._err = None

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
        self._err = tempfile.TemporaryFile()  # moto logs each request there; read only on a failed start
        env = dict(os.environ, **({"INITIAL_NO_AUTH_ACTION_COUNT": "1"} if self.auth else {}))
        self.proc = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, text=True, env=env)
        line = _read_line(self.proc, self.start_timeout_s)
        if line is None or not line.startswith("PORT "):
            code = None
            if line is not None:  # its stdout closed: it is exiting
                try:
                    code = self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
            how = f"exited with code {code}" if code is not None else f"reported no port within {self.start_timeout_s:g} s"
            self._err.seek(0)  # before stop() closes it
            tail = self._err.read().decode(errors="replace")[-800:]
            self.stop()
            raise ServerUnavailable(f"moto's server {how} (stdout {line!r}, stderr ...{tail!r})")
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
        if self._err is not None:
            self._err.close()
            self._err = None

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

    def keys(self, bucket: str, prefix: str = "", field: str = "Size") -> dict:
        """{key: size in bytes} of every object under ``prefix`` (``field="ETag"``: its ETag)."""
        out, token = {}, None
        while True:
            kw = {"Bucket": bucket, "Prefix": prefix, **({"ContinuationToken": token} if token else {})}
            page = self.client().list_objects_v2(**kw)
            out.update({o["Key"]: o[field] for o in page.get("Contents", [])})
            if not page.get("IsTruncated"):
                return out
            token = page["NextContinuationToken"]

    def budget(self, bucket: str, nbytes: int | None) -> None:
        """Let ``bucket`` take only ``nbytes`` more bytes of object data (None: no limit); a
        ``PUT`` that does not fit is refused with HTTP 507 ``XMinioStorageFull`` (:class:`Meter`)."""
        q = "" if nbytes is None else f"?bytes={int(nbytes)}"
        self._control("PUT" if nbytes is not None else "DELETE", f"budget/{bucket}{q}")

    def stats(self, bucket: str) -> dict:
        """What ``bucket`` was sent so far (:class:`Meter`): ``requests`` per ``"METHOD object"``
        / ``"METHOD bucket"`` (a request naming a key or not), and ``put_bytes``, the body bytes
        of its object ``PUT`` requests."""
        return json.loads(self._control("GET", f"stats/{bucket}"))

    def _control(self, method: str, rel: str) -> bytes:
        req = urllib.request.Request(f"{self.endpoint}{Meter.PREFIX}{rel}", method=method)
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read()


class Meter:
    """WSGI middleware in front of moto's application: per bucket, counts the requests and the
    object ``PUT`` bytes, and refuses an object ``PUT`` that exceeds the bucket's byte budget
    with MinIO's answer to a full drive (HTTP 507, ``XMinioStorageFull``; MinIO's error
    reference). Controlled under :attr:`PREFIX` (no bucket name starts with ``_``):
    ``PUT budget/<bucket>?bytes=N``, ``DELETE budget/<bucket>``, ``GET stats/<bucket>``."""

    PREFIX = "/_tierckpt/"
    FULL = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>XMinioStorageFull</Code><Message>Storage "
            "backend has reached its minimum free drive threshold. Please delete a few objects to proceed."
            "</Message><Resource>{path}</Resource><RequestId>tierckpt-test</RequestId></Error>")

    def __init__(self, app):
        self.app = app
        self.lock = threading.Lock()
        self.left: dict[str, int] = {}  # bucket -> bytes it still takes
        self.seen: dict[str, dict] = {}  # bucket -> {"requests": {kind: n}, "put_bytes": n}

    def __call__(self, environ, start_response):
        path, method = environ.get("PATH_INFO", ""), environ["REQUEST_METHOD"]
        if path.startswith(self.PREFIX):
            return self._control(method, path[len(self.PREFIX):], environ, start_response)
        bucket, _, key = path.lstrip("/").partition("/")
        # a body's bytes: aws-chunked uploads carry the payload's length in their own header
        size = int(environ.get("HTTP_X_AMZ_DECODED_CONTENT_LENGTH") or environ.get("CONTENT_LENGTH") or 0)
        data_put = method == "PUT" and bool(key) and "HTTP_X_AMZ_COPY_SOURCE" not in environ
        with self.lock:
            seen = self.seen.setdefault(bucket, {"requests": {}, "put_bytes": 0})
            kind = f"{method} {'object' if key else 'bucket'}"
            seen["requests"][kind] = seen["requests"].get(kind, 0) + 1
            refuse = data_put and bucket in self.left and size > self.left[bucket]
            if data_put:
                seen["put_bytes"] += size
                if bucket in self.left and not refuse:
                    self.left[bucket] -= size
        if refuse:
            environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))  # keep the connection usable
            body = self.FULL.format(path=path).encode()
            start_response("507 Insufficient Storage", [("Content-Type", "application/xml"),
                                                        ("Content-Length", str(len(body)))])
            return [body]
        return self.app(environ, start_response)

    def _control(self, method, rel, environ, start_response):
        what, _, bucket = rel.partition("/")
        with self.lock:
            if what == "budget" and method == "PUT":
                self.left[bucket] = int(environ.get("QUERY_STRING", "").partition("bytes=")[2])
            elif what == "budget" and method == "DELETE":
                self.left.pop(bucket, None)
            elif what != "stats" or method != "GET":
                start_response("404 Not Found", [("Content-Length", "0")])
                return [b""]
            body = json.dumps(self.seen.get(bucket, {"requests": {}, "put_bytes": 0})).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]


def _serve() -> None:
    """The child: moto's application behind :class:`Meter` on a free loopback port."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    server = make_server("127.0.0.1", 0, Meter(DomainDispatcherApplication(create_backend_app)), threaded=True,
                         request_handler=MotoRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print("PORT", server.server_address[1], flush=True)
    sys.stdin.read()  # until the parent closes it (or dies)
    server.shutdown()


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str | None:
    import selectors

    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    ready = sel.select(timeout_s)
    sel.close()
    return proc.stdout.readline().strip() if ready else None  # None: nothing within timeout_s


def clear_fsspec_cache() -> None:
    """Forget s3fs's cached filesystem instances (they keep an event loop and a client per
    option set; a test that changes the environment's endpoint must not get an old one)."""
    try:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
    except ImportError:
        pass


__all__ = ["S3Server", "ServerUnavailable", "Meter", "CREDENTIALS", "clear_fsspec_cache"]

if __name__ == "__main__":
    _serve()
