"""Throwaway X.509 material for TLS tests: a CA, and certificates it signs for 127.0.0.1 (server) or a client."""

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _write(path: Path, key, cert) -> tuple[str, str]:
    key_file, cert_file = path.with_suffix(".key"), path.with_suffix(".pem")
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_file), str(cert_file)


def _builder(subject: str, issuer: str, public_key):
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)])).public_key(public_key)
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )  # fmt: skip


class CertAuthority:
    """A CA under `directory`; `issue` signs server (127.0.0.1) or client certificates with it."""

    def __init__(self, directory: Path, name: str = "specserve test CA"):
        self.directory, self.name = Path(directory), name
        self.key = ec.generate_private_key(ec.SECP256R1())
        cert = (_builder(name, name, self.key.public_key())
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(self.key, hashes.SHA256()))  # fmt: skip
        _, self.cert_file = _write(self.directory / name.replace(" ", "-"), self.key, cert)

    def issue(self, name: str, client: bool = False) -> tuple[str, str]:
        """(key file, certificate file) for `name`."""
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = _builder(name, self.name, key.public_key()).add_extension(x509.ExtendedKeyUsage([usage]), False)
        if not client:
            san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                               x509.DNSName("localhost")])  # fmt: skip
            builder = builder.add_extension(san, False)
        return _write(self.directory / name, key, builder.sign(self.key, hashes.SHA256()))
