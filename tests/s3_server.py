"""A real S3 server on loopback for the tests: moto's (``moto[server]``, the one s3fs's own
suite runs against), on 127.0.0.1 and a free port, with throwaway credentials in the
standard variables. It answers range reads, multipart uploads, conditional writes and
paginated listings as AWS does."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "jaxdist-test-key-id",
    "AWS_SECRET_ACCESS_KEY": "jaxdist-test-secret-3f9a",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """Start the server, set the variables every client reads (``AWS_ENDPOINT_URL`` and the
    credentials), yield the endpoint; stop it and restore the variables after."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in (*CREDENTIALS, "AWS_ENDPOINT_URL")}
    os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint)
    try:
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (now)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_server_process(bucket: str, *, check_credentials: bool = False, port: int | None = None) -> Iterator[tuple[object, str]]:
    """moto's server in a process of its own (a test may kill it), with ``bucket`` made:
    ``(the process, its endpoint)``; killed at the end. The caller sets the variables.
    ``check_credentials``: every request must be signed with a key the server knows (it knows
    none, so every key is wrong, and no bucket is made). ``port``: the one an earlier server
    had (a store back after an outage, empty)."""
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    import s3fs

    endpoint = f"http://127.0.0.1:{port or free_port()}"
    port = endpoint.rsplit(":", 1)[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", port],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0" if check_credentials else "inf"},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if check_credentials:
                    urllib.request.urlopen(endpoint, timeout=5)  # noqa: S310 - loopback: any answer means it is up
                else:
                    s3fs.S3FileSystem(endpoint_url=endpoint, key="k", secret="s", skip_instance_cache=True).mkdir(bucket)
                break
            except urllib.error.HTTPError:  # it answered (refusing the unsigned request): up
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    raise RuntimeError("moto's server did not start within 60 s") from None
                time.sleep(0.2)
        yield server, endpoint
    finally:
        server.kill()
        server.wait()
