"""Reward models by name: `get(name, path, **kw) -> reward_fn(images, prompts) -> [B]`.

Built in:

| name | factory | path |
|---|---|---|
| "hps" | clip_rewards.hps | HPS-v2.1 checkpoint (.safetensors, converted from its .pt); tokenizer= |
| "clip_score" | clip_rewards.clip_score | DFN5B-CLIP-ViT-H-14 folder or weights; tokenizer= |
| "pickscore" | clip_rewards.pickscore | PickScore_v1 transformers folder |
| "aesthetic" | clip_rewards.aesthetic | the LAION MLP (.safetensors); clip_path= OpenAI ViT-L/14 |
| "remote" | RemoteReward | the URL (or url=) of an HTTP scoring service |

At run time only safetensors are read (torch is never imported, nothing is written beside the
checkpoints). PyTorch files (.pt / .pth / .bin / .ckpt) are converted once by
`python -m g2rpo_jax.convert SRC [DST]` (the one step that needs torch); a reward given such a
file reads its converted file beside it, or stops with NeedsConversionError naming the command.

`register(name, factory)` adds one (a factory is called as factory(path, **kw) when a path is
given, else factory(**kw)).

The remote reward (for models not ported to JAX, e.g. ImageReward or UnifiedReward) POSTs one
request per call to `url`:

* image_format="png" (default): `Content-Type: application/json`, body
  `{"prompts": [str, ...], "images": [base64 PNG, ...]}` (8-bit RGB PNGs);
* image_format="npz": `Content-Type: application/x-npz`, body an `np.savez` archive with
  `images` (uint8 [B, H, W, 3]) and `prompts` (unicode [B]), no pickles;

and expects `200` with a JSON body `{"scores": [float, ...]}` (or a bare JSON list), one finite
score per image. Images in [0, 1] are rounded to 8 bits, as the reference reward pipelines do.

Transient failures (connection refused / reset / dropped, timeouts, HTTP 408, 429 and 5xx other
than 501 / 505) are retried up to `retries=` times with exponential backoff (`backoff_seconds` ·
2^k, at most `max_backoff_seconds`, shortened by up to `jitter` of itself so that hosts do not
retry in lockstep; a `Retry-After` header is honoured up to `max_backoff_seconds`), each retry
logged as a WARNING. Anything else (another HTTP status, an answer that is not JSON, the wrong
number of scores, non-finite scores) raises RemoteRewardError at once; so does running out of
retries, naming the URL, the attempts, the time spent and the last error.
"""

import base64
from collections.abc import Callable, Sequence
import email.utils
import http.client
import io
import json
import logging
import math
import random
import ssl
import time
import urllib.error
import urllib.request

import numpy as np

from g2rpo_jax.rewards import clip_rewards

RewardFn = Callable[..., object]

_log = logging.getLogger(__name__)

_FACTORIES: dict[str, Callable[..., RewardFn]] = {}


