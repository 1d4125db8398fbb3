"""A verifiable reward for the embedded world (`g2rpo_jax.data.world`) and an image-quality probe.

Both read images, [H, W, 3] uint8 or float in [0, 1] (floats are clipped to [0, 1]); they are
host (numpy) functions, called between jitted programs (`score_batch`, `quality_batch`).

Pipeline
    1. `classify_pixels`: each pixel takes the nearest of the background and the palette colours
       (Euclidean distance in [0, 1]³ RGB), or is off-palette when that distance exceeds
       `OFF_PALETTE_DISTANCE` (the palette's colours are ≥ 1.0 apart).
    2. `connected_components` (4-connectivity, numpy label propagation with pointer jumping):
       every 4-connected same-colour region of ≥ `MIN_AREA` px is an object; smaller ones are
       ignored as noise.
    3. `classify_shape` from the bounding box: aspect = short / long side, fill = area / box area,
       taper = (mean width of the bottom k rows − mean width of the top k rows) / box width with
       k = max(1, round(h / 4)), and solidity = area / Σ_rows (last − first filled column + 1):
           aspect < 0.6                          → None (elongated: no shape of the world)
           solidity < 0.9                        → None (holes or notches: not a solid shape)
           taper > 0.35 and 0.4 ≤ fill ≤ 0.75    → triangle   (rendered: fill 0.59–0.63,
                                                                taper ≈ 0.7)
           |taper| ≤ 0.35 and fill ≥ 0.9         → square     (fill 1)
           |taper| ≤ 0.35 and 0.65 ≤ fill < 0.9  → circle     (fill 0.76–0.80)
           anything else                         → None
       `classify_size`: "large" when the longer box side is at least the mean of the rendered
       small and large sides (9 px on a 32 px image), else "small".

Scoring rule (`score`, in [0, 1])
    With ratio(m, n) = min(m, n) / max(m, n) (0 when m = 0; 1 iff m = n), the checks are
      - colour, one per distinct colour c of the prompt: ratio(#objects of colour c, number of
        objects the prompt asks of colour c);
      - shape, one per object spec (count n, colour c, shape s): ratio(#objects of colour c and
        shape s, n);
      - size, one per spec that names a size z: ratio(#objects of colour c, shape s, size z, n);
      - relation, for relation prompts: 1 if some (subject-candidate, object-candidate) pair of
        objects with the specs' colour and shape has centroids in the relation (e.g. "left of":
        subject column + `RELATION_MARGIN` < object column; "above": subject row + margin <
        object row; margin 2 px on a 32 px image, scaled with the image), else 0;
    and score = exclusivity × mean(colour, shape and size checks) for count prompts, and
    score = exclusivity × (mean(colour and shape checks) + relation) / 2 for relation prompts
    (the relation weighs as much as all the attributes together), where exclusivity = N / (N + E),
    N the number of objects the prompt asks for and E the number of detected objects of colours
    the prompt does not name.
    The strict rule (`strict=True`) gives no credit for extra or unrecognised objects: only
    objects of a recognised shape count in the colour checks, and E is every detected object
    beyond min(#recognised objects of colour c, n_c) summed over the prompt's colours, so
    unrecognised blobs, objects of an unnamed colour and objects beyond a colour's count are all
    extra. Under it drawing more than asked never pays: hedging between colours or counts scores
    below drawing the right ones.
    So 1.0 exactly when every colour and (colour, shape[, size]) count is exact, the relation
    holds and nothing else is drawn; an empty (all-background) image scores 0. Off-palette
    pixels and sub-`MIN_AREA` specks do not enter the score: `quality` measures them.
    Examples: "two red squares" on an image of one red square → (1/2 + 1/2) / 2 = 0.5;
    "a red circle" on a red square → (1 + 0) / 2 = 0.5; "a red circle" on two red circles →
    (1/2 + 1/2) / 2 = 0.5, strict: × 1/2 = 0.25; a relation prompt's scene scored against the flipped
    relation → (1 + 0) / 2 = 0.5.

Quality (`quality`, in [0, 1])
    1 − the fraction of pixels that are off-palette or "noisy": in a 4-connected same-class
    region (background included) of fewer than `MIN_AREA` px, which covers isolated pixels that
    differ from all their 4-neighbours. Rendered images score 1; noise scores near 0, so a
    policy that hacks `score` with noisy or off-palette pixels shows up here.
"""

