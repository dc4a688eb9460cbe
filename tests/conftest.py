"""Session fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from tests.s3_server import S3Server, ServerUnavailable


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3-API server on a free loopback port for the whole session (tests/s3_server.py),
    stopped at the end; the tests that use it are skipped, with the reason, only when it
    cannot start."""
    server = S3Server()
    try:
        server.start()
    except ServerUnavailable as e:
        pytest.skip(f"no S3-API server: {e}")
    yield server
    server.stop()
