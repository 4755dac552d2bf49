"""Integer arithmetic the layers share."""


def cdiv(a: int, b: int) -> int:
    """a / b rounded up (b > 0): e.g. the KV blocks that hold `a` tokens at `b` tokens per block."""
    return -(-a // b)
