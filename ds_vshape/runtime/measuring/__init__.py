"""Measuring: activation memory (``memory``) and layer times and memory for
``partition_method: "profile"`` (``profile``). May import the schedule layer, the config and
``tuning``, ``dropin`` and ``transfers``. ``schedule: "auto"``, which measures a few
steps and then picks a schedule, is an engine subclass beside the engine (``runtime/auto_engine.py``).
"""
