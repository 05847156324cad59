"""Offline commands that make what a run reads: the learned scorer and IndexMem trained, HeadKV's head
scores, DuoAttention's pattern and Expected Attention's query statistics measured on a model."""
