"""The internal database layer shared by the core, the relay and the receiver.

Not public API: `relay` and `receiver` build on it, users do not. One module a
concept:

- ``dialect``: engines, SQLite's transaction discipline, PostgreSQL options, the
  one-statement connection; its SQL pieces (the database clock, ON CONFLICT) are the
  drivers';
- ``handle``: an engine on a current schema, released by whoever opened it;
- ``caller``: the connection behind the Session or Connection a caller hands in;
- ``retry``: which database errors are transient, and the retry policies built
  on tenacity that the worker, the relay and the receiver store share;
- ``sql``: statement pieces every layer's statement builders use (the statements
  themselves are the drivers', outbox.drivers).
"""
