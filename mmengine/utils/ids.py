"""random_hex: request and response ids without a system call.

uuid.uuid4() reads os.urandom, which lets go of the GIL; under load the server's event loop then waited for the
step loop to hand it back (up to the interpreter's 5 ms switch interval) once per request, which delayed every
request behind it. The ids only need to be unique, not secret: a generator seeded once from os.urandom (and
again in a forked child, so that parent and child never repeat each other) draws them under the GIL.
"""

from __future__ import annotations

import os
import random

_generator = random.Random(os.urandom(32))


def _reseed() -> None:
    _generator.seed(os.urandom(32))


os.register_at_fork(after_in_child=_reseed)


def random_hex(num_chars: int = 32) -> str:
    """`num_chars` random hex digits (32: the 128 bits of a uuid4's hex, which the ids had before)."""
    return f"{_generator.getrandbits(4 * num_chars):0{num_chars}x}"
