"""Trains the embedded world's learned judge (`g2rpo_jax.rewards.judge`) contrastively.

    python scripts/train_judge.py --out=g2rpo_jax/assets/judge.safetensors

Data: every step renders fresh images (`world.render_prompt`, seeded numpy rng) of a batch of
prompts drawn from all 975 (`world.all_prompts()`): half uniformly at random, half hard
negatives of those, i.e. one-edit neighbours (another relation, subject and object swapped,
another colour / shape / count / size). Images are augmented in the jitted step (per-channel
colour gain and offset, a partial 3×3 blur, Gaussian pixel noise) so the judge tolerates the
imperfect images a generator makes.

Loss: symmetric InfoNCE over the batch with multiple positives: image i and prompt j are a
positive pair whenever the image satisfies the prompt (the verifier would score it 1): the
prompt it was rendered for, its mirror ("A left of B" / "B right of A"), "a red circle" for the
image of "a large red circle", and a relation that happens to hold too. AdamW, warm-up + cosine.

Evaluation (fresh images of every prompt, another seed; clean and augmented): top-1 retrieval
over all 975 prompts (image → prompt), counted correct when the verifier scores the retrieved
prompt 1 on the image ("top1"; "top1_exact" needs the very prompt rendered), and the mean
similarity of matching vs mismatched (image, prompt) pairs. The figures and the command are
stored in the file's config ("eval", "train").
"""

import argparse
import os
import sys
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

from g2rpo_jax.data import world
from g2rpo_jax.rewards import judge as judge_lib
from g2rpo_jax.rewards import verifier

# ---------------------------------------------------------------------------------------------
# Which prompts an image satisfies, and hard negatives
# ---------------------------------------------------------------------------------------------


def _centroid(obj: world.SceneObject) -> tuple[float, float]:
    rows, cols = np.nonzero(world.shape_mask(obj.shape, obj.radius))
    return obj.y - obj.radius + rows.mean(), obj.x - obj.radius + cols.mean()


def _holds(kind: str, a: world.SceneObject, b: world.SceneObject, margin: float) -> bool:
    (ay, ax), (by, bx) = _centroid(a), _centroid(b)
    return {"left of": ax + margin < bx, "right of": ax > bx + margin,
            "above": ay + margin < by, "below": ay > by + margin}[kind]


def satisfied_prompts(scene: world.Scene) -> list[str]:
    """The prompts a rendered scene satisfies (those the verifier scores 1 on its image)."""
    c = world.parse_prompt(scene.prompt)
    if c.relation is None:
        (spec,) = c.objects
        sizes = {o.size for o in scene.objects}
        out = [world.format_prompt(world.Constraints(
            (world.ObjectSpec(spec.count, spec.colour, spec.shape, None),)))]
        if len(sizes) == 1:
            out.append(world.format_prompt(world.Constraints(
                (world.ObjectSpec(spec.count, spec.colour, spec.shape, sizes.pop()),))))
        return out
    margin = verifier.RELATION_MARGIN * scene.canvas / world.REFERENCE_CANVAS
    a, b = scene.objects
    out = []
    for s, o in ((a, b), (b, a)):
        for kind in world.RELATIONS:
            if _holds(kind, s, o, margin):
                out.append(f"a {s.colour} {s.shape} {kind} a {o.colour} {o.shape}")
    return out


def neighbours(prompt: str, known: set[str]) -> list[str]:
    """Prompts one edit away (relation, order, a colour, a shape, the count or the size)."""
    c = world.parse_prompt(prompt)
    out = []
    if c.relation is None:
        (s,) = c.objects
        variants = ([world.ObjectSpec(n, s.colour, s.shape, s.size) for n in (1, 2, 3)]
                    + [world.ObjectSpec(s.count, s.colour, s.shape, z)
                       for z in (None, *world.SIZES)]
                    + [world.ObjectSpec(s.count, col, s.shape, s.size) for col in world.COLOURS]
                    + [world.ObjectSpec(s.count, s.colour, sh, s.size) for sh in world.SHAPES])
        out = [world.format_prompt(world.Constraints((v,))) for v in variants]
    else:
        (a, b), kind = c.objects, c.relation.kind
        objs = [(a.colour, a.shape, b.colour, b.shape, k) for k in world.RELATIONS]
        objs.append((b.colour, b.shape, a.colour, a.shape, kind))
        objs += [(col, a.shape, b.colour, b.shape, kind) for col in world.COLOURS]
        objs += [(a.colour, sh, b.colour, b.shape, kind) for sh in world.SHAPES]
        objs += [(a.colour, a.shape, col, b.shape, kind) for col in world.COLOURS]
        objs += [(a.colour, a.shape, b.colour, sh, kind) for sh in world.SHAPES]
        out = [f"a {ca} {sa} {k} a {cb} {sb}" for ca, sa, cb, sb, k in objs]
    return sorted({p for p in out if p in known and p != prompt})