def register(name: str, factory: Callable[..., RewardFn], *, overwrite: bool = False) -> None:
    """Adds a reward factory under `name` (an error if taken, unless overwrite=True)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"A reward name is a non-empty string, got {name!r}.")
    if name in _FACTORIES and not overwrite:
        raise ValueError(f"A reward named {name!r} is already registered; pass overwrite=True to "
                         "replace it.")
    _FACTORIES[name] = factory


def names() -> list[str]:
    """The registered reward names, sorted."""
    return sorted(_FACTORIES)


def get(name: str, path=None, **kw) -> RewardFn:
    """Builds the reward `name` from `path` and keyword arguments (see the module table).

    Raises:
      KeyError: unknown name (the message lists the known ones).
    """
    if name not in _FACTORIES:
        raise KeyError(f"Unknown reward {name!r}; known rewards: {names()}. Add one with "
                       "g2rpo_jax.rewards.registry.register(name, factory).")
    factory = _FACTORIES[name]
    return factory(path, **kw) if path is not None else factory(**kw)


# ---------------------------------------------------------------------------------------------
# Remote scoring over HTTP.


class RemoteRewardError(RuntimeError):
    """The remote reward service did not answer with one score per image."""


def _to_uint8(images) -> np.ndarray:
    array = np.asarray(images, dtype=np.float32)
    if array.ndim != 4 or array.shape[-1] != 3:
        raise ValueError(f"images must be [batch, height, width, 3] in [0, 1], got shape "
                         f"{array.shape}.")
    return np.round(np.clip(array, 0.0, 1.0) * 255.0).astype(np.uint8)


def _png(image: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image, mode="RGB").save(buffer, format="PNG")
    return buffer.getvalue()


class _Transient(Exception):
    """One failed attempt worth retrying: `what` for the messages, `retry_after` in seconds."""

    def __init__(self, what: str, retry_after: float | None = None):
        super().__init__(what)
        self.what, self.retry_after = what, retry_after


# HTTP statuses worth another try: request timeout, too many requests, and server errors except
# "not implemented" and "HTTP version not supported", which the same request will meet again.
def _transient_status(code: int) -> bool:
    return code in (408, 429) or (500 <= code <= 599 and code not in (501, 505))


def _retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delay-seconds or an HTTP date); None if absent/bad."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if math.isfinite(seconds) else None


def _non_negative(name: str, value) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not (math.isfinite(number) and number >= 0):
        raise ValueError(f"{name} must be a non-negative number, got {value!r}.")
    return number


class RemoteReward:
    """`reward(images [B, H, W, 3] in [0, 1], prompts) -> [B]` float32, scored by a service.

    Not jittable (it is a host round trip); call it outside jit, or through jax.pure_callback.

    Args:
      url: the endpoint (http:// or https://).
      timeout: seconds to wait for the connection and for the answer, per attempt.
      image_format: "png" (JSON with base64 PNGs) or "npz" (a numpy archive).
      headers: extra HTTP headers (e.g. an authorization token).
      retries: further attempts after a transient failure (0 = fail on the first one); a call
        makes at most retries + 1 requests.
      backoff_seconds: the wait before the first retry; it doubles with each further retry.
      max_backoff_seconds: the longest wait between two attempts (also caps Retry-After).
      jitter: each wait is shortened by a random fraction of itself in [0, jitter) (0 = exact
        waits; 0.1 spreads the retries of many hosts hitting the same service).
      sleep: the function that waits (time.sleep; tests pass one that records the waits).
    """

    def __init__(self, url: str, *, timeout: float = 120.0, image_format: str = "png",
                 headers: dict[str, str] | None = None, retries: int = 5,
                 backoff_seconds: float = 1.0, max_backoff_seconds: float = 30.0,
                 jitter: float = 0.1, sleep: Callable[[float], object] | None = None):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"The remote reward needs an http(s) URL, got {url!r}.")
        if image_format not in ("png", "npz"):
            raise ValueError(f"image_format must be 'png' or 'npz', got {image_format!r}.")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}.")
        if isinstance(retries, bool) or _non_negative("retries", retries) != int(retries):
            raise ValueError(f"retries must be a non-negative integer, got {retries!r}.")
        self.url = url
        self.timeout = float(timeout)
        self.image_format = image_format
        self.headers = dict(headers or {})
        self.retries = int(retries)
        self.backoff_seconds = _non_negative("backoff_seconds", backoff_seconds)
        self.max_backoff_seconds = _non_negative("max_backoff_seconds", max_backoff_seconds)
        self.jitter = _non_negative("jitter", jitter)
        if self.jitter > 1:
            raise ValueError(f"jitter is a fraction of the wait in [0, 1], got {jitter!r}.")
        self._sleep = time.sleep if sleep is None else sleep
        self._random = random.Random()
        self.name = "remote"

    def encode(self, images: np.ndarray, prompts: list[str]) -> tuple[bytes, str]:
        """(request body, content type) for uint8 images [B, H, W, 3] and B prompts."""
        if self.image_format == "png":
            body = {"prompts": prompts,
                    "images": [base64.b64encode(_png(image)).decode("ascii") for image in images]}
            return json.dumps(body).encode("utf-8"), "application/json"
        buffer = io.BytesIO()
        np.savez(buffer, images=images, prompts=np.asarray(prompts, dtype=np.str_))
        return buffer.getvalue(), "application/x-npz"

    def _fail(self, what: str) -> RemoteRewardError:
        return RemoteRewardError(f"Remote reward at {self.url}: {what}")

    def delay(self, retry: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number `retry` (1, 2, ...)."""
        wait = self.backoff_seconds * 2.0 ** (retry - 1)
        wait = min(wait, self.max_backoff_seconds) * (1.0 - self.jitter * self._random.random())
        if retry_after is not None:   # the service knows best, within our patience
            wait = max(wait, retry_after)
        return min(wait, self.max_backoff_seconds)

    def _post_once(self, request: urllib.request.Request) -> bytes:
        """The answer's body; raises _Transient (retry) or RemoteRewardError (do not)."""
        no_answer = f"no answer within {self.timeout:g} s"
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.read()
        except urllib.error.HTTPError as e:
            try:
                detail = e.read(300).decode("utf-8", "replace")
            except (OSError, http.client.HTTPException):
                detail = ""
            what = f"HTTP {e.code} {e.reason}: {detail!r}"
            if _transient_status(e.code):
                raise _Transient(what, _retry_after(e.headers.get("Retry-After")
                                                    if e.headers else None)) from None
            raise self._fail(what) from None
        except TimeoutError:
            raise _Transient(no_answer) from None
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, TimeoutError):
                raise _Transient(no_answer) from None
            if isinstance(reason, ssl.SSLCertVerificationError) or not isinstance(reason,
                                                                                  OSError):
                # A bad certificate or URL stays bad.
                raise self._fail(f"cannot connect ({reason})") from None
            # Refused, reset, unreachable, a DNS hiccup: the service may be (re)starting.
            raise _Transient(f"cannot connect ({reason}); is the service running?") from None
        except (ConnectionError, http.client.HTTPException) as e:
            # Dropped mid-answer (reset, closed without a status line, truncated body).
            raise _Transient(f"connection lost ({type(e).__name__}: {e})") from None

    def _post(self, body: bytes, content_type: str) -> bytes:
        request = urllib.request.Request(
            self.url, data=body, method="POST",
            headers={"Content-Type": content_type, "Accept": "application/json", **self.headers})
        start, waited = time.monotonic(), 0.0
        for attempt in range(1, self.retries + 2):
            try:
                return self._post_once(request)
            except _Transient as failure:
                last = failure
            if attempt > self.retries:
                break
            wait = self.delay(attempt, last.retry_after)
            _log.warning("Remote reward at %s: attempt %d of %d failed (%s); retrying in %.3g s.",
                         self.url, attempt, self.retries + 1, last.what, wait)
            self._sleep(wait)
            waited += wait
        attempts = self.retries + 1
        raise self._fail(
            f"gave up after {attempts} attempt{'s' if attempts > 1 else ''} in "
            f"{time.monotonic() - start:.3g} s ({waited:.3g} s of it waiting between attempts); "
            f"last error: {last.what}. Check that the service is up and healthy, or raise "
            f"retries= (now {self.retries}), backoff_seconds= (now {self.backoff_seconds:g}) or "
            f"timeout= (now {self.timeout:g} s) in its config.reward.models entry.")

    def __call__(self, images, prompts: Sequence[str]) -> np.ndarray:
        prompts = [prompts] if isinstance(prompts, str) else [str(p) for p in prompts]
        pixels = _to_uint8(images)
        if len(prompts) != pixels.shape[0]:
            raise ValueError(f"remote reward: {pixels.shape[0]} images but {len(prompts)} "
                             "prompts; pass one prompt per image.")
        raw = self._post(*self.encode(pixels, prompts))
        # A malformed answer is not retried: it came from a service that is up, so the same
        # request would most likely get the same answer, and retrying would only hide the bug.
        try:
            answer = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise self._fail(f"the answer is not JSON: {raw[:200]!r}") from None
        scores = answer.get("scores") if isinstance(answer, dict) else answer
        if not isinstance(scores, list) or len(scores) != len(prompts):
            raise self._fail(f"expected {{\"scores\": [{len(prompts)} numbers]}}, got "
                             f"{str(answer)[:200]}")
        try:
            values = [float(s) for s in scores]
        except (TypeError, ValueError):
            raise self._fail(f"scores must be numbers, got {str(scores)[:200]}") from None
        if not all(math.isfinite(v) for v in values):
            raise self._fail(f"non-finite scores {values}")
        return np.asarray(values, dtype=np.float32)


def _remote(url: str | None = None, **kw) -> RemoteReward:
    if url is None:
        raise ValueError('The remote reward needs its endpoint: get("remote", url="http://...").')
    return RemoteReward(url, **kw)


register("hps", clip_rewards.hps)
register("clip_score", clip_rewards.clip_score)
register("pickscore", clip_rewards.pickscore)
register("aesthetic", clip_rewards.aesthetic)
register("remote", _remote)
