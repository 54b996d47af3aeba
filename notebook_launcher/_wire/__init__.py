"""Wire protocols between the launcher's processes: one module per channel.

* :mod:`.control` -- kernel <-> rank, over each rank's private socketpair;
* :mod:`.forkserver` -- kernel <-> the forkserver, over its socketpair (with fds);
* :mod:`.agent` -- kernel <-> a node's agent, over TCP, authenticated (HMAC challenge,
  then sealed frames).

Bottom layer: both ends of a channel import the same module, so the client and the
server share the message classes and the codec. Imports only ``_events``, ``_spec`` and
``errors``.
"""
