"""Encoder models: sentence embeddings and cross-encoder scores from models trained for them.

An encoder reads a whole input at once (bidirectional attention, or causal for a decoder read
as an encoder) and is never decoded from, so it needs no KV cache: many inputs are packed into
one forward with no padding in the matrix products (batch.py, attention.py). Owns the
architectures (bert.py, nomic_bert.py, gemma_embedding.py), what a model file declares about
its vectors (declared.py: pooling, dense layers, normalisation, prompts, length), the heads that
turn hidden states into vectors or scores (heads.py), loading from GGUF and sentence-transformers
directories (loader.py), and the engine that batches requests (engine.py).
"""
