"""llama.cpp-compatible endpoints: ``/completion`` (and ``/completions``), ``/infill``,
``/tokenize``, ``/detokenize``, ``/apply-template``, ``/props`` and ``/slots``."""