class Data:
    """Fresh rendered batches: prompt indices, images uint8 [B, H, W, 3], positives [B, B]."""

    def __init__(self, prompts: list[str], seed: int, hard_fraction: float):
        self.prompts = prompts
        self.index = {p: i for i, p in enumerate(prompts)}
        known = set(prompts)
        self.neighbours = [np.array([self.index[q] for q in neighbours(p, known)])
                           for p in prompts]
        self.rng = np.random.default_rng(seed)
        self.hard_fraction = hard_fraction
        self._order = np.empty(0, np.int64)

    def _anchors(self, n: int) -> np.ndarray:
        while self._order.size < n:  # epochs over the prompts, so every prompt is seen evenly
            self._order = np.concatenate([self._order, self.rng.permutation(len(self.prompts))])
        out, self._order = self._order[:n], self._order[n:]
        return out

    def render(self, indices) -> tuple[np.ndarray, list[set[int]]]:
        images, sats = [], []
        for i in indices:
            scene = world.sample_scene(self.prompts[i], self.rng)
            images.append(world.render(scene))
            sats.append({self.index[p] for p in satisfied_prompts(scene)})
        return np.stack(images), sats

    def batch(self, size: int):
        n_hard = int(round(size * self.hard_fraction))
        anchors = self._anchors(size - n_hard)
        hard = [self.rng.choice(self.neighbours[a]) for a in self.rng.choice(anchors, n_hard)]
        indices = np.concatenate([anchors, np.asarray(hard, np.int64)])
        images, sats = self.render(indices)
        positives = np.array([[j in sat for j in indices] for sat in sats])
        return indices, images, positives


# ---------------------------------------------------------------------------------------------
# Augmentation, loss, step
# ---------------------------------------------------------------------------------------------


def augment(key, images, strength: float = 1.0):
    """uint8 [B, H, W, 3] → float [B, H, W, 3] in [0, 1]: per-image colour gain / offset per
    channel, a partial 3×3 box blur and Gaussian noise; a quarter of the images stay clean."""
    x = images.astype(jnp.float32) / 255.0
    b = x.shape[0]
    k = jax.random.split(key, 6)
    gain = jax.random.uniform(k[0], (b, 1, 1, 3), minval=0.85, maxval=1.05)
    offset = jax.random.uniform(k[1], (b, 1, 1, 3), minval=-0.04, maxval=0.08)
    y = x * (1 - (1 - gain) * strength) + offset * strength
    padded = jnp.pad(y, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="edge")
    h, w = x.shape[1:3]
    blurred = sum(padded[:, i:i + h, j:j + w] for i in range(3) for j in range(3)) / 9.0
    alpha = jax.random.uniform(k[2], (b, 1, 1, 1), maxval=0.6) * strength
    alpha = alpha * (jax.random.uniform(k[3], (b, 1, 1, 1)) < 0.5)
    y = (1 - alpha) * y + alpha * blurred
    sigma = jax.random.uniform(k[4], (b, 1, 1, 1), maxval=0.1) * strength
    y = y + sigma * jax.random.normal(k[5], y.shape)
    clean = (jnp.arange(b) % 4 == 0)[:, None, None, None]
    return jnp.clip(jnp.where(clean, x, y), 0.0, 1.0)


def multi_positive_nce(logits, positives):
    """mean over rows of −log(Σ_pos exp / Σ_all exp), both directions averaged."""
    def one_way(lg, pos):
        return jnp.mean(jax.nn.logsumexp(lg, -1) - jax.nn.logsumexp(jnp.where(pos, lg, -1e9), -1))
    return 0.5 * (one_way(logits, positives) + one_way(logits.T, positives.T))


def make_step(graphdef, optimizer):
    def loss_fn(params, images, ids, mask, positives):
        model = nnx.merge(graphdef, params)
        img, txt = model.encode_image(images), model.encode_text(ids, mask)
        logits = model.logit_scale() * img @ txt.T
        loss = multi_positive_nce(logits, positives)
        acc = jnp.mean(positives[jnp.arange(len(logits)), jnp.argmax(logits, -1)])
        return loss, {"loss": loss, "acc": acc, "scale": model.logit_scale()}

    @jax.jit
    def step(params, opt_state, key, images, ids, mask, positives):
        images = augment(key, images)
        grads, stats = jax.grad(loss_fn, has_aux=True)(params, images, ids, mask, positives)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, stats

    return step


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------


