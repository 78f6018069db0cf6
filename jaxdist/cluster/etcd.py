"""A small client for etcd's v3 JSON gateway (HTTP/1.1 and JSON, the standard library only).

Plain HTTP, or HTTPS (``Tls``): etcd's certificate checked against a CA file, and a client
certificate for an etcd started with ``--client-cert-auth``. The calls the rendezvous needs: range (one key or a prefix), put, a create that succeeds
only when the key is absent, a replace that succeeds only when the key is unchanged (both
one ``/v3/kv/txn`` comparing the key's version or mod_revision), and leases (grant,
keepalive, revoke). Keys and values travel base64-encoded, revisions and lease ids as
decimal strings, as the gateway writes them. HTTP proxies from the environment are not
used: etcd is on the cluster's own network.

Several endpoints (the members of an etcd cluster, ``--rdzv etcd://A:2379,B:2379``): each
request goes to the one that answered last and fails over to the others in order when it
does not answer. ``EtcdUnavailable`` means no endpoint could be reached (refused, timed
out, no leader); the caller decides whether to retry. ``EtcdError`` is etcd refusing a request.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import http.client
import ipaddress
import json
import re
import ssl
import urllib.error
import urllib.request
from collections.abc import Sequence

from jaxdist.errors import JaxdistError

REQUEST_TIMEOUT_S = 2.0  # one request; a stopped etcd must not stall a launcher's loop for long
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")


class EtcdUnavailable(Exception):
    """etcd did not answer (connection refused or reset, timeout, no leader)."""


class EtcdError(Exception):
    """etcd answered with an error (e.g. a lease that no longer exists)."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


def parse_endpoints(url: str) -> list[tuple[str, int]]:
    """``etcd://HOST:PORT[,HOST:PORT...]`` (each item may repeat ``etcd://``, as etcdctl's
    ``--endpoints`` lists do) -> [(host, port), ...] in order, without repeats; a malformed
    one raises ``JaxdistError``."""
    scheme, sep, rest = url.partition("://")
    if scheme != "etcd" or not sep:
        raise JaxdistError(f"--rdzv {url!r}: expected etcd://HOST:PORT (or a list: etcd://HOST:PORT,HOST:PORT)")
    endpoints = []
    for item in rest.split(","):
        endpoint = parse_endpoint(item if item.startswith("etcd://") else f"etcd://{item}", url)
        if endpoint not in endpoints:
            endpoints.append(endpoint)
    return endpoints


def parse_endpoint(url: str, flag_value: str | None = None) -> tuple[str, int]:
    """``etcd://HOST:PORT`` -> (host, port); a malformed one raises ``JaxdistError``
    (naming ``flag_value``, the whole ``--rdzv`` it came from)."""
    shown = url if flag_value is None else flag_value
    scheme, sep, rest = url.partition("://")
    if scheme != "etcd" or not sep:
        raise JaxdistError(f"--rdzv {shown!r}: expected etcd://HOST:PORT")
    host, colon, port = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            host = ""
    elif not _HOST.match(host):
        host = ""
    if not colon or not host or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise JaxdistError(
            f"--rdzv {shown!r}: expected etcd://HOST:PORT (a host name or address and a port from 1 to 65535; a list: comma-separated)"
        )
    return host, int(port)


def _url(host: str, port: int) -> str:
    return f"etcd://[{host}]:{port}" if ":" in host else f"etcd://{host}:{port}"


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def _prefix_end(prefix: str) -> str:
    """The range end that selects every key starting with ``prefix`` (its last byte + 1)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1  # prefixes here end in "/": never 0xff
    return _b64(bytes(raw))


@dataclasses.dataclass(frozen=True)
class Tls:
    """HTTPS to etcd: the CA that signed its certificate, and this client's certificate and key (optional)."""

    cacert: str
    cert: str | None = None
    key: str | None = None

    def context(self) -> ssl.SSLContext:
        """Raises ``JaxdistError`` (one line) for a file that cannot be read or used."""
        try:
            context = ssl.create_default_context(cafile=self.cacert)
            if self.cert:
                context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as e:
            raise JaxdistError(f"--rdzv-cacert / --rdzv-cert / --rdzv-key: cannot use them ({e.strerror or e})") from None
        return context


@dataclasses.dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_json(cls, kv: dict) -> KeyValue:
        return cls(
            key=base64.b64decode(kv["key"]).decode(errors="replace"),
            value=base64.b64decode(kv.get("value", "")),
            create_revision=int(kv.get("create_revision", 0)),
            mod_revision=int(kv.get("mod_revision", 0)),
            version=int(kv.get("version", 0)),
            lease=int(kv.get("lease", 0)),
        )


