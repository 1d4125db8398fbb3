"""The embedded world: a small, finite, verifiable text-to-image domain (pure numpy).

Images are small RGB canvases (32×32 by default) holding 1–3 flat-coloured objects with hard
edges on a black background; every prompt is generated from (and parsed by) the grammar below,
so the set of prompts is finite (`all_prompts`) and every constraint a prompt states can be
checked on an image (`g2rpo_jax.rewards.verifier`).

Vocabulary
    shapes    circle, square, triangle            (plurals: circles, squares, triangles)
    colours   red, green, blue, yellow, white     (exact RGB values in `PALETTE`)
    sizes     small, large                        (half-extents 3 and 5 px on a 32 px canvas)
    counts    a (= 1), two, three
    relations left of, right of, above, below

Palette (uint8 RGB; every pair, background included, is at least 255 apart in RGB space)
    background (0, 0, 0)        red    (255, 0, 0)      green (0, 255, 0)
    blue       (0, 0, 255)      yellow (255, 255, 0)    white (255, 255, 255)

Grammar (lower case, single spaces)
    prompt     := count_p | relation_p
    count_p    := "a" [size] colour shape            e.g. "a red circle", "a large blue square"
                | ("two" | "three") [size] colour shape "s"      e.g. "two red circles",
                                                                  "three small white triangles"
    relation_p := "a" colour shape relation "a" colour shape
                  e.g. "a blue square left of a yellow triangle"
                  The two objects differ in colour or shape (or both); sizes are not named in
                  relation prompts. "A left of B" reads: A's centroid is left of B's.

    3 counts × 3 size options (none, small, large) × 5 colours × 3 shapes = 135 count prompts;
    15 × 14 ordered pairs of distinct (colour, shape) × 4 relations = 840 relation prompts;
    975 prompts in all, at most `MAX_PROMPT_WORDS` = 8 words each.

Scenes (`sample_scene`, `render`)
    An object of half-extent r at integer centre (x, y) fills (a subset of) the (2r+1)² box
    around it: the square fills it all; the circle is {dx² + dy² ≤ r² + r}; the triangle is
    upright and isosceles, one pixel wide at the top row and 2r+1 wide at the bottom row
    (row i from the top has half-width ⌊(i+1)/2⌋). On a 32 px canvas the areas are
    square 49 / 121, circle 37 / 97, triangle 31 / 71 px (small / large).
    Boxes stay `EDGE_MARGIN` px inside the canvas and `OBJECT_GAP` px apart from each other (so
    objects never touch, not even diagonally); for a relation the two boxes are separated along
    the relation's axis by at least `RELATION_GAP` px. Objects whose size the prompt does not
    name get an independent uniformly random size. Lengths are given for a 32 px canvas and
    scale with the canvas (at least `MIN_CANVAS` px).

Splits (`split_prompts`)
    Prompts with the same meaning ("A left of B" and "B right of A"; "A above B" and "B below A")
    always land in the same split, so the held-out prompts are new compositions, not paraphrases
    of training prompts. Count and relation prompts are split separately with the same fraction.
"""

import dataclasses
import functools
import itertools

import numpy as np

SHAPES = ("circle", "square", "triangle")
COLOURS = ("red", "green", "blue", "yellow", "white")
SIZES = ("small", "large")
RELATIONS = ("left of", "right of", "above", "below")
COUNT_WORDS = ("a", "two", "three")  # COUNT_WORDS[n - 1] names the count n
MAX_OBJECTS = len(COUNT_WORDS)
MAX_PROMPT_WORDS = 8

INVERSE_RELATION = {"left of": "right of", "right of": "left of", "above": "below",
                    "below": "above"}


def _rgb(r: int, g: int, b: int) -> np.ndarray:
    value = np.array([r, g, b], np.uint8)
    value.flags.writeable = False
    return value


BACKGROUND = _rgb(0, 0, 0)
PALETTE: dict[str, np.ndarray] = {
    "red": _rgb(255, 0, 0),
    "green": _rgb(0, 255, 0),
    "blue": _rgb(0, 0, 255),
    "yellow": _rgb(255, 255, 0),
    "white": _rgb(255, 255, 255),
}

