"""``olmax serve``: an OpenAI-compatible HTTP server over the generation engine.

protocol: the JSON contract (request validation into engine requests, responses, chunks, errors);
no HTTP. admission: a body turned into engine work off the event loop (worker processes), under a
deadline. worker: the one seam to ``olmax.engine`` (the thread that steps the engine). app: the
Starlette application (routes, API key, streaming, disconnects). server: ``olmax serve`` itself
(loading a checkpoint as ``olmax generate`` does, uvicorn, SIGTERM). Nothing here is imported by
training or evaluation."""

# The cache per slot when --max-length is not given: the model's positions, at most this (a 7B's
# 65,536 positions x 32 slots would not fit a GPU).
DEFAULT_MAX_LENGTH = 4096
# Seconds from a request's arrival until its work is in the engine's queue (reading its body,
# checking it, tokenizing its prompt): past it, 408 (``olmax.serve.admission``).
DEFAULT_ADMISSION_TIMEOUT = 30.0
