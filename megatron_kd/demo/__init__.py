"""The CPU demo (``megatron-kd demo``): a real distillation with a teacher shipped on PyPI.

* :mod:`~megatron_kd.demo.run` -- the command: two training runs (KD and CE-only) and the report.
* :mod:`~megatron_kd.demo.assets` -- the teacher (imported from its GGUF file) and the text
  (source distributions of two PyPI packages), prepared once into the output directory.
"""
