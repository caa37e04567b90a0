"""Chat: conversations rendered to text, once for every caller (``olmax tokenize --chat``,
``olmax generate`` / ``olmax chat``, RL rollouts, the lm-eval adapter, serving).

- ``template``: the OLMo 3 Instruct and Think templates, a tokenizer's own jinja template rendered
  as transformers renders it, special tokens, picking a template by name, folder or file.
- ``codec``: a checkpoint's tokenizer and chat template (text <-> ids for generation), found
  beside the checkpoint or its training data; JSONL prompt records.

Imports config only: data, generation, RL and eval import it, it imports none of them."""
