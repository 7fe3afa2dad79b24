"""Where a checkpoint lives: a local directory or a tensorstore kvstore prefix.

A :class:`Location` turns what the user passed (a path, a URL such as
``s3://bucket/prefix``, or a tensorstore kvstore spec dict) into kvstore specs
for the files inside the checkpoint, and offers the few file-system operations
the commit protocol needs: fsync of directories, atomic renames, deletion.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import stat
import urllib.parse
from typing import Any

import tensorstore as ts

from orbax_flax import errors


class Location:
  """A checkpoint location. Build it with :meth:`parse`."""

  def __init__(self, spec: dict[str, Any], local_path: str | None):
    self._spec = spec
    self.local_path = local_path
    self.is_local = local_path is not None  # else an object store (or another kvstore)

  @classmethod
  def parse(cls, path: Any) -> Location:
    """Accepts a local path, a kvstore URL, a kvstore spec dict or Location.

    Example:
      >>> Location.parse("/tmp/ckpt").local_path
      '/tmp/ckpt'
      >>> Location.parse("s3://bucket/runs/1").spec("_CHECKPOINT")["path"]
      'runs/1/_CHECKPOINT'
      >>> url = Location.parse("s3://bucket/exp%231")   # the key prefix exp#1/
      >>> url.spec()["path"], str(url), Location.parse(str(url)) == url
      ('exp#1/', 's3://bucket/exp%231/', True)
      >>> Location.parse("file:///tmp/my%20run%231").local_path   # pathlib's as_uri()
      '/tmp/my run#1'
    """
    if isinstance(path, Location):
      return path
    if isinstance(path, ts.KvStore.Spec):
      path = path.to_json()
    if isinstance(path, dict):
      spec = dict(path)
      if "driver" not in spec:
        raise ValueError(f"kvstore spec {path!r} has no 'driver'; pass e.g."
                         " {'driver': 's3', 'bucket': 'b', 'path': 'prefix/'}")
      if spec["driver"] == "file":
        return cls._local(spec.get("path", ""))
      return cls._remote(spec)
    if isinstance(path, os.PathLike):
      path = os.fspath(path)
    if not isinstance(path, str) or not path:
      raise TypeError(f"checkpoint path must be a non-empty str, os.PathLike, URL or"
                      f" kvstore spec dict; got {path!r}")
    if "://" not in path:
      return cls._local(path)
    if path.startswith("file://"):
      return cls._local(_file_url_path(path))
    try:
      spec = ts.KvStore.Spec(path).to_json()
    except ValueError as e:
      raise ValueError(f"cannot use checkpoint URL {path!r}: {e}. Use a local path,"
                       " s3://bucket/prefix, gs://bucket/prefix or a kvstore spec"
                       " dict.") from None
    return cls._remote(spec)

  @classmethod
  def _local(cls, path: str) -> Location:
    path = os.path.abspath(os.path.expanduser(path)).rstrip("/") or "/"
    return cls({"driver": "file", "path": path + "/"}, path)

  @classmethod
  def _remote(cls, spec: dict[str, Any]) -> Location:
    spec = dict(spec)
    if spec.get("driver") == "s3" and "endpoint" not in spec:
      # The AWS SDKs' variables for S3-compatible stores (MinIO, SeaweedFS...).
      endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
      if endpoint:
        spec["endpoint"] = endpoint
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        spec.setdefault("aws_region", region or "us-east-1")
    if (spec.get("driver") == "s3" and "aws_credentials" not in spec
        and "aws_credentials" not in spec.get("context", {})
        and os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")):
      # Keys in the environment: use them, without the default chain's search of profile
      # files, which logs five error lines to stderr for every kvstore opened where
      # ~/.aws/config does not exist. A spec naming its credentials keeps them.
      spec["aws_credentials"] = {"type": "environment"}
    prefix = spec.get("path", "")
    if prefix and not prefix.endswith("/"):
      prefix += "/"
    spec["path"] = prefix
    return cls(spec, None)

  def spec(self, sub: str = "") -> dict[str, Any]:
    """A kvstore spec for ``sub`` (a key or a ``dir/``) inside this location."""
    return {**self._spec, "path": self._spec["path"] + sub}

  def join(self, sub: str) -> Location:
    """The location of a sub-directory."""
    if self.is_local:
      return Location._local(os.path.join(self.local_path, sub))
    return Location._remote(self.spec(sub.rstrip("/") + "/"))

  def sibling(self, name: str) -> Location:
    """A location next to this one (same parent directory or prefix)."""
    if self.is_local:
      return Location._local(os.path.join(os.path.dirname(self.local_path), name))
    parent = self._spec["path"].rstrip("/").rpartition("/")[0]
    return Location._remote({**self._spec, "path": (parent + "/" if parent else "") + name})

  @property
  def name(self) -> str:
    """The last path component."""
    if self.is_local:
      return os.path.basename(self.local_path)
    return self._spec["path"].rstrip("/").rpartition("/")[2]

  def __str__(self) -> str:
    if self.is_local:
      return self.local_path
    d = self._spec
    if d.get("driver") in ("s3", "gcs") and "bucket" in d:
      scheme = "s3" if d["driver"] == "s3" else "gs"
      # As a URL parses back to the same key: what a URL reads otherwise stays escaped.
      path = d["path"].replace("%", "%25").replace("#", "%23").replace("?", "%3F")
      return f"{scheme}://{d['bucket']}/{path}"
    return str(d)

  def __repr__(self) -> str:
    return f"Location({self})"

  def __eq__(self, other: object) -> bool:
    return isinstance(other, Location) and self._spec == other._spec

  def __hash__(self) -> int:
    return hash(str(self))


def _file_url_path(url: str) -> str:
  """The path a ``file://`` URL names, read as tensorstore reads it: percent-decoded, with an
  empty host or ``localhost`` (``file:///tmp/a%20b`` and ``file://localhost/tmp/a%20b`` are
  ``/tmp/a b``). Escaped bytes are decoded as the file system's (what ``Path.as_uri()``
  escaped).

  Raises:
    ValueError: another host, a query or fragment, or an escaped NUL, naming the URL.
  """
  host, slash, rest = url[len("file://"):].partition("/")
  fix = (" Give a local path, or a file URL of this machine: file:///abs/path (as"
         " pathlib.Path(path).as_uri() writes it), with '#', '?' and '%' escaped as %23, %3F"
         " and %25.")
  if host not in ("", "localhost"):
    raise ValueError(f"cannot use checkpoint URL {url!r}: a file:// URL names a path on this"
                     f" machine: its host is empty or 'localhost', not {host!r} (a relative path"
                     f" is given as itself, {host}/..., not as a URL).{fix}")
  if "?" in rest or "#" in rest:
    raise ValueError(f"cannot use checkpoint URL {url!r}: a URL ends its path at '?' or '#' (a"
                     f" query or fragment), which a checkpoint path cannot have.{fix}")
  path = os.fsdecode(urllib.parse.unquote_to_bytes(slash + rest))
  if not slash or "\0" in path:
    raise ValueError(f"cannot use checkpoint URL {url!r}: it names no absolute path, or one"
                     f" with a NUL byte (%00).{fix}")
  return path


# Retries of object-store requests: transient errors are retried with backoff
# for about 20 s, then reported. A kvstore spec dict may override this with
# its own "context" member.
#
# tensorstore gives its HTTP requests no deadline (google/tensorstore#291): a store that
# stops answering mid-request (its port open, nothing sent back) held a save or a restore
# for as long as it stayed silent. curl's low-speed watchdog ends such an attempt (then it
# is retried, and reported, as any failure); tensorstore reads it from the environment when
# its first HTTP request is made, so it is set here, as a default the user's own wins over.
os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", "15")
os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")
_RETRIES = {"max_retries": 6, "initial_delay": "0.5s", "max_delay": "5s"}


def context_spec() -> dict[str, Any]:
  return {"s3_request_retries": _RETRIES, "gcs_request_retries": _RETRIES}


def without_retries(loc: Location) -> Location:
  """``loc`` with one attempt per request (no retries, over the spec's own): for the cleanup
  after a store stopped answering, where every call would otherwise wait through a retry
  sequence of its own. A local location is itself.

  Example:
    >>> once = without_retries(Location.parse("s3://bucket/run"))
    >>> once.spec()["context"]["s3_request_retries"]["max_retries"], str(once)
    (0, 's3://bucket/run/')
  """
  if loc.is_local:
    return loc
  spec = loc.spec()
  one = {"max_retries": 0}
  spec["context"] = {**spec.get("context", {}), "s3_request_retries": one,
                     "gcs_request_retries": one}
  return Location(spec, None)


def unanswered(error: BaseException | None) -> bool:
  """Whether ``error`` (or an error it was raised from) is a store that did not answer
  through a whole retry sequence: stalled, unreachable or failing every attempt. The calls
  that clean up after it then make one attempt each (:func:`without_retries`)."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if "retry attempts failed" in str(error):
      return True
    error = error.__cause__ or error.__context__
  return False


def context() -> ts.Context:
  """A fresh tensorstore context with the object-store retries (no state kept between calls:
  tensorstore's HTTP connections are its own, shared by every context)."""
  return ts.Context(context_spec())


# File systems the kernel provides that cannot hold a checkpoint's files.
_SPECIAL_FS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
    "securityfs", "configfs", "pstore", "bpf", "fusectl", "mqueue", "efivarfs", "binfmt_misc",
    "autofs", "nsfs", "rpc_pipefs", "selinuxfs"})


