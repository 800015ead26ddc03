"""Onboarding: a machine reached over SSH becomes a heartbeating node.

    request.py   the request, checked as plain functions, and the job made from it
    steps.py     the job's kind and its list of steps
    install.py   the first steps: connect, preflight, install the agent
    enroll.py    the last: certificate, agent.yaml, the unit, the first heartbeat
"""
