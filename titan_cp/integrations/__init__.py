"""titan_cp under other libraries' models, through their public interfaces.

:mod:`titan_cp.integrations.transformers`: any Hugging Face decoder under context parallelism
(``attn_implementation="titan_cp"``, ``apply_cp``, ``shard_batch``), in a user's own loop and in
titan_cp's trainer (``model.name = "hf"``). Nothing here is imported by ``titan_cp`` itself:
``transformers`` stays optional.
"""
