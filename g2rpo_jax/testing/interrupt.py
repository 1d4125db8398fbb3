"""Runs the entry point and kills itself (SIGKILL) at an exact moment of a checkpoint save, to
test that a run resumes from what a kill leaves behind.

  python -m g2rpo_jax.testing.interrupt --kill_at_commit=2 -- --config=... --workdir=...

`--kill_at_commit=N`: when the save of iteration N has written every file and is about to be
committed (Orbax renames the temporary folder; this runs in the asynchronous save's background
thread while training goes on), the process kills itself: the step is complete on disk but was
never committed, the state a kill during an asynchronous save leaves.
"""

import os
import signal
import sys


def _kill_at_commit(step: int) -> None:
    from orbax.checkpoint._src.path import atomicity

    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize_or_kill(self, *args, **kwargs):
        if os.path.basename(os.fspath(self.get_final())) == str(step):
            sys.stderr.write(f"interrupt: SIGKILL during the save of iteration {step}\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return await finalize(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize_or_kill


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv:
        raise SystemExit(__doc__)
    ours, rest = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    for arg in ours:
        name, _, value = arg.partition("=")
        if name != "--kill_at_commit":
            raise SystemExit(f"Unknown option {arg}.\n{__doc__}")
        _kill_at_commit(int(value))
    from absl import app

    from g2rpo_jax import main as entry

    sys.argv = [entry.__file__, *rest]
    from absl import flags

    flags.mark_flags_as_required(["config", "workdir"])
    app.run(entry.main)


if __name__ == "__main__":
    main()
