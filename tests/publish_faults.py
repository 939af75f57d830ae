"""A kill switch for a format's publish: SIGKILL the process before the n-th file-system call made
while a pack writer publishes (``PackWriter.publish``), as a node lost at that moment would.

The calls counted are the builtins that change or make durable what is on disk (open, write,
close, fsync, truncate, rename/replace, unlink, mkdir, rmdir, and sqlite's and Arrow's writes), seen
through ``sys.setprofile`` on every thread while ``publish`` runs: a kill lands between any two
of them, so between a file written and the rename that publishes it, between two renames, or
between the last rename and the meta.

    python -m tests.publish_faults ARGS...    the neva-pack command line, killed before publish step
                                              $KILL_AT_PUBLISH_STEP (0: never; the count of steps
                                              seen is written to $PUBLISH_STEPS_FILE, a JSON list of their names)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KILL_VARIABLE = "KILL_AT_PUBLISH_STEP"
STEPS_FILE_VARIABLE = "PUBLISH_STEPS_FILE"
IO_CALLS = frozenset({
    "open", "write", "writelines", "close", "flush", "fsync", "truncate", "replace", "rename", "unlink", "remove",
    "mkdir", "rmdir", "write_text", "write_bytes", "execute", "executemany", "commit", "write_table", "savez",
})  # fmt: skip
"""Names of the builtin calls counted as steps (a str's or bytes' own ``replace`` is not one)."""


def install(kill_at: int) -> list[str]:
    """Count the steps of every writer's ``publish`` (the returned list names them) and SIGKILL
    this process before step ``kill_at`` (1-based; 0: never)."""
    counter: list[str] = []

    def profile(frame, event, arg):
        name = getattr(arg, "__name__", "")
        if event == "c_call" and name in IO_CALLS and not isinstance(getattr(arg, "__self__", None), (str, bytes)):
            counter.append(name)
            if len(counter) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    def counted(original):
        def publish(*args, **kwargs):
            sys.setprofile(profile)
            threading.setprofile(profile)
            try:
                return original(*args, **kwargs)
            finally:
                sys.setprofile(None)
                threading.setprofile(None)

        return publish

    from neva_pack.formats import bridge, compact, energon, llamafactory, nemo

    for module in (bridge, compact, energon, llamafactory, nemo):  # bridge_parquet's writer is bridge's
        if not getattr(module.Writer.publish, "counted", False):
            module.Writer.publish = counted(module.Writer.publish)
            module.Writer.publish.counted = True
    return counter


def killed_in_publish(args: list[str], kill_at: int, steps_file: Path | None = None) -> subprocess.CompletedProcess:
    """The command line in a child process, killed before publish step ``kill_at`` (0: run whole,
    the names of the steps it took written to ``steps_file``)."""
    environ = {**os.environ, KILL_VARIABLE: str(kill_at), "PYTHONPATH": str(ROOT)}
    if steps_file is not None:
        environ[STEPS_FILE_VARIABLE] = str(steps_file)
    return subprocess.run([sys.executable, "-m", "tests.publish_faults", *args], env=environ, cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip


def main() -> int:
    from neva_pack.cli import main as cli

    counter = install(int(os.environ[KILL_VARIABLE]))
    code = cli(sys.argv[1:])
    steps_file = os.environ.get(STEPS_FILE_VARIABLE)
    if steps_file:
        Path(steps_file).write_text(json.dumps(counter))
    return code


if __name__ == "__main__":
    sys.exit(main())