def _os_errno(e: BaseException) -> int | None:
  """The errno of an OSError, or the ``os_error_code`` tensorstore puts in its messages."""
  code = getattr(e, "errno", None)
  if isinstance(code, int):
    return code
  m = re.search(r"os_error_code=['\"]?(\d+)", str(e))
  return int(m.group(1)) if m else None


def _mount_of(path: str) -> tuple[str, str, bool] | None:
  """(mount point, file system type, read-only) of the mount holding ``path`` (Linux)."""
  try:
    with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
      mounts = [line.split() for line in f]
  except OSError:
    return None
  path = os.path.realpath(path)
  best = None
  for fields in mounts:
    if len(fields) < 4:
      continue
    point = fields[1].replace("\\040", " ")
    inside = path == point or path.startswith(point.rstrip("/") + "/")
    if inside and (best is None or len(point) >= len(best[0])):  # the last one mounted wins
      best = (point, fields[2], "ro" in fields[3].split(","))
  return best


# What a save puts after a local checkpoint's name for the directories beside it: the
# temporary "<name>.ofx-tmp-<generation>" it is written to (engine.saving.target), and
# "<name>.ofx-base-<generation>", where an overwritten checkpoint that others reference moves
# (format.step_dir.retired_name); a generation is 16 hex digits. Both names must fit the file
# system's NAME_MAX, so the checkpoint's own name has at most NAME_MAX - 26 bytes (229 where
# a name has at most 255, as on ext4, xfs, btrfs and tmpfs).
SIBLING_SUFFIX_BYTES = max(len(".ofx-tmp-"), len(".ofx-base-")) + 16


