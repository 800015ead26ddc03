"""The ``llmgw`` command: ``llmgw up``, ``llmgw demo``, ``llmgw ctl``, and the
hand-over to the node agent (``llmgw agent``, ``llmgw sim``).

    main.py        the entry point: parses, dispatches
    env.py         what the command reads from its environment; Django's set-up
    up.py          llmgw up: first run, then every control-plane process
    demo.py        llmgw demo: llmgw up with a simulated cluster
    simcluster.py  a simulated cluster of real agents on loopback addresses
    commands.py    the command line of each control-plane process
    processes.py   start, watch and stop a set of child processes
    wait.py        wait for an outcome, bounded in time
    ctl/           llmgw ctl, one module per area
"""
