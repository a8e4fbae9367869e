"""Hugging Face checkpoints in and out of Megatron-Core (``megatron-kd import-hf`` and
``export-hf``); the config's side is :mod:`megatron_kd.arch.hf_config`.

* :mod:`~megatron_kd.hf.importer` -- ``import-hf``: a safetensors or GGUF checkpoint -> a
  Megatron-Core checkpoint (built through :mod:`megatron_kd.integration`).
* :mod:`~megatron_kd.hf.import_weights` -- the weights' maths of the import: Hugging Face names
  and shapes -> Megatron-Core's, tensor-parallel shards and neutral padding.
* :mod:`~megatron_kd.hf.exporter` -- ``export-hf``: any Megatron-Core checkpoint -> safetensors,
  no model built.
* :mod:`~megatron_kd.hf.export_weights` -- the inverse of ``import_weights``, a layer at a time.
* :mod:`~megatron_kd.hf.checkpoint_reader` -- a ``torch_dist`` checkpoint's weights a layer at a
  time, whatever layout saved them.
"""
