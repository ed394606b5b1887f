"""TLS credentials for kvtier servers and channels, from PEM files named in configuration.

Server: ``tls_cert_file`` + ``tls_key_file`` turn TLS on; ``tls_client_ca_file`` adds mTLS:
every caller must present a certificate signed by that CA, or the handshake fails.
Client: ``tls_ca_file`` (the CA that signed the servers' certificates) turns TLS on;
``tls_cert_file`` + ``tls_key_file`` are the client certificate for servers that require
one; ``tls_server_name`` overrides the name checked against the server's certificate (for
servers dialled by IP whose certificate names a DNS name).

Errors are ``ConfigError`` naming the setting, raised at start-up, never at the first call.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio

from kvtier.domain.errors import ConfigError


def read_pem(path: Path, field: str) -> bytes:
    try:
        data = path.expanduser().read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {field} {path}: {exc.strerror}", field=field) from exc
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{field} {path} is not a PEM file (no '-----BEGIN' line)", field=field)
    return data


def _check_pair(cert_file: Path | None, key_file: Path | None) -> None:
    if (cert_file is None) != (key_file is None):
        missing = "tls_key_file" if key_file is None else "tls_cert_file"
        raise ConfigError(f"tls_cert_file and tls_key_file go together; set {missing} too", field=missing)


def server_credentials(
    cert_file: Path | None, key_file: Path | None, client_ca_file: Path | None = None
) -> grpc.ServerCredentials | None:
    """TLS (or mTLS with ``client_ca_file``) credentials for a server; None: plaintext."""
    _check_pair(cert_file, key_file)
    if cert_file is None or key_file is None:
        if client_ca_file is not None:
            raise ConfigError(
                "tls_client_ca_file needs tls_cert_file and tls_key_file: client certificates are "
                "checked only on a TLS server",
                field="tls_client_ca_file",
            )
        return None
    pair = (read_pem(key_file, "tls_key_file"), read_pem(cert_file, "tls_cert_file"))
    client_ca = read_pem(client_ca_file, "tls_client_ca_file") if client_ca_file is not None else None
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca, require_client_auth=client_ca is not None)


@dataclass(frozen=True, slots=True)
class ClientTls:
    """How a client dials servers over TLS. ``ca_file`` None: the system's root certificates."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None

    @classmethod
    def from_files(
        cls,
        ca_file: Path | None,
        cert_file: Path | None = None,
        key_file: Path | None = None,
        server_name: str | None = None,
    ) -> ClientTls | None:
        """TLS settings when any file is configured; None means plaintext."""
        _check_pair(cert_file, key_file)
        if ca_file is None and cert_file is None:
            if server_name:
                raise ConfigError("tls_server_name needs tls_ca_file: it only applies to TLS",
                                  field="tls_server_name")
            return None
        tls = cls(ca_file, cert_file, key_file, server_name or None)
        tls.credentials()  # read the files now, so a bad path fails at start-up
        return tls

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca_file, "tls_ca_file") if self.ca_file is not None else None,
            private_key=read_pem(self.key_file, "tls_key_file") if self.key_file is not None else None,
            certificate_chain=read_pem(self.cert_file, "tls_cert_file") if self.cert_file is not None else None,
        )

    @property
    def channel_options(self) -> tuple[tuple[str, str], ...]:
        return (("grpc.ssl_target_name_override", self.server_name),) if self.server_name else ()


def secure_or_insecure_channel(
    address: str, tls: ClientTls | None, options: tuple[tuple[str, object], ...] = ()
) -> grpc.aio.Channel:
    """An aio channel to ``address``: TLS with ``tls``, plaintext without."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.credentials(), options=(*options, *tls.channel_options))
