"""Where the teacher comes from (``--kd-mode``): the ``--kd-*`` flags
(:mod:`~megatron_kd.modes.args`), the one interface of a run's teacher
(:mod:`~megatron_kd.modes.source`), one module per mode (:mod:`~megatron_kd.modes.colocated`,
:mod:`~megatron_kd.modes.disaggregated`, :mod:`~megatron_kd.modes.offline`), the one place the
mode is read (:mod:`~megatron_kd.modes.build`) and the step statistics of a source, a record
until logged (:mod:`~megatron_kd.modes.stats`).
"""
