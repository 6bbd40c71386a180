"""Seeded randomness keyed on the output position: the uniform that picks a seeded request's
``i``-th output token is a pure function of (seed, i).

The sampler needs one uniform number per sampled row (:mod:`.sampling_ops` draws by inverse
CDF). A ``torch.Generator`` per request would cost a call per row, on a GPU a kernel per row,
and hold state on one device. Here draw ``i`` of seed ``s`` is output ``i`` of SplitMix64
(Steele, Lea and Flood, 2014) started from ``mix64(s)``: ``mix64(mix64(s) + (i + 1) * γ)``,
a few integer operations on the host for any ``i``. So a batch's seeded uniforms cost
microseconds whatever the batch holds, a request's draws never depend on its neighbours, and a
disaggregated decode pod lines up with the prefill pod by counting the draw made there
(:meth:`SeedStream.skip`). SplitMix64 passes BigCrush; 53 bits of each output make the float.

Index ``i`` is the output position of the token drawn, not a count of rows drawn: a speculative
step draws positions ``n .. n + k`` for a request with ``n`` output tokens and ``k``
proposals, keeps the tokens of ``n .. n + a`` (``a`` accepted) and gives back the rest
(:meth:`SeedStream.unwind`), so the next step draws position ``n + a + 1`` with the uniform
plain decoding would use there. Were the rejected rows' draws spent, a request's tokens would
depend on how many rows it verified, and so on whether speculation was on for it, which a step
with more than ``--speculative-max-num-seqs`` decoding sequences switches off: on its load.

Seeds are taken modulo 2**64, as ``torch.Generator.manual_seed`` takes them (a negative seed
is the seed plus 2**64); the API refuses seeds outside ``[-2**63, 2**64)``.
"""

from __future__ import annotations

from typing import Final

_MASK64: Final = (1 << 64) - 1
_GAMMA: Final = 0x9E3779B97F4A7C15
"""SplitMix64's increment: 2**64 over the golden ratio, odd."""
_ATTEMPT: Final = 0xD1B54A32D192ED03
"""Step between a draw's attempts: another odd constant, so attempts do not fall on the
stream's next draws."""
_UNIT: Final = 2.0**-53


def mix64(z: int) -> int:
    """SplitMix64's finaliser (Stafford's variant 13): a bijection on 64-bit integers."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, index: int, attempt: int = 0) -> float:
    """Draw ``index`` (0-based) of ``seed``'s stream: a float in ``[0, 1)``. A draw that is
    retried (top-p by rejection on the CPU) takes ``attempt`` 1, 2, ... of the same index."""
    if index < 0 or attempt < 0:
        raise ValueError(f"draw index and attempt must be >= 0, got {index}, {attempt}")
    state = (mix64(seed & _MASK64) + (index + 1) * _GAMMA + attempt * _ATTEMPT) & _MASK64
    return (mix64(state) >> 11) * _UNIT


class SeedStream:
    """One seeded request's draws: its seed and the output position of its next draw (the
    number of output tokens drawn so far and kept)."""

    __slots__ = ("draws", "seed")

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.draws = 0

    def next(self) -> int:
        """The index of the stream's next draw (its uniforms: :func:`seeded_uniform`)."""
        self.draws += 1
        return self.draws - 1

    def skip(self, count: int = 1) -> None:
        """Advance past ``count`` draws made elsewhere (a prefill pod's first token)."""
        if count < 0:
            raise ValueError(f"cannot skip {count} draws")
        self.draws += count

    def unwind(self, count: int) -> None:
        """Give back the last ``count`` draws, whose tokens were not kept (a speculative step's
        rows after the first rejected proposal): their positions are drawn again, with the same
        uniforms, by the next step."""
        if not 0 <= count <= self.draws:
            raise ValueError(f"cannot unwind {count} of {self.draws} draws")
        self.draws -= count
