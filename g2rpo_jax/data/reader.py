"""Per-host batches of a random-access dataset (a TFDS `as_data_source` split, or any sequence
of records), shared by the shapes world and the FLUX prompt-embedding datasets.

  reader = Reader(source, batch_size=per_host_batch, seed=0)
  batch = next(reader)    # {feature: [B, ...] array, or [B] str for text features}

Every epoch is one permutation of the records, the same on all hosts (seeded by (seed, epoch));
host h takes its records h, h + H, h + 2H, ..., so the hosts' batches are disjoint and together
cover the epoch once. `state()` / `restore()` give and take the position (epoch, batch), which
the RL checkpoints hold.
"""

from collections.abc import Iterator

import jax
import numpy as np


def _as_text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def stack_records(records) -> dict:
    """Records (dicts of one example each) → one batch: text features (TFDS returns them as
    bytes) become lists of str, everything else is stacked into [B, ...] arrays."""
    batch = {}
    for name in records[0]:
        values = [r[name] for r in records]
        if isinstance(values[0], bytes | str):
            batch[name] = [_as_text(v) for v in values]
        else:
            batch[name] = np.stack([np.asarray(v) for v in values])
    return batch


class Reader(Iterator):
    """Endless per-host batches of a source, reshuffled every epoch; a batch never spans two
    epochs (the epoch's tail that does not fill a whole global batch is dropped, so every host
    sees the same number of batches)."""

    def __init__(self, source, batch_size: int, seed: int = 0,
                 process_index: int | None = None, process_count: int | None = None):
        self.source = source
        self.batch_size = batch_size
        self.seed = seed
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        global_batch = batch_size * self.process_count
        if batch_size < 1:
            raise ValueError(f"The per-host batch size must be at least 1; got {batch_size}.")
        if len(source) == 0:
            raise ValueError("The split has 0 records: it is empty. Build it with records in it "
                             "(shapes world: world.held_out_fraction, data.images_per_prompt; "
                             "FLUX: a prompts file with prompts in it).")
        if len(source) < global_batch:
            raise ValueError(f"The split has {len(source)} records, fewer than one global batch "
                             f"of {global_batch} ({batch_size} per host × {self.process_count} "
                             "hosts): lower the batch size.")
        self.batches_per_epoch = len(source) // global_batch
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> np.ndarray:
        """This host's record indices for the current epoch, [batches_per_epoch · B]."""
        order = np.random.default_rng((self.seed, self.epoch)).permutation(len(self.source))
        used = order[:self.batches_per_epoch * self.batch_size * self.process_count]
        return used[self.process_index::self.process_count]

    def state(self) -> dict:
        """Where the reader is (JSON): the next batch is batch `position` of epoch `epoch`."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "records": len(self.source), "batches_per_epoch": self.batches_per_epoch}

    def restore(self, state: dict) -> None:
        """Continues from `state()` of a reader over the same records and global batch size."""
        ours = self.state()
        for field in ("seed", "records", "batches_per_epoch"):
            if state[field] != ours[field]:
                raise ValueError(f"The saved reader state has {field} {state[field]}, this "
                                 f"reader {ours[field]}: the prompt dataset or the batch size "
                                 "changed since the checkpoint.")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order()

    def __next__(self) -> dict:
        if self.position == self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order()
        start = self.position * self.batch_size
        indices = self._order[start:start + self.batch_size]
        self.position += 1
        return stack_records(read(self.source, indices))


def read(source, indices) -> list:
    """The records at `indices`, in one batched read where the source supports it."""
    indices = [int(i) for i in indices]
    if hasattr(source, "__getitems__"):
        return source.__getitems__(indices)
    return [source[i] for i in indices]
