"""`python -m colocate_rl.worker RUN_DIR`: the per-rank entry point every `launch.sh` names (also those written by
earlier versions); the program is `colocate_rl.rank.worker`."""

import sys

if __name__ == "__main__":
    from colocate_rl.rank.worker import main

    sys.exit(main())
