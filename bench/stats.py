"""Result records and the small statistics the report needs (no torch, no stack)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

STACK, ENGINE = "stack", "engine alone"  # the two systems the overhead checks compare
STAGGERED = "staggered"  # suffix of a system's name for its staggered-start run (bench.load.staggered)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100]; NaN for an empty sequence."""
    if not values:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def ratio(num: float, den: float) -> float:
    """``num / den``, NaN when either side is missing, NaN or zero in the denominator."""
    if num is None or den is None or math.isnan(num) or math.isnan(den) or den == 0:
        return math.nan
    return num / den


@dataclass
class StreamTrace:
    """One request as a client saw it: when it was sent and when each token arrived."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    tokens: int = 0  # output tokens (may exceed len(token_times) when one event carries several)
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class RunResult:
    """One measured system at one concurrency (or a skipped peer, with ``note`` saying why)."""

    system: str
    concurrency: int
    dtype: str = ""
    requests: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    errors: int = 0
    note: str = ""
    cpu: dict[str, dict[str, float]] = field(default_factory=dict)  # per process group (bench.cpu.shares)

    @property
    def skipped(self) -> bool:
        return self.requests == 0

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else math.nan

    def summary(self) -> dict[str, object]:
        """A flat row for the CSV: latencies in milliseconds."""
        ms = lambda v: round(v * 1e3, 2) if not math.isnan(v) else ""  # noqa: E731
        tps = self.tok_per_s
        return {
            "system": self.system, "dtype": self.dtype, "concurrency": self.concurrency,
            "requests": self.requests, "output_tokens": self.output_tokens, "wall_s": round(self.wall_s, 3),
            "tok_per_s": round(tps, 2) if not math.isnan(tps) else "",
            "ttft_p50_ms": ms(percentile(self.ttft_s, 50)), "ttft_p99_ms": ms(percentile(self.ttft_s, 99)),
            "itl_p50_ms": ms(percentile(self.itl_s, 50)), "itl_p99_ms": ms(percentile(self.itl_s, 99)),
            "errors": self.errors, "note": self.note,
        }


def from_traces(system: str, concurrency: int, dtype: str, traces: list[StreamTrace], wall_s: float,
                note: str = "") -> RunResult:
    """Fold client traces into a :class:`RunResult`; failed requests count as errors, not tokens."""
    ok = [t for t in traces if not t.error]
    return RunResult(
        system=system, concurrency=concurrency, dtype=dtype, requests=len(ok),
        output_tokens=sum(t.tokens for t in ok), wall_s=wall_s,
        ttft_s=[t.ttft for t in ok if t.ttft is not None],
        itl_s=[d for t in ok for d in t.itls], errors=len(traces) - len(ok), note=note,
    )
