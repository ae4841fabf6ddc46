"""A real S3 API on 127.0.0.1 for tests and benchmarks: moto's server in a subprocess (``moto[server]``, the
``test`` extra), killed with the process that started it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .launchers import free_port, stop_process_group

__all__ = ["CREDENTIALS_ENV", "MotoServer"]

CREDENTIALS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}
"""moto accepts any credentials; these are the ones tests and benchmarks use."""


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent dies (Linux ``PR_SET_PDEATHSIG``)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


class MotoServer:
    """``python -m moto.server`` on 127.0.0.1 and a free port (a separate process: its GIL is not ours)."""

    def __init__(self, log: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> MotoServer:
        with open(self.log if self.log is not None else os.devnull, "wb") as out:  # the child keeps its copy
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **CREDENTIALS_ENV},
                preexec_fn=_die_with_parent,  # a test process killed outright takes its server along
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self._proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        self.__exit__()
        raise RuntimeError("moto server did not start within 30 s")

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            stop_process_group(self._proc, 5)
            self._proc = None

    def boto3(self) -> Any:
        """A boto3 S3 client of this server (``boto3``: the ``s3`` extra)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=CREDENTIALS_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS_ENV["AWS_REGION"],
        )

    def create_bucket(self, name: str) -> None:
        """Create the bucket ``name``."""
        self.boto3().create_bucket(Bucket=name)
