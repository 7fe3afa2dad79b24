"""An object-store server process on 127.0.0.1 for tests: what S3 and GCS share.

:class:`StoreServer` runs one server binary from a temporary directory, kills it
(a crash that keeps its data) and starts it again on the same data and port, and
puts its environment in ``os.environ`` while tests use it. Subclasses
(``s3server.S3Server``, ``gcsserver.GcsServer``) say how to start their binary
and how to read and write objects behind the library's back, so one test body
runs on both stores.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from typing import Any


def port_open(port: int) -> bool:
  with socket.socket() as s:
    s.settimeout(0.2)
    return s.connect_ex(("127.0.0.1", port)) == 0


def free_ports(n: int, gap: int = 0) -> list[int]:
  """``n`` free ports p, with p + ``gap`` free too when ``gap`` is given."""
  rng = random.Random()
  out: list[int] = []
  while len(out) < n:
    p = rng.randrange(20000, 50000)
    if p in out or port_open(p) or (gap and (p + gap in out or port_open(p + gap))):
      continue
    out.append(p)
  return out


class StoreServer:
  """A server binary on loopback; ``stop()`` kills it and removes its data.

  Subclasses set ``scheme`` (the URL scheme), ``driver`` (tensorstore's kvstore
  driver) and ``retries_key`` (the context resource of its request retries),
  call :meth:`_launch` from ``__init__``, and implement :meth:`ready`,
  :meth:`env`, :meth:`unreachable`, :meth:`new_bucket`, :meth:`keys`,
  :meth:`get`, :meth:`put` and :meth:`delete`.
  """

  scheme: str
  driver: str
  retries_key: str
  name: str

  def _launch(self, cmd: list[str], port: int, workdir: str) -> None:
    self._cmd, self.port, self.dir = cmd, port, workdir
    self.endpoint = f"http://127.0.0.1:{port}"
    self.log = open(os.path.join(workdir, "server.log"), "a")
    self.start()

  def start(self) -> None:
    """Starts the server (again, on the same data and port after :meth:`kill`)."""
    self.proc = subprocess.Popen(self._cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    self._wait_ready()

  def kill(self) -> None:
    """SIGKILLs the server (a crash); its data stays for :meth:`start`."""
    if self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait()
    deadline = time.monotonic() + 10
    while port_open(self.port) and time.monotonic() < deadline:
      time.sleep(0.1)

  def ready(self) -> None:
    """Raises unless the server answers requests."""
    raise NotImplementedError

  def _wait_ready(self, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
      if self.proc.poll() is not None:
        break
      if port_open(self.port):
        try:
          self.ready()
          return
        except Exception as e:  # pylint: disable=broad-except  # not ready yet
          last = e
      time.sleep(0.1)
    with open(os.path.join(self.dir, "server.log")) as f:
      log = f.read()[-2000:]
    self.stop()
    raise RuntimeError(f"{self.name} did not start: {last}; log tail:\n{log}")

  def env(self) -> dict[str, str]:
    """The environment variables that point tensorstore at this server."""
    raise NotImplementedError

  def new_bucket(self) -> str:
    raise NotImplementedError

  def keys(self, bucket: str, prefix: str = "") -> list[str]:
    """The sorted keys under ``prefix``, listed with the store's own API."""
    raise NotImplementedError

  def get(self, bucket: str, key: str) -> bytes:
    raise NotImplementedError

  def put(self, bucket: str, key: str, body: bytes) -> None:
    raise NotImplementedError

  def delete(self, bucket: str, key: str) -> None:
    raise NotImplementedError

  def url(self, bucket: str, path: str) -> str:
    return f"{self.scheme}://{bucket}/{path}"

  def spec(self, bucket: str, path: str, max_retries: int | None = None) -> dict[str, Any]:
    """A kvstore spec dict; with ``max_retries``, its context shortens the retries."""
    spec: dict[str, Any] = {"driver": self.driver, "bucket": bucket, "path": path}
    if max_retries is not None:
      spec["context"] = {self.retries_key: {"max_retries": max_retries,
                                            "initial_delay": "0.2s", "max_delay": "1s"}}
    return spec

  def unreachable(self, bucket: str, path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A spec of a store that no server answers (one retry), and the environment it needs."""
    raise NotImplementedError

  @classmethod
  def serve_new(cls):
    """A new server, served (the body of a pytest fixture); a skip that says why if it cannot start."""
    import pytest  # pylint: disable=g-import-not-at-top
    try:
      server = cls()
    except RuntimeError as e:
      pytest.skip(f"the {cls.scheme}:// tests need a local {cls.name} server, which could not"
                  f" start: {e}")
    yield from server.serve()

  def serve(self):
    """Yields this server with its environment in os.environ; restores the environment and
    stops the server afterwards (the body of a pytest fixture)."""
    old = {k: os.environ.get(k) for k in self.env()}
    os.environ.update(self.env())
    try:
      yield self
    finally:
      for k, v in old.items():
        if v is None:
          os.environ.pop(k, None)
        else:
          os.environ[k] = v
      self.stop()

  def stop(self) -> None:
    if self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGKILL)  # weed ignores SIGTERM for long
      self.proc.wait()
    self.log.close()
    shutil.rmtree(self.dir, ignore_errors=True)