import dataclasses
from typing import NamedTuple

import numpy as np

from g2rpo_jax.data import world

CLASS_NAMES = ("background", *world.COLOURS)  # class index i ↔ CLASS_NAMES[i]; −1 off-palette
OFF_PALETTE = -1
OFF_PALETTE_DISTANCE = 0.3
MIN_AREA = 4
RELATION_MARGIN = 2  # px on the reference (32 px) canvas

_CLASS_RGB = np.stack([world.BACKGROUND, *(world.PALETTE[c] for c in world.COLOURS)]
                      ).astype(np.float32) / 255.0


def as_unit_float(image) -> np.ndarray:
    """uint8 [0, 255] or float image → float32 in [0, 1] (floats are clipped)."""
    image = np.asarray(image)
    if image.dtype == np.uint8:
        return image.astype(np.float32) / 255.0
    return np.clip(image.astype(np.float32), 0.0, 1.0)


def _check_image(image: np.ndarray) -> None:
    if image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"Expected an [H, W, 3] image; got shape {image.shape}.")


def classify_pixels(image) -> np.ndarray:
    """[H, W, 3] image → int32 [H, W]: index into CLASS_NAMES, or OFF_PALETTE (−1)."""
    image = as_unit_float(image)
    _check_image(image)
    dist2 = ((image[..., None, :] - _CLASS_RGB) ** 2).sum(-1)  # [H, W, K]
    classes = np.argmin(dist2, -1).astype(np.int32)
    far = np.take_along_axis(dist2, classes[..., None], -1)[..., 0] > OFF_PALETTE_DISTANCE ** 2
    classes[far] = OFF_PALETTE
    return classes


def segment(image) -> dict[str, np.ndarray]:
    """[H, W, 3] image → {colour: bool mask [H, W]} for every palette colour, plus the
    "background" and "off_palette" masks (the masks partition the image)."""
    classes = classify_pixels(image)
    masks = {name: classes == i for i, name in enumerate(CLASS_NAMES)}
    masks["off_palette"] = classes == OFF_PALETTE
    return masks


