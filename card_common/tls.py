"""TLS on gRPC links: one set of files per process, for what it serves and what it dials.

A process has one identity and one trust anchor:

- ``cert`` / ``key`` (PEM): the certificate chain it serves (card-cache, card-target, card-draft's
  health port) and the one it presents when a server asks for a client certificate (mutual TLS);
- ``ca`` (PEM bundle): the authority it trusts: a client verifies the server's certificate with it
  (without it, the system's roots), a server that requires client certificates checks them with it;
- ``client_auth``: a server refuses a client without a certificate signed by ``ca`` (mutual TLS);
- ``server_name``: the name a client checks in the server's certificate, where the address it
  dials is not that name (an IP address, a port-forward).

A server serves TLS when it has a certificate; a client dials with TLS when it has a CA or a
certificate. A plaintext client of a TLS port fails its handshake: the server never reads a byte
of it. Every process follows its files when they change (cert-manager renews a Secret in place):
gRPC servers at the next handshake, card-target's HTTP front within a second (``reloader``), and
clients at the next call (card.common.channels: a new connection with the new files). A
certificate and key that do not go together yet (one written, not the other) leave the previous
pair in use until they do.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from card.engine.shared.errors import InvalidArgument

log = logging.getLogger(__name__)


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise InvalidArgument(f"cannot read the TLS {what} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in data:
        raise InvalidArgument(f"the TLS {what} {path} is not PEM (no -----BEGIN line)")
    return data


def check_pair(cert: str, key: str) -> None:
    """InvalidArgument unless ``key`` is the private key of ``cert``'s certificate (and neither is
    encrypted: no service could ask for a passphrase)."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=b"")
    except (ssl.SSLError, OSError) as exc:
        raise InvalidArgument(f"the TLS key {key} does not go with the certificate {cert} (or is "
                              f"encrypted): {exc}") from None


@dataclass(frozen=True)
class TlsConfig:
    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    client_auth: bool = False
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise InvalidArgument("--tls-cert and --tls-key go together (a certificate and its private key)")
        if self.client_auth and not (self.ca and self.cert):
            raise InvalidArgument("--tls-client-auth needs --tls-ca (to check client certificates) and a "
                                  "server certificate (--tls-cert / --tls-key)")
        self.check_files()  # fail at start, with the path, not at the first handshake

    @property
    def serves(self) -> bool:
        """A server with this config listens with TLS."""
        return self.cert is not None

    @property
    def dials(self) -> bool:
        """A client with this config dials with TLS."""
        return self.cert is not None or self.ca is not None

    def describe(self) -> str:
        if not self.serves:
            return "plaintext"
        return "TLS, client certificates required" if self.client_auth else "TLS"

    # ---- servers ---------------------------------------------------------------------------
    def _server_files(self) -> tuple[bytes, bytes, bytes | None]:
        assert self.cert is not None and self.key is not None
        ca = _read(self.ca, "CA bundle") if self.ca else None
        return _read(self.cert, "certificate"), _read(self.key, "key"), ca

    def stamp(self) -> tuple[int, ...]:
        """The files' modification times (-1: missing): what changes when they are renewed."""
        out = []
        for path in (self.cert, self.key, self.ca):
            if path:
                try:
                    out.append(os.stat(path).st_mtime_ns)
                except OSError:
                    out.append(-1)
        return tuple(out)

    def check_files(self) -> None:
        """InvalidArgument unless every file reads as PEM and the key goes with the certificate
        (what a renewal must pass before it replaces the files in use)."""
        for path, what in ((self.cert, "certificate"), (self.key, "key"), (self.ca, "CA bundle")):
            if path is not None:
                _read(path, what)
        if self.cert is not None and self.key is not None:
            check_pair(self.cert, self.key)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials that re-read the files at the first handshake after any of them changed."""
        cert, key, ca = self._server_files()
        initial = grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)
        seen = [self.stamp()]

        def fetch() -> Any:
            now = self.stamp()
            if now == seen[0]:
                return None  # unchanged: gRPC keeps the current configuration
            try:
                self.check_files()
                c, k, a = self._server_files()
                fresh = grpc.ssl_server_certificate_configuration([(k, c)], root_certificates=a)
            except InvalidArgument as exc:  # mid-rotation (one file written, not yet the other)
                log.warning("TLS files changed but cannot be read yet: %s; keeping the previous ones", exc)
                return None
            seen[0] = now
            log.info("TLS certificate reloaded from %s", self.cert)
            return fresh

        return grpc.dynamic_ssl_server_credentials(initial, fetch,
                                                   require_client_authentication=self.client_auth)

    def reloader(self, context: ssl.SSLContext) -> Callable[[], None]:
        """For a server whose TLS is a Python ``ssl`` context (card-target's HTTP front, on uvicorn):
        a check that loads the certificate and key into ``context`` at its first call after either
        file changed. Call it often, on the thread that runs the context's handshakes (an event
        loop's); files that do not load together yet (mid-rotation) leave the previous pair in use
        and are tried again at the next call."""
        assert self.cert is not None and self.key is not None
        seen: list[tuple[int, ...]] = [self.stamp()]
        warned: list[tuple[int, ...]] = [()]

        def check() -> None:
            now = self.stamp()
            if now == seen[0]:
                return
            try:
                self.check_files()  # on a scratch context: the live one must never hold half a pair
                context.load_cert_chain(self.cert, self.key, password=b"")  # type: ignore[arg-type]
            except (InvalidArgument, ssl.SSLError, OSError) as exc:
                if warned[0] != now:
                    warned[0] = now
                    log.warning("TLS files changed but cannot be read yet: %s; keeping the previous ones",
                                exc)
                return
            seen[0] = now
            log.info("TLS certificate reloaded from %s", self.cert)

        return check

    # ---- clients ---------------------------------------------------------------------------
    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca = _read(self.ca, "CA bundle") if self.ca else None
        cert = _read(self.cert, "certificate") if self.cert else None
        key = _read(self.key, "key") if self.key else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


PLAINTEXT = TlsConfig()
