"""Real in-process servers over the session's fp32 model (see tests/service_fixtures.py)."""

from service_fixtures import (  # noqa: F401 - fixtures are found by name
    draft,
    fp32_runtime,
    service_loop,
    start_draft,
    start_target,
    target,
)
