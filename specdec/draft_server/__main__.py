"""`python -m specdec.draft_server`: bind the OpenMP threads, then load torch and serve."""

import sys

from specdec.tuning.thread_placement import bind_threads_before_torch

if __name__ == "__main__":
    bind_threads_before_torch(sys.argv[1:])  # first: libgomp reads its binding once, as torch loads

    from specdec.draft_server.config import DraftConfig
    from specdec.draft_server.server import create_server
    from specdec.serving.entrypoint import run_model_service

    run_model_service("draft_server", DraftConfig, create_server)
