"""What can stop a pipeline-run job, and the exit code each gives (the README's table says the same).

0    done, or nothing left to do, or stopped at --limit (resumable).
1    runtime failure: the model or the engine failed, the disk is full, a bug. Completed work is kept.
2    usage error: a bad option (argparse's own code), or an --output that cannot be used (a file,
     read-only, inside an input directory, in use by another run, holding another job).
3    input error: an input missing or unreadable, a bad record (without --errors return), a
     --text-field or --id-field that matches nothing, an input changed since the job began or while
     it was read.
130  interrupted by SIGINT (Ctrl-C), 143 by SIGTERM: completed work is kept, --resume continues.
"""

from __future__ import annotations

EXIT_RUNTIME = 1
EXIT_USAGE = 2  # what argparse itself uses
EXIT_INPUT = 3


class UsageError(ValueError):
    """The command line asks for something that cannot be done (exit 2)."""


class InputError(ValueError):
    """An input cannot be read as asked: the message names the file, the line and the id (exit 3)."""
