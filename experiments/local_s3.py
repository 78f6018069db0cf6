"""An S3 server on loopback for the storage benchmarks: moto's, in a process of its own (so its
request handling does not share the benchmark's interpreter), with throwaway credentials."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator


@contextlib.contextmanager
def local_s3(bucket: str) -> Iterator[str]:
    """Start the server with ``bucket`` made and the AWS variables set; yield the endpoint; stop it after."""
    import s3fs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench-key-id",
        AWS_SECRET_ACCESS_KEY="bench-secret-key",
        AWS_DEFAULT_REGION="us-east-1",
    )
    try:
        fs = s3fs.S3FileSystem(endpoint_url=endpoint)
        for _ in range(100):  # the server starts in about a second
            try:
                fs.mkdir(bucket)
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.1)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=30)
