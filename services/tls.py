"""Transport security from certificate paths: gRPC server TLS (mutual where a client CA is set),
the channel credentials of the internal hops and the client, and redis-py's TLS arguments.

No TLS setting set: plaintext, as before. `tls.cert_file` + `tls.key_file` make every server
speak TLS; `tls.client_ca_file` also makes it require a client certificate signed by that CA
(mutual TLS). Clients speak TLS when `tls.ca_file` (the CA that signed the servers) or a
server certificate is set; for mutual TLS they present `tls.client_cert_file`/`client_key_file`
(default: the service's own certificate, which serves within one cluster).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


@dataclass(frozen=True)
class TlsOptions:
    cert_file: str = ""  # this service's certificate chain, PEM; with key_file the servers speak TLS
    key_file: str = ""
    client_ca_file: str = ""  # mutual TLS: servers require a client certificate signed by this CA
    ca_file: str = ""  # clients verify the servers against this CA; empty: the system's roots
    client_cert_file: str = ""  # what a client presents for mutual TLS; empty: cert_file
    client_key_file: str = ""  # empty: key_file
    server_name: str = ""  # the name clients expect in the server's certificate; empty: the address's host

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("tls.cert_file and tls.key_file go together")
        if self.client_ca_file and not self.cert_file:
            raise ValueError("tls.client_ca_file (mutual TLS) needs tls.cert_file and tls.key_file")

    @property
    def server_on(self) -> bool:
        return bool(self.cert_file)

    @property
    def client_on(self) -> bool:
        return bool(self.ca_file or self.cert_file or self.client_cert_file)


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"tls: cannot read {path}: {e.strerror}") from None


def server_credentials(options: TlsOptions) -> grpc.ServerCredentials | None:
    """None: plaintext."""
    if not options.server_on:
        return None
    pair = [(_read(options.key_file), _read(options.cert_file))]
    if options.client_ca_file:
        return grpc.ssl_server_credentials(pair, root_certificates=_read(options.client_ca_file),
                                           require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


def channel_credentials(options: TlsOptions) -> grpc.ChannelCredentials | None:
    """None: plaintext."""
    if not options.client_on:
        return None
    cert = options.client_cert_file or options.cert_file
    key = options.client_key_file or options.key_file
    return grpc.ssl_channel_credentials(
        root_certificates=_read(options.ca_file) if options.ca_file else None,
        private_key=_read(key) if cert and key else None,
        certificate_chain=_read(cert) if cert and key else None)


def channel_options(options: TlsOptions) -> list[tuple[str, Any]]:
    return [("grpc.ssl_target_name_override", options.server_name)] if options.server_name and options.client_on \
        else []


def describe(options: TlsOptions, service: str) -> str:
    if not options.server_on:
        return f"{service}: TLS OFF (plaintext; set tls.cert_file and tls.key_file)"
    return f"{service}: TLS ON" + (" with client certificates required (mutual TLS)" if options.client_ca_file else "")


def redis_tls_kwargs(url: str, ca_file: str = "", cert_file: str = "", key_file: str = "") -> dict[str, Any]:
    """redis-py's TLS arguments for a `rediss://` URL (certificates verified); none for `redis://`,
    whose connection class takes no ssl_* arguments."""
    if not url.startswith("rediss://"):
        if ca_file or cert_file:
            raise ValueError("redis.ssl_* settings need a rediss:// URL")
        return {}
    out: dict[str, Any] = {"ssl_cert_reqs": "required"}
    if ca_file:
        out["ssl_ca_certs"] = ca_file
    if cert_file:
        out["ssl_certfile"], out["ssl_keyfile"] = cert_file, key_file or None
    return out
