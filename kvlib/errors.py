class UserError(Exception):
    """Bad input from a user: reported as one message, without a traceback."""


class DeviceOOM(Exception):
    """An allocation would exceed the configured device capacity."""

    def __init__(self, where: str, requested: int, in_use: int, capacity: int):
        self.where, self.requested, self.in_use, self.capacity = where, requested, in_use, capacity
        super().__init__(
            f"device capacity exceeded at {where}: {requested / 2**20:.1f} MiB requested, "
            f"{in_use / 2**20:.1f} MiB in use, capacity {capacity / 2**20:.1f} MiB"
        )


class RequestTooLarge(UserError):
    """A block pool cannot hold one request even with no other running (kvlib.engine.scheduler): a capacity that
    this runner cannot serve the trace at (the serving experiment records it as an OOM point)."""
