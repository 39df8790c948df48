"""titan_cp under other libraries' models, through their public interfaces.

:mod:`titan_cp.integrations.transformers`: any Hugging Face decoder under context parallelism
(``attn_implementation="titan_cp"``, ``apply_cp``, ``shard_batch``), in a user's own loop and in
titan_cp's trainer (``model.name = "hf"``). The rest of the package imports these modules only
inside the functions that run for a Hugging Face model (the ``hf`` family, its generation runner),
so ``transformers`` stays optional.
"""
