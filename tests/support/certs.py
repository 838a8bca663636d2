"""Certificates for TLS tests, made with the openssl command."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SERVER_NAME = "handoff-internal"


def openssl(cwd: Path, *args: str) -> None:
    if shutil.which("openssl") is None:
        pytest.fail("the openssl CLI is needed to make the test certificates (apt-get install openssl)")
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"openssl {' '.join(args)} failed:\n{proc.stderr}"



def make_ca(folder: Path, name: str) -> tuple[Path, Path]:
    openssl(folder, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return folder / f"{name}.crt", folder / f"{name}.key"


def make_cert(folder: Path, name: str, ca: tuple[Path, Path],
              sans: tuple[str, ...] = (f"DNS:{SERVER_NAME}",)) -> tuple[Path, Path]:
    """A certificate for `sans` (SERVER_NAME unless told), good as server and as client certificate."""
    openssl(folder, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
    ext = folder / f"{name}.ext"
    ext.write_text(f"subjectAltName={','.join(sans)}\nextendedKeyUsage=serverAuth,clientAuth\n"
                   "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n")
    openssl(folder, "x509", "-req", "-in", f"{name}.csr", "-CA", str(ca[0]), "-CAkey", str(ca[1]),
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", ext.name)
    return folder / f"{name}.crt", folder / f"{name}.key"

