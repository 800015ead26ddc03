"""Autoscaling: a model's replica count follows its load (docs/autoscaling.md).

- ``policy``: the per-model policy in the catalog, its rules and defaults;
- ``decide``: the decision, a pure function of signals, policy and history;
- ``signals``: what the decision is made from (the gateways' load, the engines'), through hooks;
- ``history``: the recent samples of each autoscaled model (Redis, or files on the embedded default);
- ``service``: gathers the inputs, calls ``decide`` and persists what it says (beat's task);
- ``choice``: which replica goes on a scale-down.
"""
