"""The machinery behind ``distcomm-run`` and ``python -m distcomm.launch``.

One module per concern, so each can be read (and tested) alone:

- ``config``   LaunchConfig and the parsers of torchrun's option values (nproc, nnodes, std specs)
- ``store``    the job store: host it or connect to it (the one place that names a TCPStore class)
- ``workers``  start one worker (own session, dies with the launcher), signal names, stopping
- ``output``   one selector reads every worker pipe; whole lines, rank prefixes, log files, tails
- ``failure``  what failed and why: exit descriptions, traceback tails, the summary text
- ``cleanup``  hook point run after every round's workers are gone (shared-memory segments)
- ``coordination``  what the launchers of a job agree through the store: rendezvous per round,
               the root cause of a failure, abort, heartbeats, the exit barrier
- ``agent``    one node's launcher: rounds of workers, restarts, the summary, signal forwarding
- ``watchdog`` the process that cleans up after a SIGKILLed launcher (worker sessions, temp dir, segments)

The user-facing contract (options, environment of each worker) is documented in
``distcomm.run``'s module docstring.
"""
