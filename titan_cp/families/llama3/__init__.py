"""``model.name = "llama3"``: titan_cp's Llama 3, its room: the family spec (:mod:`.family`)."""

from titan_cp.families.llama3.family import LLAMA3, Llama3

__all__ = ["LLAMA3", "Llama3"]
