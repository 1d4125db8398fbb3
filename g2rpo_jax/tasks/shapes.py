"""The embedded shapes world as a task: the generator bundle (word encoder, FLUX-architecture
transformer, pixel autoencoder), prompts from the TFDS train split, the verifier / judge /
quality scores as rewards, the held-out split as evaluation, `generator.safetensors` as output.
"""

import dataclasses
import os

import jax
import numpy as np

from g2rpo_jax import parallel
from g2rpo_jax.data import reader as reader_lib
from g2rpo_jax.data import shapes_tfds, world
from g2rpo_jax.models import lora
from g2rpo_jax.run import config_lib
from g2rpo_jax.tasks import generator as generator_lib
from g2rpo_jax.tasks import held_out
from g2rpo_jax.tasks.base import Batch


def make_reward_fn(generator: generator_lib.Generator, names, prompts, config):
    """The training reward, computed on the host between the rollout's two jitted stages:
    `reward_fn(latents [P, M, N, C], prompt_ids [P] (indices into prompts)) -> float32
    [R, P, M]` over the named scores (`held_out.score_images`)."""
    unknown = [n for n in names if n not in held_out.SCORES]
    if unknown or not names:
        raise ValueError(f"reward.train must name rewards from {held_out.SCORES}; got "
                         f"{list(names)}.")
    judge = held_out.judge_fn(config, prompts) if "out_of_domain" in names else None
    decode = jax.jit(generator.decode)
    strict = held_out.strict_verifier(config)

    def reward_fn(latents, prompt_ids):
        images = np.asarray(decode(latents))                          # [P, M, H, W, 3]
        scores = held_out.score_images(images, [prompts[i] for i in prompt_ids], names,
                                       judge, prompt_ids, strict)
        return np.stack([scores[n] for n in names])
    return reward_fn


def prompt_stream(config, mesh, rules) -> reader_lib.Reader:
    """This process's rows of each iteration's training prompts, from the TFDS train split
    (shuffled per epoch)."""
    data_dir = config.data.data_dir or None
    source = shapes_tfds.load_split(data_dir, "train", shapes_tfds.config_from(config))
    prompts = config.train.prompts_per_iteration
    return reader_lib.Reader(source, prompts, seed=config.seed,
                             rows=parallel.host_row_indices(mesh, prompts, rules))


class ShapesTask:
    """See `tasks.base.Task`."""

    def __init__(self, config, mesh, rules, training: bool = True):
        if not config.model.checkpoint:
            raise ValueError("config.model.checkpoint is empty: RL starts from a generator file "
                             "(the shipped base: configs/shapes_cpu.py sets it).")
        execution = config_lib.execution_fields(config.model)
        self.generator = generator_lib.load_generator(config.model.checkpoint, mesh, rules,
                                                      **execution)
        self.mesh, self.rules = mesh, rules
        # model.lora.rank > 0: adapters on the policy before anything takes its graph.
        lora.from_config(self.generator.flux, config.model, config.seed, mesh, rules)
        self.prompts_per_iteration = config.train.prompts_per_iteration
        self._decode = None
        self.policy = self.generator.flux
        self.latent_shape = self.generator.latent_shape
        self.reward_names = tuple(config.reward.train)
        self.reward_weights = tuple(config.reward.weights)
        if training:
            train_prompts = world.split_prompts(config.world.split_seed,
                                                config.world.held_out_fraction)["train"]
            self._prompt_index = {p: i for i, p in enumerate(train_prompts)}
            self.reader = prompt_stream(config, mesh, rules)
        self.evaluator = held_out.Evaluator(config, self.generator,
                                            held_out.held_out_prompts(config), mesh)
        self.score_names = self.evaluator.scorers
        self.in_domain = tuple(n for n in self.score_names if n in self.reward_names)
        if training:
            self._reward_fn = make_reward_fn(self.generator, list(self.reward_names),
                                             train_prompts, config)

    def next_batch(self) -> Batch:
        prompts = next(self.reader)["prompt"]
        cond = parallel.place_cond(self.generator.encode(prompts), self.mesh, self.rules,
                                  prompts=self.prompts_per_iteration)
        ids = np.asarray([self._prompt_index[p] for p in prompts], np.int32)
        return Batch(cond, prompts, ids)

    def decode(self, latents: np.ndarray) -> np.ndarray:
        if self._decode is None:
            self._decode = jax.jit(self.generator.decode)
        return np.asarray(self._decode(np.asarray(latents)), np.float32)

    def data_state(self) -> dict:
        return self.reader.state()

    def restore_data_state(self, state: dict) -> None:
        self.reader.restore(state)

    def rewards(self, finals, batch: Batch) -> np.ndarray:
        local = parallel.local_rows(finals, self.mesh, rules=self.rules)   # [P_host, M, N, C]
        return parallel.gather_rows(self._reward_fn(local, batch.prompt_ids), self.mesh,
                                    self.prompts_per_iteration, axis=1, rules=self.rules)

    def save(self, workdir: str, policy, metadata: dict) -> str:
        """The starting generator with the fine-tuned transformer, as one generator file."""
        fine_tuned = dataclasses.replace(self.generator, flux=policy)
        return generator_lib.save_generator(os.path.join(workdir, "generator.safetensors"),
                                            fine_tuned, {"rl": metadata})
