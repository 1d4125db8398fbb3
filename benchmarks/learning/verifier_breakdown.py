"""Where a shapes generator loses verifier score: the mean of each kind of check on held-out
prompts, and how many of the objects it draws the verifier cannot classify as a shape.

  python benchmarks/learning/verifier_breakdown.py [--generator=PATH] [--prompts=96] [--steps=10]

Samples with the evaluation's fixed noise and ODE sampler (configs/shapes_cpu.py's settings) and
prints, over the held-out prompts: the score; the mean colour, shape, size and relation checks
(verifier.score_breakdown); exclusivity; and the share of detected objects with no shape.
"""

import argparse
import collections

from flax import nnx
import numpy as np

from g2rpo_jax import parallel
from g2rpo_jax.rewards import verifier
from g2rpo_jax.run import config_lib
from g2rpo_jax.tasks import generator as generator_lib
from g2rpo_jax.tasks import held_out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--generator", default=generator_lib.SHIPPED_BASE)
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    config = config_lib.shapes_config()
    config.sampling.num_steps = args.steps
    config.evaluation.num_prompts = args.prompts
    config.evaluation.seed = args.seed
    mesh = parallel.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    generator = generator_lib.load_generator(args.generator, mesh)
    prompts = held_out.held_out_prompts(config)
    evaluator = held_out.Evaluator(config, generator, prompts, mesh, scorers=("in_domain",))
    images = evaluator.images(nnx.state(generator.flux, nnx.Param))[:, 0]
    checks, scores, exclusivity = collections.defaultdict(list), [], []
    shapes = collections.Counter()
    for image, prompt in zip(images, prompts):
        breakdown = verifier.score_breakdown(image, prompt)
        scores.append(breakdown.score)
        exclusivity.append(breakdown.exclusivity)
        for name, value in breakdown.checks:
            checks[name.split()[0]].append(value)
        for blob in verifier.detect_objects(image):
            shapes[blob.shape] += 1
    print(f"{args.generator}: {len(prompts)} held-out prompts, {args.steps} Euler steps")
    print(f"  score        {np.mean(scores):.3f}")
    for kind in ("colour", "shape", "size", "relation"):
        if checks[kind]:
            print(f"  {kind:<12} {np.mean(checks[kind]):.3f}  ({len(checks[kind])} checks)")
    print(f"  exclusivity  {np.mean(exclusivity):.3f}")
    total = sum(shapes.values())
    print(f"  objects      {total}: " + ", ".join(f"{k or 'no shape'} {v}" for k, v in
                                                   shapes.most_common()))


if __name__ == "__main__":
    main()