def _limit(probe: str, name: str, default: int) -> int:
  """``os.pathconf(probe, name)``, or ``default`` where the file system does not say."""
  try:
    return os.pathconf(probe, name)
  except (OSError, ValueError):
    return default


def _name_too_long(path: str, probe: str) -> str:
  """Which name of the local ``path`` is too long (ENAMETOOLONG), and the fix."""
  name_max = _limit(probe, "PC_NAME_MAX", 255)
  most = name_max - SIBLING_SUFFIX_BYTES
  last = os.fsencode(os.path.basename(path))
  if len(last) > most:
    return (f"its last component is {len(last)} bytes, and a save writes a directory named"
            f" '<that name>.ofx-tmp-<16 hex digits>' beside it (and may move the checkpoint aside"
            f" as '<that name>.ofx-base-<16 hex digits>'), {SIBLING_SUFFIX_BYTES} bytes longer,"
            f" whose name must fit this file system's limit of {name_max} bytes per name."
            f" Fix: shorten the last path component to at most {most} bytes.")
  longest = max(os.fsencode(path).split(b"/"), key=len)
  if len(longest) > name_max:
    return (f"a component of the path is {len(longest)} bytes ({os.fsdecode(longest[:40])}...),"
            f" more than this file system's limit of {name_max} bytes per name. Fix: shorten it.")
  path_max = _limit(probe, "PC_PATH_MAX", 4096)
  return (f"the path is {len(os.fsencode(path))} bytes, and the files a save writes under it"
          f" must have paths of less than {path_max} bytes (PATH_MAX). Fix: save to a shorter"
          " path (a directory nearer the root, or shorter names).")


