"""One rank of test_dist_env's exit test (run with torchrun's variables set).

Usage: python -m tests.trainers._leave_worker

Plays a member of a group whose torchrun agents have restarted different numbers of times
(``TORCHELASTIC_RESTART_COUNT`` = rank + 1, as after a partition: the nodes that lost a peer
restarted once more than the node that came back), leaves the ``with DistEnv`` block cleanly,
and prints how long the exit took.
"""

from __future__ import annotations

import os
import time

from trainers import DistEnv


def main() -> None:
    with DistEnv.from_env(device="cpu") as env:
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(env.rank + 1)
        start = time.monotonic()
    print(f"rank {env.rank} left in {time.monotonic() - start:.2f} s", flush=True)


if __name__ == "__main__":
    main()
