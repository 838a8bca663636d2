"""A policy scan of the rendered manifests and the Dockerfile with checkov (its own venv)."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.manifests import (
    CHECKOV_SKIPS,
    CHECKOV_VENV,
    CHECKOV_VERSION,
    DEPLOY,
    DOCKERFILE,
    OVERLAYS,
    render,
)


def checkov() -> Path:
    """checkov in its own venv in the user's cache, installed on first use (a file lock keeps
    parallel runs from installing twice); a venv whose base interpreter is gone is installed again."""
    exe = CHECKOV_VENV / "bin" / "checkov"
    done = CHECKOV_VENV / ".installed"
    CHECKOV_VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(CHECKOV_VENV.parent / f".checkov-{CHECKOV_VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (done.exists() and (CHECKOV_VENV / "bin" / "python").resolve().exists()):
            shutil.rmtree(CHECKOV_VENV, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(CHECKOV_VENV)], check=True, timeout=120)
            proc = subprocess.run([str(CHECKOV_VENV / "bin" / "python"), "-m", "pip", "install", "-q",
                                   "--disable-pip-version-check", f"checkov=={CHECKOV_VERSION}"],
                                  capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                shutil.rmtree(CHECKOV_VENV, ignore_errors=True)
                pytest.fail(f"could not install checkov=={CHECKOV_VERSION} into {CHECKOV_VENV} "
                            f"(needs the package index once):\n{proc.stderr[-3000:]}")
            done.touch()
    return exe


MODEL_LOADER = DEPLOY / "k8s" / "components" / "model-pvc" / "loader.yaml"


# A pod that breaks most policies: the scan must flag it, or it is not scanning.
CONTROL_POD = {
    "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "control", "namespace": "control"},
    "spec": {"containers": [{"name": "c", "image": "busybox", "securityContext": {"privileged": True}}]},
}


def test_policy_scan_with_checkov(tmp_path):
    exe = checkov()
    scan_dir = tmp_path / "scan"
    scan_dir.mkdir()
    for overlay in OVERLAYS:
        (scan_dir / f"{overlay}.yaml").write_text(yaml.safe_dump_all(render(overlay), sort_keys=False))
    shutil.copy(MODEL_LOADER, scan_dir / "model-loader.yaml")  # applied by hand, beside the overlays
    (scan_dir / "control.yaml").write_text(yaml.safe_dump(CONTROL_POD))
    shutil.copy(DOCKERFILE, scan_dir / "Dockerfile")
    proc = subprocess.run(
        [str(exe), "--directory", str(scan_dir), "--framework", "kubernetes", "dockerfile",
         "--skip-check", ",".join(CHECKOV_SKIPS), "--skip-download", "--quiet", "--compact", "--output", "json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_LOG_LEVEL": "ERROR"})
    assert proc.returncode in (0, 1), f"checkov crashed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    reports = json.loads(proc.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    by_type = {r["check_type"]: r for r in reports}
    assert set(by_type) == {"kubernetes", "dockerfile"}, f"checkov scanned {sorted(by_type)}"
    for report in reports:
        assert report["summary"]["parsing_errors"] == 0, report["summary"]
        assert report["summary"]["passed"] > 0, report["summary"]
    failed = [(f["check_id"], f["check_name"], f["resource"], f["file_path"])
              for r in reports for f in r["results"]["failed_checks"]]
    control = [f for f in failed if f[3].endswith("control.yaml")]
    ours = [f for f in failed if not f[3].endswith("control.yaml")]
    assert {"CKV_K8S_16", "CKV_K8S_20"} <= {f[0] for f in control}, \
        f"checkov did not flag the privileged control pod: {control}"
    assert not ours, "checkov findings:\n" + "\n".join(map(str, ours))