def _sticky_owner(path: str) -> str | None:
  """Why the directory ``path``, which this process may write, refused it: sticky
  (``chmod +t``, as /tmp and shared run directories), where only an entry's owner renames or
  deletes it, and another user owns entries there; else None (then it is not the cause)."""
  try:
    st = os.stat(path)
  except OSError:
    return None
  if not (os.path.isdir(path) and st.st_mode & stat.S_ISVTX and os.access(path, os.W_OK)):
    return None
  owners = set()
  try:
    for name in os.listdir(path):
      o = os.lstat(os.path.join(path, name)).st_uid
      if o != os.getuid():
        owners.add(o)
  except OSError:
    return None
  if not owners:
    return None
  return (f"{path} is sticky (mode {stat.S_IMODE(st.st_mode):o}): only an entry's owner may"
          f" rename or delete it there, and other users (uid {sorted(owners)[:5]}) own entries"
          f" this process (uid {os.getuid()}) must move. Fix: run the job as the user who saved"
          " those steps, or give each user a directory of their own (or clear the sticky bit:"
          " chmod -t).")


def _local_cause(path: str, code: int | None) -> str | None:
  """Why a write under the local ``path`` failed, with the fix, from what is on disk."""
  # The nearest part of the path that exists says most: a file in the way, a
  # read-only or special file system, a directory without write permission.
  probe = os.path.abspath(path)
  while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
    probe = os.path.dirname(probe)
  if code == errno.ENAMETOOLONG:
    return _name_too_long(os.path.abspath(path), probe)
  if os.path.lexists(probe) and not os.path.isdir(probe) and probe != os.path.abspath(path):
    return (f"{probe} is a file, not a directory, so nothing can be created under it (a file is"
            " in the way). Fix: remove or rename that file, or choose another path.")
  mount = _mount_of(probe)
  if mount is not None and mount[1] in _SPECIAL_FS:
    return (f"{mount[0]} is a special file system ({mount[1]}, provided by the kernel), which"
            " cannot hold checkpoint files. Fix: save to a directory on a disk (a local"
            " directory, a network file system or a bucket).")
  if code == errno.EROFS or (mount is not None and mount[2]):
    where = mount[0] if mount is not None else probe
    return (f"the file system at {where} is mounted read-only. Fix: save to a writable"
            " directory, or remount it read-write.")
  if code in (errno.EACCES, errno.EPERM):
    sticky = _sticky_owner(probe)
    if sticky is not None:
      return sticky
    return (f"permission denied: this process (uid {os.getuid()}) may not write in {probe}."
            " Fix: make that directory writable for it (chmod/chown), or choose another path.")
  if code == errno.ENOENT:
    return (f"{probe} exists but what was being written under it vanished (removed by"
            " someone else during the save?). Fix: check that nothing else deletes files there.")
  return None


def storage_error(loc: Location, what: str, e: BaseException) -> errors.StorageError:
  """A storage failure as a StorageError naming the user's ``loc`` and the likely fix.

  Example:
    >>> e = storage_error(Location.parse("/tmp/x"), "writing", OSError(28, "No space left on device"))
    >>> type(e).__name__, "the store is full" in str(e)
    ('StorageError', True)
    >>> e = storage_error(Location.parse("/tmp/" + "x" * 240), "writing", OSError(36, "File name too long"))
    >>> str(e)[-58:]   # where names have at most 255 bytes
    'Fix: shorten the last path component to at most 229 bytes.'
  """
  text = str(e)
  code = _os_errno(e)
  if ("No space left" in text or "ENOSPC" in text or code in (errno.ENOSPC, errno.EDQUOT)):
    return errors.StorageError(
        f"{what} at {loc} failed: the store is full (no space left on device): {e}. Fix: free"
        " space there (e.g. keep fewer checkpoints: max_to_keep), or save elsewhere.")
  if code in (errno.EMFILE, errno.ENFILE) or "Too many open files" in text:
    return errors.StorageError(
        f"{what} at {loc} failed: this process may open no more files ({e}). Fix: raise the"
        " open-file limit (`ulimit -n`, RLIMIT_NOFILE; often 1024 by default), or close files"
        " the job keeps open.")
  if code == errno.EFBIG or "File too large" in text:
    return errors.StorageError(
        f"{what} at {loc} failed: a file would pass this process's file-size limit or the"
        f" file system's largest file ({e}). Fix: raise the limit (`ulimit -f unlimited`,"
        " RLIMIT_FSIZE), or save to a file system that holds files this large.")
  if "QuotaExceeded" in text or "quota" in text.lower():
    return errors.StorageError(f"{what} at {loc} failed: the store's quota is exhausted: {e}."
                               " Fix: free space in the bucket or raise its quota.")
  if loc.is_local:
    if isinstance(e, OSError) and e.strerror:
      # The file named is often inside the save's temporary directory: name it only
      # when it is the user's path or one of its parents.
      name = os.fsdecode(e.filename) if isinstance(e.filename, (str, bytes)) else ""
      mine = name and (loc.local_path + "/").startswith(name.rstrip("/") + "/")
      text = e.strerror + (f" ({name})" if mine else "")
    cause = _local_cause(loc.local_path, code)
    if cause is not None:
      return errors.StorageError(f"{what} at {loc} failed: {text}: {cause}")
    return errors.StorageError(f"{what} at {loc} failed: {text}. Fix: check that the directory"
                               " is writable and the disk is not full.")
  hint = ("check the endpoint, bucket name, credentials (AWS_ACCESS_KEY_ID/"
          "AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS) and network")
  return errors.StorageError(f"{what} at {loc} failed: {e}. Fix: {hint}.")


