"""Per-host batches of a random-access dataset (a TFDS `as_data_source` split, or any sequence
of records), shared by the shapes world and the FLUX prompt-embedding datasets.

  reader = Reader(source, batch_size=global_batch, seed=0,
                  rows=parallel.host_row_indices(mesh, global_batch))
  batch = next(reader)    # {feature: [R, ...] array, or [R] str for text features}

Every epoch is one permutation of the records, the same on all hosts (seeded by (seed, epoch)),
cut into global batches of `batch_size`; a host reads only its `rows` of each (the rows of the
batch that lie on its devices), so the hosts together read every batch once and the batch does
not depend on the number of hosts. `state()` / `restore()` give and take the position (epoch,
batch), which the RL checkpoints hold; restoring checks that the seed, the number of records
and the batches per epoch are those of the checkpoint.

Why not grain: its samplers also reshuffle every epoch and checkpoint their position, but they
shard by process (`IndexSampler` with `ShardByJaxProcess` gives each process a contiguous slice
of the records, shuffled within it), so a host's rows follow its process index rather than the
mesh and the global batch changes with the number of processes; and grain's index shuffle
orders the records differently from this permutation, on which every measured run's data
order depends.
"""

from collections.abc import Iterator

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
    """Endless batches of a source (this host's rows of each global batch), reshuffled every
    epoch; a batch never spans two epochs (the epoch's tail that does not fill a whole global
    batch is dropped).

    Args:
      source: a random-access sequence of records.
      batch_size: the global batch size B (all hosts together).
      seed: the shuffling seed.
      rows: the rows of each batch this host reads ([R] indices in [0, B)); default all.
    """

    def __init__(self, source, batch_size: int, seed: int = 0, rows=None):
        self.source = source
        self.batch_size = batch_size
        self.seed = seed
        if batch_size < 1:
            raise ValueError(f"The batch size must be at least 1; got {batch_size}.")
        self.rows = np.arange(batch_size) if rows is None else np.asarray(rows, np.int64)
        if len(self.rows) == 0 or self.rows.min() < 0 or self.rows.max() >= batch_size:
            raise ValueError(f"This host's rows {self.rows.tolist()} are not rows of a batch of "
                             f"{batch_size}.")
        if len(source) == 0:
            raise ValueError("The split has 0 records: it is empty. Build it with records in it "
                             "(shapes world: world.held_out_fraction, data.images_per_prompt; "
                             "FLUX: a prompts file with prompts in it).")
        if len(source) < batch_size:
            raise ValueError(f"The split has {len(source)} records, fewer than one global batch "
                             f"of {batch_size}: lower the batch size.")
        self.batches_per_epoch = len(source) // batch_size
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> np.ndarray:
        """The record indices of the current epoch's batches, [batches_per_epoch, B]."""
        order = np.random.default_rng((self.seed, self.epoch)).permutation(len(self.source))
        return order[:self.batches_per_epoch * self.batch_size].reshape(-1, self.batch_size)

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
        indices = self._order[self.position, self.rows]
        self.position += 1
        return stack_records(read(self.source, indices))


def read(source, indices) -> list:
    """The records at `indices`, in one batched read where the source supports it."""
    indices = [int(i) for i in indices]
    if hasattr(source, "__getitems__"):
        return source.__getitems__(indices)
    return [source[i] for i in indices]
