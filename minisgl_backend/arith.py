"""Integer arithmetic the layers share."""


def cdiv(a: int, b: int) -> int:
    """a / b rounded up (b > 0): e.g. the KV blocks that hold `a` tokens at `b` tokens per block."""
    return -(-a // b)


def int_bits(c: int) -> int:
    """The int64 whose bits are the uint64 `c` (how a tensor or a native call holds a sampling key)."""
    c &= (1 << 64) - 1
    return c - (1 << 64) if c >= 1 << 63 else c
