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
of it. Servers re-read their files when they change (cert-manager renews a Secret in place), at the
next handshake; clients read theirs once, at start.
"""

from __future__ import annotations

import logging
import os
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
        for path, what in ((self.cert, "certificate"), (self.key, "key"), (self.ca, "CA bundle")):
            if path is not None:
                _read(path, what)  # fail at start, with the path, not at the first handshake

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

    def _mtimes(self) -> tuple[float, ...]:
        return tuple(os.stat(p).st_mtime_ns if os.path.exists(p) else -1
                     for p in (self.cert, self.key, self.ca) if p)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials that re-read the files at the first handshake after any of them changed."""
        cert, key, ca = self._server_files()
        initial = grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)
        seen = [self._mtimes()]

        def fetch() -> Any:
            now = self._mtimes()
            if now == seen[0]:
                return None  # unchanged: gRPC keeps the current configuration
            try:
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

    # ---- clients ---------------------------------------------------------------------------
    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca = _read(self.ca, "CA bundle") if self.ca else None
        cert = _read(self.cert, "certificate") if self.cert else None
        key = _read(self.key, "key") if self.key else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


PLAINTEXT = TlsConfig()