def _region_roots(classes: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Flat index of the first (raster-order) pixel of each pixel's 4-connected same-class
    region among `valid` pixels; H·W for invalid pixels."""
    h, w = classes.shape
    n = h * w
    labels = np.where(valid, np.arange(n).reshape(h, w), n)
    join_x = valid[:, :-1] & valid[:, 1:] & (classes[:, :-1] == classes[:, 1:])
    join_y = valid[:-1, :] & valid[1:, :] & (classes[:-1, :] == classes[1:, :])
    while True:
        new = labels.copy()
        np.minimum(new[:, :-1], np.where(join_x, labels[:, 1:], n), out=new[:, :-1])
        np.minimum(new[:, 1:], np.where(join_x, labels[:, :-1], n), out=new[:, 1:])
        np.minimum(new[:-1, :], np.where(join_y, labels[1:, :], n), out=new[:-1, :])
        np.minimum(new[1:, :], np.where(join_y, labels[:-1, :], n), out=new[1:, :])
        # Pointer jumping: a label is a pixel of the same region with a label no larger.
        flat = new.reshape(-1)
        inside = flat < n
        flat[inside] = flat[flat[inside]]
        if np.array_equal(new, labels):
            return labels
        labels = new


def connected_components(mask) -> tuple[np.ndarray, int]:
    """4-connected components of a boolean mask → (labels int32 [H, W], count): 0 off the mask,
    1..count numbering the components in the raster order of their first pixel."""
    mask = np.asarray(mask, bool)
    if mask.ndim != 2:
        raise ValueError(f"Expected a 2-D mask; got shape {mask.shape}.")
    roots = _region_roots(np.zeros(mask.shape, np.int8), mask)
    labels = np.zeros(mask.shape, np.int32)
    if not mask.any():
        return labels, 0
    uniq, inverse = np.unique(roots[mask], return_inverse=True)
    labels[mask] = inverse + 1
    return labels, int(uniq.size)


class ComponentStats(NamedTuple):
    """Per component (index k ↔ label k + 1): area [K] (px), centroid [K, 2] (row, col),
    bbox [K, 4] (top, left, bottom, right; inclusive)."""

    area: np.ndarray
    centroid: np.ndarray
    bbox: np.ndarray


def component_stats(labels: np.ndarray, count: int) -> ComponentStats:
    labels = np.asarray(labels)
    rows, cols = np.nonzero(labels)
    k = labels[rows, cols] - 1
    area = np.bincount(k, minlength=count)
    with np.errstate(invalid="ignore", divide="ignore"):
        centroid = np.stack([np.bincount(k, rows, count), np.bincount(k, cols, count)], -1)
        centroid = centroid / area[:, None]
    bbox = np.empty((count, 4), np.int64)
    bbox[:, :2] = np.iinfo(np.int64).max
    bbox[:, 2:] = -1
    np.minimum.at(bbox[:, 0], k, rows)
    np.minimum.at(bbox[:, 1], k, cols)
    np.maximum.at(bbox[:, 2], k, rows)
    np.maximum.at(bbox[:, 3], k, cols)
    return ComponentStats(area, centroid, bbox)


def classify_shape(component: np.ndarray) -> str | None:
    """Boolean mask of one component (any frame) → "circle" / "square" / "triangle" or None;
    the rule is in the module docstring."""
    component = np.asarray(component, bool)
    rows = np.flatnonzero(component.any(1))
    cols = np.flatnonzero(component.any(0))
    if rows.size == 0:
        return None
    crop = component[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1]
    h, w = crop.shape
    if min(h, w) / max(h, w) < 0.6:
        return None
    fill = crop.sum() / (h * w)
    widths = crop.sum(1)
    filled = np.flatnonzero(widths)
    first, last = crop[filled].argmax(1), w - 1 - crop[filled, ::-1].argmax(1)
    if widths.sum() / (last - first + 1).sum() < 0.9:
        return None
    k = max(1, round(h / 4))
    taper = (widths[-k:].mean() - widths[:k].mean()) / w
    if taper > 0.35:
        return "triangle" if 0.4 <= fill <= 0.75 else None
    if taper < -0.35:
        return None
    if fill >= 0.9:
        return "square"
    if fill >= 0.65:
        return "circle"
    return None


def size_threshold(image_size: int) -> float:
    """Longer box side from which an object counts as "large" on an `image_size` px image."""
    sides = [2 * world.object_radius(s, max(image_size, world.MIN_CANVAS)) + 1
             for s in world.SIZES]
    return float(np.mean(sides))


def classify_size(bbox, image_size: int) -> str:
    top, left, bottom, right = bbox
    side = max(bottom - top, right - left) + 1
    return "large" if side >= size_threshold(image_size) else "small"


@dataclasses.dataclass(frozen=True)
class Blob:
    """A detected object: centroid is (row, col), bbox (top, left, bottom, right) inclusive."""

    colour: str
    shape: str | None
    size: str
    area: int
    centroid: tuple[float, float]
    bbox: tuple[int, int, int, int]


def detect_objects(image, min_area: int = MIN_AREA) -> list[Blob]:
    """Every 4-connected same-colour region of ≥ `min_area` px (background excluded), in the
    raster order of the regions' first pixels."""
    classes = classify_pixels(image)
    h, w = classes.shape
    roots = _region_roots(classes, classes > 0)
    flat = roots.reshape(-1)
    inside = flat < h * w
    uniq, counts = np.unique(flat[inside], return_counts=True)
    blobs = []
    for root, area in zip(uniq, counts):
        if area < min_area:
            continue
        mask = roots == root
        rows, cols = np.nonzero(mask)
        bbox = (int(rows.min()), int(cols.min()), int(rows.max()), int(cols.max()))
        blobs.append(Blob(CLASS_NAMES[classes.flat[root]], classify_shape(mask),
                          classify_size(bbox, h), int(area),
                          (float(rows.mean()), float(cols.mean())), bbox))
    return blobs


def _ratio(m: int, n: int) -> float:
    return min(m, n) / max(m, n) if max(m, n) else 1.0


def _relation_holds(kind: str, subject: Blob, obj: Blob, margin: float) -> bool:
    (sy, sx), (oy, ox) = subject.centroid, obj.centroid
    return {"left of": sx + margin < ox, "right of": sx > ox + margin,
            "above": sy + margin < oy, "below": sy > oy + margin}[kind]


class ScoreBreakdown(NamedTuple):
    """`checks`: ((name, value in [0, 1]), ...), the relation last; `score` combines them with
    `exclusivity` as the module docstring says."""

    checks: tuple[tuple[str, float], ...]
    exclusivity: float
    score: float


def score_breakdown(image, prompt: str, strict: bool = False) -> ScoreBreakdown:
    """The checks behind `score` (rule in the module docstring)."""
    constraints = world.parse_prompt(prompt)
    image = as_unit_float(image)
    _check_image(image)
    blobs = detect_objects(image)
    checks = []
    wanted: dict[str, int] = {}
    for spec in constraints.objects:
        wanted[spec.colour] = wanted.get(spec.colour, 0) + spec.count
    matched = 0   # objects that a colour of the prompt accounts for
    for colour, n in wanted.items():
        m = sum(b.colour == colour and (b.shape is not None or not strict) for b in blobs)
        matched += min(m, n)
        checks.append((f"colour {colour}", _ratio(m, n)))
    candidates = []
    for spec in constraints.objects:
        of_shape = [b for b in blobs if b.colour == spec.colour and b.shape == spec.shape]
        candidates.append(of_shape)
        checks.append((f"shape {spec.colour} {spec.shape}", _ratio(len(of_shape), spec.count)))
        if spec.size is not None:
            sized = sum(b.size == spec.size for b in of_shape)
            checks.append((f"size {spec.size} {spec.colour} {spec.shape}",
                           _ratio(sized, spec.count)))
    value = float(np.mean([v for _, v in checks]))
    rel = constraints.relation
    if rel is not None:
        margin = RELATION_MARGIN * image.shape[0] / world.REFERENCE_CANVAS
        holds = float(any(_relation_holds(rel.kind, s, o, margin)
                          for s in candidates[rel.subject] for o in candidates[rel.object]))
        checks.append((f"relation {rel.kind}", holds))
        value = (value + holds) / 2
    n_wanted = constraints.num_objects
    extra = len(blobs) - matched if strict else sum(b.colour not in wanted for b in blobs)
    exclusivity = n_wanted / (n_wanted + extra)
    return ScoreBreakdown(tuple(checks), exclusivity, value * exclusivity)


def score(image, prompt: str, strict: bool = False) -> float:
    """How well `image` satisfies `prompt`, in [0, 1]; 1.0 only when every constraint holds."""
    return score_breakdown(image, prompt, strict).score


def quality(image) -> float:
    """1 − fraction of pixels that are off-palette or in a same-class region < MIN_AREA px."""
    classes = classify_pixels(image)
    h, w = classes.shape
    valid = classes != OFF_PALETTE
    roots = _region_roots(classes, valid)
    flat = roots.reshape(-1)
    sizes = np.bincount(flat, minlength=h * w + 1)
    bad = ~valid.reshape(-1) | (sizes[flat] < MIN_AREA)
    return float(1.0 - bad.mean())


def score_batch(images, prompts, strict: bool = False) -> np.ndarray:
    """[B, H, W, 3] images and B prompts → float32 [B] scores."""
    images = np.asarray(images)
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts.")
    return np.array([score(img, p, strict) for img, p in zip(images, prompts)], np.float32)


def object_counts_batch(images, prompts) -> dict[str, np.ndarray]:
    """What the held-out evaluation counts besides the scores, for [B, H, W, 3] images and B
    prompts, each int32 [B]: "objects" detected (`detect_objects`), "unrecognised_objects"
    among them (a shape `classify_shape` names none of the world's: a ragged blob), and
    "objects_asked" by the prompt. Scores can rise while these drift (more objects, more
    blobs): a sign of reward hacking that no mean score shows."""
    images = np.asarray(images)
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts.")
    blobs = [detect_objects(image) for image in images]
    return {"objects": np.array([len(b) for b in blobs], np.int32),
            "unrecognised_objects": np.array([sum(o.shape is None for o in b) for b in blobs],
                                             np.int32),
            "objects_asked": np.array([world.parse_prompt(p).num_objects for p in prompts],
                                      np.int32)}


def quality_batch(images) -> np.ndarray:
    """[B, H, W, 3] images → float32 [B] qualities."""
    return np.array([quality(img) for img in np.asarray(images)], np.float32)
