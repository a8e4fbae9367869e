"""Data for ``megatron-kd``: text -> Megatron indexed dataset, and the training datasets.

* :mod:`megatron_kd.data.tokenizer` -- a Hugging Face ``tokenizers`` tokenizer with the attributes
  Megatron-Core's datasets expect (``unique_identifiers``, ``eod``, ``pad``, ``vocab_size``).
* :mod:`megatron_kd.data.preprocess` -- ``megatron-kd preprocess``: text files -> ``.bin``/``.idx``.
* :mod:`megatron_kd.data.datasets` -- ``GPTDataset`` splits through
  ``BlendedMegatronDatasetBuilder``, a synthetic dataset (``--mock-data``) and the batch order.
"""
