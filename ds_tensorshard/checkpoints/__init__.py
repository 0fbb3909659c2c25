"""Checkpoints: safe atomic files, the rank file, readers of every layout (own, stock ZeRO, universal),
the engine's save/load hooks, the optimizer's state in and out, and offline conversion."""
