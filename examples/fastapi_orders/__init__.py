"""An orders service in FastAPI on the outbox, deployed with its relay and receiver.

- ``app``: ``POST /orders`` writes the order, publishes ``order-<id>:created`` and
  submits the fulfilment task, all in the request's one async transaction;
- ``worker``: the fulfilment task's async handler, for ``outbox worker``: the
  order becomes ``fulfilled`` and the task ``done`` (with its reply) in one commit;
- ``relay.toml``: the relay sidecar, delivering both to the receiver;
- ``launcher``: ``python -m examples.fastapi_orders`` prepares the databases on the
  local PostgreSQL and runs the app (uvicorn), the worker, the relay and the
  reference receiver (``outbox receiver``) until Ctrl-C.

The settings (database, ports, secret) are environment variables: see ``settings``.
"""
