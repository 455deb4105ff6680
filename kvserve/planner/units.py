"""Byte and count formatting, and parsing of human-sized numbers, shared by every figure the planner prints."""

from __future__ import annotations

from kvserve.planner.errors import PlannerError

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

_BINARY_UNITS = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def format_bytes(num_bytes: float) -> str:
    """`196608` -> `192 KiB`; `2147483648` -> `2 GiB`; `45829131878` -> `42.68 GiB`.

    Binary units throughout, because that is what GPU memory and tensor sizes are counted in; whole multiples
    print without decimals so exact figures (the per-token KV bytes) read as exact.
    """
    sign = "-" if num_bytes < 0 else ""
    magnitude = abs(num_bytes)
    for unit, size in _BINARY_UNITS:
        if magnitude >= size:
            return f"{sign}{_trim(magnitude / size)} {unit}"
    return f"{sign}{_trim(magnitude)} B"


def _trim(value: float) -> str:
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.2f}"


def format_count(value: float) -> str:
    """Thousands separators for integers, two decimals otherwise (concurrency is fractional)."""
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.2f}"


def format_params(num_params: int) -> str:
    """`14770033664` -> `14.77 B`."""
    if num_params >= 10**9:
        return f"{num_params / 10**9:.2f} B"
    return f"{num_params / 10**6:.1f} M"


def gib_to_bytes(gib: float) -> int:
    return int(round(gib * GiB))


def parse_token_count(text: str | int, flag: str) -> int:
    """Parse a token count the way vLLM's `--max-model-len` does: `32768`, `32k` (x1000) or `32K` (x1024)."""
    if isinstance(text, int):
        return text
    raw = str(text).strip()
    multipliers = {"k": 1000, "m": 1000**2, "K": 1024, "M": 1024**2}
    try:
        if raw and raw[-1] in multipliers:
            return int(float(raw[:-1]) * multipliers[raw[-1]])
        return int(raw)
    except ValueError:
        raise PlannerError(f"{flag}: {text!r} is not a token count (examples: 32768, 32k, 32K)") from None


def ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)
