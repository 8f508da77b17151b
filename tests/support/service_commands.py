"""What a deployment file runs, parsed by the service's own flags (specdec.flags).

A flag a service does not have, or a value it refuses (a dtype it does not know, a port out
of range), fails here the way it would fail in the container.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Mapping, Sequence

from specdec.draft_server.config import DraftConfig
from specdec.flags import parse_config
from specdec.gateway.config import GatewayConfig
from specdec.target_server.config import TargetConfig

CONFIGS = {
    "specdec.target_server": TargetConfig,
    "specdec.draft_server": DraftConfig,
    "specdec.gateway": GatewayConfig,
}


def parse_service_command(argv: Sequence[str]) -> tuple[str, object]:
    """`python -m specdec.<service> --flag ...` -> (module, the config the service would build)."""
    argv = list(argv)
    assert argv[:2] == ["python", "-m"] and argv[2] in CONFIGS, f"not a specdec service command: {argv}"
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return argv[2], parse_config(CONFIGS[argv[2]], argv[3:])
    except SystemExit:
        raise AssertionError(f"{argv[2]} refuses its flags {argv[3:]}: {stderr.getvalue().strip()}") from None


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(NAME) expansion in command and args; an unknown NAME is an error here
    (Kubernetes would pass the text on unchanged, and the service would get "$(NAME)")."""

    def value(match: re.Match[str]) -> str:
        assert match.group(1) in env, f"$({match.group(1)}) is not in the container's environment"
        return env[match.group(1)]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, text)
