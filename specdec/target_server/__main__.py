"""`python -m specdec.target_server`: bind the OpenMP threads, then load torch and serve."""

import sys

from specdec.tuning.thread_placement import bind_threads_before_torch

if __name__ == "__main__":
    bind_threads_before_torch(sys.argv[1:])  # first: libgomp reads its binding once, as torch loads

    from specdec.serving.entrypoint import run_model_service
    from specdec.target_server.config import TargetConfig
    from specdec.target_server.server import create_server

    run_model_service("target_server", TargetConfig, create_server)