REFERENCE_CANVAS = 32
MIN_CANVAS = 24
SIZE_RADII = {"small": 3, "large": 5}  # half-extent in px on the reference canvas
EDGE_MARGIN = 2  # px between any object's box and the canvas border
OBJECT_GAP = 2  # px between the boxes of any two objects
RELATION_GAP = 3  # px between the two boxes along a relation's axis


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ObjectSpec:
    """`count` objects of one colour and shape; `size` is None when the prompt names none."""

    count: int
    colour: str
    shape: str
    size: str | None = None


@dataclasses.dataclass(frozen=True)
class Relation:
    """`objects[subject]` is `kind` (e.g. "left of") `objects[object]`."""

    kind: str
    subject: int
    object: int


@dataclasses.dataclass(frozen=True)
class Constraints:
    """What a prompt asks for: object specs (a tuple) and an optional relation between two."""

    objects: tuple[ObjectSpec, ...]
    relation: Relation | None = None

    @property
    def num_objects(self) -> int:
        return sum(spec.count for spec in self.objects)


def _noun(shape: str, count: int) -> str:
    return shape if count == 1 else shape + "s"


def word_vocabulary() -> list[str]:
    """Every word that can appear in a prompt, sorted and unique."""
    words = {*COUNT_WORDS, *SIZES, *COLOURS, *SHAPES, *(s + "s" for s in SHAPES)}
    for relation in RELATIONS:
        words.update(relation.split())
    return sorted(words)


def format_prompt(constraints: Constraints) -> str:
    """The prompt that `parse_prompt` maps to `constraints` (its inverse on the grammar)."""
    if constraints.relation is None:
        (spec,) = constraints.objects
        words = [COUNT_WORDS[spec.count - 1], *([spec.size] if spec.size else []), spec.colour,
                 _noun(spec.shape, spec.count)]
        return " ".join(words)
    rel = constraints.relation
    a, b = constraints.objects[rel.subject], constraints.objects[rel.object]
    return f"a {a.colour} {a.shape} {rel.kind} a {b.colour} {b.shape}"


def _all_constraints() -> list[Constraints]:
    out = []
    for count, size, colour, shape in itertools.product(
            range(1, MAX_OBJECTS + 1), (None, *SIZES), COLOURS, SHAPES):
        out.append(Constraints((ObjectSpec(count, colour, shape, size),)))
    pairs = list(itertools.product(COLOURS, SHAPES))
    for (ca, sa), (cb, sb) in itertools.permutations(pairs, 2):
        for kind in RELATIONS:
            out.append(Constraints((ObjectSpec(1, ca, sa), ObjectSpec(1, cb, sb)),
                                   Relation(kind, 0, 1)))
    return out


@functools.cache
def _all_prompts() -> tuple[str, ...]:
    return tuple(sorted(format_prompt(c) for c in _all_constraints()))


def all_prompts() -> list[str]:
    """Every prompt of the grammar, sorted (975 of them)."""
    return list(_all_prompts())


def _malformed(prompt: str, why: str) -> ValueError:
    return ValueError(
        f"Malformed prompt {prompt!r}: {why}. Expected '<count> [<size>] <colour> <shape>[s]' "
        f"(e.g. 'two red circles', 'a large blue square') or "
        f"'a <colour> <shape> <relation> a <colour> <shape>' "
        f"(e.g. 'a blue square left of a yellow triangle').")


def _parse_object(words: list[str], prompt: str) -> tuple[str, str]:
    """["a", colour, shape] → (colour, shape)."""
    if len(words) != 3 or words[0] != "a" or words[1] not in COLOURS or words[2] not in SHAPES:
        raise _malformed(prompt, f"{' '.join(words)!r} is not 'a <colour> <shape>'")
    return words[1], words[2]


