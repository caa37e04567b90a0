"""Text generation from a checkpoint: ``olmax generate`` and ``olmax chat`` (run: loading a
checkpoint, prompts, decoding, stop strings, streaming; chat: the interactive loop). A tool above
train and eval: imports the KV-cache decoder (``olmax.engine``), the tokenizer and chat
template of ``olmax.chat``, parameter loading and the layers below; never verify or the CLI."""
