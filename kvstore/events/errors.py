"""The events package's operator error, importable without pyzmq (the daemon's start catches it)."""


class EventsAddressError(Exception):
    """An [events] address cannot be bound (in use, not on this machine); the message is the
    one line the daemon prints before it exits with status 2."""
