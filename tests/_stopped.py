"""A stopped timer of a given length, for the corrections' tests (they read ``done`` and ``seconds``)."""


class Stopped:
    """A timer that stopped ``seconds`` after it started."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    def done(self) -> bool:
        return True

    def seconds(self) -> float:
        return self._seconds