def pread_into(fd: int, buffers: list[Any], offset: int) -> int:
  """Fills ``buffers`` (contiguous, writable) in order from ``fd`` at ``offset``, in as many
  reads as it takes: Linux returns at most 0x7ffff000 bytes (2 GiB less a page) from one
  call. Returns the bytes read, fewer only where the file ends.

  Example:
    >>> import tempfile
    >>> with tempfile.TemporaryFile() as f:
    ...   _ = f.write(b"abcdef"); f.flush()
    ...   a, b = bytearray(2), bytearray(3)
    ...   pread_into(f.fileno(), [a, b], 1), bytes(a), bytes(b)
    (5, b'bc', b'def')
  """
  views = [memoryview(b).cast("B") for b in buffers]
  views = [v for v in views if len(v)]
  total = 0
  while views:
    got = os.preadv(fd, views, offset + total)
    if got <= 0:
      break  # the end of the file
    total += got
    while views and got >= len(views[0]):
      got -= len(views.pop(0))
    if views and got:
      views[0] = views[0][got:]
  return total


def open_kvstore(loc: Location, sub: str = "", context: ts.Context | None = None) -> ts.KvStore:
  try:
    return ts.KvStore.open(loc.spec(sub), context=context or ts.Context(context_spec())).result()
  except ValueError as e:
    raise storage_error(loc, "opening the store", e) from e


def read_key(loc: Location, key: str, context: ts.Context | None = None,
             max_bytes: int | None = None) -> bytes | None:
  """Reads one key (its first ``max_bytes`` if given); None when it is missing."""
  if loc.is_local:
    # Plain reads are cheaper than a kvstore open for small local files. Opened without
    # blocking, and read only if a plain file: a FIFO put in its place would block forever.
    try:
      with open_plain(os.path.join(loc.local_path, key), str(loc)) as f:
        return f.read() if max_bytes is None else read_at_most(f, max_bytes)
    except (FileNotFoundError, NotADirectoryError):
      return None
    except errors.CheckpointError:
      raise
    except OSError as e:  # (a disk error, the process's open-file limit: each with its fix)
      raise storage_error(loc, f"reading {key!r}", e) from e
  try:
    byte_range = None if max_bytes is None else slice(0, max_bytes)
    r = open_kvstore(loc, "", context).read(key, byte_range=byte_range).result()
  except ValueError as e:
    if max_bytes is not None and "OUT_OF_RANGE" in str(e):
      return read_key(loc, key, context)  # shorter than max_bytes
    raise storage_error(loc, f"reading {key!r}", e) from e
  return r.value if r.state == "value" else None


def read_at_most(f: Any, max_bytes: int) -> bytes:
  """The first ``max_bytes`` of the open file ``f`` (all of it if shorter), read in pieces:
  ``f.read(n)`` allocates ``n`` bytes first, so a bound of 256 MiB for a 40-byte manifest
  raised MemoryError under an address-space limit (``ulimit -v``, strict overcommit).

  Example:
    >>> import io
    >>> read_at_most(io.BytesIO(b"abc"), 1 << 30), read_at_most(io.BytesIO(b"abc"), 2)
    (b'abc', b'ab')
  """
  chunks, left = [], max_bytes
  while left > 0:
    chunk = f.read(min(left, 1 << 20))
    if not chunk:
      break
    chunks.append(chunk)
    left -= len(chunk)
  return b"".join(chunks)


