"""A throwaway PKI for tests, made with the ``openssl`` command: a CA and certificates it signs.

Every leaf certificate is good for both server and client authentication and lists
``localhost``, ``127.0.0.1`` and ``epd-internal`` unless told otherwise.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

DEFAULT_NAMES = ("DNS:localhost", "IP:127.0.0.1", "DNS:epd-internal")


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@dataclass(frozen=True)
class Leaf:
    cert: str
    key: str


@dataclass(frozen=True)
class CA:
    root: Path
    name: str

    @property
    def cert(self) -> str:
        return str(self.root / f"{self.name}.crt")

    @property
    def key(self) -> str:
        return str(self.root / f"{self.name}.key")

    def issue(self, name: str, alt_names: tuple[str, ...] = DEFAULT_NAMES) -> Leaf:
        """A key and a certificate for ``name`` signed by this CA."""
        ext = self.root / f"{name}.ext"
        ext.write_text(
            f"subjectAltName={','.join(alt_names)}\n"
            "extendedKeyUsage=serverAuth,clientAuth\n"
            "basicConstraints=critical,CA:FALSE\n"
        )
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
                 cwd=self.root)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", self.cert, "-CAkey", self.key,
                 "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", ext.name,
                 cwd=self.root)  # fmt: skip
        return Leaf(str(self.root / f"{name}.crt"), str(self.root / f"{name}.key"))


def make_ca(root: Path, name: str = "ca") -> CA:
    root.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2",
             "-subj", f"/CN=epd test {name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=root)  # fmt: skip
    return CA(root, name)


def write_secret(path: Path, *lines: str) -> str:
    path.write_text("".join(f"{line}\n" for line in lines))
    return str(path)
