"""Training data: the corpus (the stdlib's own sources by default) or dataset files
(``sources``), tokenizers (byte, BPE, Hugging Face: ``hf_tokenizer``), tokenizing once
(``prepare``), mixing sources (``mix``), packed and resumable data-parallel batches (``loader``),
rows of whole documents (``packing``), token-budget microbatches of whole documents (``varlen``),
a step's budgets (``budgets``) and Zeppelin's partition (``zeppelin``). See each module's
docstring for why it is shaped as it is.

The package exports nothing itself: its users import the module that owns a name, so the
config and the planner can import the torch-free modules (the corpus, sources, tokenizers and
budgets) without the loaders, which import torch.
"""