def open_plain(path: str, inside: str) -> Any:
  """``open(path, "rb")`` of a file of a local checkpoint (``inside`` says which), refused
  unless a plain file: opened without blocking, so a FIFO put in its place is refused at
  once rather than blocking the read forever. Missing: ``FileNotFoundError`` as ``open``.

  Raises:
    CheckpointFormatError: ``path`` is a FIFO, socket or device (see :func:`refuse_special`).
  """
  return os.fdopen(open_plain_fd(path, inside), "rb")


def open_plain_fd(path: str, inside: str) -> int:
  """:func:`open_plain`, as a file descriptor (for ``os.pread``); the caller closes it."""
  fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
  try:
    refuse_special(path, inside, os.fstat(fd).st_mode)
    os.set_blocking(fd, True)
  except BaseException:
    os.close(fd)
    raise
  return fd


def refuse_special(path: str, inside: str, mode: int | None = None) -> None:
  """Refuses ``path`` (inside a local checkpoint: ``inside`` says where) unless it is a
  plain file or directory, or is missing: a symbolic link would lead anywhere, and a FIFO,
  socket or device would block a read forever or return what no save wrote. ``mode``: its
  ``st_mode`` if known (of an open file), else it is ``lstat``-ed.

  Raises:
    CheckpointFormatError: naming the path, what it is, and the fix.
  """
  if mode is None:
    try:
      mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
      return
  if stat.S_ISLNK(mode):
    try:
      target = os.readlink(path)
    except OSError:
      target = "?"
    raise errors.CheckpointFormatError(
        f"{path} is a symbolic link (to {target}) inside {inside}: a checkpoint reads only"
        " its own files, never through a link (orbax_flax never writes one; the checkpoint"
        " was crafted or assembled by hand). Copy the real files in place of the link, or"
        " restore another checkpoint.")
  if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
    kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device file")
    raise errors.CheckpointFormatError(
        f"{path} is {kind} inside {inside}, not a file a save writes: reading it could block"
        " forever or return anything. Remove it (and copy the real file in its place), or"
        " restore another checkpoint.")


def write_key(loc: Location, key: str, data: bytes, context: ts.Context | None = None) -> None:
  """Writes one key durably (the file driver fsyncs, object PUTs are atomic)."""
  try:
    open_kvstore(loc, "", context).write(key, data).result()
  except ValueError as e:
    raise storage_error(loc, f"writing {key!r}", e) from e


def delete_key(loc: Location, key: str, context: ts.Context | None = None) -> None:
  """Deletes one key; a missing key is fine."""
  if loc.is_local:
    try:
      os.remove(os.path.join(loc.local_path, key))
    except FileNotFoundError:
      pass
    except OSError as e:
      raise storage_error(loc, f"deleting {key!r}", e) from e
    return
  try:
    open_kvstore(loc, "", context).write(key, None).result()
  except ValueError as e:
    raise storage_error(loc, f"deleting {key!r}", e) from e


def list_keys(loc: Location, context: ts.Context | None = None) -> list[str]:
  """All keys under a remote location, relative to it."""
  try:
    store = open_kvstore(loc, "", context)
    return sorted(k.decode() for k in store.list().result())
  except ValueError as e:
    raise storage_error(loc, "listing", e) from e


def delete_prefix(loc: Location, sub: str, context: ts.Context | None = None) -> None:
  """Deletes every key under ``sub`` (a ``dir/`` inside ``loc``)."""
  if loc.is_local:
    shutil.rmtree(os.path.join(loc.local_path, sub), ignore_errors=True)
    return
  try:
    store = open_kvstore(loc, sub, context)
    store.delete_range(ts.KvStore.KeyRange()).result()
  except ValueError as e:
    raise storage_error(loc, f"deleting {sub!r}", e) from e


def write_local_durably(path: str, data: bytes) -> None:
  """Writes a new local file and fsyncs it."""
  with open(path, "xb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def fsync_tree(root: str) -> None:
  """Fsyncs every directory under ``root`` (tensorstore fsyncs files only)."""
  for dirpath, _, _ in os.walk(root):
    fsync_dir(dirpath)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: str, b: str) -> bool:
  """Atomically swaps two paths (Linux renameat2); False where unsupported."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = libc.renameat2
  except (OSError, AttributeError):
    return False
  renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
  rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
  if rc == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
    return False
  raise OSError(err, os.strerror(err), a)
