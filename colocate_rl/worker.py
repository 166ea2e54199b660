"""`python -m colocate_rl.worker RUN_DIR`: the per-rank entry point every `launch.sh` names (also those written by
earlier versions); the program is `colocate_rl.rank.worker`."""

import sys

if __name__ == "__main__":
    import gc

    from colocate_rl.rank.worker import main

    code = main()
    # Interpreter teardown's last garbage collection walks every object of the training process (~1 s of a CPU
    # rank's exit, measured on 2 cores); frozen, they are left to the process's end. atexit handlers (report_to
    # backends) and the flush of stdout/stderr still run.
    gc.freeze()
    sys.exit(code)
