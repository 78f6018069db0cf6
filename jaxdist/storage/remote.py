"""Object storage through fsspec: ``s3://`` (built and tested here against a local S3 server),
``gs://`` and ``hdfs://`` through the same calls (their fsspec packages; untested here).

Endpoint, region and credentials come from the standard variables and files (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``~/.aws``), read by the
client, never written into a config, a log line or an error: messages name a URL without its
user part and with any secret from the environment blanked. Every call is bounded in time
(connect and read timeouts, a few retries with backoff), so a dead endpoint is one line, not a hang.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from jaxdist.errors import JaxdistError

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 30
ATTEMPTS = 3  # botocore's standard retry mode: exponential backoff between them
_SECRET_VARIABLES = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")


def is_remote(path: str | os.PathLike) -> bool:
    """A URL other than ``file://``."""
    match = _SCHEME.match(str(path))
    return bool(match) and match.group(1).lower() != "file"


def redact(text: str) -> str:
    """``text`` without a URL's user part (``s3://key:secret@bucket``) or a secret from the environment."""
    text = re.sub(r"([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]*@", r"\1", str(text))
    for name in _SECRET_VARIABLES:
        value = os.environ.get(name, "")
        if len(value) >= 4:
            text = text.replace(value, "***")
    return text


def filesystem(url: str):
    """``(fsspec filesystem, path inside it)`` for ``url``."""
    import fsspec

    scheme = _SCHEME.match(url).group(1).lower()
    options: dict = {}
    if scheme in ("s3", "s3a"):
        try:
            import s3fs  # noqa: F401 - fsspec's s3 implementation
        except ImportError:
            raise JaxdistError(f"{redact(url)}: s3:// needs the s3fs package (pip install -e '.[storage]')") from None
        retries = {"max_attempts": ATTEMPTS, "mode": "standard"}
        options["config_kwargs"] = {"connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S, "retries": retries}
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:  # botocore reads it too; said explicitly so that every client agrees
            options["endpoint_url"] = endpoint
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        raise JaxdistError(f"{redact(url)}: {scheme}:// needs a package fsspec names: {e}") from None
    except ValueError as e:
        raise JaxdistError(f"{redact(url)}: {e}") from None


def storage_error(url: str, error: BaseException) -> JaxdistError:
    """One line for a failed call on ``url``."""
    name = type(error).__name__
    if isinstance(error, FileNotFoundError):
        why = "no such bucket" if "bucket" in str(error).lower() else "no such object"
    elif isinstance(error, PermissionError) or (name == "ClientError" and "denied" in str(error).lower()):
        why = "access denied: check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE)"
    elif name in ("NoCredentialsError", "PartialCredentialsError"):
        why = "no credentials: set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
    elif name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "the default endpoint"
        why = f"cannot reach {endpoint} after {ATTEMPTS} attempts ({name})"
    else:
        why = f"{name}: {str(error).splitlines()[0] if str(error) else ''}"
    return JaxdistError(redact(f"{url}: {why}"))


class Folder:
    """A folder, local or in object storage: what reading prepared data needs of it."""

    def __init__(self, location: str | os.PathLike):
        self.location = str(location).rstrip("/")
        self.remote = is_remote(self.location)
        if self.remote:
            self._fs, self._root = filesystem(self.location)

    def __str__(self) -> str:
        return redact(self.location)

    def url(self, name: str) -> str:
        return f"{self.location}/{name}" if self.remote else str(Path(self.location) / name)

    def read_bytes(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        if not self.remote:
            with open(Path(self.location) / name, "rb") as f:
                f.seek(start or 0)
                return f.read() if end is None else f.read(end - (start or 0))
        try:
            return self._fs.cat_file(f"{self._root}/{name}", start=start, end=end)
        except Exception as e:  # noqa: BLE001 - the storage client's errors, made one line
            raise storage_error(self.url(name), e) from None

    def put_file(self, local: str | os.PathLike, name: str) -> None:
        """Upload ``local`` as ``name`` (remote folders only; large files go in parts)."""
        try:
            self._fs.put_file(str(local), f"{self._root}/{name}")
        except Exception as e:  # noqa: BLE001
            raise storage_error(self.url(name), e) from None

    def remove(self, name: str) -> None:
        try:
            self._fs.rm_file(f"{self._root}/{name}")
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001
            raise storage_error(self.url(name), e) from None

    def sizes(self) -> dict[str, int]:
        """{name: bytes} of the files directly in the folder (one listing)."""
        return {name: size for name, (size, _) in self.listing().items()}

    def listing(self) -> dict[str, tuple[int, str]]:
        """{name: (bytes, version)} of the files directly in the folder (one listing); the
        version is the object's ETag (remote) or modification time (local)."""
        if not self.remote:
            root = Path(self.location)
            if not root.is_dir():
                return {}
            return {p.name: (p.stat().st_size, str(p.stat().st_mtime_ns)) for p in root.iterdir() if p.is_file()}
        try:
            entries = self._fs.ls(self._root, detail=True, refresh=True)
        except FileNotFoundError as e:
            if "bucket" in str(e).lower():
                raise storage_error(self.location, e) from None
            return {}
        except Exception as e:  # noqa: BLE001
            raise storage_error(self.location, e) from None
        return {
            e["name"].rsplit("/", 1)[-1]: (int(e.get("size") or 0), str(e.get("ETag") or e.get("etag") or e.get("mtime") or ""))
            for e in entries
            if e.get("type") == "file"
        }


def open_binary(location: str | os.PathLike):
    """A file opened for binary reading, local or remote (a remote one reads by range requests,
    so seeking, as Parquet's row groups need, fetches only what is read)."""
    if not is_remote(location):
        return open(location, "rb")  # noqa: SIM115 - the caller's context manager closes it
    fs, path = filesystem(str(location))
    try:
        return fs.open(path, "rb", block_size=1 << 22)
    except Exception as e:  # noqa: BLE001
        raise storage_error(str(location), e) from None


def size_of(location: str | os.PathLike) -> int:
    if not is_remote(location):
        return os.stat(location).st_size
    fs, path = filesystem(str(location))
    try:
        return int(fs.size(path))
    except Exception as e:  # noqa: BLE001
        raise storage_error(str(location), e) from None


def expand_remote(pattern: str) -> list[str]:
    """The files a URL names: itself, every file below it (a folder; hidden ones skipped) or
    those a glob matches, as URLs."""
    fs, path = filesystem(pattern)
    scheme = pattern.split("://", 1)[0]
    try:
        if any(c in path for c in "*?["):
            found = [p for p in fs.glob(path) if not fs.isdir(p)]
        elif fs.isdir(path):
            found = [p for p in fs.find(path) if not any(part.startswith(".") for part in p[len(path) :].split("/"))]
        else:
            found = [path] if fs.exists(path) else []
    except Exception as e:  # noqa: BLE001
        raise storage_error(pattern, e) from None
    return [f"{scheme}://{p}" for p in found]
