"""The one log line of start-up choices."""

from __future__ import annotations

from specdec.tuning.choices import REASONS, TuningChoice, tuning_line


def test_one_line_lists_every_choice_with_its_reason() -> None:
    choices = [
        TuningChoice("int4_kernel", "int4dot", "cached"),
        TuningChoice("compiled_steps", "single-request 1-token steps", "measured", "1x1 eager / compiled 9.0 / 6.0 ms"),
        TuningChoice("threads", "2", "fixed"),
    ]
    line = tuning_line(choices)
    assert "\n" not in line
    assert line == (
        "start-up choices: int4_kernel=int4dot (cached); compiled_steps=single-request 1-token steps "
        "(measured: 1x1 eager / compiled 9.0 / 6.0 ms); threads=2 (fixed)"
    )
    assert REASONS == ("measured", "cached", "flag", "fixed")