def evaluate(judge, tokenizer, prompts: list[str], seed: int, copies: int = 1) -> dict:
    """Fresh images (`copies` per prompt, rng `seed`), clean and augmented: retrieval over all
    prompts and matching vs mismatched similarity."""
    data = Data(prompts, seed, 0.0)
    indices = np.repeat(np.arange(len(prompts)), copies)
    images, sats = data.render(indices)
    ids, mask = tokenizer.encode(prompts)
    graphdef, state = nnx.split(judge)

    @jax.jit
    def sims_of(state, x):
        model = nnx.merge(graphdef, state)
        return model.encode_image(x) @ model.encode_text(ids, mask).T

    noisy = augment(jax.random.key(seed), jnp.asarray(images))
    out = {}
    for name, x in (("clean", jnp.asarray(images)), ("augmented", noisy)):
        sims = np.concatenate([np.asarray(sims_of(state, x[i:i + 512]))
                               for i in range(0, len(x), 512)])
        top = sims.argmax(1)
        positive = np.zeros_like(sims, bool)
        for r, sat in enumerate(sats):
            positive[r, list(sat)] = True
        own = sims[np.arange(len(sims)), indices]
        top1 = np.mean([verifier.score(images[r], prompts[t]) == 1.0
                        for r, t in enumerate(top)])
        relation = np.array([world.parse_prompt(prompts[i]).relation is not None
                             for i in indices])
        rng = np.random.default_rng(seed + 1)
        other = rng.integers(len(prompts), size=len(sims))
        keep = ~positive[np.arange(len(sims)), other]
        out[name] = {
            "top1": float(top1),
            "top1_exact": float(np.mean(top == indices)),
            "top1_satisfied": float(np.mean(positive[np.arange(len(sims)), top])),
            "top1_count_prompts": float(np.mean(positive[np.arange(len(sims)), top][~relation])),
            "top1_relation_prompts": float(np.mean(positive[np.arange(len(sims)), top][relation])),
            "own_beats_random_other": float(np.mean(
                (own > sims[np.arange(len(sims)), other])[keep])),
            "mean_sim_matching": float(own.mean()),
            "mean_sim_mismatched": float(sims[~positive].mean()),
            "images": int(len(sims)),
        }
    return out


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=judge_lib.DEFAULT_JUDGE_PATH, help="safetensors file to write")
    p.add_argument("--steps", type=int, default=700)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight_decay", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--hard_fraction", type=float, default=0.5,
                   help="share of each batch that is one-edit neighbours of the rest")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval_seed", type=int, default=12345)
    p.add_argument("--eval_copies", type=int, default=2, help="eval images per prompt")
    p.add_argument("--max_minutes", type=float, default=5.0,
                   help="stop training early (then evaluate and save) after this long")
    p.add_argument("--conv_channels", default="16,32,64,64")
    p.add_argument("--head_width", type=int, default=128)
    return p.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    start = time.time()
    prompts = world.all_prompts()
    cfg = judge_lib.JudgeConfig(conv_channels=tuple(int(c) for c in args.conv_channels.split(",")),
                                head_width=args.head_width)
    judge = judge_lib.Judge(cfg, rngs=nnx.Rngs(args.seed))
    tokenizer = judge_lib.make_tokenizer(cfg)
    all_ids, all_mask = tokenizer.encode(prompts)
    print(f"judge: {judge_lib.num_params(judge):,} parameters; {len(prompts)} prompts")

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, args.steps,
                                                  args.lr * 0.02)
    optimizer = optax.adamw(schedule, weight_decay=args.weight_decay)
    graphdef, params = nnx.split(judge, nnx.Param)
    opt_state = optimizer.init(params)
    step = make_step(graphdef, optimizer)
    data = Data(prompts, args.seed, args.hard_fraction)
    key = jax.random.key(args.seed)
    deadline = start + 60 * args.max_minutes
    done = 0
    with tqdm.tqdm(range(args.steps), desc="train judge", mininterval=2.0) as bar:
        for i in bar:
            indices, images, positives = data.batch(args.batch)
            key, sub = jax.random.split(key)
            params, opt_state, stats = step(params, opt_state, sub, images, all_ids[indices],
                                            all_mask[indices], positives)
            done = i + 1
            if i % 20 == 0 or done == args.steps:
                bar.set_postfix({k: f"{float(v):.3f}" for k, v in stats.items()})
            if time.time() > deadline:
                print(f"stopping after {done} steps: --max_minutes={args.max_minutes} reached")
                break
    train_s = time.time() - start
    judge = nnx.merge(graphdef, params)
    figures = evaluate(judge, tokenizer, prompts, args.eval_seed, args.eval_copies)
    for name, f in figures.items():
        print(f"eval ({name}): " + ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else
                                              f"{k}={v}" for k, v in f.items()))
    command = " ".join(["python", "scripts/train_judge.py", *argv])
    extra = {"eval": {**figures, "seed": args.eval_seed, "copies": args.eval_copies},
             "train": {"command": command, "steps": done, "batch": args.batch, "lr": args.lr,
                       "weight_decay": args.weight_decay, "hard_fraction": args.hard_fraction,
                       "seed": args.seed, "train_seconds": round(train_s, 1),
                       "final": {k: float(v) for k, v in stats.items()}}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    judge_lib.save_judge(args.out, judge, extra)
    print(f"wrote {args.out} ({os.path.getsize(args.out):,} bytes) in "
          f"{time.time() - start:.0f} s (training {train_s:.0f} s)")


if __name__ == "__main__":
    main()
