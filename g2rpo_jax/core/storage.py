"""Paths that are local or on an object store (`gs://bucket/...`): every read and write of the
project goes through this module or `etils.epath` (gcsfs underneath for gs://; Orbax and JAX's
compilation cache use the same library).

  storage.path("gs://b/run/x.json").exists()     # an epath.Path (its bucket probed once)
  with storage.open_atomic("gs://b/run/x.png") as f: image.save(f, format="PNG")
  storage.write_json(path, report)
  local = storage.local("gs://b/flux/transformer")   # a local copy to memory-map or tokenize

Writes are whole and atomic. `open_atomic` writes a local temporary file; when the block ends
without an error it is renamed into place (local) or uploaded as one object (an object on GCS
exists only once its upload is complete). An error or a kill leaves the old content, never half a
file. (A gcsfs file opened for writing would commit what it holds when an exception closes it.)

Reads that need local files (memory-mapped safetensors, tokenizers, ArrayRecord datasets) call
`local(path)`: a gs:// file or folder is downloaded once into the cache, `$G2RPO_CACHE_DIR`
(default `~/.cache/g2rpo_jax`), at `<cache>/gs/<bucket>/<object>`, and used from there while
the object's size and generation are unchanged (a re-written object is downloaded again). A
download goes to a temporary file renamed when complete, so a killed download leaves no half
file; files over 64 MiB show a progress bar. Other files (configs, prompts, metrics, JSON) are
read straight from the bucket.

Directories do not exist on GCS: `makedirs` does nothing there (gcsfs would create a missing
*bucket* for `mkdir(parents=True)`; a mistyped bucket must be an error, not a new bucket).

Endpoints. The first access to a bucket in a process is a probe bounded by
`$G2RPO_STORAGE_TIMEOUT` seconds (default 20): gcsfs retries a failed connection for about
35 s with a traceback per try, so an unreachable endpoint is instead one error naming it.
`STORAGE_EMULATOR_HOST=http://HOST:PORT` points gcsfs at an emulator (e.g. the PyPI package
`gcp-storage-emulator`), `TENSORSTORE_GCS_HTTP_URL` points tensorstore (Orbax's arrays) at one;
the second defaults to the first here.
"""

from collections.abc import Iterable
import contextlib
import json
import os
import shutil
import tempfile
import threading

from etils import epath