@functools.lru_cache(maxsize=4096)
def parse_prompt(prompt: str) -> Constraints:
    """Prompt → Constraints. Case and runs of whitespace are ignored.

    Raises ValueError naming the first unknown word (and listing the vocabulary), or naming the
    prompt when its words do not follow the grammar.
    """
    words = prompt.lower().split()
    vocabulary = word_vocabulary()
    for word in words:
        if word not in vocabulary:
            raise ValueError(f"Unknown word {word!r} in prompt {prompt!r}; the vocabulary is "
                             f"{vocabulary}.")
    if not words:
        raise _malformed(prompt, "it is empty")

    for kind in RELATIONS:
        kind_words = kind.split()
        k = len(kind_words)
        for start in range(len(words) - k + 1):
            if words[start:start + k] == kind_words:
                a = _parse_object(words[:start], prompt)
                b = _parse_object(words[start + k:], prompt)
                if a == b:
                    raise _malformed(prompt, "a relation needs two different objects")
                return Constraints((ObjectSpec(1, *a), ObjectSpec(1, *b)), Relation(kind, 0, 1))

    if words[0] not in COUNT_WORDS:
        raise _malformed(prompt, f"it starts with {words[0]!r}, not a count")
    count = COUNT_WORDS.index(words[0]) + 1
    rest = words[1:]
    size = None
    if rest and rest[0] in SIZES:
        size, rest = rest[0], rest[1:]
    if len(rest) != 2 or rest[0] not in COLOURS:
        raise _malformed(prompt, "expected a colour and a shape after the count (and size)")
    colour, noun = rest
    shape = noun[:-1] if count > 1 else noun
    if shape not in SHAPES or noun != _noun(shape, count):
        want = "singular" if count == 1 else "plural"
        raise _malformed(prompt, f"{noun!r} is not a {want} shape noun")
    return Constraints((ObjectSpec(count, colour, shape, size),))


# GenEval's six categories (Ghosh et al., 2023), in its report order. This world's grammar has
# prompts of three of them: `category` names which.
GENEVAL_CATEGORIES = ("single_object", "two_object", "counting", "colors", "position",
                      "color_attr")


def category(prompt: str) -> str:
    """The GenEval category of a prompt: "position" for a relation ("a red circle left of a
    blue square"), "counting" for two or three objects ("two red circles"), "colors" for one
    object of a named colour, with or without a size ("a red circle", "a large blue square":
    GenEval has no size category, and its colour prompts are one object of a named colour)."""
    constraints = parse_prompt(prompt)
    if constraints.relation is not None:
        return "position"
    return "counting" if constraints.num_objects > 1 else "colors"


# ---------------------------------------------------------------------------------------------
# Noisy captions
# ---------------------------------------------------------------------------------------------

CAPTION_NOISE_KINDS = ("colour", "count", "relation")


def noisy_caption(prompt: str, rng: np.random.Generator, rates: dict[str, float],
                  allowed: frozenset[str] | set[str] | None = None) -> str:
    """A caption of `prompt`'s scene that is wrong in the way web captions are.

    Each colour word is replaced, with probability rates["colour"], by another colour; the count
    word of a count prompt, with probability rates["count"], by another count; a relation, with
    probability rates["relation"], by another relation (kinds not in `rates` are never changed).
    A replacement is drawn uniformly among the values that keep the caption a prompt of the
    grammar and, when `allowed` is given, in `allowed` (e.g. the training split, so that no
    held-out prompt is ever seen as a caption); where none is, that word is left as it is.
    A pre-training run on such captions gives a base that draws what the words say only part of
    the time: the kind of error that reinforcement learning with a verifier repairs.
    """
    unknown = set(rates) - set(CAPTION_NOISE_KINDS)
    if unknown:
        raise ValueError(f"Unknown caption noise kinds {sorted(unknown)}; the kinds are "
                         f"{list(CAPTION_NOISE_KINDS)}.")
    for kind, rate in rates.items():
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"Caption noise rate {kind}={rate} must lie in [0, 1].")
    constraints = parse_prompt(prompt)
    objects, relation = list(constraints.objects), constraints.relation

    def ok(candidate: Constraints) -> bool:
        if relation is not None and (candidate.objects[0].colour, candidate.objects[0].shape) == (
                candidate.objects[1].colour, candidate.objects[1].shape):
            return False   # a relation needs two different objects
        return allowed is None or format_prompt(candidate) in allowed

    def replaced(candidates: list[Constraints]) -> None:
        nonlocal objects, relation
        candidates = [c for c in candidates if ok(c)]
        if candidates:
            pick = candidates[rng.integers(len(candidates))]
            objects, relation = list(pick.objects), pick.relation

    for i in range(len(objects)):
        if rng.random() < rates.get("colour", 0.0):
            replaced([Constraints(tuple(dataclasses.replace(o, colour=c) if j == i else o
                                        for j, o in enumerate(objects)), relation)
                      for c in COLOURS if c != objects[i].colour])
    if relation is None and rng.random() < rates.get("count", 0.0):
        (spec,) = objects
        replaced([Constraints((dataclasses.replace(spec, count=n),))
                  for n in range(1, MAX_OBJECTS + 1) if n != spec.count])
    if relation is not None and rng.random() < rates.get("relation", 0.0):
        replaced([Constraints(tuple(objects), dataclasses.replace(relation, kind=k))
                  for k in RELATIONS if k != relation.kind])
    return format_prompt(Constraints(tuple(objects), relation))


