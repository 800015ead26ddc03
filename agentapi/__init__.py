"""The agent API's mTLS listener: gunicorn with a worker class of our own.

    command.py   the gunicorn command line that serves the agent API
    worker.py    the worker: TLS handshakes in the main loop, under a deadline
    peers.py     after the handshake: revoked certificates, connections per certificate
    intake.py    requests read whole in the main loop, under a deadline; closes that linger there
    quick.py     heartbeats that bring no news, and pings, answered in the main loop
    framing.py   where a request ends in the bytes received so far
    pool.py      the threads that answer requests
    response.py  an HTTP response written in one send
    parking.py   the worker that runs (AgentApiParkingWorker): AgentApiWorker,
                 and desired-state long-polls parked in its event loop
    wsgi.py      the WSGI entry, with urls.py as its URLconf

The worker overrides and reads gunicorn internals, so the pinned gunicorn
version is part of its correctness: tests/agentapi/test_gunicorn_contract.py
fails when one of them changes.
"""
