"""DeepSpeed's own unit tests as the conformance bar (``launch/deepspeed_tests.sh DEEPSPEED_SRC``).

The runner (:mod:`.run`) runs each selected test file of a DeepSpeed source tree twice, stock and with
ds_tensorshard forced on for every ZeRO stage 1/2 engine, and prints a table per file (:mod:`.table`).
Nothing of DeepSpeed's test code is edited or copied: every process of a run imports ``site/sitecustomize.py``,
which registers the plugin once ``deepspeed`` is imported (plugin run) and records what each engine was built
with (:mod:`.events`); :mod:`.results`, a pytest plugin, ties those records to the test that made them.
"""