# ---------------------------------------------------------------------------------------------
# Splits
# ---------------------------------------------------------------------------------------------


def _meaning(constraints: Constraints) -> Constraints:
    """A canonical representative of the prompts meaning the same as `constraints`."""
    rel = constraints.relation
    if rel is None:
        return constraints
    flipped = Constraints(constraints.objects[::-1], Relation(INVERSE_RELATION[rel.kind], 0, 1))
    return min(constraints, flipped, key=format_prompt)


def split_prompts(seed: int = 0, held_out_fraction: float = 0.2) -> dict[str, list[str]]:
    """A deterministic split of `all_prompts()` into disjoint {"train": [...], "held_out": [...]}.

    Prompts are grouped by meaning (a relation and its mirror, e.g. "a red circle left of a blue
    square" and "a blue square right of a red circle", share a group); `held_out_fraction` of
    the groups of count prompts and, separately, of relation prompts (at least one, at most all
    but one, of each) are held out. Groups holding a word absent from the rest of train then move
    back to train, so every vocabulary word appears in train. Both lists are sorted.
    """
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must lie in (0, 1); got {held_out_fraction}.")
    rng = np.random.default_rng(seed)
    groups: dict[Constraints, list[str]] = {}
    for c in _all_constraints():
        groups.setdefault(_meaning(c), []).append(format_prompt(c))
    keys = sorted(groups, key=lambda k: format_prompt(k))
    held: set[Constraints] = set()
    for is_relation in (False, True):
        kind_keys = [k for k in keys if (k.relation is not None) == is_relation]
        n_held = min(max(1, round(held_out_fraction * len(kind_keys))), len(kind_keys) - 1)
        order = rng.permutation(len(kind_keys))
        held.update(kind_keys[i] for i in order[:n_held])

    def words_of(ks):
        return {w for k in ks for p in groups[k] for w in p.split()}

    for word in word_vocabulary():
        train_keys = [k for k in keys if k not in held]
        if word not in words_of(train_keys):
            held.remove(next(k for k in keys if k in held and word in words_of([k])))
    train = sorted(p for k in keys if k not in held for p in groups[k])
    held_out = sorted(p for k in keys if k in held for p in groups[k])
    return {"train": train, "held_out": held_out}


# ---------------------------------------------------------------------------------------------
# Scenes and rendering
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SceneObject:
    """One object: centre (x = column, y = row) in pixels and half-extent `radius` in pixels."""

    colour: str
    shape: str
    size: str
    x: int
    y: int
    radius: int

    @property
    def box(self) -> tuple[int, int, int, int]:
        """(top, left, bottom, right), inclusive."""
        r = self.radius
        return self.y - r, self.x - r, self.y + r, self.x + r


@dataclasses.dataclass(frozen=True)
class Scene:
    """A prompt's objects placed on a `canvas` × `canvas` image; for a relation prompt
    objects[0] is the subject and objects[1] the object."""

    prompt: str
    canvas: int
    objects: tuple[SceneObject, ...]


def _scaled(px: int, canvas: int, minimum: int = 1) -> int:
    return max(minimum, round(px * canvas / REFERENCE_CANVAS))


def object_radius(size: str, canvas: int = REFERENCE_CANVAS) -> int:
    """Half-extent in pixels of a `size` ("small" / "large") object on a `canvas` px image."""
    return _scaled(SIZE_RADII[size], canvas)


@functools.cache
def shape_mask(shape: str, radius: int) -> np.ndarray:
    """The read-only boolean [2r+1, 2r+1] footprint of a shape of half-extent `radius`."""
    d = np.arange(-radius, radius + 1)
    dy, dx = d[:, None], d[None, :]
    if shape == "square":
        mask = np.ones((d.size, d.size), bool)
    elif shape == "circle":
        mask = dy ** 2 + dx ** 2 <= radius * radius + radius
    elif shape == "triangle":
        half_width = (np.arange(d.size)[:, None] + 1) // 2
        mask = np.abs(dx) <= half_width
    else:
        raise ValueError(f"Unknown shape {shape!r}; the shapes are {list(SHAPES)}.")
    mask.flags.writeable = False
    return mask


