"""A GCS emulator on 127.0.0.1 for the gs:// tests: the PyPI package `gcp-storage-emulator`,
in memory, with one bucket, and the two variables that point the project at it
(STORAGE_EMULATOR_HOST for gcsfs / etils.epath, TENSORSTORE_GCS_HTTP_URL for tensorstore).

  with GcsEmulator() as gcs:          # gcs.bucket, gcs.env (for subprocesses), gcs.url
      gcs.objects("run/")             # {name: size} under a prefix (the JSON API's listing)

Two gaps of the emulator's object download are filled here (as GCS behaves): it sends no
`x-goog-generation` header and ignores `ifGenerationMatch` / `ifGenerationNotMatch`.
Tensorstore's OCDBT driver (Orbax's array format) re-reads its manifest conditionally once a
checkpoint has more than a few dozen arrays, and without these it fails with "Malformed
StorageGeneration". Run as a program (`python tests/gcs_emulator.py PORT BUCKET`) it serves
until killed.
"""

from http import HTTPStatus
import json
import os
import subprocess
import sys
import time
import urllib.request


def _patched_download():
    """objects.download with GCS's generation header and preconditions."""
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    original = objects.download

    def download(request, response, storage, *args, **kwargs):
        try:
            obj = storage.get_file_obj(request.params["bucket_name"],
                                       request.params["object_id"])
        except NotFound:
            return original(request, response, storage, *args, **kwargs)
        generation = str(obj["generation"])
        query = request.query
        if query.get("ifGenerationNotMatch", [None])[0] == generation:
            response.status = HTTPStatus.NOT_MODIFIED
            return None
        wanted = query.get("ifGenerationMatch", [None])[0]
        if wanted is not None and wanted != generation:
            response.status = HTTPStatus.PRECONDITION_FAILED
            return None
        response["x-goog-generation"] = generation
        response["x-goog-metageneration"] = str(obj.get("metageneration", 1))
        return original(request, response, storage, *args, **kwargs)

    objects.download = download


def serve(port: int, bucket: str) -> None:
    _patched_download()   # before server.py binds the handlers
    from gcp_storage_emulator.server import create_server

    create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket).run()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GcsEmulator:
    """The emulator in a child process, for a `with` block (or a pytest fixture)."""

    def __init__(self, bucket: str = "g2rpo-test"):
        self.bucket, self.port = bucket, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = dict(os.environ, STORAGE_EMULATOR_HOST=self.url,
                        TENSORSTORE_GCS_HTTP_URL=self.url)
        self._process = None

    def __enter__(self) -> "GcsEmulator":
        self._process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(self.port), self.bucket],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b/{self.bucket}", timeout=2)
                return self
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError(f"The GCS emulator did not start on {self.url}.") from None
                time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()

    def objects(self, prefix: str = "") -> dict[str, int]:
        """{object name: size} of the bucket's objects under `prefix`."""
        names, token = {}, ""
        while True:
            query = f"prefix={prefix}" + (f"&pageToken={token}" if token else "")
            with urllib.request.urlopen(
                    f"{self.url}/storage/v1/b/{self.bucket}/o?{query}", timeout=10) as r:
                page = json.load(r)
            names.update({item["name"]: int(item["size"]) for item in page.get("items", [])})
            token = page.get("nextPageToken", "")
            if not token:
                return names


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2])
