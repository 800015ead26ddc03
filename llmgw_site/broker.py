"""Celery's Redis transport, surviving the loss of Redis with tasks in flight.

kombu 5.7.0 crashes the whole worker ("Unrecoverable error: AttributeError:
'NoneType' object has no attribute 'hostname'") when its connection to Redis
breaks while an acks_late task runs: closing the channel tries to put the
unacknowledged messages back through a connection it has just released.
Nothing is lost by not trying: those messages stay in Redis's unacked set,
from which kombu restores them after the visibility timeout, and every task
here is periodic or idempotent (the reconcile reaches the same end anyway).
"""

from kombu.transport import redis


class Channel(redis.Channel):
    def close(self) -> None:
        if getattr(self.connection, "client", None) is None:
            self.do_restore = False
        super().close()


class Transport(redis.Transport):
    Channel = Channel
