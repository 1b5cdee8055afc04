"""Embeddings: OpenAI's ``/v1/embeddings`` and llama.cpp's ``/embedding`` and ``/embeddings``,
served from the loaded model's final hidden states (``engine/pooling.py``)."""
