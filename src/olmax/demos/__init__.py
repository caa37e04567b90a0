"""The README's demos, each a short end-to-end run on CPU that ends in a verdict (exit 1 when it
is not met):

- ``pretrain``: ``olmax demo``, a tiny OLMo 3 pre-trained on the Python standard library.
- ``sft``: ``olmax demo sft``, that model fine-tuned on a chat set built here.
- ``rl``: ``olmax demo rl``, SFT -> DPO -> RL with verifiable rewards on a counting task.

A tool above train, eval and RL: imports the training loop, generation and the layers below;
never verify or the CLI (the ``olmax demo`` command is in ``olmax.train.commands``)."""
