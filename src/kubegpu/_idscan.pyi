# Types of the compiled ID reader (_idscan.c, which explains what it does and why).

class IdTable:
    def __init__(self, keys: tuple[bytes, ...], values: tuple[str, ...]) -> None: ...
    def read(
        self, data: bytes | bytearray | memoryview, start: int, end: int, /
    ) -> tuple[int, bool, set[str]] | None: ...
