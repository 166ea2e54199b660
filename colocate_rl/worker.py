"""`python -m colocate_rl.worker RUN_DIR`: the per-rank entry point every `launch.sh` names (also those written by
earlier versions); the program is `colocate_rl.rank.worker`."""

import sys

if __name__ == "__main__":
    import atexit
    import os

    code = None

    def leave() -> None:
        """Registered before any library's handler, so the last to run (report_to backends' have run): ends the
        process before the interpreter's teardown and C++ destructors, which now and then abort a finished rank on a
        loaded CPU ("terminate called without an active exception": exit code 1 after every step) and walk every
        object of the training process (~1 s of a CPU rank's exit, measured on 2 cores)."""
        if code is not None:  # main returned; an exception that escaped it gets Python's own exit
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    atexit.register(leave)
    from colocate_rl.rank.worker import main

    code = main()
    sys.exit(code)