def _emulator() -> str:
    """$STORAGE_EMULATOR_HOST, read when a bucket is first used (not at import, so that a
    test or launcher may set it later), and passed on to tensorstore and gcsfs."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if emulator:
        # One variable for both clients (tensorstore reads its own when it opens a bucket).
        os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", emulator if "://" in emulator
                              else f"http://{emulator}")
        # gcsfs's extended file system asks the storage-control API for the bucket type on
        # every call; an emulator has no such API, so each call would log a warning.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    return emulator

CACHE_ENV = "G2RPO_CACHE_DIR"
TIMEOUT_ENV = "G2RPO_STORAGE_TIMEOUT"
_PROGRESS_BYTES = 64 << 20
_IDENTITY = ".identity"       # <cache>/.identity/<scheme>/<bucket>/<object>.json


def is_remote(path) -> bool:
    """True for a URL (gs://, s3://, ...), False for a local path."""
    return "://" in os.fspath(path)


def absolute(path) -> str:
    """A local path made absolute; a URL as it is (os.path.abspath would make gs://b/x
    ./gs:/b/x)."""
    path = os.fspath(path)
    return path if is_remote(path) else os.path.abspath(path)


def cache_dir() -> str:
    return os.path.expanduser(os.environ.get(CACHE_ENV) or "~/.cache/g2rpo_jax")


# ---------------------------------------------------------------------------------------------
# The bucket probe.

_probed: set[str] = set()
_probe_lock = threading.Lock()


def _bucket(path: str) -> str:
    scheme, rest = path.split("://", 1)
    return f"{scheme}://{rest.split('/', 1)[0]}"


def _fs(path: str):
    """The fsspec file system epath uses for `path` (one cached gcsfs instance)."""
    from etils.epath import backend

    return backend.fsspec_backend.fs(path)


def _endpoint() -> str:
    emulator = _emulator()
    return (f"STORAGE_EMULATOR_HOST={emulator}" if emulator
            else "storage.googleapis.com (STORAGE_EMULATOR_HOST is not set)")


def probe(path) -> None:
    """Checks once per process and bucket that the bucket's endpoint answers, within
    $G2RPO_STORAGE_TIMEOUT seconds (default 20). A local path is not probed.

    Raises:
      ConnectionError: no answer in time, or a connection or authentication failure.
    """
    path = os.fspath(path)
    if not is_remote(path):
        return
    bucket = _bucket(path)
    with _probe_lock:
        if bucket in _probed:
            return
    _emulator()
    timeout = float(os.environ.get(TIMEOUT_ENV) or 20)
    outcome = []

    def ask():
        try:
            outcome.append(_fs(bucket).exists(bucket))
        except BaseException as e:  # noqa: BLE001  (reported by the waiting thread)
            outcome.append(e)

    # A daemon thread: after a timeout, gcsfs's retries must not keep the process alive.
    thread = threading.Thread(target=ask, name="g2rpo-storage-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    fix = (f"Check the endpoint ({_endpoint()}) and the network, and the credentials "
           f"(gcloud auth application-default login); set {TIMEOUT_ENV} to wait longer.")
    if not outcome:
        raise ConnectionError(f"The storage endpoint of {bucket} did not answer within "
                              f"{timeout:g} s. {fix}")
    result = outcome[0]
    # A missing bucket or a denied bucket lookup still proves the endpoint answers; the
    # operation itself reports those.
    if isinstance(result, BaseException) and not isinstance(
            result, (FileNotFoundError, PermissionError)) and "Forbidden" not in str(result):
        raise ConnectionError(f"Cannot reach the storage endpoint of {bucket}: "
                              f"{type(result).__name__}: {result}. {fix}") from None
    with _probe_lock:
        _probed.add(bucket)


def path(p) -> epath.Path:
    """`p` as an epath.Path (local or remote), its bucket's endpoint probed first."""
    probe(p)
    return epath.Path(p)


def makedirs(p) -> None:
    """Creates a local directory (and its parents); nothing for a URL (see the docstring)."""
    if not is_remote(p):
        os.makedirs(p, exist_ok=True)
    else:
        probe(p)


def remove(p) -> bool:
    """Removes a file or a whole folder; returns whether anything was there."""
    target = path(p)
    if target.is_dir():
        target.rmtree()
    elif target.exists():
        target.unlink()
    else:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Writing.


def put(local_file: str, p) -> None:
    """Copies a complete local file to `p` as one atomic write (upload, or copy + rename)."""
    p = os.fspath(p)
    if is_remote(p):
        probe(p)
        _fs(p).put_file(local_file, p)
        return
    with open_atomic(p, "wb") as out, open(local_file, "rb") as src:
        shutil.copyfileobj(src, out, 8 << 20)


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def open_atomic(p, mode: str = "wb"):
    """Yields a local file opened with `mode` ("wb" or "w"); `p` gets its content only when
    the block ends without an error (see the module docstring)."""
    if mode not in ("wb", "w"):
        raise ValueError(f"open_atomic writes whole files: mode 'wb' or 'w', not {mode!r}.")
    p = os.fspath(p)
    remote = is_remote(p)
    name = p.rstrip("/").rsplit("/", 1)[-1]
    if remote:
        probe(p)
        directory = None
    else:
        directory = os.path.dirname(os.path.abspath(p))
        os.makedirs(directory, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as f:
            yield f
            f.flush()
            if not remote:
                os.fsync(f.fileno())
        if remote:
            _fs(p).put_file(temporary, p)
        else:
            os.chmod(temporary, _umask_mode())
            os.replace(temporary, p)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)


def write_text(p, text: str) -> None:
    with open_atomic(p, "w") as f:
        f.write(text)


def write_json(p, value, indent: int | None = 2) -> None:
    write_text(p, json.dumps(value, indent=indent))


def upload_tree(local_dir: str, p, last: Iterable[str] = ()) -> None:
    """Copies every file under `local_dir` to the folder `p`, the names in `last` (relative
    paths, e.g. a dataset's "dataset_info.json", whose presence marks it complete) after all
    the others, so a copy cut short is never taken as complete."""
    p = os.fspath(p).rstrip("/")
    last = list(last)
    files = []
    for root, _, names in os.walk(local_dir):
        files += [os.path.relpath(os.path.join(root, n), local_dir) for n in sorted(names)]
    ordered = [f for f in files if f not in last] + [f for f in last if f in files]
    for relative in ordered:
        put(os.path.join(local_dir, relative), f"{p}/{relative}")


# ---------------------------------------------------------------------------------------------
# Reading through the download cache.


def _identity(info: dict) -> dict:
    return {"size": int(info.get("size") or 0),
            "generation": str(info.get("generation") or info.get("etag")
                              or info.get("mtime") or "")}


def _cached(remote: str, info: dict, target: str, identity_file: str) -> None:
    """Downloads one object to `target` unless the cache holds this very version."""
    wanted = _identity(info)
    if os.path.isfile(target) and os.path.isfile(identity_file):
        with open(identity_file) as f:
            if json.load(f) == wanted and os.path.getsize(target) == wanted["size"]:
                return
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if wanted["size"] > free:
        raise OSError(f"Downloading {remote} ({wanted['size'] / 2**30:.2f} GiB) needs more than "
                      f"the {free / 2**30:.2f} GiB free in the cache {cache_dir()}: set "
                      f"{CACHE_ENV} to a larger disk.")
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(target)}.",
                                     suffix=".download")
    os.close(fd)
    try:
        callback = None
        if wanted["size"] >= _PROGRESS_BYTES:
            from fsspec.callbacks import TqdmCallback

            callback = TqdmCallback(tqdm_kwargs=dict(desc=f"download {remote}", unit="B",
                                                     unit_scale=True, dynamic_ncols=True))
        _fs(remote).get_file(remote, temporary, callback=callback)
        if os.path.getsize(temporary) != wanted["size"]:
            raise OSError(f"The download of {remote} is incomplete ({os.path.getsize(temporary)}"
                          f" of {wanted['size']} bytes); run again.")
        os.chmod(temporary, _umask_mode())
        os.replace(temporary, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    os.makedirs(os.path.dirname(identity_file), exist_ok=True)
    with open_atomic(identity_file, "w") as f:
        json.dump(wanted, f)


def mirror(p) -> str:
    """Where `local(p)` keeps the copy of a URL (nothing is downloaded); `p` itself when local.
    A folder built here and then uploaded with `upload_tree` (a dataset) is built there."""
    p = os.fspath(p)
    if not is_remote(p):
        return p
    scheme, rest = p.rstrip("/").split("://", 1)
    return os.path.join(cache_dir(), scheme, rest)


def local(p, parts: Iterable[str] = ()) -> str:
    """A local path holding the content of the file or folder `p`: `p` itself when local;
    for a URL, its copy in the download cache, `mirror(p)` (downloaded where missing or out of
    date; a folder is mirrored file by file, files no longer in it removed from the copy).

    Args:
      p: a file or folder, local or a URL.
      parts: for a folder holding some of these subfolders or files (e.g. a FLUX.1 folder's
        "transformer", "vae"), only those are downloaded (not the text encoders' 10 GB when
        the transformer is wanted); a folder holding none of them is downloaded whole.

    Raises:
      FileNotFoundError: nothing at `p`.
      ConnectionError: the endpoint does not answer (`probe`).
    """
    p = os.fspath(p)
    if not is_remote(p):
        return p
    probe(p)
    p = p.rstrip("/")
    fs = _fs(p)
    present = [part for part in parts if fs.exists(f"{p}/{part}")]
    if present:
        for part in present:
            local(f"{p}/{part}")
        return mirror(p)
    scheme, rest = p.split("://", 1)
    root = mirror(p)
    identity_root = os.path.join(cache_dir(), _IDENTITY, scheme, rest)
    try:
        info = fs.info(p)
    except FileNotFoundError:
        info = None
    if info is not None and info.get("type") == "file":
        _cached(p, info, root, identity_root + ".json")
        return root
    found = fs.find(p, detail=True) if info is not None else {}
    prefix = rest + "/"
    objects = {name[len(prefix):]: entry for name, entry in found.items()
               if name.startswith(prefix) and not name.endswith("/")}
    if not objects:
        raise FileNotFoundError(f"No file or folder at {p}: check the path (and that the "
                                "bucket holds it).")
    for relative, entry in sorted(objects.items()):
        _cached(f"{p}/{relative}", entry, os.path.join(root, relative),
                os.path.join(identity_root, relative + ".json"))
    for directory, _, names in os.walk(root):
        for name in names:
            relative = os.path.relpath(os.path.join(directory, name), root)
            # Removed from the bucket since it was cached (not another process's download).
            in_flight = name.startswith(".") and name.endswith(".download")
            if relative not in objects and not in_flight:
                os.remove(os.path.join(directory, name))
    return root
