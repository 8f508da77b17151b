"""The classes of decoding forwards that get a path of their own: a compiled graph each
(`specdec.tuning.compiled_layers`) and a start-up decision whether the native call serves
them (`specdec.model.native_steps`).

A class is (requests, tokens each): (1, T) for a single request, (MANY, T) for a batch of
two or more; the 1- and 2-token forwards (a drafting step, a round's opening feed of the last
draft token and the bonus token) are classes of their own, and every width from MULTI to
MAX_MULTI (a verify, a drawn token fed with guessed ones) is the class MULTI.
"""

from __future__ import annotations

from specdec.model.linear import MAX_NARROW_ROWS

#: The request count of a shape class with the batch dimension dynamic: two or more.
MANY = 2
#: The narrowest width of the classes whose width is dynamic: (1, MULTI) and (MANY, MULTI)
#: stand for every width from MULTI to `MAX_MULTI`.
MULTI = 3
#: The widest forward of those classes: a verify at the services' largest K (16) and its
#: bonus position. Past `MAX_NARROW_ROWS` rows an int4 layer may take its wide kernel, which
#: the graph traced at `MULTI_TIMING_WIDTH` guards against: there a draft's single 17-token
#: forward runs eager, unless the native call takes it (`specdec.model.native_steps`).
MAX_MULTI = MAX_NARROW_ROWS + 1
#: The width that builds and times the MULTI classes: a drawn token and 8 guessed ones,
#: the draft's default guess.
MULTI_TIMING_WIDTH = 9
#: The shape classes, in order of use.
SHAPES = ((1, 1), (1, 2), (MANY, 1), (MANY, 2), (1, MULTI), (MANY, MULTI))

Shape = tuple[int, int]


def shape_class(batch_size: int, width: int) -> Shape:
    """The class of a forward of `batch_size` requests × `width` tokens."""
    return min(batch_size, MANY), MULTI if MULTI <= width <= MAX_MULTI else width


def shape_name(shape: Shape) -> str:
    requests, width = shape
    tokens = f"{MULTI}-{MAX_MULTI}" if width == MULTI else str(width)
    return f"{'batch' if requests == MANY else 'single-request'} {tokens}-token steps"


def shape_key(shape: Shape) -> str:
    """How the tuning cache names a shape class: "1x1", "2x1", ..."""
    return f"{shape[0]}x{shape[1]}"


def built_width(shape: Shape) -> int:
    """The width of the steps that build and time a shape class's path."""
    return MULTI_TIMING_WIDTH if shape[1] == MULTI else shape[1]
