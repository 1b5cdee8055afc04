"""Images in, for the natively multimodal Qwen3.5 / 3.6 checkpoints (``--vision``).

``processor.py`` turns image bytes into patches (resized to the patch grid within a pixel
budget, normalised); ``encoder.py`` is the vision tower (``model.visual.*``) that turns them into
embeddings of the language model's width; ``media.py`` places those embeddings on a prompt's
image placeholder tokens and gives the prompt its three-axis M-RoPE positions.
"""
