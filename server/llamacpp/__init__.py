"""llama.cpp-compatible endpoints: ``/completion``, ``/tokenize``, ``/detokenize``,
``/apply-template``, ``/props`` and ``/slots``."""
