"""The ``ds-tensorshard`` commands (cli) and what they share: model sources, presets, progress."""
