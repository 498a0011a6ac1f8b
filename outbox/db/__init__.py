"""The internal database layer shared by the core, the relay and the receiver.

Not public API: `relay` and `receiver` build on it, users do not. One module a
concept:

- ``dialect``: the toolkit's engines (each backend's set-up is its driver's), the
  one-statement connection; its SQL pieces (the database clock, ON CONFLICT) are the
  drivers';
- ``handle``: an engine on a current schema, released by whoever opened it;
- ``caller``: the connection behind the Session or Connection a caller hands in;
- ``retry``: the retry policies built on tenacity that the worker, the relay and the
  receiver store share (which errors are transient, each driver says);
- ``sql``: statement pieces every layer's statement builders use (the statements
  themselves are the drivers', outbox.drivers).
"""
