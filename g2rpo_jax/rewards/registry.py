"""Reward models by name: `get(name, path, **kw) -> reward_fn(images, prompts) -> [B]`.

Built in:

| name | factory | path |
|---|---|---|
| "hps" | clip_rewards.hps | HPS-v2.1 checkpoint (.pt or .safetensors); tokenizer= needed |
| "clip_score" | clip_rewards.clip_score | DFN5B-CLIP-ViT-H-14 folder or weights; tokenizer= |
| "pickscore" | clip_rewards.pickscore | PickScore_v1 transformers folder |
| "aesthetic" | clip_rewards.aesthetic | the LAION MLP state dict; clip_path= OpenAI ViT-L/14 |
| "remote" | RemoteReward | the URL (or url=) of an HTTP scoring service |

`register(name, factory)` adds one (a factory is called as factory(path, **kw) when a path is
given, else factory(**kw)).

The remote reward (for models not ported to JAX, e.g. ImageReward or UnifiedReward) POSTs one
request per call to `url`:

* image_format="png" (default): `Content-Type: application/json`, body
  `{"prompts": [str, ...], "images": [base64 PNG, ...]}` (8-bit RGB PNGs);
* image_format="npz": `Content-Type: application/x-npz`, body an `np.savez` archive with
  `images` (uint8 [B, H, W, 3]) and `prompts` (unicode [B]), no pickles;

and expects `200` with a JSON body `{"scores": [float, ...]}` (or a bare JSON list), one finite
score per image. Anything else (connection refused, timeout, non-2xx status, malformed JSON,
wrong count) raises RemoteRewardError naming the URL and what went wrong. Images in [0, 1] are
rounded to 8 bits, as the reference reward pipelines do.
"""

import base64
from collections.abc import Callable, Sequence
import io
import json
import math
import urllib.error
import urllib.request

import numpy as np

from g2rpo_jax.rewards import clip_rewards

RewardFn = Callable[..., object]

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


class RemoteReward:
    """`reward(images [B, H, W, 3] in [0, 1], prompts) -> [B]` float32, scored by a service.

    Not jittable (it is a host round trip); call it outside jit, or through jax.pure_callback.

    Args:
      url: the endpoint (http:// or https://).
      timeout: seconds to wait for the connection and for the answer.
      image_format: "png" (JSON with base64 PNGs) or "npz" (a numpy archive).
      headers: extra HTTP headers (e.g. an authorization token).
    """

    def __init__(self, url: str, *, timeout: float = 120.0, image_format: str = "png",
                 headers: dict[str, str] | None = None):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"The remote reward needs an http(s) URL, got {url!r}.")
        if image_format not in ("png", "npz"):
            raise ValueError(f"image_format must be 'png' or 'npz', got {image_format!r}.")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}.")
        self.url = url
        self.timeout = float(timeout)
        self.image_format = image_format
        self.headers = dict(headers or {})
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

    def __call__(self, images, prompts: Sequence[str]) -> np.ndarray:
        prompts = [prompts] if isinstance(prompts, str) else [str(p) for p in prompts]
        pixels = _to_uint8(images)
        if len(prompts) != pixels.shape[0]:
            raise ValueError(f"remote reward: {pixels.shape[0]} images but {len(prompts)} "
                             "prompts; pass one prompt per image.")
        body, content_type = self.encode(pixels, prompts)
        request = urllib.request.Request(
            self.url, data=body, method="POST",
            headers={"Content-Type": content_type, "Accept": "application/json", **self.headers})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            detail = e.read(300).decode("utf-8", "replace")
            raise self._fail(f"HTTP {e.code} {e.reason}: {detail!r}") from None
        except TimeoutError:
            raise self._fail(f"no answer within {self.timeout:g} s (raise timeout= or check the "
                             "service)") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise self._fail(f"no answer within {self.timeout:g} s (raise timeout= or check "
                                 "the service)") from None
            raise self._fail(f"cannot connect ({e.reason}); is the service running?") from None
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
