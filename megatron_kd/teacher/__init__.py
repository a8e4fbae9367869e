"""The teacher as a service: replicas of their own (``megatron-kd teacher serve``), students that
connect by address.

* :mod:`~megatron_kd.teacher.wire` -- self-describing request and response messages.
* :mod:`~megatron_kd.teacher.transport` -- two-process links over PyTorch's own process groups,
  waited on the host with a deadline.
* :mod:`~megatron_kd.teacher.endpoint` -- where replicas register and students look them up.
* :mod:`~megatron_kd.teacher.protocol` -- what both sides agree on besides the messages: store
  keys, connection metadata, tags, where a link's buffers live, a replica's load.
* :mod:`~megatron_kd.teacher.config` -- what a client and a replica are started with, as small
  typed records (a connection, a student rank's place, a replica's address and limits).
* :mod:`~megatron_kd.teacher.service` -- the replica side: connections, batching, responses.
* :mod:`~megatron_kd.teacher.client` -- the student side: requests ahead, the receive ring,
  replica choice.
* :mod:`~megatron_kd.teacher.ring` -- the client's records of its requests in flight.
* :mod:`~megatron_kd.teacher.step_stats` -- a client's step statistics, one record combined over
  the student's ranks.
* :mod:`~megatron_kd.teacher.choice` -- which replica a connection goes to.
* :mod:`~megatron_kd.teacher.launcher_watch` -- a replica's ranks leave when their launcher dies.

Pure torch and ``torch.distributed``: the Megatron-Core model and schedule are handed in
(:mod:`megatron_kd.commands.teacher_serve`).
"""
