"""The task interface (see the package docstring)."""

import dataclasses
from typing import Any, Protocol

import numpy as np


@dataclasses.dataclass
class Batch:
    """One iteration's prompts.

    cond: the conditioning on the mesh: {"txt" [P, T, D], "y" [P, Dy]} split over the batch
      axes, {"txt_ids" [T, 3], "img_ids" [N, 3]} replicated (P prompts over all processes).
    prompts: this process's prompts [P_host], in the order of its rows of `cond`.
    prompt_ids: [P_host] int, each prompt's index in the task's training prompts (the shapes
      task's rewards look the prompts up by it).
    """

    cond: dict
    prompts: list[str]
    prompt_ids: np.ndarray | None = None


class Task(Protocol):
    """policy: the initial transformer (`flux.Flux`, sharded on the mesh).
    latent_shape: (N, C) of one sample's packed latents.
    reward_names / reward_weights: the training rewards (the R axis of `rewards`), weights
      in the advantage.
    evaluator: a `held_out.Evaluator` of the held-out prompts, or None (no evaluation).
    score_names: what the evaluator reports, in order; in_domain: those that are also trained
      on (the rest are out-of-domain)."""

    policy: Any
    latent_shape: tuple[int, int]
    reward_names: tuple[str, ...]
    reward_weights: tuple[float, ...]
    evaluator: Any
    score_names: tuple[str, ...]
    in_domain: tuple[str, ...]

    def next_batch(self) -> Batch:
        """The next training prompts (this process's share) with their conditioning."""

    def rewards(self, finals, batch: Batch) -> np.ndarray:
        """finals [P, M, N, C] (a global array) → rewards [R, P, M] (float32 numpy, the same
        on every process), computed on the hosts between the rollout's two jitted stages:
        each process scores its own rows (`parallel.local_rows`) and `parallel.gather_rows`
        shares the scores."""

    def decode(self, latents: np.ndarray) -> np.ndarray:
        """Packed latents [..., N, C] on this host → images [..., H, W, 3] in [0, 1], float32
        (the run's sample grids)."""

    def data_state(self) -> dict:
        """The prompt stream's position (JSON), saved in the run's checkpoints."""

    def restore_data_state(self, state: dict) -> None:
        """Continues the prompt stream from `data_state()`."""

    def save(self, workdir: str, policy, metadata: dict) -> str | None:
        """Writes the fine-tuned policy in the task's own format (besides the Orbax checkpoint
        the loop writes); returns the path, or None."""
