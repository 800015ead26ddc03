"""The agent API's mTLS listener: gunicorn with a worker class of our own.

    command.py   the gunicorn command line that serves the agent API
    worker.py    the worker: TLS handshakes in the main loop, under a deadline
    peers.py     after the handshake: revoked certificates, connections per certificate
    intake.py    requests read whole in the main loop, under a deadline; closes that linger there
    framing.py   where a request ends in the bytes received so far
    pool.py      the threads that answer requests (gthread's get_thread_pool hook)
    parking.py   the worker that runs: AgentApiWorker, and desired-state long-polls parked
    wsgi.py      the WSGI entry, with urls.py as its URLconf

The worker overrides gthread methods, so the pinned gunicorn version is part
of its correctness: tests/agentapi/test_gunicorn_contract.py fails when one
of them changes.
"""