def _check_canvas(size: int) -> None:
    if size < MIN_CANVAS:
        raise ValueError(f"The canvas must be at least {MIN_CANVAS} px; got {size}.")


def sample_scene(prompt: str, rng: np.random.Generator, size: int = REFERENCE_CANVAS,
                 max_attempts: int = 10_000, grid: int = 1) -> Scene:
    """Random placement (and sizes, where unnamed) of the prompt's objects on a `size` px canvas.

    Objects are placed one after another, each uniformly among the centres that keep it inside
    the margins, clear of the objects already placed and (for a relation's object) on the right
    side of the subject; a dead end restarts the whole scene.

    `grid` (px): every object's box has its top-left corner on a lattice of this pitch, offset
    by the edge margin; 1 = any pixel. With the generator's patch size as the pitch, an object's
    pixels inside each latent token depend only on the token it starts in, not on a sub-token
    offset (the shapes world's configs set this: `world.placement_grid`).
    """
    _check_canvas(size)
    if grid < 1:
        raise ValueError(f"The placement grid must be at least 1 px; got {grid}.")
    constraints = parse_prompt(prompt)
    margin = _scaled(EDGE_MARGIN, size)
    gap = _scaled(OBJECT_GAP, size, minimum=2)
    rel_gap = _scaled(RELATION_GAP, size, minimum=3)
    rel = constraints.relation
    items = [(spec.colour, spec.shape, spec.size)
             for spec in constraints.objects for _ in range(spec.count)]
    for _ in range(max_attempts):
        placed: list[SceneObject] = []
        for index, (colour, shape, size_word) in enumerate(items):
            size_word = size_word or SIZES[rng.integers(len(SIZES))]
            r = object_radius(size_word, size)
            lo, hi = margin + r, size - 1 - margin - r
            ys, xs = np.mgrid[lo:hi + 1:grid, lo:hi + 1:grid]
            ok = np.ones(ys.shape, bool)
            for other in placed:
                clear = r + other.radius + 1 + gap
                ok &= (np.abs(xs - other.x) >= clear) | (np.abs(ys - other.y) >= clear)
            if rel is not None and index == rel.object:
                s = placed[rel.subject]
                apart = s.radius + r + 1 + rel_gap
                ok &= {"left of": xs >= s.x + apart, "right of": xs <= s.x - apart,
                       "above": ys >= s.y + apart, "below": ys <= s.y - apart}[rel.kind]
            candidates = np.flatnonzero(ok)
            if candidates.size == 0:
                break
            pick = candidates[rng.integers(candidates.size)]
            placed.append(SceneObject(colour, shape, size_word, int(xs.flat[pick]),
                                      int(ys.flat[pick]), r))
        else:
            return Scene(prompt, size, tuple(placed))
    raise RuntimeError(f"Could not place {prompt!r} on a {size} px canvas in {max_attempts} "
                       f"attempts.")


def render(scene: Scene, size: int | None = None) -> np.ndarray:
    """Scene → uint8 [size, size, 3]: hard-edged shapes in exact palette colours on BACKGROUND.

    `size` defaults to (and must equal) the canvas the scene was sampled for.
    """
    if size is not None and size != scene.canvas:
        raise ValueError(f"The scene was sampled for a {scene.canvas} px canvas, not {size} px; "
                         f"pass size={size} to sample_scene.")
    image = np.empty((scene.canvas, scene.canvas, 3), np.uint8)
    image[:] = BACKGROUND
    for obj in scene.objects:
        top, left, bottom, right = obj.box
        window = image[top:bottom + 1, left:right + 1]
        window[shape_mask(obj.shape, obj.radius)] = PALETTE[obj.colour]
    return image


def render_prompt(prompt: str, rng: np.random.Generator, size: int = REFERENCE_CANVAS,
                  grid: int = 1) -> np.ndarray:
    """`render(sample_scene(prompt, rng, size, grid=grid))`."""
    return render(sample_scene(prompt, rng, size, grid=grid))
