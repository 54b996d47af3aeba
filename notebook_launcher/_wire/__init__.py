"""Wire protocols between the launcher's processes: one module per channel.

* :mod:`.control` -- kernel <-> rank, over each rank's private socketpair;
* :mod:`.forkserver` -- kernel <-> the forkserver, over its socketpair (with fds);
* :mod:`.agent` -- kernel <-> a node's agent, over TCP, authenticated (HMAC challenge,
  then sealed frames);
* :mod:`.store` -- the ranks' rendezvous store on a cluster, through authenticated
  forwarders;
* :mod:`.supervisor` -- kernel <-> the supervisor of a detached run or session, over a
  Unix socket in the run's record (a session's calls; a result held in memory).

Bottom layer: both ends of a channel import the same module, so the client and the
server share the message classes and the codec. Imports only ``_events``, ``_spec``,
``_posix`` and ``errors``.
"""
