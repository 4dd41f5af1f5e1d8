"""The transactional outbox: handlers publish by writing rows; a relay sends them.

One module per audience, so a reader of one side never reads the others:

- :mod:`~worker.outbox.model`: the ``outbox`` table, its states, ``WORKER_OUTBOX_*``
  and the backlog query; shared by the three below, importing none of them.
- :mod:`~worker.outbox.publish`: the handler side, what ``ctx.publish`` calls. It
  imports nothing of the pump, the registry or the relay.
- :mod:`~worker.outbox.relay`: the relay, its metrics and the purge of sent rows.
- :mod:`~worker.outbox.commands`: ``worker outbox`` and ``worker relay``.

This package imports none of them itself: importing the handler side loads no relay.
"""