class Etcd:
    """An etcd server (``host``, ``port``), or a cluster's members (``others``: more endpoints
    to fail over to), over HTTP or HTTPS (``tls``)."""

    def __init__(
        self, host: str, port: int, timeout_s: float = REQUEST_TIMEOUT_S, tls: Tls | None = None, others: Sequence[tuple[str, int]] = ()
    ):
        self.endpoints = [(host, port), *[e for e in others if e != (host, port)]]
        self.timeout_s = timeout_s
        self.scheme = "https" if tls else "http"
        self.current = 0  # the endpoint that answered last: asked first
        handlers = [urllib.request.ProxyHandler({})]
        if tls is not None:
            handlers.append(urllib.request.HTTPSHandler(context=tls.context()))
        self.opener = urllib.request.build_opener(*handlers)

    @property
    def host(self) -> str:
        return self.endpoints[self.current][0]

    @property
    def port(self) -> int:
        return self.endpoints[self.current][1]

    def answering(self) -> str:
        """The endpoint asked first (the one that answered last)."""
        return _url(self.host, self.port)

    def describe(self) -> str:
        """The endpoints as ``--rdzv`` names them."""
        first, *rest = (_url(h, p) for h, p in self.endpoints)
        return ",".join([first, *(r.removeprefix("etcd://") for r in rest)])

    def call(self, path: str, body: dict) -> dict:
        """One request, to the endpoint that answered last, then to each other one in turn
        while they do not answer (``EtcdUnavailable`` once none did)."""
        unavailable = []
        n = len(self.endpoints)
        for i in [(self.current + k) % n for k in range(n)]:
            try:
                answer = self._call(self.endpoints[i], path, body)
            except EtcdUnavailable as e:
                unavailable.append(str(e))
                continue
            self.current = i  # a plain store: threads that race here only pick one that answered
            return answer
        raise EtcdUnavailable("; ".join(unavailable))

    def _call(self, endpoint: tuple[str, int], path: str, body: dict) -> dict:
        host, port = endpoint
        where = _url(host, port)
        url_host = f"[{host}]" if ":" in host else host
        request = urllib.request.Request(
            f"{self.scheme}://{url_host}:{port}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with self.opener.open(request, timeout=self.timeout_s) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as e:
            try:
                detail = json.loads(e.read() or b"{}")
            except ValueError:
                detail = {}
            message = detail.get("message") or detail.get("error") or f"HTTP {e.code}"
            if e.code >= 500 and detail.get("code") != 5:  # no leader, shutting down: try again later (or another member)
                raise EtcdUnavailable(f"{where}: {message}") from None
            raise EtcdError(f"{where}: {message}", detail.get("code")) from None
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError, ssl.SSLError) as e:
            reason = getattr(e, "reason", None) or e
            raise EtcdUnavailable(f"{where}: {reason}") from None
        except ValueError as e:  # not JSON: not an etcd gateway
            raise EtcdError(f"{where}: the answer is not etcd's JSON ({e})") from None

    # --- keys ---

    def range(self, prefix: str) -> tuple[int, list[KeyValue]]:
        """(the store's revision, every key that starts with ``prefix``, in key order)."""
        answer = self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)})
        return int(answer.get("header", {}).get("revision", 0)), [KeyValue.from_json(kv) for kv in answer.get("kvs", [])]

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Write ``key``; the revision of the write."""
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self.call("/v3/kv/put", body).get("header", {}).get("revision", 0))

    def create(self, key: str, value: bytes) -> tuple[int, KeyValue | None]:
        """Write ``key`` only if it does not exist: (the revision of the write, 0 when not
        written; the key as it is now when not)."""
        compare = {"key": _b64(key), "result": "EQUAL", "target": "VERSION", "version": "0"}
        return self._txn(key, value, compare)

    def replace(self, key: str, value: bytes, mod_revision: int) -> tuple[int, KeyValue | None]:
        """Write ``key`` only if it was last written at ``mod_revision`` (0: it must not exist)."""
        if mod_revision == 0:
            return self.create(key, value)
        compare = {"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": str(mod_revision)}
        return self._txn(key, value, compare)

    def _txn(self, key: str, value: bytes, compare: dict) -> tuple[int, KeyValue | None]:
        body = {
            "compare": [compare],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value)}}],
            "failure": [{"request_range": {"key": _b64(key)}}],
        }
        answer = self.call("/v3/kv/txn", body)
        if answer.get("succeeded"):
            return int(answer.get("header", {}).get("revision", 0)), None
        kvs = [kv for r in answer.get("responses", []) for kv in r.get("response_range", {}).get("kvs", [])]
        return 0, KeyValue.from_json(kvs[0]) if kvs else None

    def delete(self, key: str) -> None:
        self.call("/v3/kv/deleterange", {"key": _b64(key)})

    # --- leases ---

    def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its id."""
        answer = self.call("/v3/lease/grant", {"TTL": str(ttl_s)})
        if answer.get("error"):
            raise EtcdError(f"{self.answering()}: {answer['error']}")
        return int(answer["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; its new TTL in seconds, 0 when it no longer exists (expired)."""
        answer = self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """End ``lease`` now: the keys on it are deleted."""
        with contextlib.suppress(EtcdError):  # already gone
            self.call("/v3/lease/revoke", {"ID": str(lease)})
