"""The ``megatron-kd`` commands that run distributed jobs: ``train``, ``teacher serve`` /
``registry``, ``cache build`` / ``verify`` / ``info``, ``report``, and the planner's view of a
``train`` run (``plan_adapter``); each starts the same way (:mod:`~megatron_kd.commands.startup`).
"""
